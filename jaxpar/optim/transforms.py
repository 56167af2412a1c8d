"""Small gradient transformations the registry composes with optax's.

* :func:`per_tensor`: a transformation on every parameter separately, the leading stacked dims
  (``layers``, the pipeline's ``stages``) as batch dims (``jax.vmap``). jaxpar stores a weight's L
  layers as one [L, ...] array where PyTorch has a tensor per layer; per-tensor statistics
  (Adafactor's RMS clipping, parameter scale, factored moments) are then taken per layer, as in
  PyTorch, and alike in the stage and model forms of the parameters.
* :func:`batch_dims`: how many leading dims of a parameter are stacked layers (``layers``, ``stages``).
* :func:`decay_mask`: which parameters take weight decay (:class:`jaxpar.sharding.ParamPlacement`).
* :func:`decoupled_weight_decay`: ``u - lr(k) * rate * p`` on masked leaves (AdamW's decoupled,
  learning-rate-scaled decay, Loshchilov & Hutter 2019, arXiv:1711.05101) for optimizers whose optax
  alias has no masked decay of that kind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxpar.sharding import is_placement

STACKED = ("layers", "stages")  # leading stacked dims: batch dims of per-tensor statistics


def batch_dims(logical: tuple[str, ...]) -> int:
    """Number of leading stacked dims (``layers``, ``stages``) of a parameter's logical dims."""
    n = 0
    while n < len(logical) and logical[n] in STACKED:
        n += 1
    return n


def decay_mask(placements: Any) -> Any:
    """A tree of bools like the parameters: True where the parameter decays (not norms, biases)."""
    return jax.tree.map(lambda place: place.weight_decay, placements, is_leaf=is_placement)


def _vmapped(fn: Callable, batch_dims: int) -> Callable:
    for _ in range(batch_dims):
        fn = jax.vmap(fn)
    return fn


def per_tensor(
    transforms: dict[str, optax.GradientTransformation], labels: Any, batch_dims: Any
) -> optax.GradientTransformation:
    """``transforms[label]`` applied to each parameter leaf on its own, vmapped over its leading
    ``batch_dims`` dims.

    ``labels`` (str) and ``batch_dims`` (int): trees shaped like the parameters. The state is a tree
    shaped like the parameters whose leaves are the per-parameter states (their leaves carry the
    batch dims in front: a per-layer step count is an [L] vector)."""

    def init(params: Any) -> Any:
        return jax.tree.map(lambda p, lab, b: _vmapped(transforms[lab].init, b)(p), params, labels, batch_dims)

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        leaves, treedef = jax.tree.flatten(updates)
        states = treedef.flatten_up_to(state)
        ps = treedef.flatten_up_to(params) if params is not None else [None] * len(leaves)
        labs, dims = treedef.flatten_up_to(labels), treedef.flatten_up_to(batch_dims)
        out = []
        for u, s, p, lab, b in zip(leaves, states, ps, labs, dims, strict=True):
            tx = transforms[lab]
            if p is None:
                out.append(_vmapped(lambda u, s, tx=tx: tx.update(u, s), b)(u, s))
            else:
                out.append(_vmapped(lambda u, s, p, tx=tx: tx.update(u, s, p), b)(u, s, p))
        return treedef.unflatten([o[0] for o in out]), treedef.unflatten([o[1] for o in out])

    return optax.GradientTransformation(init, update)


def decoupled_weight_decay(schedule: Callable, rate: float, mask: Any) -> optax.GradientTransformation:
    """Add ``-schedule(k) * rate * p`` to the (already learning-rate-scaled, descent-signed) updates
    of the leaves where ``mask`` is true; k counts this transformation's updates."""

    def init(params: Any) -> optax.ScaleByScheduleState:
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros((), jnp.int32))

    def update(updates: Any, state: optax.ScaleByScheduleState, params: Any = None):
        step = schedule(state.count) * rate
        new = jax.tree.map(lambda u, p, m: u - step * p if m else u, updates, params, mask)
        return new, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init, update)
