"""DeepSpeed's precision, loss scaling, optimizer and learning-rate scheduler sections -> jaxpar's
``train.*`` and ``optim.*`` fields."""

from __future__ import annotations

import math
from typing import Any

from jaxpar.config import ConfigError, default_config
from jaxpar.port.deepspeed_keys import NOOP, Ctx
from jaxpar.port.report import (
    FP16_AS_BF16,
    LOSS_SCALE_NOOP,
    apply_schedule_fields,
)

# DeepSpeed's fp16 loss-scale keys -> train.loss_scale fields (jaxpar.train.loss_scale, rule deepspeed)
FP16_LOSS_SCALE = {
    "initial_scale_power": ("initial_scale_power", int),
    "loss_scale_window": ("window", int),
    "hysteresis": ("hysteresis", int),
    "consecutive_hysteresis": ("consecutive_hysteresis", bool),
    "min_loss_scale": ("min_scale", float),
}


def precision(ctx: Ctx) -> None:
    fp16 = ctx.raw.get("fp16", {}) or {}
    bf16 = ctx.raw.get("bf16", ctx.raw.get("bfloat16", {})) or {}
    fp16_on = bool(ctx.get("fp16.enabled", False)) if isinstance(fp16, dict) else False
    bf16_key = "bf16" if "bf16" in ctx.raw else "bfloat16"
    bf16_on = bool(ctx.get(f"{bf16_key}.enabled", False)) if isinstance(bf16, dict) else False
    autocast = ctx.raw.get("torch_autocast", {}) or {}
    if fp16_on and bf16_on:
        raise ConfigError("deepspeed: fp16.enabled and bf16.enabled are both true (DeepSpeed rejects this); enable one")
    half = autocast.get("enabled") and str(autocast.get("dtype")) in ("torch.float16", "float16")
    # fp16: float16 with DeepSpeed's loss scaler; fp16 under torch autocast (torch's GradScaler): see FP16_AS_BF16
    dtype = "float16" if fp16_on and not autocast.get("enabled") else "float32"
    if bf16_on or autocast.get("enabled"):
        dtype = "bfloat16"
    ctx.values["model.compute_dtype"] = dtype
    if dtype == "float16" and not ctx.get("fp16.loss_scale", 0):
        ctx.values["train.loss_scale.rule"] = "deepspeed"
    for section, on in (("fp16", fp16_on), (bf16_key, bf16_on), ("torch_autocast", bool(autocast.get("enabled")))):
        block = ctx.raw.get(section)
        if block is None:
            continue
        for key, value in block.items() if isinstance(block, dict) else [("enabled", block)]:
            src = f"{section}.{key}"
            if section == "torch_autocast" and key in ("enabled", "dtype") and on and half:
                ctx.report.approximated(src, value, "model.compute_dtype", FP16_AS_BF16)
            elif key == "enabled" or (section == "torch_autocast" and key == "dtype"):
                how = f"compute dtype {dtype}" + (
                    ", DeepSpeed's loss scaling (train.loss_scale)" * (dtype == "float16")
                )
                ctx.report.mapped(src, value, "model.compute_dtype" if on else "", how if on else "disabled")
            elif not on:
                ctx.report.approximated(src, value, "", NOOP + f"{section} is disabled")
            elif key == "auto_cast" or section == "torch_autocast":
                ctx.report.approximated(
                    src,
                    value,
                    "model.compute_dtype",
                    "jaxpar casts inputs and activations to the compute dtype throughout",
                )
            elif section == "fp16" and dtype != "float16":
                ctx.report.approximated(src, value, "", LOSS_SCALE_NOOP)
            else:
                _loss_scale(ctx, key, value)
    if "fp16" not in ctx.raw and bf16_key not in ctx.raw and not autocast:
        ctx.report.mapped("(precision)", None, "model.compute_dtype", "neither fp16 nor bf16: DeepSpeed trains in fp32")


def _loss_scale(ctx: Ctx, key: str, value: Any) -> None:
    """One key of an enabled ``fp16`` section: DeepSpeed's loss scaler, field by field."""
    src, static = f"fp16.{key}", ctx.get("fp16.loss_scale", 0)
    value = ctx.get(src)  # "auto" resolved
    if value is None:  # an unresolved "auto": named by the refusal
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if key == "loss_scale":
        if not number or value < 0:
            raise ConfigError(f"deepspeed: {src}={value!r}: DeepSpeed takes 0 (dynamic) or a fixed scale > 0; fix it")
        if value > 0:
            ctx.values["train.loss_scale.static"] = float(value)
        ctx.report.mapped(src, value, "train.loss_scale.static", "a fixed scale" if value > 0 else "0: dynamic")
    elif key in FP16_LOSS_SCALE:
        field, kind = FP16_LOSS_SCALE[key]
        if kind is bool and not isinstance(value, bool) or kind is not bool and not number:
            want = "true or false" if kind is bool else "a number"
            raise ConfigError(f"deepspeed: {src}={value!r}: DeepSpeed takes {want}; fix it")
        if static:
            ctx.report.approximated(src, value, "", NOOP + f"fp16.loss_scale={static} is a fixed scale")
            return
        ctx.values[f"train.loss_scale.{field}"] = kind(value)
        ctx.report.mapped(src, value, f"train.loss_scale.{field}", "DeepSpeed's DynamicLossScaler rule")
    elif key == "fp16_master_weights_and_grads" and not value:
        ctx.report.mapped(src, value, "model.param_dtype", "fp32 master weights, as jaxpar keeps them")
    elif key == "fp16_master_weights_and_grads":
        ctx.report.approximated(src, value, "model.param_dtype", "jaxpar keeps fp32 master weights: memory only")
    else:
        ctx.report.unknown(src, value, ["enabled", "auto_cast", "loss_scale", *FP16_LOSS_SCALE], "DeepSpeed fp16")


def optimizer(ctx: Ctx) -> float | None:
    opt = ctx.raw.get("optimizer")
    if not isinstance(opt, dict):
        return _script_optimizer(ctx)
    kind = str(opt.get("type", ""))
    params = opt.get("params", {}) or {}
    if kind.lower() not in ("adam", "adamw"):
        ctx.report.unsupported(
            "optimizer.type", kind, "this port maps Adam/AdamW only; optim.* left at defaults, pick optim.name by hand"
        )
        for key, value in params.items():
            ctx.report.unsupported(f"optimizer.params.{key}", value, f"belongs to the {kind} optimizer")
        return None
    decoupled = kind.lower() == "adamw" or bool(ctx.get("optimizer.params.adam_w_mode", True))
    ctx.report.mapped(
        "optimizer.type",
        kind,
        "optim.name, optim.decoupled_weight_decay",
        "AdamW (decoupled)" if decoupled else "Adam with L2 (adam_w_mode false)",
    )
    torch_adamw = bool(params.get("torch_adam")) and decoupled
    lr = float(ctx.get("optimizer.params.lr", 1e-3))
    betas = ctx.get("optimizer.params.betas", [0.9, 0.999])
    ctx.values.update(
        {
            "optim.name": "adamw",
            "optim.decoupled_weight_decay": decoupled,
            "optim.lr": lr,
            "optim.b1": float(betas[0]),
            "optim.b2": float(betas[1]),
            "optim.eps": float(ctx.get("optimizer.params.eps", 1e-8)),
            "optim.weight_decay": float(ctx.get("optimizer.params.weight_decay", 0.01 if torch_adamw else 0.0)),
        }
    )
    targets = {
        "lr": "optim.lr",
        "betas": "optim.b1, optim.b2",
        "eps": "optim.eps",
        "weight_decay": "optim.weight_decay",
        "adam_w_mode": "optim.decoupled_weight_decay",
    }
    for key, target in targets.items():
        if key not in params and key != "adam_w_mode":
            ctx.report.mapped(
                f"optimizer.params.{key} (default)", ctx.values[target.split(",")[0]], target, "DeepSpeed/torch default"
            )
    for key, value in params.items():
        src = f"optimizer.params.{key}"
        if key in targets:
            ctx.report.mapped(src, value, targets[key], f"= {ctx.get(src)!r}" if value == "auto" else "")
        elif key in ("torch_adam", "fused", "capturable", "foreach", "set_grad_none"):
            ctx.report.approximated(
                src, value, "", NOOP + "implementation choice; jaxpar's AdamW runs inside the XLA step"
            )
        elif key in ("amsgrad", "bias_correction") and bool(value) == (key == "amsgrad"):
            ctx.report.unsupported(src, value, f"jaxpar's AdamW has no {key} switch")
        elif key in ("amsgrad", "bias_correction"):
            ctx.report.mapped(src, value, "", "jaxpar's behaviour")
        else:
            ctx.report.unknown(
                src, value, [f"optimizer.params.{k}" for k in (*targets, "torch_adam", "amsgrad")], "DeepSpeed Adam"
            )
    return lr


# side inputs that set the optimizer the training script builds when the config has no optimizer section:
# name -> jaxpar field (the HF Trainer builds AdamW from its learning_rate, adam_beta1/2, adam_epsilon,
# weight_decay)
SCRIPT_OPTIMIZER = {
    "lr": "optim.lr",
    "learning_rate": "optim.lr",
    "betas": "optim.b1, optim.b2",
    "eps": "optim.eps",
    "adam_epsilon": "optim.eps",
    "weight_decay": "optim.weight_decay",
}


def _script_optimizer(ctx: Ctx) -> float | None:
    """No optimizer section: the training script builds the optimizer (the HF Trainer: AdamW). Side
    inputs ``--set lr= / betas= / eps= / weight_decay=`` are its settings and set ``optim.*``; without
    them ``optim.*`` stay at jaxpar's defaults, and the report says so."""
    given = [name for name in SCRIPT_OPTIMIZER if name in ctx.side]
    for name in given:
        value, target = ctx.side[name], SCRIPT_OPTIMIZER[name]
        ctx.used.add(name)
        try:
            if name == "betas":
                b1, b2 = (float(b) for b in value)
                ctx.values.update({"optim.b1": b1, "optim.b2": b2})
            else:
                ctx.values[target] = float(value)
        except (TypeError, ValueError):
            raise ConfigError(
                f"deepspeed: --set {name}={value!r}: "
                + ("give two numbers, e.g. [0.9, 0.95]" if name == "betas" else "give a number, e.g. 3e-4")
            ) from None
        ctx.report.mapped(
            f"--set {name}",
            value,
            target,
            "no optimizer section: the training script's optimizer takes it (the HF Trainer's AdamW)",
        )
    ctx.report.approximated(
        "(optimizer)",
        None,
        "optim.*",
        "no optimizer section: the training script builds it; "
        + (
            f"{', '.join(given)} from --set, the rest of optim.* at jaxpar defaults (AdamW)"
            if given
            else "optim.* left at jaxpar defaults (AdamW); give its settings with --set lr=... (betas, eps, "
            "weight_decay)"
        ),
    )
    return ctx.values.get("optim.lr")


def schedule_fields(kind: str, params: dict[str, Any], optimizer_lr: float | None) -> dict[str, Any]:
    """optim fields reproducing DeepSpeed's scheduler ``kind`` exactly (see jaxpar.optim.lr)."""
    warmup = max(2, int(params.get("warmup_num_steps", 1000)))  # DeepSpeed: max(2, warmup_num_steps)
    wtype = params.get("warmup_type", "log")
    fields: dict[str, Any] = {
        "warmup_steps": warmup,
        "warmup_type": wtype if wtype in ("log", "linear") else "log",
        "schedule_offset": 1,
        "decay_start_step": -1,
        "decay_steps": -1,
    }
    if kind == "WarmupCosineLR":
        lr = optimizer_lr if optimizer_lr is not None else 1e-3
        total = int(params["total_num_steps"])
        return {
            **fields,
            "lr": lr,
            "warmup_init_lr": lr * float(params.get("warmup_min_ratio", 0.0)),
            "schedule": "cosine",
            "min_lr_ratio": float(params.get("cos_min_ratio", 0.0001)),
            "decay_start_step": warmup - 1,
            "decay_steps": total - 1,
        }
    default_max = optimizer_lr if kind == "WarmupLR" and optimizer_lr is not None else 1e-3
    peak = float(params.get("warmup_max_lr") if params.get("warmup_max_lr") is not None else default_max)
    low = float(params.get("warmup_min_lr", 0.0))
    if peak <= 0 or low > peak:
        raise ConfigError(f"deepspeed: scheduler warmup_max_lr={peak} must be > 0 and >= warmup_min_lr={low}")
    fields.update(lr=peak, warmup_init_lr=low)
    if kind == "WarmupLR":
        return {**fields, "schedule": "constant"}
    return {**fields, "schedule": "linear", "min_lr_ratio": low / peak, "decay_steps": int(params["total_num_steps"])}


def scheduler(ctx: Ctx, opt_lr: float | None) -> None:
    sched = ctx.raw.get("scheduler")
    if not isinstance(sched, dict):
        ctx.values.update({"optim.schedule": "constant", "optim.warmup_steps": 0})
        ctx.report.approximated(
            "(scheduler)",
            None,
            "optim.schedule",
            "no scheduler section: constant lr (unless the training script passes one; then set optim.* by hand)",
        )
        return
    kind = str(sched.get("type", ""))
    raw_params = sched.get("params", {}) or {}
    known = {
        "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
        "WarmupDecayLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"),
        "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"),
    }
    if kind not in known:
        ctx.report.unsupported(
            "scheduler.type",
            kind,
            "jaxpar reproduces WarmupLR, WarmupDecayLR and WarmupCosineLR; optim schedule left at jaxpar defaults",
        )
        return
    params = {k: ctx.get(f"scheduler.params.{k}") for k in known[kind] if k in raw_params}
    if "total_num_steps" in known[kind] and "total_num_steps" not in raw_params:
        raise ConfigError(f"deepspeed: scheduler {kind} needs params.total_num_steps (DeepSpeed requires it); add it")
    if "total_num_steps" in known[kind] and params["total_num_steps"] is None and ctx.allow:
        params["total_num_steps"] = ctx.defaulted["scheduler.params.total_num_steps"] = default_config().train.steps
    if any(v is None for v in params.values()):
        return  # unresolved "auto" values, already listed
    fields = schedule_fields(kind, params, ctx.values.get("optim.lr", opt_lr))
    notes = apply_schedule_fields(fields, ctx.values)
    if kind != "WarmupLR":
        ctx.values["train.steps"] = int(params["total_num_steps"])
    ctx.report.add(
        "scheduler.type",
        kind,
        "approximated" if notes else "mapped",
        "optim.*",
        "; ".join(notes) or "exact, DeepSpeed's last_batch_iteration = k - 1 at update k",
    )
    targets = {
        "warmup_min_lr": "optim.warmup_init_lr",
        "warmup_max_lr": "optim.lr",
        "warmup_num_steps": "optim.warmup_steps",
        "warmup_type": "optim.warmup_type",
        "total_num_steps": "train.steps, optim.decay_steps",
        "warmup_min_ratio": "optim.warmup_init_lr",
        "cos_min_ratio": "optim.min_lr_ratio",
    }
    for key, value in raw_params.items():
        src = f"scheduler.params.{key}"
        if key in known[kind]:
            ctx.report.mapped(src, value, targets[key], f"= {params[key]!r}" if value == "auto" else "")
        elif key == "last_batch_iteration":
            ctx.report.approximated(src, value, "train.resume", "jaxpar resumes the schedule from its checkpoint")
        else:
            ctx.report.unknown(src, value, [f"scheduler.params.{k}" for k in known[kind]], f"DeepSpeed {kind}")
    if "warmup_type" not in raw_params:
        ctx.report.mapped("scheduler.params.warmup_type (default)", "log", "optim.warmup_type", "DeepSpeed default")
