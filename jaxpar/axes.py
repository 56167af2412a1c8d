"""The mesh axes: the one place their names are written as strings.

Vocabulary (as in torchtitan's ``parallel_dims.py``): an *axis* is a mesh axis; a *dim* is an
array dimension. :class:`MeshAxis` is the only place mesh-axis names are written as strings
(a leaf module, so the config schema can name its fields after it); everything else names
``MeshAxis.DATA`` and friends (a ``StrEnum``: each member is equal to, and hashes like, its
string, so it can stand wherever JAX expects an axis name).
"""

from __future__ import annotations

import enum


class MeshAxis(enum.StrEnum):
    """The named axes of the device mesh."""

    DATA = "data"  # data parallel and ZeRO sharding
    TENSOR = "tensor"  # Megatron tensor parallelism (innermost: neighbouring devices)
    PIPELINE = "pipeline"  # pipeline stages (outermost: the axis that crosses nodes)


# Every axis, in the order the config and reports list them.
MESH_AXES: tuple[MeshAxis, ...] = (MeshAxis.DATA, MeshAxis.TENSOR, MeshAxis.PIPELINE)
# Order of the device array, outermost first: pipeline crosses nodes, tensor stays inside one.
DEVICE_ORDER: tuple[MeshAxis, ...] = (MeshAxis.PIPELINE, MeshAxis.DATA, MeshAxis.TENSOR)
