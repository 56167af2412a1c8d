"""ZeRO-3 on the forward side: gathering parameter shards over ``data`` and the remat policy.

ZeRO-3 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", stage P_os+g+p; PyTorch FSDP's full sharding) stores each parameter split over ``data`` on
its ZeRO dim (:func:`jaxpar.sharding.zero_dim`) and all-gathers it just before use. The model
receives the split dims as a *tree of dims* matching its parameter tree (:func:`zero3_dims`, an int
per leaf, :data:`NOT_GATHERED` for a parameter stored whole), so nothing matches parameter paths.

The gathered copies are named :data:`ZERO3_NAME`; the remat policy (:func:`remat_policy`) never
keeps them, so the backward pass gathers each layer again and the gather's transpose
reduce-scatters its gradient, one layer at a time. The gradient side of the step (the reductions
over ``data`` of the other stages) lives in :mod:`jaxpar.train.step`.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

from jaxpar.axes import MeshAxis
from jaxpar.sharding import is_layout

ZERO3_NAME = "zero3_gathered_param"  # checkpoint_name of a gathered parameter (the remat policy's key)
NOT_GATHERED = -1  # entry of a dims tree: the parameter is stored whole, nothing to gather


def zero3_dims(layouts: Any) -> Any | None:
    """Tree of the dims ZeRO-3 splits over ``data`` (one int per parameter, ``NOT_GATHERED`` for
    those stored whole), from a tree of :class:`~jaxpar.sharding.ParamLayout`; ``None`` when no
    parameter is stored sharded (ZeRO 0-2)."""
    dims = jax.tree.map(lambda lay: lay.zero_dim if lay.sharded_storage else NOT_GATHERED, layouts, is_leaf=is_layout)
    return dims if any(d != NOT_GATHERED for d in jax.tree.leaves(dims)) else None


def layer_dims(dims: Any) -> Any:
    """The dims tree of one layer of a stacked (scanned) subtree: the leading ``layers`` dim is gone."""
    return jax.tree.map(lambda d: d - 1 if d != NOT_GATHERED else NOT_GATHERED, dims)


def gather_param(p: jax.Array, dim: int, data_axis: str, compute_dtype: Any) -> jax.Array:
    """All-gather one parameter's shards over ``data_axis`` on ``dim``, in the compute dtype.

    The cast comes first (on the shard), so nothing full-size but the gathered value itself
    exists, and the remat policy refuses to keep that one: the backward pass gathers again.
    The gradient's reduce-scatter (the gather's transpose) therefore runs in the compute dtype.
    """
    p = p.astype(compute_dtype)
    return checkpoint_name(jax.lax.all_gather(p, data_axis, axis=dim, tiled=True), ZERO3_NAME)


def gather_tree(tree: Any, dims: Any, data_axis: str, compute_dtype: Any) -> Any:
    """Gather every leaf of ``tree`` whose entry in ``dims`` (same structure) is a dim."""
    return jax.tree.map(
        lambda p, d: p if d == NOT_GATHERED else gather_param(p, d, data_axis, compute_dtype), tree, dims
    )


def _is_zero3_gather(prim: Any, params: dict) -> bool:
    if prim.name == "name":
        return params.get("name") == ZERO3_NAME
    if "all_gather" in prim.name:
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
        return policies.dots_with_no_batch_dims_saveable
    return _save_all_but_zero3_gathers
