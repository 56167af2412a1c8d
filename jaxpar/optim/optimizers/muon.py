"""``optim.name='muon'``, where the installed optax has ``optax.contrib.muon`` (Jordan et al. 2024;
Liu et al. 2025, arXiv:2502.16982): Newton-Schulz orthogonalised momentum (``optim.momentum``,
default 0.95, ``optim.nesterov``) for the block weight matrices (:func:`muon_dims`), AdamW (``b1``,
``b2``, ``eps``) for the rest; decoupled weight decay where the parameter decays."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

from jaxpar.config import ConfigDict
from jaxpar.optim.fields import momentum
from jaxpar.optim.state import StateLeaf, same_shape
from jaxpar.optim.transforms import batch_dims, decay_mask, decoupled_weight_decay
from jaxpar.sharding import is_placement

FIELDS = {"momentum", "nesterov", "b1", "b2", "eps", "weight_decay"}
DEFAULT_MOMENTUM = 0.95  # optim.momentum = -1


def available() -> bool:
    """optax.contrib.muon exists in the installed optax."""
    try:
        from optax.contrib import muon  # noqa: F401
    except ImportError:
        return False
    return True


def muon_dims(logical: tuple[str, ...]) -> Any:
    """optax.contrib.muon's dimension numbers for one parameter, None where AdamW applies: weight
    matrices of the blocks (>= 2 dims besides the stacked ones, which are batch dims; no vocabulary
    dim). Input dims: ``embed``, or all but the last; output dims: the rest."""
    from optax.contrib import MuonDimensionNumbers

    b = batch_dims(logical)
    rest = logical[b:]
    if len(rest) < 2 or "vocab" in rest:
        return None
    n = len(logical)
    if rest[0] == "embed":  # input features first: x @ W
        return MuonDimensionNumbers(reduction_axis=(b,), output_axis=tuple(range(b + 1, n)))
    return MuonDimensionNumbers(reduction_axis=tuple(range(b, n - 1)), output_axis=(n - 1,))


def build(o: ConfigDict, schedule: Callable, placements: Any) -> optax.GradientTransformation:
    from optax.contrib import muon

    dims = jax.tree.map(lambda place: muon_dims(place.logical), placements, is_leaf=is_placement)
    tx = muon(
        schedule,
        beta=momentum(o, DEFAULT_MOMENTUM),
        eps=o.eps,
        nesterov=o.nesterov,
        adam_b1=o.b1,
        adam_b2=o.b2,
        muon_weight_dimension_numbers=dims,
    )
    if not o.weight_decay:
        return tx
    return optax.chain(tx, decoupled_weight_decay(schedule, o.weight_decay, decay_mask(placements)))


def state(o: ConfigDict, shape: tuple[int, ...], logical: tuple[str, ...]) -> list[StateLeaf]:
    if muon_dims(logical) is not None:
        return [same_shape(shape)]  # momentum
    return [same_shape(shape), same_shape(shape)]  # AdamW mu, nu
