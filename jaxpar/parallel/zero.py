"""ZeRO's gradient side over ``data``, driven by the per-parameter placements (:class:`jaxpar.sharding.ParamPlacement`).

ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models") shards, over the ``data`` axis, the optimizer state (stage 1), the gradients (stage 2)
and the parameters (stage 3) of every parameter that has a ZeRO dim. Here: parameters replicated
over ``data`` are marked varying so their gradients stay local (:func:`vary_replicated`); one
reduction per step (:func:`reduce_grads`; stage 0: all-reduce; stage 1: reduce-scatter; stage 2:
reduce-scatter per microbatch into a sharded accumulator) leaves each gradient laid out like its
optimizer state; the optimizer updates this rank's shard (:func:`local_shard`) and, at stages 1
and 2, the updated shards are all-gathered into the replicated parameter (:func:`gather_update`).

Stage 3's forward side, the parameter gathers the model runs, is a kernel below the models:
:mod:`jaxpar.ops.zero3` (and the remat policy that never keeps the gathered copies,
:mod:`jaxpar.ops.remat`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.axes import MeshAxis, group_axes
from jaxpar.compat import all_gather_invariant
from jaxpar.sharding import ParamPlacement, is_placement


def map_placements(fn: Callable, placements: Any, *trees: Any) -> Any:
    """``fn(layout, *leaves)`` over a tree of :class:`ParamPlacement` and trees of the same structure."""
    return jax.tree.map(lambda place, *xs: fn(place, *xs), placements, *trees, is_leaf=is_placement)


def is_split_over(place: ParamPlacement, axis: MeshAxis) -> bool:
    """Whether the gradient (laid out like the optimizer state) is split over ``axis``."""
    return axis in jax.tree.leaves(tuple(place.optimizer))


def vary_replicated(placements: Any, params: Any, over_pipeline: bool) -> Any:
    """Mark every parameter replicated over ``data`` (and, in a pipeline, over ``pipeline``) as
    varying there, so that its gradient is this shard's local, unreduced one: the reduction of
    :func:`reduce_grads` (pipeline: the schedule's sum) is then the only collective on gradients
    (the gradient with respect to the replicated value would carry the cast's transpose, an
    all-reduce)."""

    def one(place: ParamPlacement, p):
        axes = () if place.sharded_storage else group_axes(place.zero_axes)
        if over_pipeline and not is_split_over(place, MeshAxis.PIPELINE):
            axes += (MeshAxis.PIPELINE,)
        return jax.lax.pcast(p, axes, to="varying") if axes else p

    return map_placements(one, placements, params)


def reduce_grads(placements: Any, grads: Any, scatter: bool, reduce_dtype: Any, prescattered: bool = False) -> Any:
    """Reduce local gradients over ``data`` in ``reduce_dtype``: reduce-scatter on the ZeRO dim where
    the optimizer state (or the accumulation buffer) is sharded and ``scatter`` is set, all-reduce
    otherwise. Stage-3 gradients arrive reduce-scattered (the gather's transpose), and so do the
    optimizer-sharded ones when ``prescattered`` (the pipeline's ZeRO-2 ticks). Returns fp32."""

    def one(place: ParamPlacement, g):
        if place.sharded_storage or (prescattered and place.sharded_optimizer):
            return g.astype(jnp.float32)
        g = g.astype(reduce_dtype)
        if scatter and place.sharded_optimizer:
            g = jax.lax.psum_scatter(g, place.zero_axes, scatter_dimension=place.zero_dim, tiled=True)
        else:
            g = jax.lax.psum(g, place.zero_axes)
        return g.astype(jnp.float32)

    return map_placements(one, placements, grads)


def local_shard(x: jax.Array, place: ParamPlacement) -> jax.Array:
    """This data rank's ZeRO shard of a parameter replicated over ``data`` (stages 1 and 2)."""
    size = x.shape[place.zero_dim] // jax.lax.axis_size(place.zero_axes)
    start = jax.lax.axis_index(place.zero_axes) * size
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=place.zero_dim)


def gather_update(new_shard: jax.Array, place: ParamPlacement) -> jax.Array:
    """Stages 1 and 2: the updated shards all-gathered into the replicated parameter."""
    return all_gather_invariant(new_shard, place.zero_axes, axis=place.zero_dim)


def shards_locally(place: ParamPlacement) -> bool:
    """The optimizer updates a shard of a parameter stored whole (stages 1 and 2)."""
    return place.sharded_optimizer and not place.sharded_storage
