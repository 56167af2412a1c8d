"""fp16 loss scaling (``train.loss_scale``, with ``model.compute_dtype=float16``).

The loss is multiplied by the scale before the backward pass, so small fp16 gradients do not
underflow, and the gradients are divided by it before clipping and the update (Micikevicius et al.
2018, "Mixed Precision Training"). ``static > 0`` is a fixed scale; ``static = 0`` a dynamic one that
starts at ``2**initial_scale_power``: a step whose gradients overflow (a non-finite gradient norm) is
skipped; the ``hysteresis``-th overflow since the hysteresis was last full halves the scale (never
below ``min_scale``), and so does every overflow after it until a growth refills the hysteresis;
``window`` good steps double the scale. Two rules, as the frameworks whose recipes port here run them:

* ``deepspeed`` (DeepSpeed's ``DynamicLossScaler``): the scale doubles at every good step whose
  count of good steps before it since the last overflow (or the start) is a positive multiple of
  ``window``, which also refills the hysteresis (``consecutive_hysteresis``: every good step
  refills it); an overflow at ``min_scale`` with the hysteresis spent stops the run.
* ``megatron`` (Megatron-LM's ``DynamicGradScaler``): an overflow resets the good-step count; each
  ``window`` good steps in a row double the scale and refill the hysteresis.

The state (scale, step tracker, hysteresis left) is kept in the optimizer state (``opt_state
["loss_scale"]``), so checkpoints hold it and a resumed run continues with the same scale.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

RULES = ("deepspeed", "megatron")


@dataclasses.dataclass(frozen=True)
class LossScale:
    """A validated ``train.loss_scale``; :func:`from_config` gives None where no scale applies."""

    static: float
    initial: float
    window: int
    hysteresis: int
    min_scale: float
    consecutive_hysteresis: bool
    rule: str

    @property
    def dynamic(self) -> bool:
        return self.static == 0


def from_config(model_cfg: Any, train_cfg: Any) -> LossScale | None:
    """The loss scale of a run: None unless ``model.compute_dtype`` is float16."""
    if model_cfg.compute_dtype != "float16":
        return None
    ls = train_cfg.loss_scale
    return LossScale(
        static=float(ls.static),
        initial=float(2.0**ls.initial_scale_power),
        window=int(ls.window),
        hysteresis=int(ls.hysteresis),
        min_scale=float(ls.min_scale),
        consecutive_hysteresis=bool(ls.consecutive_hysteresis),
        rule=str(ls.rule),
    )


def init_state(ls: LossScale) -> dict[str, jax.Array]:
    """``tracker``: deepspeed: steps since the last overflow (1 at the start); megatron: good steps in a row."""
    return {
        "scale": jnp.float32(ls.static or ls.initial),
        "tracker": jnp.int32(1 if ls.rule == "deepspeed" else 0),
        "hysteresis": jnp.int32(ls.hysteresis),
    }


def add_state(opt_state: dict, ls: LossScale | None) -> dict:
    """``opt_state`` with the loss scale's state added (unchanged without a scale)."""
    return opt_state if ls is None else {**opt_state, "loss_scale": init_state(ls)}


def add_specs(specs: dict, ls: LossScale | None) -> dict:
    """Optimizer-state ``specs`` with the loss scale's (replicated scalars) added."""
    return specs if ls is None else {**specs, "loss_scale": dict.fromkeys(("scale", "tracker", "hysteresis"), P())}


def update(ls: LossScale, state: dict[str, jax.Array], overflow: jax.Array) -> tuple[dict[str, jax.Array], jax.Array]:
    """The state after a step that did (``overflow``) or did not overflow, and whether the run must
    stop (deepspeed: an overflow at ``min_scale`` with the hysteresis spent)."""
    scale, tracker, hyst = state["scale"], state["tracker"], state["hysteresis"]
    if not ls.dynamic:
        return state, jnp.bool_(False)
    full = jnp.int32(ls.hysteresis)
    if ls.rule == "deepspeed":
        spent = (hyst == 1) | (ls.hysteresis == 1)  # this overflow halves the scale
        stop = overflow & spent & (scale == ls.min_scale)
        stable = tracker - 1  # DeepSpeed's stable_interval: good steps before this one since the last overflow
        grow = ~overflow & (stable > 0) & (stable % ls.window == 0)
        refill = grow | (~overflow & ls.consecutive_hysteresis)
        new_hyst = jnp.where(overflow, jnp.where(spent, hyst, hyst - 1), jnp.where(refill, full, hyst))
        new_tracker = jnp.where(overflow, 1, tracker + 1)
    else:
        new_hyst = jnp.where(overflow, hyst - 1, hyst)
        spent = new_hyst <= 0
        stop = jnp.bool_(False)
        count = jnp.where(overflow, 0, tracker + 1)
        grow = ~overflow & (count == ls.window)
        new_hyst = jnp.where(grow, full, new_hyst)
        new_tracker = jnp.where(grow, 0, count)
    halve = overflow & spent
    new_scale = jnp.where(halve, jnp.maximum(scale * 0.5, ls.min_scale), jnp.where(grow, scale * 2, scale))
    new = {
        "scale": new_scale.astype(jnp.float32),
        "tracker": new_tracker.astype(jnp.int32),
        "hysteresis": new_hyst.astype(jnp.int32),
    }
    return new, stop


# ---------------------------------------------------------------- the step's hooks (jaxpar.train.step)


def with_scale(guard: jax.Array, opt_state: dict) -> jax.Array:
    """The step's guard with the loss scale appended (``guard[2]``) when the run has one."""
    if "loss_scale" not in opt_state:
        return guard
    return jnp.concatenate([guard, opt_state["loss_scale"]["scale"][None]])


def scaled(factor: float, guard: jax.Array) -> Any:
    """The loss normaliser ``factor`` times the loss scale carried by ``guard`` (if any)."""
    return factor * guard[2] if guard.shape[0] > 2 else factor


def unscale(grads: Any, loss: jax.Array, guard: jax.Array) -> tuple[Any, jax.Array]:
    """Gradients and loss divided by the loss scale again (exact for the powers of two a dynamic scale takes)."""
    if guard.shape[0] <= 2:
        return grads, loss
    inverse = 1.0 / guard[2]
    return jax.tree.map(lambda g: g * inverse.astype(g.dtype), grads), loss * inverse


def advance(
    ls: LossScale | None, opt_state: dict, new_state: dict, metrics: dict, grad_norm: jax.Array
) -> tuple[dict, dict]:
    """Fold the step's overflow (a non-finite gradient norm) into the loss scale: the new state and the
    metrics ``loss_scale`` (the scale this step used), ``overflow`` and ``loss_scale_stop``."""
    if ls is None:
        return new_state, metrics
    overflow = ~jnp.isfinite(grad_norm)
    state, stop = update(ls, opt_state["loss_scale"], overflow)
    metrics = {
        **metrics,
        "loss_scale": opt_state["loss_scale"]["scale"],
        "overflow": overflow.astype(jnp.int32),
        "loss_scale_stop": stop.astype(jnp.int32),
    }
    return {**new_state, "loss_scale": state}, metrics


# ---------------------------------------------------------------- the loop's lines (jaxpar.train.loop)


def overflow_line(step: int, values: dict, ls: LossScale | None, total: int) -> str:
    """The log line of a step skipped for a gradient overflow."""
    used = float(values["loss_scale"])
    if ls is None or not ls.dynamic:
        then = "a fixed scale: unchanged"
    else:
        then = "the scale halves once the hysteresis is spent"
    return f"step {step}: update skipped: gradient overflow at loss scale {used:g} ({then}; {total} skipped in all)"


def stop_line(step: int, ls: LossScale | None) -> str:
    """Why the run stops: a deepspeed-rule overflow at the minimum scale (DeepSpeed exits there too)."""
    floor = ls.min_scale if ls is not None else 0.0
    return (
        f"step {step}: gradients overflow at the minimum loss scale {floor:g} (train.loss_scale.min_scale), as "
        "DeepSpeed stops; lower optim.lr, lower train.loss_scale.min_scale or use model.compute_dtype=bfloat16"
    )
