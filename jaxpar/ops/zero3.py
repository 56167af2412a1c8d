"""ZeRO-3's forward side: parameters stored split over ``data``, all-gathered just before use.

ZeRO-3 (Rajbhandari et al. 2020, stage P_os+g+p; PyTorch FSDP's full sharding) stores each parameter
split over ``data`` on its ZeRO dim (:func:`jaxpar.sharding.zero_dim`). The model receives the split
dims as a tree matching its parameters (:func:`zero3_dims`: an int per leaf, :data:`NOT_GATHERED`
for one stored whole), so nothing matches parameter paths. The gathered copies are named
:data:`ZERO3_NAME`, which the remat policy never keeps: the backward gathers each layer again and
the gather's transpose reduce-scatters its gradient, one layer at a time. The gradient side is
:mod:`jaxpar.parallel.zero`.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

from jaxpar.axes import group_axes
from jaxpar.sharding import is_placement

ZERO3_NAME = "zero3_gathered_param"  # checkpoint_name of a gathered parameter (the remat policy's key)
NOT_GATHERED = -1  # entry of a dims tree: the parameter is stored whole, nothing to gather


def zero3_dims(placements: Any) -> Any | None:
    """Tree of the dims ZeRO-3 splits over ``data`` (one int per parameter, ``NOT_GATHERED`` for
    those stored whole), from a tree of :class:`~jaxpar.sharding.ParamPlacement`; ``None`` when no
    parameter is stored sharded (ZeRO 0-2)."""
    dims = jax.tree.map(
        lambda place: place.zero_dim if place.sharded_storage else NOT_GATHERED, placements, is_leaf=is_placement
    )
    return dims if any(d != NOT_GATHERED for d in jax.tree.leaves(dims)) else None


def zero3_groups(placements: Any) -> Any | None:
    """Tree of the axes each parameter's ZeRO-3 shards are gathered over (its
    :attr:`~jaxpar.sharding.ParamPlacement.zero_axes`), or ``None`` when every parameter uses the
    same group (no ``expert`` axis): then the context's ``data_axis`` is the group."""
    groups = jax.tree.map(lambda place: place.zero_axes, placements, is_leaf=is_placement)
    return groups if len({group_axes(g) for g in jax.tree.leaves(groups, is_leaf=is_group)}) > 1 else None


def is_group(x: Any) -> bool:
    """Whether ``x`` is a leaf of a groups tree: a mesh axis name or a tuple of them."""
    return isinstance(x, str) or (isinstance(x, tuple) and all(isinstance(a, str) for a in x))


def layer_dims(dims: Any) -> Any:
    """The dims tree of one layer of a stacked (scanned) subtree: the leading ``layers`` dim is gone."""
    return jax.tree.map(lambda d: d - 1 if d != NOT_GATHERED else NOT_GATHERED, dims)


def gather_param(p: jax.Array, dim: int, data_axis: str | tuple[str, ...], compute_dtype: Any) -> jax.Array:
    """All-gather one parameter's shards over ``data_axis`` on ``dim``, in the compute dtype: the cast
    comes first (on the shard), so nothing full-size exists but the gathered value, which remat never
    keeps; its transpose, the gradient's reduce-scatter, runs in the compute dtype too."""
    p = p.astype(compute_dtype)
    return checkpoint_name(jax.lax.all_gather(p, data_axis, axis=dim, tiled=True), ZERO3_NAME)


def gather_tree(tree: Any, dims: Any, data_axis: str | tuple[str, ...], compute_dtype: Any, groups: Any = None) -> Any:
    """Gather every leaf of ``tree`` whose entry in ``dims`` (same structure) is a dim, over
    ``data_axis``, or over its entry in ``groups`` (:func:`zero3_groups`) where given."""
    if groups is None:
        return jax.tree.map(
            lambda p, d: p if d == NOT_GATHERED else gather_param(p, d, data_axis, compute_dtype), tree, dims
        )
    return jax.tree.map(
        lambda p, d, g: p if d == NOT_GATHERED else gather_param(p, d, g, compute_dtype),
        tree,
        dims,
        jax.tree.unflatten(jax.tree.structure(dims), jax.tree.leaves(groups, is_leaf=is_group)),
    )
