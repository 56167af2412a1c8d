"""Learning-rate schedule: warmup, optional hold, decay, built from the ``optim`` sub-config.

:func:`make_schedule` turns the optim fields into an ``optax.Schedule`` that the training loop
calls as ``schedule(k)`` for its k-th optimizer update (k = 0, 1, ...). It reproduces, step for
step, the schedules of ported recipes (DeepSpeed's Warmup* schedulers, Megatron-LM's
``OptimizerParamScheduler``, torchtitan's warmup-stable-decay), hence the care about off-by-one;
how their step indices map onto ``k`` is in docs/porting.md, "Learning-rate schedules".

The curve, as a function of the *schedule index* ``j = max(k - schedule_offset, 0)``, with
``W = warmup_steps``, ``S = decay_start_step`` (-1: ``W``), ``D = decay_steps`` (-1:
``total_steps``), ``peak = lr``, ``end = lr * min_lr_ratio``, ``init = warmup_init_lr``:

* ``j < W`` warmup: linear ``init + (peak - init) * j / W``; log (DeepSpeed's default)
  ``init + (peak - init) * log(j + 1) / log(max(W, 2))`` (it reaches ``peak`` at ``j = W - 1``).
* ``schedule == 'constant'``: ``peak``.
* ``j > D``: ``end`` (Megatron's "past lr_decay_steps -> min_lr").
* ``j < S`` (only when ``S > W``): ``peak`` (the stable phase of warmup-stable-decay).
* decay, with progress ``p = (j - S) / (D - S)``: linear ``1 - p``; cosine
  ``(1 + cos(pi p)) / 2``; sqrt ``1 - sqrt(p)`` (torchtitan); the lr is ``end + (peak - end) * coeff``.
  ``inverse_sqrt`` is Megatron's ``max(end, peak * sqrt(max(S, 1) / max(j, 1)))``.

``schedule_offset`` and ``decay_start_step`` default to 0 and -1 when the optim config lacks them;
step counts may be floats (fractional steps), which the formulas take as they are.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import optax

from jaxpar.config import ConfigError
from jaxpar.optim.fields import OPTIONAL_FIELDS

WARMUP_TYPES = ("linear", "log")
DECAY_TYPES = ("cosine", "linear", "constant", "inverse_sqrt", "sqrt")


@dataclasses.dataclass(frozen=True)
class ScheduleParams:
    """Resolved schedule parameters (no -1 sentinels left); step counts may be fractional."""

    peak_lr: float
    end_lr: float
    init_lr: float
    warmup_steps: float
    warmup_type: str
    decay_type: str
    decay_start: float
    decay_end: float
    offset: int


def _field(cfg: Any, name: str) -> Any:
    if isinstance(cfg, dict):
        return cfg[name] if name in cfg else OPTIONAL_FIELDS.get(name)
    if hasattr(cfg, name):
        return getattr(cfg, name)
    if name in OPTIONAL_FIELDS:
        return OPTIONAL_FIELDS[name]
    raise ConfigError(f"optim.{name} is missing from the optim config; start from jaxpar.config.default_config()")


def resolve_schedule(optim_cfg: Any, total_steps: int) -> ScheduleParams:
    """Check the optim fields and resolve ``decay_steps`` / ``decay_start_step`` sentinels."""
    lr = float(_field(optim_cfg, "lr"))
    warmup = float(_field(optim_cfg, "warmup_steps"))
    warmup_type = str(_field(optim_cfg, "warmup_type"))
    decay_type = str(_field(optim_cfg, "schedule"))
    decay_steps = float(_field(optim_cfg, "decay_steps"))
    decay_start = float(_field(optim_cfg, "decay_start_step"))
    offset = int(_field(optim_cfg, "schedule_offset"))
    ratio = float(_field(optim_cfg, "min_lr_ratio"))
    init = float(_field(optim_cfg, "warmup_init_lr"))
    if lr <= 0:
        raise ConfigError(f"optim.lr={lr}: must be > 0")
    if warmup < 0:
        raise ConfigError(f"optim.warmup_steps={warmup}: must be >= 0")
    if warmup_type not in WARMUP_TYPES:
        raise ConfigError(f"optim.warmup_type='{warmup_type}': use one of {', '.join(WARMUP_TYPES)}")
    if decay_type not in DECAY_TYPES:
        raise ConfigError(f"optim.schedule='{decay_type}': use one of {', '.join(DECAY_TYPES)}")
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={ratio}: use a value in [0, 1]")
    if init < 0:
        raise ConfigError(f"optim.warmup_init_lr={init}: must be >= 0")
    if offset < 0:
        raise ConfigError(f"optim.schedule_offset={offset}: must be >= 0")
    start = warmup if decay_start == -1 else decay_start
    # decay_steps=-1 decays over the run; a run shorter than its warmup simply never decays.
    end = max(float(total_steps), start) if decay_steps == -1 else decay_steps
    if decay_type != "constant" and end < start:
        raise ConfigError(
            f"optim.decay_steps={end:g} ends before the decay starts (step {start:g}); "
            "decay_steps counts from step 0 including warmup, so use a value >= warmup_steps"
        )
    return ScheduleParams(
        peak_lr=lr,
        end_lr=lr * ratio,
        init_lr=init,
        warmup_steps=warmup,
        warmup_type=warmup_type,
        decay_type=decay_type,
        decay_start=start,
        decay_end=end,
        offset=offset,
    )


def make_schedule(optim_cfg: Any, total_steps: int) -> optax.Schedule:
    """The ``optax.Schedule`` for ``optim_cfg``; ``schedule(k)`` is the lr of the k-th update.

    ``total_steps`` is the run length (``train.steps``), used when ``decay_steps`` is -1.
    """
    p = resolve_schedule(optim_cfg, total_steps)
    log_den = math.log(max(p.warmup_steps, 2.0))
    span = p.decay_end - p.decay_start

    def schedule(count: Any) -> Any:
        j = jnp.maximum(jnp.asarray(count) - p.offset, 0).astype(jnp.float32)
        if p.warmup_type == "log":
            warm_frac = jnp.log1p(j) / log_den
        else:
            warm_frac = j / max(p.warmup_steps, 1e-30)
        warm = p.init_lr + (p.peak_lr - p.init_lr) * warm_frac
        if p.decay_type == "constant":
            after = jnp.full_like(j, p.peak_lr)
        else:
            after = _decay(j, p, span)
        return jnp.where(j < p.warmup_steps, warm, after)

    return schedule


def _decay(j: Any, p: ScheduleParams, span: float) -> Any:
    """The lr after warmup: hold until the decay start, decay to ``end_lr``, then stay there."""
    if p.decay_type == "inverse_sqrt":
        value = p.peak_lr * jnp.sqrt(max(p.decay_start, 1.0) / jnp.maximum(j, 1.0))
        decayed = jnp.maximum(p.end_lr, value)
    else:
        # Remaining fraction q = 1 - progress, computed directly so float32 keeps its relative
        # precision near the end of the decay (1 - p and 1 + cos(pi p) would cancel there).
        q = jnp.clip((p.decay_end - j) / (span if span > 0 else 1.0), 0.0, 1.0)
        if p.decay_type == "linear":
            coeff = q
        elif p.decay_type == "cosine":
            coeff = jnp.sin(0.5 * jnp.pi * q) ** 2  # == (1 + cos(pi * (1 - q))) / 2
        else:  # sqrt: 1 - sqrt(progress) == q / (1 + sqrt(1 - q)), stable as q -> 0
            coeff = q / (1.0 + jnp.sqrt(1.0 - q))
        decayed = p.end_lr + (p.peak_lr - p.end_lr) * coeff
    decayed = jnp.where(j < p.decay_start, p.peak_lr, decayed)
    return jnp.where(j > p.decay_end, p.end_lr, decayed)
