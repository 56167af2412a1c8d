"""The device mesh: the only place that knows how many devices there are and how they are arranged.

Vocabulary (as in torchtitan's ``parallel_dims.py``): an *axis* is a mesh axis
(:class:`jaxpar.axes.MeshAxis`); a *dim* is an array dimension.

Device order: ``tensor`` is the innermost axis so a tensor-parallel group is made of
neighbouring devices (the same host, the NVLink domain on GPUs); ``data`` is next, and
``pipeline`` is outermost, so pipeline boundaries are the ones that cross nodes, as the usual
selection rule goes (Narayanan et al. 2021, section 3.3) (TP inside a node, PP across nodes, DP/ZeRO outermost of the rest).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from jaxpar.axes import DEVICE_ORDER, MESH_AXES
from jaxpar.errors import ConfigError
from jaxpar.layout import ParallelLayout


def _ordered_devices(devices: list[jax.Device]) -> list[jax.Device]:
    # Group by process (host) first so the innermost axes stay inside a host.
    return sorted(devices, key=lambda d: (d.process_index, d.id))


def make_mesh(layout: ParallelLayout, devices: list[jax.Device] | None = None) -> Mesh:
    """Build the ``jax.sharding.Mesh`` of ``layout``'s mesh sizes over ``devices`` (default: all devices).

    Raises :class:`ConfigError` when the device count does not match the product of the sizes.
    """
    devices = list(jax.devices()) if devices is None else list(devices)
    if layout.devices != len(devices):
        sizes = "*".join(str(layout.size(a)) for a in MESH_AXES)
        raise ConfigError(
            f"mesh: {'*'.join(MESH_AXES)} = {sizes} = {layout.devices} but {len(devices)} devices are available; "
            f"set --config.mesh.* so the product is {len(devices)}"
        )
    if jax.process_count() > 1 and layout.tensor > jax.local_device_count():
        raise ConfigError(
            f"mesh.tensor={layout.tensor} exceeds the {jax.local_device_count()} devices of one process; "
            "keep tensor parallelism inside a host"
        )
    grid = np.array(_ordered_devices(devices), dtype=object).reshape([layout.size(a) for a in DEVICE_ORDER])
    return Mesh(grid, tuple(axis.value for axis in DEVICE_ORDER))


def single_device_mesh() -> Mesh:
    """A 1x1x1 mesh on the first device: the reference every layout is compared with."""
    return make_mesh(ParallelLayout(), jax.devices()[:1])
