"""Logical axis names -> mesh axes: the rules table and the per-parameter shardings.

Model code names *logical* dims (``vocab``, ``embed``, ``heads``, ``kv_heads``, ``head_dim``,
``mlp``, ``layers``, ``norm``, ``pos``). A :class:`Strategy` is data, not a subclass: the rules
table, i.e. the Megatron tensor-parallel rules and the expert rule (plus ``layers -> pipeline`` when there
is more than one pipeline stage: each stage holds a block of the stacked layers, see
:mod:`jaxpar.parallel.pipeline` for the layer order with virtual stages). It follows from the
layout (:meth:`Strategy.for_layout`); the ZeRO stage and the mesh sizes are the layout's
(:class:`jaxpar.layout.ParallelLayout`). From (strategy, layout, parameter shapes and logical names)
follow, per parameter:

* the **compute spec**: how the shard-local model sees it (Megatron column/row split over
  ``tensor``; QKV and MLP up/gate column-parallel, attention output and MLP down row-parallel,
  vocabulary-parallel embedding and output layer);
* the **ZeRO dim**: which dim is split over ``data`` when ZeRO shards it. Rule: the largest dim
  that the tensor rules leave unsplit, excluding the stacked ``layers`` dim, whose size is
  divisible by the ``data`` size; ``None`` (replicated) if no dim qualifies;
* the **storage spec** (parameters: ZeRO-3, :attr:`~jaxpar.layout.ParallelLayout.shards_parameters`,
  adds ``data`` on the ZeRO dim) and the **optimizer spec** (ZeRO >= 1,
  :attr:`~jaxpar.layout.ParallelLayout.shards_optimizer`, adds ``data`` on the ZeRO dim).

With context parallelism (``mesh.context > 1``) "``data``" above reads "``data`` x ``context``"
(:func:`jaxpar.axes.data_group`, the placement's :attr:`ParamPlacement.zero_axes`): every context
rank computes a partial gradient, so ZeRO shards and reduces over the pair as one group.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.axes import EXPERT_RULES, PIPELINE_RULES, TENSOR_RULES, MeshAxis, axis_rules, data_group, group_axes  # noqa: F401 - re-exported
from jaxpar.config import ConfigError
from jaxpar.layout import ParallelLayout

NOT_ZERO_SHARDED = ("layers",)  # never split the scanned layer dim over data


@dataclasses.dataclass(frozen=True)
class Strategy:
    """The rules: which mesh axis each logical dim is split over. Everything else a layout decides
    (the ZeRO stage, sequence parallelism, the mesh sizes) is the layout's."""

    rules: Mapping[str, str] = dataclasses.field(default_factory=axis_rules)

    @classmethod
    def for_layout(cls, layout: ParallelLayout) -> Strategy:
        """The rules of ``layout`` (:func:`jaxpar.axes.axis_rules`): with more than one pipeline
        stage the layers are split over ``pipeline`` too."""
        return cls(rules=axis_rules(layout.mesh))


@dataclasses.dataclass(frozen=True)
class ParamPlacement:
    """Where one parameter (global shape) lives: the specs it is computed, stored and optimized with
    and the dim ZeRO splits (a tree of these, one per parameter, is a layout's "placements")."""

    logical: tuple[str, ...]
    compute: P  # spec seen by the shard-local model (tensor split only)
    zero_dim: int | None  # dim split over `data` by ZeRO, if any
    storage: P  # parameter storage spec
    optimizer: P  # optimizer-state spec (and the sharded gradient at ZeRO >= 2)
    weight_decay: bool  # norms (and biases) are not decayed
    # The group ZeRO shards and gradients are reduced over: `data`, or (`data`, `context`)
    # (jaxpar.axes.data_group); a collective's axis argument as it is written.
    zero_axes: str | tuple[str, ...] = MeshAxis.DATA

    @property
    def sharded_storage(self) -> bool:
        return MeshAxis.DATA in spec_axes(self.storage)

    @property
    def sharded_optimizer(self) -> bool:
        return MeshAxis.DATA in spec_axes(self.optimizer)


def spec_axes(spec: P) -> set[str]:
    """The mesh axes named anywhere in a PartitionSpec."""
    return {a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)}


def _with_data(spec: tuple, dim: int | None, group: str | tuple[str, ...] = MeshAxis.DATA) -> P:
    if dim is None:
        return P(*spec)
    out = list(spec)
    out[dim] = group if out[dim] is None else (out[dim], *group_axes(group))
    return P(*out)


def zero_dim(shape: tuple[int, ...], logical: tuple[str, ...], rules: Mapping[str, str], data: int) -> int | None:
    """The dim ZeRO splits over ``data`` (see the module docstring for the rule)."""
    best, best_size = None, 0
    for i, (size, name) in enumerate(zip(shape, logical)):
        if name in NOT_ZERO_SHARDED or rules.get(name):
            continue
        if size % data == 0 and size > best_size:
            best, best_size = i, size
    return best if data > 1 else None


def param_placement(
    shape: tuple[int, ...], logical: tuple[str, ...], strategy: Strategy, layout: ParallelLayout
) -> ParamPlacement:
    """Where one parameter of global ``shape`` lives under ``strategy``'s rules on ``layout``'s mesh."""
    mesh_shape = {axis.value: size for axis, size in layout.mesh.items()}
    if len(shape) != len(logical):
        raise ValueError(f"shape {shape} and logical axes {logical} differ in rank")
    compute = []
    for size, name in zip(shape, logical):
        axis = strategy.rules.get(name)
        if axis is not None and size % mesh_shape[axis] != 0:
            raise ConfigError(
                f"dim '{name}' of size {size} is not divisible by mesh axis '{axis}' of size {mesh_shape[axis]}; "
                f"choose mesh.{axis} that divides {size}"
            )
        compute.append(axis)
    # the group leaves out the axes the parameter is split over (the experts' weights: `expert`)
    group = data_group(mesh_shape, split={a for a in compute if a is not None})
    zdim = zero_dim(shape, logical, strategy.rules, math.prod(mesh_shape[a] for a in group_axes(group)))
    return ParamPlacement(
        logical=logical,
        compute=P(*compute),
        zero_dim=zdim,
        storage=_with_data(compute, zdim if layout.shards_parameters else None, group),
        optimizer=_with_data(compute, zdim if layout.shards_optimizer else None, group),
        weight_decay="norm" not in logical and "bias" not in logical,
        zero_axes=group,
    )


def param_placements(abstract_params: Any, logical_axes: Any, strategy: Strategy, layout: ParallelLayout) -> Any:
    """A tree of :class:`ParamPlacement` matching the parameter tree."""
    return jax.tree.map(
        lambda a, names: param_placement(tuple(a.shape), tuple(names), strategy, layout),
        abstract_params,
        logical_axes,
        is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(n, str) for n in x),
    )


def is_placement(x: Any) -> bool:
    return isinstance(x, ParamPlacement)


def specs(placements: Any, field: str) -> Any:
    """Pull one spec field (``compute``, ``storage``, ``optimizer``) out of a placement tree."""
    return jax.tree.map(lambda place: getattr(place, field), placements, is_leaf=is_placement)


def named(mesh: Mesh, spec_tree: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), spec_tree, is_leaf=lambda x: isinstance(x, P))


def check_sufficiently_sharded(
    abstract_params: Any, placements: Any, layout: ParallelLayout, max_replicated_fraction: float
) -> float:
    """ZeRO-3 guard against silent under-sharding (cf. MaxText's
    ``assert_params_sufficiently_sharded``): fail if more than ``max_replicated_fraction``
    (``parallel.max_replicated_fraction``) of the parameter bytes stay replicated over ``data``.
    Returns the replicated fraction."""
    total, replicated = 0, 0
    worst: list[tuple[int, str]] = []
    flat_p = jax.tree_util.tree_leaves_with_path(abstract_params)
    flat_l = jax.tree.leaves(placements, is_leaf=is_placement)
    for (path, a), place in zip(flat_p, flat_l):
        nbytes = int(np.prod(a.shape)) * a.dtype.itemsize
        total += nbytes
        if not place.sharded_storage:
            replicated += nbytes
            worst.append((nbytes, jax.tree_util.keystr(path)))
    fraction = replicated / max(total, 1)
    if layout.shards_parameters and fraction > max_replicated_fraction:
        worst.sort(reverse=True)
        names = ", ".join(name for _, name in worst[:3])
        raise ConfigError(
            f"ZeRO-3 leaves {fraction:.1%} of parameter bytes replicated over data (largest: {names}); "
            f"choose a mesh.data that divides the model dims or raise parallel.max_replicated_fraction "
            f"(now {max_replicated_fraction})"
        )
    return fraction
