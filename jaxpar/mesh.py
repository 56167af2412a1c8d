"""The device mesh: the only place that knows how many devices there are and how they are arranged.

Vocabulary (as in torchtitan's ``parallel_dims.py``): an *axis* is a mesh axis
(:class:`jaxpar.axes.MeshAxis`); a *dim* is an array dimension.

Device order: ``tensor`` is the innermost axis so a tensor-parallel group is made of
neighbouring devices (the same host, the NVLink domain on GPUs); ``data`` is next, and
``pipeline`` is outermost, so pipeline boundaries are the ones that cross nodes, as the seed's
selection framework argues (TP inside a node, PP across nodes, DP/ZeRO outermost of the rest).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

from jaxpar.axes import DEVICE_ORDER
from jaxpar.config import ConfigDict, ConfigError


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Sizes of the three named axes."""

    data: int = 1
    tensor: int = 1
    pipeline: int = 1

    @classmethod
    def from_config(cls, mesh_cfg: ConfigDict) -> MeshSpec:
        return cls(data=mesh_cfg.data, tensor=mesh_cfg.tensor, pipeline=mesh_cfg.pipeline)

    @property
    def size(self) -> int:
        return self.data * self.tensor * self.pipeline

    def shape(self) -> dict[str, int]:
        return {axis.value: getattr(self, axis) for axis in DEVICE_ORDER}


def _ordered_devices(devices: list[jax.Device]) -> list[jax.Device]:
    # Group by process (host) first so the innermost axes stay inside a host.
    return sorted(devices, key=lambda d: (d.process_index, d.id))


def make_mesh(spec: MeshSpec, devices: list[jax.Device] | None = None) -> Mesh:
    """Build the ``jax.sharding.Mesh`` for ``spec`` over ``devices`` (default: all devices).

    Raises :class:`ConfigError` when the device count does not match data*tensor*pipeline.
    """
    devices = list(jax.devices()) if devices is None else list(devices)
    if spec.size != len(devices):
        raise ConfigError(
            f"mesh: data*tensor*pipeline = {spec.data}*{spec.tensor}*{spec.pipeline} = {spec.size} but "
            f"{len(devices)} devices are available; set --config.mesh.* so the product is {len(devices)}"
        )
    if jax.process_count() > 1 and spec.tensor > jax.local_device_count():
        raise ConfigError(
            f"mesh.tensor={spec.tensor} exceeds the {jax.local_device_count()} devices of one process; "
            "keep tensor parallelism inside a host"
        )
    grid = np.array(_ordered_devices(devices), dtype=object).reshape([spec.pipeline, spec.data, spec.tensor])
    return Mesh(grid, tuple(axis.value for axis in DEVICE_ORDER))


def single_device_mesh() -> Mesh:
    """A 1x1x1 mesh on the first device: the reference every layout is compared with."""
    return make_mesh(MeshSpec(), jax.devices()[:1])
