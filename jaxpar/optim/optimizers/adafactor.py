"""``optim.name='adafactor'``: ``optax.adafactor`` (Shazeer & Stern 2018, arXiv:1804.04235) per
tensor (:func:`jaxpar.optim.transforms.per_tensor`: stacked layers are batch dims) with optax's
defaults: factored second moments when the second-largest dim is >= 128, update clipping 1.0,
parameter scale. ``optim.momentum`` > 0 adds momentum (default 0: none); decoupled weight decay
``lr(k) * weight_decay * p`` where the parameter decays."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from jaxpar.config import ConfigDict
from jaxpar.optim.fields import momentum
from jaxpar.optim.state import StateLeaf, same_shape
from jaxpar.optim.transforms import batch_dims, per_tensor
from jaxpar.sharding import is_placement

FIELDS = {"momentum", "weight_decay"}
DEFAULT_MOMENTUM = 0.0  # optim.momentum = -1
MIN_DIM_TO_FACTOR = 128  # optax.adafactor's default


def build(o: ConfigDict, schedule: Callable, placements: Any) -> optax.GradientTransformation:
    # optax.adafactor adds weight_decay_rate * p after the learning rate: a schedule makes it lr(k) * wd.
    inner = lambda wd: optax.adafactor(  # noqa: E731
        schedule,
        momentum=momentum(o, DEFAULT_MOMENTUM) or None,
        weight_decay_rate=(lambda k: schedule(k) * o.weight_decay) if wd else None,
    )
    dims = jax.tree.map(lambda place: batch_dims(place.logical), placements, is_leaf=is_placement)
    labels = jax.tree.map(
        lambda place: "decay" if place.weight_decay and o.weight_decay else "plain", placements, is_leaf=is_placement
    )
    return per_tensor({"decay": inner(True), "plain": inner(False)}, labels, dims)


def _scalar_per_batch(shape: tuple[int, ...], b: int) -> StateLeaf:
    return tuple(shape[:b]), tuple(range(b))


def state(o: ConfigDict, shape: tuple[int, ...], logical: tuple[str, ...]) -> list[StateLeaf]:
    """optax.scale_by_factored_rms per layer: factored over the two largest dims d1 (second) and d0
    (largest) of the per-layer tensor when d1 >= 128: v_row drops d0, v_col drops d1; else a full v."""
    b = batch_dims(logical)
    inner = shape[b:]
    batch = tuple(range(b))
    one = (tuple(shape[:b]) + (1,), batch + (None,))  # optax's (1,) placeholder, per layer
    out = [_scalar_per_batch(shape, b)]  # factored-rms count
    order = np.argsort(inner) if len(inner) >= 2 else None
    if order is not None and inner[order[-2]] >= MIN_DIM_TO_FACTOR:
        d1, d0 = b + int(order[-2]), b + int(order[-1])
        for drop in (d0, d1):
            kept = tuple(i for i in range(len(shape)) if i != drop)
            out.append((tuple(shape[i] for i in kept), kept))
        out.append(one)
    else:
        out += [one, one, same_shape(shape)]
    out.append(_scalar_per_batch(shape, b))  # scale_by_learning_rate's count
    if momentum(o, DEFAULT_MOMENTUM):
        out += [_scalar_per_batch(shape, b), same_shape(shape)]  # ema count, ema
    return out
