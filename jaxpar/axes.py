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
    CONTEXT = "context"  # context parallelism: the sequence split over devices (ring / all-gather attention)


# Every axis, in the order the config and reports list them.
MESH_AXES: tuple[MeshAxis, ...] = (MeshAxis.DATA, MeshAxis.TENSOR, MeshAxis.PIPELINE, MeshAxis.CONTEXT)
# Order of the device array, outermost first: pipeline crosses nodes, tensor stays inside one;
# context sits between data and tensor (torchtitan's pp, dp, cp, tp order): its ring exchanges
# every layer, so it is kept closer than data, whose reductions come once per step.
DEVICE_ORDER: tuple[MeshAxis, ...] = (MeshAxis.PIPELINE, MeshAxis.DATA, MeshAxis.CONTEXT, MeshAxis.TENSOR)


def data_group(context: int) -> MeshAxis | tuple[MeshAxis, ...]:
    """The axes that split the batch and over which ZeRO shards and gradients are reduced: ``data``,
    or ``(data, context)`` with context parallelism (as torchtitan's FSDP over dp_shard x cp: every
    context rank holds a different part of the sequence, so its gradients are partial sums too).
    A single name when ``context == 1``, so those layouts trace exactly as before the axis existed."""
    return MeshAxis.DATA if context == 1 else (MeshAxis.DATA, MeshAxis.CONTEXT)


def group_axes(group: str | tuple[str, ...]) -> tuple[str, ...]:
    """A collective's axis argument as a tuple of names."""
    return (group,) if isinstance(group, str) else tuple(group)
