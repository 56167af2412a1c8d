"""``optim.name='lion'``: ``optax.lion`` (Chen et al. 2023, arXiv:2302.06675), the sign of an
interpolated momentum; one fp32 moment per parameter; decoupled weight decay where the parameter
decays."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax

from jaxpar.config import ConfigDict
from jaxpar.optim.state import StateLeaf, same_shape
from jaxpar.optim.transforms import decay_mask

FIELDS = {"b1", "b2", "weight_decay"}


def build(o: ConfigDict, schedule: Callable, placements: Any) -> optax.GradientTransformation:
    return optax.lion(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, mask=decay_mask(placements))


def state(o: ConfigDict, shape: tuple[int, ...], logical: tuple[str, ...]) -> list[StateLeaf]:
    return [same_shape(shape)]  # the momentum
