"""Optimizer state laid out like its parameters: shardings, sizes and the pipeline's two forms.

Derived from the state's *shapes* (``jax.eval_shape(tx.init, params)``), never from leaf names:

* A state leaf belongs to the parameter whose tree path runs, contiguously, inside its own
  (``[0].mu['blocks']['attn']['wq']``; :func:`jaxpar.optim.transforms.per_tensor` puts the
  parameter path first); leaves of no parameter (step counts) are replicated.
* :func:`kept_dims`: which parameter dim each leaf dim runs along (greedy, left to right, by size).
  A same-shape leaf takes the parameter's optimizer spec (ZeRO >= 1 splits it over ``data``), a
  factored leaf (Adafactor's v_row / v_col) the entries of the dims it keeps, a scalar none. (For a
  square matrix the match may pick the other dim: only where the bytes live changes.)
* :func:`convert_state`: stage form <-> model form (:mod:`jaxpar.parallel.pipeline.forms`) for
  every leaf: leaves keeping the ``layers`` dim are permuted like the layers; of ``ends`` [p, V, h],
  slot 0 becomes ``embed`` and slot p-1 ``lm_head`` (transposed): per slot a parameter-shaped leaf
  is transposed, a smaller one (factored moments, counts) copied, exact because optax factors by
  dim *size*, so head^T and head have the same statistics (V == h would swap them: refused). The
  middle slots hold zero parameters: same-shape leaves get zeros, smaller ones slot 0's values.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar.config import ConfigError

Path = tuple
# A state leaf of one parameter: (shape, kept) where kept[i] is the parameter dim that leaf dim i
# runs along (None: a dim of its own, e.g. a size-1 placeholder). Same shape: kept = all dims.
StateLeaf = tuple[tuple[int, ...], tuple[int | None, ...]]


def same_shape(shape: tuple[int, ...]) -> StateLeaf:
    """A state leaf shaped like its parameter (a moment)."""
    return tuple(shape), tuple(range(len(shape)))


def kept_dims(shape: tuple[int, ...], param_shape: tuple[int, ...]) -> tuple[int | None, ...] | None:
    """For each leaf dim, the parameter dim it runs along (None: a size-1 dim of its own); None if the
    leaf is not a sub-shape of the parameter."""
    out, j = [], 0
    for size in shape:
        while j < len(param_shape) and param_shape[j] != size:
            j += 1
        if j < len(param_shape):
            out.append(j)
            j += 1
        elif size == 1:
            out.append(None)
        else:
            return None
    return tuple(out)


def spec_for(kept: tuple[int | None, ...] | None, param_spec: P) -> P:
    if not kept:
        return P()
    entries = tuple(param_spec) + (None,) * 8
    return P(*(None if k is None else entries[k] for k in kept))


def _param_paths(params: Any) -> list[tuple[Path, Any]]:
    return [(tuple(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(params)]


def owner(path: Path, params_index: list[tuple[Path, Any]]) -> tuple[int, int] | None:
    """(index into params_index, start of the parameter path inside ``path``), longest match."""
    best = None
    for i, (ppath, _) in enumerate(params_index):
        n = len(ppath)
        for start in range(len(path) - n + 1):
            if path[start : start + n] == ppath and (best is None or n > len(params_index[best[0]][0])):
                best = (i, start)
                break
    return best


def state_specs(abstract_state: Any, abstract_params: Any, param_specs: Any) -> Any:
    """A PartitionSpec per state leaf (see the module docstring)."""
    index = _param_paths(abstract_params)
    specs = [
        s for _, s in _param_paths(jax.tree.map(lambda s: _Box(s), param_specs, is_leaf=lambda x: isinstance(x, P)))
    ]

    def one(path, leaf):
        hit = owner(tuple(path), index)
        if hit is None or not leaf.shape:
            return P()
        return spec_for(kept_dims(tuple(leaf.shape), tuple(index[hit[0]][1].shape)), specs[hit[0]].spec)

    return jax.tree_util.tree_map_with_path(one, abstract_state)


class _Box:
    """Wraps a PartitionSpec so it is one leaf (PartitionSpec is a tuple)."""

    def __init__(self, spec: P):
        self.spec = spec


def local_size(shape: tuple[int, ...], spec: P, mesh_shape: dict) -> int:
    """Elements of one device's shard of ``shape`` under ``spec``."""
    out = 1
    for i, size in enumerate(shape):
        entry = tuple(spec)[i] if i < len(tuple(spec)) else None
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out *= size // math.prod(mesh_shape[a] for a in axes)
    return out


# --------------------------------------------------------------------------- pipeline forms


def convert_state(
    state: Any,
    target: Any,
    dst_params: Any,
    to_model: bool,
    permute: Callable[[jax.Array, int], jax.Array],
    has_ends: bool,
    stacked: str,
) -> Any:
    """Move optimizer ``state`` from one form to the layout of ``target`` (an abstract state for
    ``dst_params``, the parameters in the other form). ``permute(x, dim)`` reorders the stacked
    layer dim ``dim`` of ``x`` the way the parameters' layers move; ``stacked``: the model's subtree of
    stacked layers (:attr:`jaxpar.models.base.Model.stacked`)."""
    dst_index = _param_paths(dst_params)
    src = {tuple(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(state)}
    out = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(target):
        path = tuple(path)
        hit = owner(path, dst_index)
        if hit is None:  # a step count: the same in both forms
            out.append(src[path])
            continue
        ppath, pleaf = dst_index[hit[0]]
        pre, post = path[: hit[1]], path[hit[1] + len(ppath) :]
        name = _key(ppath[0])
        if has_ends and to_model and name in ("embed", "lm_head"):
            ends = src[pre + (jax.tree_util.DictKey("ends"),) + post]
            out.append(_from_ends(ends, name, pleaf.shape, leaf.shape))
        elif has_ends and not to_model and name == "ends":
            e = src[pre + (jax.tree_util.DictKey("embed"),) + post]
            h = src[pre + (jax.tree_util.DictKey("lm_head"),) + post]
            out.append(_to_ends(e, h, pleaf.shape, leaf.shape))
        else:
            x = src[path]
            kept = kept_dims(tuple(leaf.shape), tuple(pleaf.shape))
            if name == stacked and kept and kept[0] == 0:
                x = permute(x, 0)
            out.append(x)
    return jax.tree.unflatten(jax.tree.structure(target), out)


def _key(k: Any) -> str:
    return str(getattr(k, "key", getattr(k, "name", k)))


def _check_square(shape: tuple[int, ...], slot_leaf: tuple[int, ...]) -> None:
    if len(shape) >= 2 and shape[-1] == shape[-2] and tuple(slot_leaf) != tuple(shape[-2:]) and slot_leaf:
        raise ConfigError(
            "optimizer state: a factored moment of a square output layer (vocab_size == embed_dim) "
            "cannot move between pipeline forms; use model.tie_embeddings or another optimizer"
        )


def _from_ends(ends: jax.Array, name: str, param_shape: tuple[int, ...], shape: tuple[int, ...]) -> jax.Array:
    slot = ends[0] if name == "embed" else ends[-1]
    if name == "lm_head" and slot.ndim == 2 and tuple(slot.shape) == tuple(param_shape)[::-1]:
        return jnp.transpose(slot)
    _check_square(tuple(ends.shape[1:]), tuple(slot.shape))
    return slot.reshape(shape)


def _to_ends(e: jax.Array, h: jax.Array, param_shape: tuple[int, ...], shape: tuple[int, ...]) -> jax.Array:
    stages = shape[0]
    same = tuple(shape[1:]) == tuple(param_shape[1:])
    if same:
        h = jnp.transpose(h)
    else:
        _check_square(tuple(param_shape[1:]), tuple(e.shape))
    middle = [jnp.zeros_like(e) if same else e] * (stages - 2)
    return jnp.stack([e, *middle, h.astype(e.dtype)])


def layer_permuter(order: np.ndarray) -> Callable[[jax.Array, int], jax.Array]:
    return lambda x, dim: jnp.take(x, order, axis=dim)
