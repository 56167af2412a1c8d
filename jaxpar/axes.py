"""The mesh axes: the one place their names are written as strings.

Vocabulary (as in torchtitan's ``parallel_dims.py``): an *axis* is a mesh axis; a *dim* is an array
dimension. A leaf module, so the config schema can name its fields after :class:`MeshAxis`, a
``StrEnum`` whose members equal and hash like their strings, so they stand wherever JAX expects an
axis name.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection, Mapping


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

# Megatron tensor parallelism. With mesh.tensor == 1 it is a no-op.
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


@dataclasses.dataclass(frozen=True)
class AxisRole:
    """What the training step does with one mesh axis: the per-axis facts that the sharding rules
    (:mod:`jaxpar.sharding`), the batch split (:mod:`jaxpar.train.batches`), ZeRO's reduction and
    gather groups (:mod:`jaxpar.sharding`, :mod:`jaxpar.ops.zero3`) and the model's
    ``ShardContext`` (:mod:`jaxpar.train.step`) read from :data:`AXIS_ROLES`, so that none of them
    names an axis.

    A group is written in :data:`MESH_AXES` order, the batch axes first; an axis joins it only when
    its size exceeds 1, except with ``at_size_one`` (``data``: a group is never empty)."""

    # the batch's sequences are split over it: its ranks see other sequences, so every parameter
    # not split over it has partial gradients there (the batch group, then the gradient group)
    splits_batch: bool = False
    # its ranks see other tokens of the same sequences (context parallelism): partial gradients, so
    # it joins the gradient (and ZeRO) group after the batch axes, as in torchtitan's FSDP over dp x cp
    splits_sequence: bool = False
    at_size_one: bool = False  # joins its groups at size 1 too
    # the model's ShardContext field that names it (None: not bound by itself), and whether it is
    # bound at size 1 too (expert: the experts' weights are split over it whatever its size)
    shard_context_field: str | None = None
    bound_at_size_one: bool = False
    rules: Mapping[str, str] = dataclasses.field(default_factory=dict)  # logical dims split over it
    rules_at_size_one: bool = True  # False: its rules only apply when it is split (pipeline's stage form)


# The per-axis table (every MeshAxis has a row; tests/test_axes.py checks the step, the sharding,
# the batch split and ZeRO-3 derive their groups from it). ``expert`` takes its devices from data
# parallelism: the layers other than the experts see data x expert as their data-parallel group,
# as in Megatron-core's MoE parallel folding and MaxText.
AXIS_ROLES: Mapping[MeshAxis, AxisRole] = {
    MeshAxis.DATA: AxisRole(splits_batch=True, at_size_one=True),
    MeshAxis.TENSOR: AxisRole(shard_context_field="tensor_axis", bound_at_size_one=True, rules=TENSOR_RULES),
    MeshAxis.PIPELINE: AxisRole(rules=PIPELINE_RULES, rules_at_size_one=False),
    MeshAxis.CONTEXT: AxisRole(splits_sequence=True, shard_context_field="context_axis"),
    MeshAxis.EXPERT: AxisRole(
        splits_batch=True, shard_context_field="expert_axis", bound_at_size_one=True, rules=EXPERT_RULES
    ),
}

Group = MeshAxis | tuple[MeshAxis, ...]  # a collective's axis argument: one name, or a tuple of them


def _group(axes: tuple[MeshAxis, ...]) -> Group:
    return axes[0] if len(axes) == 1 else axes


def _joins(axis: MeshAxis, sizes: Mapping[str, int]) -> bool:
    return AXIS_ROLES[axis].at_size_one or sizes.get(axis, 1) > 1


def batch_axes(sizes: Mapping[str, int]) -> Group:
    """The axes that split the batch's sequences on a mesh of ``sizes`` (axis -> size): those whose
    :attr:`AxisRole.splits_batch`, i.e. ``data``, or ``(data, expert)`` with ``expert > 1``."""
    return _group(tuple(a for a in MESH_AXES if AXIS_ROLES[a].splits_batch and _joins(a, sizes)))


def data_group(sizes: Mapping[str, int], split: Collection[str] = ()) -> Group:
    """The axes over which ZeRO shards and gradients are reduced, on a mesh of ``sizes``, for a
    parameter split over the axes ``split``: the batch axes (:func:`batch_axes`), then the axes that
    split the sequence (``context``: every context rank's gradients are partial sums, as in
    torchtitan's FSDP over dp_shard x cp), less those the parameter is split over (the experts'
    weights leave ``expert`` out). A single name when only ``data`` remains."""
    return _group(tuple(a for a in gradient_axes() if _joins(a, sizes) and a not in split))


def gradient_axes() -> tuple[MeshAxis, ...]:
    """Every axis that can join a gradient group (:func:`data_group`), in its order: the batch
    axes, then the sequence axes."""
    batch = [a for a in MESH_AXES if AXIS_ROLES[a].splits_batch]
    return (*batch, *(a for a in MESH_AXES if AXIS_ROLES[a].splits_sequence))


def axis_rules(sizes: Mapping[str, int] | None = None) -> dict[str, str]:
    """The logical dim -> mesh axis rules on a mesh of ``sizes`` (None: the rules that hold at every
    size, those of :attr:`AxisRole.rules_at_size_one`)."""
    sizes = sizes or {}
    return {
        dim: axis
        for a, role in AXIS_ROLES.items()
        if role.rules_at_size_one or sizes.get(a, 1) > 1
        for dim, axis in role.rules.items()
    }


def shard_context_axes(sizes: Mapping[str, int]) -> dict[str, Group | None]:
    """The mesh axes the model's ``ShardContext`` is bound to on a mesh of ``sizes``: ``data_axis``,
    the gradient group (:func:`data_group`), and each :attr:`AxisRole.shard_context_field`: its axis where
    it is split (or :attr:`AxisRole.bound_at_size_one`), else None."""
    out: dict[str, Group | None] = {"data_axis": data_group(sizes)}
    for axis, role in AXIS_ROLES.items():
        if role.shard_context_field is not None:
            out[role.shard_context_field] = axis if role.bound_at_size_one or sizes.get(axis, 1) > 1 else None
    return out


def group_axes(group: str | tuple[str, ...]) -> tuple[str, ...]:
    """A collective's axis argument as a tuple of names."""
    return (group,) if isinstance(group, str) else tuple(group)
