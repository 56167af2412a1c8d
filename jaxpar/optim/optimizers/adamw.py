"""jaxpar's AdamW (``optim.name='adamw'``, the default), all of it: the update that runs on each
device's shard inside the step's ``shard_map`` (:func:`update`), its state and the state's specs,
the state-size formula the planner prices, and ``optax.adamw``, its reference (tests/test_optim.py).

The update is optax.scale_by_adam (Kingma & Ba 2015, arXiv:1412.6980) with decoupled weight decay
(Loshchilov & Hutter 2019, arXiv:1711.05101), or L2 on the gradient with
``decoupled_weight_decay=False``. Elementwise, so exact on shards: ZeRO-1/2 update the local shard
of the optimizer spec and gather the new parameters (:mod:`jaxpar.parallel.zero`). A bad step
multiplies by exactly 1 and adds 0, so the donated buffers are updated in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxpar.config import ConfigDict
from jaxpar.optim.state import StateLeaf, same_shape
from jaxpar.optim.transforms import decay_mask
from jaxpar.parallel import zero
from jaxpar.sharding import ParamPlacement, is_placement

FIELDS = {"b1", "b2", "eps", "weight_decay", "decoupled_weight_decay"}
IN_SHARD_MAP = True  # the step calls update() on each device's shard; build() is the reference


def build(o: ConfigDict, schedule: Callable, placements: Any) -> optax.GradientTransformation:
    """``optax.adamw`` with the same fields: the reference :func:`update` is tested against."""
    mask = decay_mask(placements)
    if o.decoupled_weight_decay:
        return optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=mask)
    adam = optax.adam(schedule, b1=o.b1, b2=o.b2, eps=o.eps)
    return optax.chain(optax.add_decayed_weights(o.weight_decay, mask), adam)  # L2 (Adam)


def state(o: ConfigDict, shape: tuple[int, ...], logical: tuple[str, ...]) -> list[StateLeaf]:
    return [same_shape(shape), same_shape(shape)]  # mu, nu (fp32)


def init_state(params: Any) -> dict:
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    return {"count": jnp.zeros((), jnp.int32), "mu": zeros, "nu": jax.tree.map(jnp.copy, zeros)}


def state_specs(placements: Any) -> dict:
    moments = jax.tree.map(lambda place: place.optimizer, placements, is_leaf=is_placement)
    return {"count": P(), "mu": moments, "nu": moments}


def update(
    o: ConfigDict, placements: Any, params: Any, grads: Any, opt_state: Any, lr: jax.Array, ok: jax.Array
) -> tuple[Any, dict]:
    """AdamW on each parameter's (local) shard: (new parameters, new state); ``ok`` false keeps
    every value as it was."""
    step = opt_state["count"]
    count = step + 1
    bc1 = 1 - o.b1 ** count.astype(jnp.float32)
    bc2 = 1 - o.b2 ** count.astype(jnp.float32)
    # A skipped step (ok false) multiplies by exactly 1 and adds exactly 0: every value stays
    # bitwise as it was. Scalars rather than a select over the results keep the update
    # in place in the donated buffers (a select would hold old and new side by side).
    b1, c1 = jnp.where(ok, o.b1, 1.0), jnp.where(ok, 1 - o.b1, 0.0)
    b2, c2 = jnp.where(ok, o.b2, 1.0), jnp.where(ok, 1 - o.b2, 0.0)
    step_lr = jnp.where(ok, lr, 0.0)

    def one(place: ParamPlacement, p, g, m, v):
        local = p
        if zero.shards_locally(place):
            local = zero.local_shard(p, place)
        decay = o.weight_decay if place.weight_decay else 0.0
        if not o.decoupled_weight_decay and decay:
            g = g + decay * local
        g = jnp.where(ok, g, 0.0)  # a skipped step may carry NaN/Inf gradients
        m = b1 * m + c1 * g
        v = b2 * v + c2 * g * g
        update = (m / bc1) / (jnp.sqrt(v / bc2) + o.eps)  # optax.scale_by_adam
        if o.decoupled_weight_decay and decay:
            update = update + decay * local
        new = local - step_lr * update
        if zero.shards_locally(place):  # ZeRO-1/2: gather the update
            new = zero.gather_update(new, place)
        return new, m, v

    out = zero.map_placements(one, placements, params, grads, opt_state["mu"], opt_state["nu"])
    new_params, mu, nu = (
        jax.tree.map(lambda t, i=i: t[i], out, is_leaf=lambda t: isinstance(t, tuple)) for i in range(3)
    )
    return new_params, {"count": jnp.where(ok, step + 1, step), "mu": mu, "nu": nu}
