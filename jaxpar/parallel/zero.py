"""ZeRO over ``data``, driven by the per-parameter placements (:class:`jaxpar.sharding.ParamPlacement`).

ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models") shards, over the ``data`` axis, the optimizer state (stage 1), the gradients (stage 2)
and the parameters (stage 3) of every parameter that has a ZeRO dim. Two halves live here:

* **the gradient side** (:func:`vary_replicated`, :func:`reduce_grads`, :func:`local_shard`,
  :func:`gather_update`): parameters replicated over ``data`` are marked varying so their
  gradients stay local; one reduction per step (stage 0: all-reduce; stage 1: reduce-scatter;
  stage 2: reduce-scatter per microbatch into a sharded accumulator) leaves each gradient laid out
  like its optimizer state; the optimizer updates this rank's shard and, at stages 1 and 2, the
  updated shards are all-gathered into the replicated parameter;
* **the forward side of stage 3** (below).

Stage 3 on the forward side:

ZeRO-3 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", stage P_os+g+p; PyTorch FSDP's full sharding) stores each parameter split over ``data`` on
its ZeRO dim (:func:`jaxpar.sharding.zero_dim`) and all-gathers it just before use. The model
receives the split dims as a *tree of dims* matching its parameter tree (:func:`zero3_dims`, an int
per leaf, :data:`NOT_GATHERED` for a parameter stored whole), so nothing matches parameter paths.

The gathered copies are named :data:`ZERO3_NAME`; the remat policy (:func:`remat_policy`) never
keeps them, so the backward pass gathers each layer again and the gather's transpose
reduce-scatters its gradient, one layer at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxpar.axes import MeshAxis, group_axes
from jaxpar.compat import all_gather_invariant
from jaxpar.sharding import ParamPlacement, is_placement

ZERO3_NAME = "zero3_gathered_param"  # checkpoint_name of a gathered parameter (the remat policy's key)
DENSE_NAME = "dense"  # a weight matmul's output (jaxpar.models.matmul.dense): saved by remat "selective"
NOT_GATHERED = -1  # entry of a dims tree: the parameter is stored whole, nothing to gather


def zero3_dims(placements: Any) -> Any | None:
    """Tree of the dims ZeRO-3 splits over ``data`` (one int per parameter, ``NOT_GATHERED`` for
    those stored whole), from a tree of :class:`~jaxpar.sharding.ParamPlacement`; ``None`` when no
    parameter is stored sharded (ZeRO 0-2)."""
    dims = jax.tree.map(
        lambda lay: lay.zero_dim if lay.sharded_storage else NOT_GATHERED, placements, is_leaf=is_placement
    )
    return dims if any(d != NOT_GATHERED for d in jax.tree.leaves(dims)) else None


def zero3_groups(placements: Any) -> Any | None:
    """Tree of the axes each parameter's ZeRO-3 shards are gathered over (its
    :attr:`~jaxpar.sharding.ParamPlacement.zero_axes`), or ``None`` when every parameter uses the
    same group (no ``expert`` axis): then the context's ``data_axis`` is the group."""
    groups = jax.tree.map(lambda lay: lay.zero_axes, placements, is_leaf=is_placement)
    return groups if len({group_axes(g) for g in jax.tree.leaves(groups, is_leaf=_is_group)}) > 1 else None


def _is_group(x: Any) -> bool:
    return isinstance(x, str) or (isinstance(x, tuple) and all(isinstance(a, str) for a in x))


def layer_dims(dims: Any) -> Any:
    """The dims tree of one layer of a stacked (scanned) subtree: the leading ``layers`` dim is gone."""
    return jax.tree.map(lambda d: d - 1 if d != NOT_GATHERED else NOT_GATHERED, dims)


def gather_param(p: jax.Array, dim: int, data_axis: str | tuple[str, ...], compute_dtype: Any) -> jax.Array:
    """All-gather one parameter's shards over ``data_axis`` on ``dim``, in the compute dtype.

    The cast comes first (on the shard), so nothing full-size but the gathered value itself
    exists, and the remat policy refuses to keep that one: the backward pass gathers again.
    The gradient's reduce-scatter (the gather's transpose) therefore runs in the compute dtype.
    """
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
        jax.tree.unflatten(jax.tree.structure(dims), jax.tree.leaves(groups, is_leaf=_is_group)),
    )


def _is_zero3_gather(prim: Any, params: dict) -> bool:
    if prim.name == "name":
        return params.get("name") == ZERO3_NAME
    if "all_gather" in prim.name:  # over data: a gathered parameter (the experts' all-gather of
        # tokens runs over `expert` alone)
        axes = params.get("axis_name", ())
        return MeshAxis.DATA in (axes if isinstance(axes, tuple) else (axes,))
    return False


def _save_all_but_zero3_gathers(prim: Any, *_: Any, **params: Any) -> bool:
    """Remat policy for ZeRO-3 without recomputation: keep every residual except gathered
    parameters (the all-gather over ``data`` and its named output), which are gathered again."""
    return not _is_zero3_gather(prim, params)


def remat_policy(remat: str) -> Any:
    """The ``jax.checkpoint`` policy of ``model.remat`` (``none`` with ZeRO-3: keep all but the gathers)."""
    policies = jax.checkpoint_policies
    if remat == "full":
        return policies.nothing_saveable
    if remat == "selective":  # keep weight-matmul outputs, recompute the attention core
        # dense's dot sits inside a custom_vjp the dot policy does not see into: its output is named
        return policies.save_from_both_policies(
            policies.dots_with_no_batch_dims_saveable, policies.save_only_these_names(DENSE_NAME)
        )
    return _save_all_but_zero3_gathers


# --------------------------------------------------------------------------- gradient side


def map_placements(fn: Callable, placements: Any, *trees: Any) -> Any:
    """``fn(layout, *leaves)`` over a tree of :class:`ParamPlacement` and trees of the same structure."""
    return jax.tree.map(lambda lay, *xs: fn(lay, *xs), placements, *trees, is_leaf=is_placement)


def is_split_over(lay: ParamPlacement, axis: MeshAxis) -> bool:
    """Whether the gradient (laid out like the optimizer state) is split over ``axis``."""
    return axis in jax.tree.leaves(tuple(lay.optimizer))


def vary_replicated(placements: Any, params: Any, over_pipeline: bool) -> Any:
    """Mark every parameter replicated over ``data`` (and, in a pipeline, over ``pipeline``) as
    varying there, so that its gradient is this shard's local, unreduced one: the reduction of
    :func:`reduce_grads` (pipeline: the schedule's sum) is then the only collective on gradients
    (the gradient with respect to the replicated value would carry the cast's transpose, an
    all-reduce)."""

    def one(lay: ParamPlacement, p):
        axes = () if lay.sharded_storage else group_axes(lay.zero_axes)
        if over_pipeline and not is_split_over(lay, MeshAxis.PIPELINE):
            axes += (MeshAxis.PIPELINE,)
        return jax.lax.pcast(p, axes, to="varying") if axes else p

    return map_placements(one, placements, params)


def reduce_grads(placements: Any, grads: Any, scatter: bool, reduce_dtype: Any, prescattered: bool = False) -> Any:
    """Reduce local gradients over ``data`` in ``reduce_dtype``: reduce-scatter on the ZeRO dim where
    the optimizer state (or the accumulation buffer) is sharded and ``scatter`` is set, all-reduce
    otherwise. Stage-3 gradients arrive reduce-scattered (the gather's transpose), and so do the
    optimizer-sharded ones when ``prescattered`` (the pipeline's ZeRO-2 ticks). Returns fp32."""

    def one(lay: ParamPlacement, g):
        if lay.sharded_storage or (prescattered and lay.sharded_optimizer):
            return g.astype(jnp.float32)
        g = g.astype(reduce_dtype)
        if scatter and lay.sharded_optimizer:
            g = jax.lax.psum_scatter(g, lay.zero_axes, scatter_dimension=lay.zero_dim, tiled=True)
        else:
            g = jax.lax.psum(g, lay.zero_axes)
        return g.astype(jnp.float32)

    return map_placements(one, placements, grads)


def local_shard(x: jax.Array, lay: ParamPlacement) -> jax.Array:
    """This data rank's ZeRO shard of a parameter replicated over ``data`` (stages 1 and 2)."""
    size = x.shape[lay.zero_dim] // jax.lax.axis_size(lay.zero_axes)
    start = jax.lax.axis_index(lay.zero_axes) * size
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=lay.zero_dim)


def gather_update(new_shard: jax.Array, lay: ParamPlacement) -> jax.Array:
    """Stages 1 and 2: the updated shards all-gathered into the replicated parameter."""
    return all_gather_invariant(new_shard, lay.zero_axes, axis=lay.zero_dim)


def shards_locally(lay: ParamPlacement) -> bool:
    """The optimizer updates a shard of a parameter stored whole (stages 1 and 2)."""
    return lay.sharded_optimizer and not lay.sharded_storage
