"""The device mesh: the only place that knows how many devices there are and how they are arranged.

An *axis* is a mesh axis (:class:`jaxpar.axes.MeshAxis`), a *dim* an array dimension. ``tensor`` is
the innermost axis, so a tensor-parallel group is neighbouring devices (one host, the NVLink
domain); ``data`` is next and ``pipeline`` outermost, so pipeline boundaries cross nodes: TP inside
a node, PP across nodes (Narayanan et al. 2021, section 3.3).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxpar.axes import DEVICE_ORDER, MESH_AXES, MeshAxis
from jaxpar.errors import ConfigError
from jaxpar.layout import ParallelLayout


def _ordered_devices(devices: list[jax.Device], nodes: Sequence[str]) -> list[jax.Device]:
    # Group by node, then process, so the innermost axes stay inside a node (NVLink on GPUs), even
    # when SLURM numbers the tasks of a node non-contiguously (--distribution=cyclic).
    first = {node: i for i, node in reversed(list(enumerate(nodes)))}
    return sorted(devices, key=lambda d: (first[nodes[d.process_index]], d.process_index, d.id))


def process_nodes() -> list[str]:
    """The node of each process (index = ``jax.process_index()``): what places it, from
    :func:`jaxpar.distributed.launch_spec` (SLURM's node name, ``JAXPAR_NODE`` or the host name),
    gathered from every process. One process: one node."""
    if jax.process_count() == 1:
        return [""]
    from jax.experimental import multihost_utils

    from jaxpar.distributed import launch_spec

    digest = hashlib.sha256(launch_spec().node.encode()).digest()[:16]
    gathered = multihost_utils.process_allgather(np.frombuffer(digest, dtype=np.int32))
    return [np.asarray(row).tobytes().hex() for row in np.asarray(gathered).reshape(jax.process_count(), -1)]


def make_mesh(
    layout: ParallelLayout,
    devices: list[jax.Device] | None = None,
    *,
    nodes: Sequence[str] | None = None,
    cross_node_tensor: bool = False,
) -> Mesh:
    """Build the ``jax.sharding.Mesh`` of ``layout``'s mesh sizes over ``devices`` (default: all devices).

    ``nodes[p]`` names the node of process ``p`` (default: :func:`process_nodes`). The ``tensor`` and
    ``context`` axes, whose collectives run every layer, must each lie inside one node unless
    ``cross_node_tensor`` (``parallel.cross_node_tensor``) asks otherwise. Raises
    :class:`ConfigError` when the device count is not the product of the sizes.
    """
    devices = list(jax.devices()) if devices is None else list(devices)
    if layout.devices != len(devices):
        sizes = "*".join(str(layout.size(a)) for a in MESH_AXES)
        raise ConfigError(
            f"mesh: {'*'.join(MESH_AXES)} = {sizes} = {layout.devices} but {len(devices)} devices are available; "
            f"set --config.mesh.* so the product is {len(devices)}"
        )
    if nodes is None:
        nodes = (
            process_nodes()
            if any(d.process_index for d in devices)
            else [""] * (1 + max(d.process_index for d in devices))
        )
    ordered = _ordered_devices(devices, nodes)
    grid = np.array(ordered, dtype=object).reshape([layout.size(a) for a in DEVICE_ORDER])
    if not cross_node_tensor:
        _check_inner_axes_in_nodes(layout, grid, nodes)
    return Mesh(grid, tuple(axis.value for axis in DEVICE_ORDER))


def _check_inner_axes_in_nodes(layout: ParallelLayout, grid: np.ndarray, nodes: Sequence[str]) -> None:
    """Refuse a ``tensor`` x ``context`` block of devices that spans nodes, in one line."""
    block = layout.size(MeshAxis.CONTEXT) * layout.size(MeshAxis.TENSOR)
    for group in grid.reshape(-1, block):
        if len({nodes[d.process_index] for d in group}) > 1:
            per_node = collections.Counter(nodes[d.process_index] for d in grid.flat)
            raise ConfigError(
                f"mesh.tensor={layout.tensor} x mesh.context={layout.context} = {block} devices span nodes "
                f"(each node has {min(per_node.values())} of the {grid.size} devices); keep tensor*context within a node, "
                "put the rest on mesh.data or mesh.pipeline, or set parallel.cross_node_tensor=true to allow it"
            )


def single_device_mesh() -> Mesh:
    """A 1x1x1 mesh on the first device: the reference every layout is compared with."""
    return make_mesh(ParallelLayout(), jax.devices()[:1])
