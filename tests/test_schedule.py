"""The optax schedule against the PyTorch-side schedulers it ports, at every step of a 1,000-step run.

The references below copy the PyTorch-side arithmetic line for line (DeepSpeed
``deepspeed/runtime/lr_schedules.py``, Megatron-LM ``megatron/core/optimizer_param_scheduler.py``
and ``training.get_optimizer_param_scheduler``, torchtitan ``components/lr_scheduler.py``) and
replay how each trainer steps its scheduler around the optimizer, so "update k" means the same
thing on both sides. The importers' ``schedule_fields`` turn the scheduler settings into optim
fields; the test checks the optax curve to a relative error below 1e-6.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import ConfigError, default_config
from jaxpar.optim.lr import make_schedule, resolve_schedule
from jaxpar.port import deepspeed, megatron, torchtitan

STEPS = 1000
RTOL = 1e-6


# --------------------------------------------------------------------------- DeepSpeed references


def _ds_warmup_gamma(lbi, warmup_num_steps, warmup_type):
    """DeepSpeed WarmupLR's warm-up factor at ``lbi < warmup_num_steps`` (WarmupDecayLR inherits it)."""
    if warmup_type == "log":
        return 1.0 / math.log(warmup_num_steps) * math.log(lbi + 1)
    return lbi / warmup_num_steps


def ds_warmup_lr(lbi, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000, warmup_type="log"):
    """WarmupLR.get_lr() at last_batch_iteration ``lbi``."""
    warmup_num_steps = max(2, warmup_num_steps)
    if lbi < 0:
        return warmup_min_lr
    gamma = _ds_warmup_gamma(lbi, warmup_num_steps, warmup_type) if lbi < warmup_num_steps else 1.0
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma


def ds_warmup_decay_lr(
    lbi, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000, warmup_type="log"
):
    """WarmupDecayLR.get_lr() at ``lbi``."""
    warmup_num_steps = max(2, warmup_num_steps)
    if lbi < 0:
        return warmup_min_lr
    if lbi < warmup_num_steps:
        gamma = _ds_warmup_gamma(lbi, warmup_num_steps, warmup_type)
    else:
        gamma = max(0.0, float(total_num_steps - lbi) / float(max(1.0, total_num_steps - warmup_num_steps)))
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma


def ds_warmup_cosine_lr(
    lbi, org_lr, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000, cos_min_ratio=0.0001, warmup_type="log"
):
    """WarmupCosineLR.get_lr() at ``lbi`` (the current, clamped version)."""
    warmup_num_steps = max(2, warmup_num_steps)
    inverse_log_warm_up = 1.0 / math.log(warmup_num_steps)
    if lbi < 0:
        return 0.0
    if lbi < warmup_num_steps:
        if warmup_type == "log":
            ratio = inverse_log_warm_up * math.log(lbi + 1)
        else:
            ratio = lbi / warmup_num_steps
        ratio = warmup_min_ratio + ratio * (1.0 - warmup_min_ratio)
        return org_lr * ratio
    real_last_step = lbi - warmup_num_steps + 1
    real_total_steps = max(1, total_num_steps - warmup_num_steps)
    cosine_progress = min(1.0, real_last_step / real_total_steps)
    ratio = (1 + math.cos(math.pi * cosine_progress)) / 2
    ratio = max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * ratio)
    return org_lr * ratio


def deepspeed_updates(get_lr, n):
    """The lr of each of n updates: the constructor sets the lr for last_batch_iteration = -1 and the
    engine calls lr_scheduler.step() after optimizer.step()."""
    lrs, lbi = [], -1
    for _ in range(n):
        lrs.append(get_lr(lbi))  # optimizer.step() runs with the current lr
        lbi += 1  # lr_scheduler.step()
    return np.array(lrs)


# --------------------------------------------------------------------------- Megatron references


def megatron_lr(
    num_steps,
    max_lr,
    min_lr,
    lr_warmup_steps,
    lr_decay_steps,
    lr_decay_style,
    init_lr=0.0,
    wsd_decay_steps=None,
    lr_wsd_decay_style=None,
):
    """OptimizerParamScheduler.get_lr() (steps in samples)."""
    if lr_warmup_steps > 0 and num_steps <= lr_warmup_steps:
        return init_lr + ((max_lr - init_lr) * float(num_steps) / float(lr_warmup_steps))
    if lr_decay_style == "constant":
        return max_lr
    if num_steps > lr_decay_steps:
        return min_lr
    if lr_decay_style == "inverse-square-root":
        warmup_steps = max(lr_warmup_steps, 1)
        num_steps = max(num_steps, 1)
        lr = max_lr * warmup_steps**0.5 / (num_steps**0.5)
        return max(min_lr, lr)
    num_steps_ = num_steps - lr_warmup_steps
    decay_steps_ = lr_decay_steps - lr_warmup_steps
    decay_ratio = float(num_steps_) / float(decay_steps_)
    delta_lr = max_lr - min_lr
    if lr_decay_style == "linear":
        coeff = 1.0 - decay_ratio
    elif lr_decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
    else:  # WSD
        wsd_anneal_start_ = lr_decay_steps - wsd_decay_steps
        if num_steps <= wsd_anneal_start_:
            coeff = 1.0
        else:
            wsd_decay_ratio = float(num_steps - wsd_anneal_start_) / float(wsd_decay_steps)
            coeff = (
                1.0 - wsd_decay_ratio
                if lr_wsd_decay_style == "linear"
                else 0.5 * (math.cos(math.pi * wsd_decay_ratio) + 1.0)
            )
    return min_lr + coeff * delta_lr


def megatron_updates(n, global_batch, **kw):
    """The lr of each of n updates: step(0) in the constructor, step(increment=global batch) after each update."""
    lrs, num_steps = [], 0
    for _ in range(n):
        lrs.append(megatron_lr(num_steps, **kw))
        num_steps += global_batch
    return np.array(lrs)


# --------------------------------------------------------------------------- torchtitan reference


def torchtitan_updates(n, lr, training_steps, warmup_steps, decay_ratio=None, decay_type="linear", min_lr_factor=0.0):
    """LambdaLR(linear_warmup_stable_decay): factor at last_epoch = k for update k."""
    warmup_steps = min(int(warmup_steps), training_steps)
    if decay_ratio is not None:
        decay_steps = round(training_steps * decay_ratio)
        if warmup_steps + decay_steps > training_steps:
            decay_steps = training_steps - warmup_steps
    else:
        decay_steps = training_steps - warmup_steps
    stable_steps = training_steps + 1 - warmup_steps - decay_steps

    def factor(current_step):
        warmup_stable_steps = warmup_steps + stable_steps
        if current_step < warmup_steps:
            current_step += 1
            return float(current_step / warmup_steps)
        if current_step < warmup_stable_steps:
            return 1.0
        current_step += 1
        progress = float(current_step - warmup_stable_steps) / decay_steps
        if decay_type == "linear":
            adj = 1 - progress
        elif decay_type == "sqrt":
            adj = 1 - math.sqrt(progress)
        else:
            adj = 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_lr_factor + (1 - min_lr_factor) * adj

    return np.array([lr * factor(k) for k in range(n)])


# --------------------------------------------------------------------------- helpers


def curve(fields, total=STEPS, n=STEPS):
    """The optax schedule for ``fields`` over the defaults, at updates 0..n-1 (fields may carry floats
    and the optional keys the schema may lack)."""
    optim = {**default_config().optim.to_dict(), **fields}
    return np.asarray(make_schedule(optim, total)(jnp.arange(n)), dtype=np.float64)


def assert_close(ours, ref, start=0):
    ours, ref = ours[start:], ref[start:]
    err = np.abs(ours - ref)
    bad = np.nonzero(err > RTOL * np.abs(ref))[0]
    assert bad.size == 0, f"update {bad[0] + start}: ours {ours[bad[0]]!r} vs reference {ref[bad[0]]!r}"


# --------------------------------------------------------------------------- DeepSpeed


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("warmup", [100, 1, 7])
def test_deepspeed_warmup_lr(warmup_type, warmup):
    params = {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4, "warmup_num_steps": warmup, "warmup_type": warmup_type}
    ref = deepspeed_updates(lambda lbi: ds_warmup_lr(lbi, **params), STEPS)
    assert_close(curve(deepspeed.schedule_fields("WarmupLR", params, 1e-3)), ref)


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("low", [0.0, 2e-5])
def test_deepspeed_warmup_decay_lr(warmup_type, low):
    params = {
        "warmup_min_lr": low,
        "warmup_max_lr": 1e-3,
        "warmup_num_steps": 100,
        "total_num_steps": STEPS,
        "warmup_type": warmup_type,
    }
    ref = deepspeed_updates(lambda lbi: ds_warmup_decay_lr(lbi, **params), STEPS)
    assert_close(curve(deepspeed.schedule_fields("WarmupDecayLR", params, None)), ref)


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("cos_min_ratio", [0.0001, 0.1])
def test_deepspeed_warmup_cosine_lr(warmup_type, cos_min_ratio):
    params = {
        "total_num_steps": 900,
        "warmup_num_steps": 50,
        "cos_min_ratio": cos_min_ratio,
        "warmup_type": warmup_type,
    }
    ref = deepspeed_updates(lambda lbi: ds_warmup_cosine_lr(lbi, 2e-4, **params), STEPS)
    assert_close(curve(deepspeed.schedule_fields("WarmupCosineLR", params, 2e-4)), ref)


def test_deepspeed_warmup_cosine_min_ratio_differs_only_at_the_first_update():
    """WarmupCosineLR's lr before its first step() is 0, not warmup_min_ratio * lr (documented)."""
    params = {"total_num_steps": STEPS, "warmup_num_steps": 100, "warmup_min_ratio": 0.1, "warmup_type": "linear"}
    ref = deepspeed_updates(lambda lbi: ds_warmup_cosine_lr(lbi, 5e-4, **params), STEPS)
    ours = curve(deepspeed.schedule_fields("WarmupCosineLR", params, 5e-4))
    assert ref[0] == 0.0 and ours[0] == pytest.approx(5e-5)
    assert_close(ours, ref, start=1)


def test_deepspeed_fields_without_offset_follow_last_batch_iteration():
    """The fallback when optim.schedule_offset is missing: schedule(k) == get_lr() at last_batch_iteration k."""
    params = {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 100, "total_num_steps": STEPS}
    fields = deepspeed.schedule_fields("WarmupDecayLR", params, None)
    fields.pop("schedule_offset")
    assert_close(curve(fields), np.array([ds_warmup_decay_lr(k, **params) for k in range(STEPS)]))


# --------------------------------------------------------------------------- Megatron


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root"])
@pytest.mark.parametrize("init_lr", [0.0, 1e-6])
def test_megatron_iteration_based(style, init_lr):
    gbs, warmup_iters, decay_iters = 32, 100, 800  # Megatron counts samples: iterations * global batch
    ref = megatron_updates(
        STEPS,
        gbs,
        max_lr=3e-4,
        min_lr=3e-5,
        lr_warmup_steps=warmup_iters * gbs,
        lr_decay_steps=decay_iters * gbs,
        lr_decay_style=style,
        init_lr=init_lr,
    )
    fields = megatron.schedule_fields(3e-4, 3e-5, style, warmup_iters, decay_iters, init_lr)
    assert_close(curve(fields), ref)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_megatron_warmup_fraction(style):
    """--lr-warmup-fraction: warmup = fraction * decay, a fractional number of iterations here."""
    gbs, decay_iters, fraction = 16, 777, 0.013
    ref = megatron_updates(
        STEPS,
        gbs,
        max_lr=1e-4,
        min_lr=1e-5,
        lr_warmup_steps=fraction * decay_iters * gbs,
        lr_decay_steps=decay_iters * gbs,
        lr_decay_style=style,
    )
    assert_close(curve(megatron.schedule_fields(1e-4, 1e-5, style, fraction * decay_iters, decay_iters)), ref)


@pytest.mark.parametrize("style", ["linear", "cosine", "inverse-square-root"])
@pytest.mark.parametrize("gbs", [128, 96])
def test_megatron_sample_based(style, gbs):
    """--lr-warmup-samples / --lr-decay-samples: steps = samples / global batch, fractional."""
    warmup_samples, decay_samples = 12_345, 88_888
    ref = megatron_updates(
        STEPS,
        gbs,
        max_lr=6e-5,
        min_lr=6e-6,
        lr_warmup_steps=warmup_samples,
        lr_decay_steps=decay_samples,
        lr_decay_style=style,
    )
    fields = megatron.schedule_fields(6e-5, 6e-6, style, warmup_samples / gbs, decay_samples / gbs)
    assert isinstance(fields["warmup_steps"], float)
    assert_close(curve(fields), ref)


@pytest.mark.parametrize("wsd_style", ["linear", "cosine"])
def test_megatron_wsd(wsd_style):
    gbs = 8
    ref = megatron_updates(
        STEPS,
        gbs,
        max_lr=2e-4,
        min_lr=2e-5,
        lr_warmup_steps=50 * gbs,
        lr_decay_steps=900 * gbs,
        lr_decay_style="WSD",
        wsd_decay_steps=200 * gbs,
        lr_wsd_decay_style=wsd_style,
    )
    fields = megatron.schedule_fields(2e-4, 2e-5, "WSD", 50, 900, wsd_decay=200, wsd_style=wsd_style)
    assert_close(curve(fields), ref)


# --------------------------------------------------------------------------- torchtitan


@pytest.mark.parametrize("decay_ratio", [None, 0.8, 0.5])
@pytest.mark.parametrize("decay_type", ["linear", "cosine", "sqrt"])
def test_torchtitan(decay_ratio, decay_type):
    ref = torchtitan_updates(STEPS, 3e-4, STEPS, 200, decay_ratio, decay_type, min_lr_factor=0.1)
    fields = torchtitan.schedule_fields(3e-4, 200, STEPS, decay_ratio, decay_type, 0.1)
    assert_close(curve(fields), ref)


def test_torchtitan_short_warmup():
    ref = torchtitan_updates(STEPS, 1e-3, STEPS, 1)
    assert_close(curve(torchtitan.schedule_fields(1e-3, 1, STEPS)), ref)


# --------------------------------------------------------------------------- the schedule itself


def test_defaults_and_decay_to_total_steps():
    cfg = default_config().optim  # linear warmup 20 steps to 3e-3, cosine to 10% over train.steps
    lrs = np.asarray(make_schedule(cfg, 300)(jnp.arange(400)))
    assert lrs[0] == 0.0 and lrs[10] == pytest.approx(1.5e-3) and lrs[20] == pytest.approx(3e-3)
    assert lrs[300] == pytest.approx(3e-4) and lrs[399] == pytest.approx(3e-4)
    assert np.all(np.diff(lrs[20:300]) <= 0)


def test_log_warmup_reaches_peak_one_step_early():
    fields = {"warmup_type": "log", "warmup_steps": 10, "schedule": "constant", "lr": 1.0}
    lrs = curve(fields, n=12)
    assert lrs[0] == 0.0 and lrs[9] == pytest.approx(1.0) and lrs[5] == pytest.approx(math.log(6) / math.log(10))


def test_schedule_jits():
    import jax

    sched = make_schedule(default_config().optim, 300)
    assert float(jax.jit(sched)(jnp.int32(20))) == pytest.approx(3e-3)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("schedule", "step", "optim.schedule"),
        ("warmup_type", "exp", "optim.warmup_type"),
        ("decay_steps", 5, "decay_steps"),
        ("min_lr_ratio", 1.5, "min_lr_ratio"),
    ],
)
def test_bad_fields_raise_config_error(field, value, match):
    optim = {**default_config().optim.to_dict(), field: value}
    with pytest.raises(ConfigError, match=match):
        resolve_schedule(optim, 300)
