"""``optim.name='sgd'``: ``optax.sgd`` with ``optim.momentum`` (default 0.9; 0: none) and
``optim.nesterov``; decoupled weight decay ``lr(k) * weight_decay * p``, or L2 on the gradient
(``torch.optim.SGD``'s ``weight_decay``) with ``decoupled_weight_decay=False``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax

from jaxpar.config import ConfigDict
from jaxpar.optim.fields import momentum
from jaxpar.optim.state import StateLeaf, same_shape
from jaxpar.optim.transforms import decay_mask

FIELDS = {"momentum", "nesterov", "weight_decay", "decoupled_weight_decay"}
DEFAULT_MOMENTUM = 0.9  # optim.momentum = -1


def build(o: ConfigDict, schedule: Callable, placements: Any) -> optax.GradientTransformation:
    beta = momentum(o, DEFAULT_MOMENTUM) or None
    decay = optax.add_decayed_weights(o.weight_decay, decay_mask(placements))
    if not o.decoupled_weight_decay:  # L2: torch.optim.SGD's weight_decay
        return optax.chain(decay, optax.sgd(schedule, momentum=beta, nesterov=o.nesterov))
    parts = [optax.trace(decay=beta, nesterov=o.nesterov)] if beta else []
    return optax.chain(*parts, decay, optax.scale_by_learning_rate(schedule))


def state(o: ConfigDict, shape: tuple[int, ...], logical: tuple[str, ...]) -> list[StateLeaf]:
    return [same_shape(shape)] if momentum(o, DEFAULT_MOMENTUM) else []  # the trace
