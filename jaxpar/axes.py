"""The mesh axes: the one place their names are written as strings.

Vocabulary (as in torchtitan's ``parallel_dims.py``): an *axis* is a mesh axis; a *dim* is an array
dimension. A leaf module, so the config schema can name its fields after :class:`MeshAxis`, a
``StrEnum`` whose members equal and hash like their strings, so they stand wherever JAX expects an
axis name.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class MeshAxis(enum.StrEnum):
    """The named axes of the device mesh."""

    DATA = "data"  # data parallel and ZeRO sharding
    TENSOR = "tensor"  # Megatron tensor parallelism (innermost: neighbouring devices)
    PIPELINE = "pipeline"  # pipeline stages (outermost: the axis that crosses nodes)
    CONTEXT = "context"  # context parallelism: the sequence split over devices (ring / all-gather attention)
    EXPERT = "expert"  # expert parallelism: MoE experts split over devices; more data parallelism elsewhere


# Every axis, in the order the config and reports list them.
MESH_AXES: tuple[MeshAxis, ...] = (
    MeshAxis.DATA,
    MeshAxis.TENSOR,
    MeshAxis.PIPELINE,
    MeshAxis.CONTEXT,
    MeshAxis.EXPERT,
)

# Megatron tensor parallelism: the only rules table. With mesh.tensor == 1 it is a no-op.
TENSOR_RULES: Mapping[str, str] = {
    "vocab": MeshAxis.TENSOR,  # vocabulary-parallel embedding and logits / cross-entropy
    "heads": MeshAxis.TENSOR,  # QKV column-parallel, attention output row-parallel
    "kv_heads": MeshAxis.TENSOR,
    "mlp": MeshAxis.TENSOR,  # MLP up/gate column-parallel, down row-parallel (the experts' too)
}
# Expert parallelism: MoE expert weights split over `expert` (jaxpar.models.moe). With
# mesh.expert == 1 it is a no-op, like the tensor rules.
EXPERT_RULES: Mapping[str, str] = {"experts": MeshAxis.EXPERT}
# Pipeline parallelism (mesh.pipeline > 1): the stacked layer dim is split into stages.
# With an untied output layer the embedding and output layer share one table per stage
# (jaxpar.parallel.pipeline.to_stage_form): its leading "stages" dim is split over pipeline too.
PIPELINE_RULES: Mapping[str, str] = {"layers": MeshAxis.PIPELINE, "stages": MeshAxis.PIPELINE}
# Order of the device array, outermost first: pipeline crosses nodes, tensor stays inside one;
# context sits between data and tensor (torchtitan's pp, dp, cp, tp order): its ring exchanges
# every layer, so it is kept closer than data, whose reductions come once per step. expert sits
# between data and context: its dispatch and combine run every MoE layer (closer than data), but
# move the activations once per layer where the context ring moves K/V blocks per block pair.
DEVICE_ORDER: tuple[MeshAxis, ...] = (
    MeshAxis.PIPELINE,
    MeshAxis.DATA,
    MeshAxis.EXPERT,
    MeshAxis.CONTEXT,
    MeshAxis.TENSOR,
)


def batch_axes(expert: int = 1) -> MeshAxis | tuple[MeshAxis, ...]:
    """The axes that split the batch's sequences: ``data``, or ``(data, expert)``: ``expert`` takes
    its devices from data parallelism (the layers other than the experts see ``data x expert`` as
    their data-parallel group, as in Megatron-core's MoE parallel folding and MaxText)."""
    return MeshAxis.DATA if expert == 1 else (MeshAxis.DATA, MeshAxis.EXPERT)


def data_group(context: int, expert: int = 1) -> MeshAxis | tuple[MeshAxis, ...]:
    """The axes over which ZeRO shards and gradients are reduced, for every parameter but the
    experts': the batch axes (:func:`batch_axes`), and ``context`` with context parallelism (every
    context rank's gradients are partial sums, as in torchtitan's FSDP over dp_shard x cp). The
    experts' group leaves ``expert`` out (their weights are split over it). A single name when
    ``context == expert == 1``."""
    axes = (*group_axes(batch_axes(expert)), *((MeshAxis.CONTEXT,) if context > 1 else ()))
    return axes[0] if len(axes) == 1 else axes


def group_axes(group: str | tuple[str, ...]) -> tuple[str, ...]:
    """A collective's axis argument as a tuple of names."""
    return (group,) if isinstance(group, str) else tuple(group)
