"""Megatron's optimizer, learning-rate schedule, loss scaling, logging and other run flags -> jaxpar's
``optim.*`` and ``train.*`` fields."""

from __future__ import annotations

import math
import re
from typing import Any

from jaxpar.config import ConfigError
from jaxpar.port.megatron_flags import NOOP_NOTE, TB, TENSORBOARD_FLAGS, Args
from jaxpar.port.report import (
    apply_schedule_fields,
)


def schedule_fields(
    lr: float,
    min_lr: float,
    style: str,
    warmup: float,
    decay: float,
    warmup_init: float = 0.0,
    wsd_decay: float | None = None,
    wsd_style: str = "linear",
) -> dict[str, Any]:
    """optim fields reproducing Megatron's OptimizerParamScheduler; steps in iterations (may be fractional)."""
    shapes = {"constant": "constant", "linear": "linear", "cosine": "cosine", "inverse-square-root": "inverse_sqrt"}
    wsd = {"linear": "linear", "cosine": "cosine", "minus_sqrt": "sqrt"}
    if style not in shapes and not (style == "WSD" and wsd_style in wsd and wsd_decay is not None):
        raise ConfigError(
            f"megatron: --lr-decay-style {style} (wsd style {wsd_style}) has no jaxpar counterpart; "
            f"use one of {', '.join(shapes)} or WSD with linear/cosine/minus_sqrt"
        )
    if not 0 <= min_lr <= lr:
        raise ConfigError(f"megatron: --min-lr {min_lr} must lie in [0, --lr {lr}]")
    as_int = lambda x: int(x) if float(x).is_integer() else float(x)  # noqa: E731
    fields = {
        "lr": lr,
        "min_lr_ratio": min_lr / lr,
        "warmup_init_lr": warmup_init,
        "warmup_type": "linear",
        "warmup_steps": as_int(warmup),
        "decay_steps": as_int(decay),
        "decay_start_step": -1,
        "schedule_offset": 0,
        "schedule": shapes.get(style) or wsd[wsd_style],
    }
    if style == "WSD":
        fields["decay_start_step"] = as_int(decay - wsd_decay)
    return fields


def map_optim(a: Args, values: dict[str, Any], s: dict[str, Any]) -> None:
    optimizer = a.get("--optimizer", str, "adam")
    if optimizer != "adam":
        a.note(
            "--optimizer",
            "unsupported",
            "optim.name",
            f"this port maps Adam only ({optimizer} requested); pick optim.name by hand",
        )
    a.note("--optimizer", "mapped", "optim.name", "Megatron's adam is AdamW (decoupled weight decay)")
    for name, key, default in (
        ("--adam-beta1", "optim.b1", 0.9),
        ("--adam-beta2", "optim.b2", 0.999),
        ("--adam-eps", "optim.eps", 1e-8),
        ("--weight-decay", "optim.weight_decay", 0.01),
        ("--clip-grad", "optim.clip_norm", 1.0),
    ):
        values[key] = a.get(name, float, default)
        a.note(
            name, "mapped", key, "biases and 1-D parameters skip weight decay in both" if key.endswith("decay") else ""
        )
        if not a.has(name):
            a.report.mapped(f"{name} (default)", default, key, "Megatron default")
    if a.get("--start-weight-decay", float) != a.get("--end-weight-decay", float):
        for name in ("--start-weight-decay", "--end-weight-decay", "--weight-decay-incr-style"):
            a.note(name, "unsupported", "optim.weight_decay", "jaxpar keeps weight decay constant")
    lr = a.get("--lr", float)
    gbs = s["gbs"] or 0
    iters, samples = a.get("--train-iters", int), a.get("--train-samples", int)
    if lr is None or not (iters or samples) or (samples and not gbs):
        if not a.has("--lr") or not (a.has("--train-iters") or a.has("--train-samples")):
            raise ConfigError("megatron: --lr and --train-iters (or --train-samples) are required; add them")
        return
    unit = 1 if iters else gbs  # the schedule counts samples: num_steps grows by GBS per update
    decay = a.get("--lr-decay-iters" if iters else "--lr-decay-samples", int) or (iters or samples)
    fraction = a.get("--lr-warmup-fraction", float)
    warmup = (
        fraction * decay
        if fraction is not None
        else a.get("--lr-warmup-iters" if iters else "--lr-warmup-samples", int, 0)
    )
    wsd = a.get("--lr-wsd-decay-iters" if iters else "--lr-wsd-decay-samples", int)
    fields = schedule_fields(
        lr,
        a.get("--min-lr", float, 0.0),
        a.get("--lr-decay-style", str, "linear"),
        warmup / unit,
        decay / unit,
        a.get("--lr-warmup-init", float, 0.0),
        None if wsd is None else wsd / unit,
        a.get("--lr-wsd-decay-style", str, "linear"),
    )
    notes = apply_schedule_fields(fields, values)
    values["train.steps"] = iters or samples // gbs
    if fields["schedule"] == "inverse_sqrt" and warmup < unit:
        notes.append(
            "inverse-square-root with warmup under one iteration: Megatron's samples-based arithmetic "
            "makes the first steps lr/sqrt(GBS*k)"
        )
    status = "approximated" if notes else "mapped"
    a.note(
        "--lr-decay-style", status, "optim.schedule", "; ".join(notes) or "exact; update k runs at num_steps = k*GBS"
    )
    if not a.has("--lr-decay-style"):
        a.report.add("--lr-decay-style (default)", "linear", status, "optim.schedule", "Megatron default")
    targets = {
        "--lr": "optim.lr",
        "--min-lr": "optim.min_lr_ratio",
        "--lr-warmup-init": "optim.warmup_init_lr",
        "--lr-warmup-iters": "optim.warmup_steps",
        "--lr-warmup-fraction": "optim.warmup_steps",
        "--lr-warmup-samples": "optim.warmup_steps",
        "--lr-decay-iters": "optim.decay_steps",
        "--lr-decay-samples": "optim.decay_steps",
        "--lr-wsd-decay-iters": "optim.decay_start_step",
        "--lr-wsd-decay-samples": "optim.decay_start_step",
        "--lr-wsd-decay-style": "optim.schedule",
        "--train-iters": "train.steps",
        "--train-samples": "train.steps",
    }
    for name, target in targets.items():
        a.note(
            name, status if name != "--lr" else "mapped", target, "samples / global batch" if "sample" in name else ""
        )


def map_observability(a: Args, values: dict[str, Any]) -> None:
    """--tensorboard-dir and the --log-*-to-tensorboard flags -> jaxpar's event files in train.workdir;
    --profile with --profile-step-start/-end -> train.profile_steps (a jax.profiler trace)."""
    a.note("--tensorboard-dir", "approximated", "train.workdir", TB + "; the directory given is not used")
    for name in TENSORBOARD_FLAGS:
        a.note(name, "approximated", "", TB)
    start, end = a.get("--profile-step-start", int, 10, soft=True), a.get("--profile-step-end", int, 12, soft=True)
    if a.get("--profile", bool, False):
        # Megatron starts the profiler when `iteration` (steps done, from 0) reaches start and stops it once
        # it reaches end: steps start+1 .. end in jaxpar's numbering (from 1); nothing when end <= start
        if end > start:
            values["train.profile_steps"] = f"{start + 1},{end}"
            a.note("--profile", "mapped", "train.profile_steps", f"a jax.profiler trace of steps {start + 1}-{end}")
        else:
            a.note(
                "--profile",
                "approximated",
                "",
                NOOP_NOTE + f"--profile-step-end {end} <= start {start}: Megatron traces nothing",
            )
        for name in ("--profile-step-start", "--profile-step-end"):
            a.note(
                name, "mapped", "train.profile_steps", "Megatron counts steps done from 0: jaxpar steps start+1..end"
            )
        a.note("--profile-ranks", "approximated", "train.profile_steps", "every jaxpar process traces its own devices")
    else:
        for name in ("--profile-step-start", "--profile-step-end", "--profile-ranks"):
            a.note(name, "approximated", "", NOOP_NOTE + "without --profile Megatron traces nothing")


# Megatron's loss-scale flags -> train.loss_scale fields (megatron/training/arguments.py defaults)
LOSS_SCALE_FLAGS = {
    "--min-loss-scale": ("min_scale", float, 1.0),
    "--loss-scale-window": ("window", int, 1000),
    "--hysteresis": ("hysteresis", int, 2),
}


def _loss_scale(a: Args, values: dict[str, Any]) -> None:
    """--fp16's loss scale: --loss-scale fixes it, else Megatron's DynamicGradScaler from
    --initial-loss-scale (default 2**32), --min-loss-scale, --loss-scale-window, --hysteresis. With
    --deepspeed the DeepSpeed JSON's fp16 section decides instead (DeepSpeed's rule)."""
    flags = ("--loss-scale", "--initial-loss-scale", *LOSS_SCALE_FLAGS)
    if a.get("--deepspeed", bool, False):
        a.note(
            "--fp16",
            "approximated",
            "model.compute_dtype",
            "float16 with DeepSpeed's loss scaler, whose settings are the DeepSpeed JSON's fp16 section (port it "
            "too); the port keeps DeepSpeed's defaults (train.loss_scale)",
        )
        for name in flags:
            a.note(name, "approximated", "", NOOP_NOTE + "with --deepspeed the DeepSpeed JSON's fp16 section decides")
        return
    static = a.get("--loss-scale", float, None)
    if static is not None and not (math.isfinite(static) and static >= 0):
        raise ConfigError(f"megatron: --loss-scale {static:g}: use a fixed scale > 0, or drop it for a dynamic one")
    if static is not None and static > 0:
        values["train.loss_scale.static"] = static
        a.note("--fp16", "mapped", "model.compute_dtype", "float16 with a fixed loss scale (--loss-scale)")
        a.note("--loss-scale", "mapped", "train.loss_scale.static")
        for name in flags[1:]:
            a.note(name, "approximated", "", NOOP_NOTE + "Megatron ignores it with a fixed --loss-scale")
        return
    values["train.loss_scale.rule"] = "megatron"
    a.note("--fp16", "mapped", "model.compute_dtype", "float16 with Megatron's dynamic loss scaling (train.loss_scale)")
    a.note("--loss-scale", "mapped", "train.loss_scale.static", "none: dynamic")
    initial = a.get("--initial-loss-scale", float, 2.0**32)
    power = round(math.log2(initial)) if initial > 0 and math.isfinite(initial) else -1
    if not 0 <= power <= 64:
        raise ConfigError(f"megatron: --initial-loss-scale {initial:g}: use a scale in [1, 2**64]; fix the value")
    values["train.loss_scale.initial_scale_power"] = power
    exact = 2.0**power == initial
    a.note(
        "--initial-loss-scale",
        "mapped" if exact else "approximated",
        "train.loss_scale.initial_scale_power",
        f"2**{power}" if exact else f"2**{power}, the nearest power of two: jaxpar starts the scale at a power of two",
    )
    if not a.has("--initial-loss-scale"):
        a.report.mapped("(initial loss scale)", "2**32", "train.loss_scale.initial_scale_power", "Megatron's default")
    for name, (field, kind, default) in LOSS_SCALE_FLAGS.items():
        values[f"train.loss_scale.{field}"] = a.get(name, kind, default)
        a.note(name, "mapped", f"train.loss_scale.{field}", "Megatron's DynamicGradScaler rule")


# Megatron's defaults of the run options map_misc maps (megatron/arguments.py): a recipe without them runs these
RUN_DEFAULTS = {"--seed": 1234, "--log-interval": 100, "--eval-interval": 1000, "--eval-iters": 100}


def map_misc(a: Args, values: dict[str, Any]) -> None:
    """Precision, recompute, data, checkpoints, logging."""
    fp16 = a.get("--fp16", bool, False) and not a.get("--bf16", bool, False)
    dtype = "bfloat16" if a.get("--bf16", bool, False) else "float16" if fp16 else "float32"
    values["model.compute_dtype"] = dtype
    a.note("--bf16", "mapped", "model.compute_dtype")
    if fp16:
        _loss_scale(a, values)
    if dtype == "float32":
        a.report.mapped(
            "(precision)", "fp32", "model.compute_dtype", "neither --bf16 nor --fp16: Megatron trains in fp32"
        )
    if a.get("--grad-reduce-in-bf16", bool, False):
        values["parallel.grad_reduce_dtype"] = "bfloat16"
    a.note("--grad-reduce-in-bf16", "mapped", "parallel.grad_reduce_dtype")
    a.note("--accumulate-allreduce-grads-in-fp32", "mapped", "parallel.grad_reduce_dtype")
    granularity = a.get("--recompute-granularity", str)
    if a.get("--checkpoint-activations", bool, False):
        granularity = granularity or "full"
    if a.get("--recompute-activations", bool, False):
        granularity = granularity or "selective"
    if granularity:
        values["parallel.recompute"] = granularity if granularity in ("full", "selective") else "full"
    for name in ("--recompute-granularity", "--recompute-activations", "--checkpoint-activations"):
        a.note(name, "mapped", "parallel.recompute")
    for name, note in (
        ("--recompute-method", "jaxpar rematerializes every layer"),
        ("--recompute-num-layers", "jaxpar rematerializes every layer"),
        ("--deepspeed-activation-checkpointing", "DeepSpeed's implementation; same policy in jaxpar"),
        ("--calculate-per-token-loss", "jaxpar averages the loss over the tokens of the global batch"),
        ("--load", "train.resume=auto resumes from train.workdir"),
    ):
        a.note(name, "approximated", "train.resume" if name == "--load" else "", note)
    for name, key, kind in (
        ("--seed", "train.seed", int),
        ("--log-interval", "train.log_every", int),
        ("--eval-interval", "train.eval_every", int),
        ("--eval-iters", "train.eval_batches", int),
        ("--save-interval", "checkpoint.every", int),
        ("--save", "train.workdir", str),
    ):
        value = a.get(name, kind, soft=True)
        if value is not None:
            values[key] = value
        elif name in RUN_DEFAULTS and not a.has(name):  # absent: Megatron's default, not jaxpar's
            values[key] = RUN_DEFAULTS[name]
            a.report.mapped(f"{name} (default)", RUN_DEFAULTS[name], key, "Megatron's default")
        a.note(
            name,
            "mapped" if value is not None else "approximated",
            key,
            "" if value is not None else "value unresolved: jaxpar default kept",
        )
    if values.get("train.eval_batches") == 0:  # Megatron: --eval-iters 0 evaluates at no interval
        values["train.eval_every"] = 0
    data = a.get("--data-path", str, soft=True)
    if a.get("--mock-data", bool, False):
        values["data.source"] = "synthetic"
        a.note("--mock-data", "mapped", "data.source")
    elif data:
        parts = data.split()
        prefixes = parts[1::2] if len(parts) > 1 and len(parts) % 2 == 0 else parts
        values.update({"data.source": "megatron", "data.path": prefixes[0]})
        a.note(
            "--data-path",
            "mapped" if len(prefixes) == 1 else "approximated",
            "data.path",
            "" if len(prefixes) == 1 else f"first of {len(prefixes)} blended prefixes",
        )
    a.note("--data-path", "approximated", "data.path", "value unresolved: data left at the jaxpar default")
    # read as Megatron-core's parse_and_normalize_split does: the numbers in it (quotes a script left are ignored)
    split = [float(x) for x in re.findall(r"[.0-9]+", str(a.get("--split", str, "969,30,1")))]
    if values.get("data.source") == "synthetic":  # jaxpar's synthetic batches are not split
        a.note("--split", "approximated", "", "with --mock-data jaxpar's synthetic data has no validation share")
    elif a.has("--split") and len(split) >= 2 and 0 < sum(split[1:]) < sum(split):
        values["data.val_fraction"] = sum(split[1:]) / sum(split)
    a.note("--split", "approximated", "data.val_fraction", "validation + test share of the split")
