"""Import a DeepSpeed JSON config (``ds_config.json``) into a jaxpar config, with a report.

DeepSpeed resolves its batch settings against the data-parallel size at launch
(``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * DP``,
``DP = world / (tensor * pipeline)``), silently ignores keys it does not know, and leaves
``"auto"`` values to the HF Trainer / accelerate. The importer does the same arithmetic,
reports every key (typos included), fills ``"auto"`` from side inputs, and fails with one
line when something it needs is missing. A DeepSpeed config does not describe the model: the
report carries a ``(model)`` model change that ``--model-config`` (an HF ``config.json``) or
``--set`` of every shape field resolves (:func:`no_model`).
"""

from __future__ import annotations

import collections
import json
import math
import pathlib
import re
from typing import Any

from jaxpar import files
from jaxpar.config import ConfigDict, ConfigError, default_config
from jaxpar.port.report import (
    FP16_AS_BF16,
    LOSS_SCALE_NOOP,
    SHAPE_FIELDS,
    Report,
    apply_schedule_fields,
    build_config,
)

_NOOP = "no-op in jaxpar: "
_LOGGING = _NOOP + "logging/profiling only; jaxpar logs under train.workdir"
_BUCKET = _NOOP + "XLA schedules, fuses and overlaps the collectives; there are no buckets to size"
TOP_NOOP = {
    "steps_per_print": None,
    "wall_clock_breakdown": _LOGGING,
    "memory_breakdown": _LOGGING,
    "dump_state": _LOGGING,
    "wandb": _LOGGING,
    "csv_monitor": _LOGGING,
    "comet": _LOGGING,
    "timers": _LOGGING,
    "zero_allow_untested_optimizer": _NOOP + "jaxpar's ZeRO works with its one optimizer (AdamW)",
    "zero_force_ds_cpu_optimizer": _NOOP + "no CPU optimizer in jaxpar",
    "prescale_gradients": _NOOP + "gradients are averaged in parallel.grad_reduce_dtype; pre-division only "
    "guards fp16 overflow",
    "gradient_predivide_factor": _NOOP + "gradients are averaged in parallel.grad_reduce_dtype",
    "disable_allgather": _BUCKET,
    "checkpoint": _NOOP + "orbax checkpoints are sharded and restore onto any mesh",
    "compile": _NOOP + "XLA always compiles the whole step",
    "seq_parallel_communication_data_type": _BUCKET,
}
TOP_UNSUPPORTED = {
    "amp": "apex AMP has no jaxpar counterpart; use bf16 (model.compute_dtype=bfloat16)",
    "sparse_gradients": "no sparse gradients in jaxpar",
    "sparse_attention": "no sparse attention in jaxpar",
    "elasticity": "no elastic batch sizing in jaxpar",
    "curriculum_learning": "no curriculum learning in jaxpar",
    "data_efficiency": "no data sampling/routing schedules in jaxpar",
    "compression_training": "no compression",
    "quantize_training": "no quantized training",
    "weight_quantization": "no weight quantization",
    "eigenvalue": "no eigenvalue tracking",
    "progressive_layer_drop": "no layer drop",
    "autotuning": "no autotuner",
    "hybrid_engine": "no RLHF hybrid engine",
    "aio": "no NVMe offload (jaxpar keeps state on the accelerators)",
    "nebula": "no Nebula checkpoint service",
    "data_types": "no separate gradient-accumulation dtype setting",
}
ZERO_NOOP = {
    k: _BUCKET
    for k in (
        "allgather_partitions",
        "allgather_bucket_size",
        "reduce_bucket_size",
        "overlap_comm",
        "reduce_scatter",
        "contiguous_gradients",
        "sub_group_size",
        "stage3_prefetch_bucket_size",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
        "round_robin_gradients",
        "use_multi_rank_bucket_allreduce",
        "stage3_module_granularity_threshold",
        "memory_efficient_linear",
        "mics_hierarchical_params_gather",
    )
}
ZERO_NOOP.update(
    {
        "stage3_param_persistence_threshold": _NOOP + "1-D parameters (norms) stay replicated by jaxpar's rules; "
        "parallel.max_replicated_fraction bounds the replicated share",
        "stage3_model_persistence_threshold": _NOOP + "see stage3_param_persistence_threshold",
        "stage3_gather_16bit_weights_on_model_save": _NOOP + "orbax saves sharded checkpoints; no gather on save",
        "stage3_gather_fp16_weights_on_model_save": _NOOP + "orbax saves sharded checkpoints; no gather on save",
        "elastic_checkpoint": _NOOP + "orbax checkpoints restore onto any mesh",
        "load_from_fp32_weights": _NOOP + "master weights are param_dtype=float32 already",
        "ignore_unused_parameters": _NOOP + "jax differentiates the whole tree",
        "legacy_stage1": _BUCKET,
        "pipeline_loading_checkpoint": _BUCKET,
        "override_module_apply": _BUCKET,
        "log_trace_cache_warnings": _LOGGING,
    }
)
OFFLOAD = (
    "jaxpar keeps all training state on the accelerators; nearest: ZeRO-3 sharding over data "
    "(parallel.zero_stage=3), which divides the state by the data size instead of moving it to CPU"
)
ZERO_OTHER = (
    "stage",
    "offload_optimizer",
    "offload_param",
    "cpu_offload",
    "cpu_offload_params",
    "cpu_offload_use_pin_memory",
    "zero_hpz_partition_size",
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients",
    "mics_shard_size",
)
_XLA_REMAT = _NOOP + "XLA plans the rematerialized buffers"
SECTION_KEYS = {  # key -> (status, jaxpar target, note)
    "activation_checkpointing": {
        "partition_activations": (
            "unsupported",
            "",
            "saved activations are not split over tensor ranks; nearest: "
            "parallel.sequence_parallel with mesh.tensor > 1",
        ),
        "cpu_checkpointing": ("unsupported", "", "no activation offload to CPU in jaxpar"),
        **dict.fromkeys(
            ("contiguous_memory_optimization", "number_checkpoints", "synchronize_checkpoint_boundary", "profile"),
            ("approximated", "", _XLA_REMAT),
        ),
    },
    "pipeline": {
        "activation_checkpoint_interval": ("mapped", "parallel.recompute", "0: none, 1: every layer (full)"),
        **dict.fromkeys(
            ("stages", "partition"),
            ("approximated", "mesh.pipeline", "stages come from --pipeline; jaxpar splits layers evenly over stages"),
        ),
        **dict.fromkeys(
            ("seed_layers", "pipe_partitioned", "grad_partitioned", "use_reentrant"),
            ("approximated", "", _NOOP + "jaxpar seeds and partitions by construction"),
        ),
    },
}
TOP_HANDLED = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "optimizer",
    "scheduler",
    "fp16",
    "bf16",
    "bfloat16",
    "torch_autocast",
    "zero_optimization",
    "gradient_clipping",
    "activation_checkpointing",
    "pipeline",
    "communication_data_type",
    "tensor_parallel",
)
TOP_OBSERVABILITY = ("tensorboard", "flops_profiler")  # mapped by _observability
KNOWN_TOP = tuple(TOP_HANDLED) + TOP_OBSERVABILITY + tuple(TOP_NOOP) + tuple(TOP_UNSUPPORTED)
# "auto" values the HF Trainer fills, by side-input name (first found wins) and its default.
AUTO_ALIASES = {
    "optimizer.params.lr": (("lr", "learning_rate"), 5e-5),
    "optimizer.params.betas": (("betas",), [0.9, 0.999]),
    "optimizer.params.eps": (("eps", "adam_epsilon"), 1e-8),
    "optimizer.params.weight_decay": (("weight_decay",), 0.0),
    "scheduler.params.warmup_min_lr": (("warmup_min_lr",), 0.0),
    "scheduler.params.warmup_max_lr": (("warmup_max_lr", "lr", "learning_rate"), 5e-5),
    "scheduler.params.warmup_num_steps": (("warmup_num_steps", "warmup_steps"), 0),
    "scheduler.params.total_num_steps": (("total_num_steps", "max_steps", "steps"), None),
    "gradient_clipping": (("gradient_clipping", "max_grad_norm"), 1.0),
    "train_micro_batch_size_per_gpu": (("train_micro_batch_size_per_gpu", "per_device_train_batch_size"), 8),
    "gradient_accumulation_steps": (("gradient_accumulation_steps",), 1),
    "fp16.enabled": (("fp16",), False),
    "bf16.enabled": (("bf16",), False),
}


class _Ctx:
    """The parsed config plus the bookkeeping shared by the section handlers."""

    def __init__(self, raw: dict, report: Report, side: dict[str, Any], allow_unresolved: bool) -> None:
        self.raw, self.report, self.side, self.allow = raw, report, side, allow_unresolved
        self.values: dict[str, Any] = {}
        self.unresolved: list[str] = []
        self.defaulted: dict[str, Any] = {}  # "auto" paths filled with defaults (--allow-unresolved)
        self.used: set[str] = {"world_size"}  # side inputs that filled a value (the rest are refused)

    def get(self, path: str, default: Any = None) -> Any:
        """The value at a dotted path with ``"auto"`` resolved (side input, HF default, or unresolved)."""
        node: Any = self.raw
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        if node != "auto":
            return node
        names, hf_default = AUTO_ALIASES.get(path, ((path.rsplit(".", 1)[-1],), None))
        for name in (path, *names):
            if name in self.side:
                self.used.add(name)
                return self.side[name]
        if path == "scheduler.params.warmup_min_lr":
            return 0.0  # the HF Trainer always fills 0 here
        if self.allow:
            self.defaulted[path] = hf_default if hf_default is not None else default
            return self.defaulted[path]
        self.unresolved.append(path)
        return default


def port_deepspeed(
    path_or_dict: str | pathlib.Path | dict,
    *,
    world_size: int | None = None,
    tensor: int | None = None,
    pipeline: int = 1,
    side_inputs: dict[str, Any] | None = None,
    allow_unresolved: bool = False,
) -> tuple[ConfigDict, Report]:
    """Port a DeepSpeed config (path or dict); ``tensor``/``pipeline`` are the model-parallel sizes
    (``tensor`` None: the recipe's ``tensor_parallel.autotp_size``, else 1).

    ``side_inputs`` fill ``"auto"`` values (``{"lr": 3e-4, "world_size": 8}``; leaf names, HF
    names or dotted paths). Raises :class:`ConfigError` (one line) for placeholders, unresolved
    values, or inconsistent batch settings.
    """
    raw, source = _load(path_or_dict)
    side = dict(side_inputs or {})
    if world_size is None and "world_size" in side:
        world_size = int(side["world_size"])
    report = Report("deepspeed", source)
    ctx = _Ctx(raw, report, side, allow_unresolved)
    for key, value in raw.items():
        if key in TOP_HANDLED or key in TOP_OBSERVABILITY:
            continue
        if key == "steps_per_print":
            ctx.values["train.log_every"] = int(value)
            report.mapped(key, value, "train.log_every")
        elif key in TOP_NOOP:
            report.approximated(key, value, "", TOP_NOOP[key])
        elif key in TOP_UNSUPPORTED:
            report.unsupported(key, value, TOP_UNSUPPORTED[key])
        else:
            report.unknown(key, value, KNOWN_TOP, "DeepSpeed")
    tensor = _tensor(ctx, tensor)
    _batch(ctx, world_size, tensor, pipeline)
    _precision(ctx)
    opt_lr = _optimizer(ctx)
    _scheduler(ctx, opt_lr)
    _zero(ctx)
    _misc(ctx)
    _observability(ctx)
    if ctx.unresolved:
        names = ", ".join(
            f"{n} (needed to split the batch; --world-size N)"
            if n == "world_size"
            else f'{n} ("auto", filled by the HF Trainer)'
            for n in sorted(set(ctx.unresolved))
        )
        raise ConfigError(
            f"deepspeed: unresolved values: {names}; give each with --set NAME=VALUE (e.g. --set "
            "lr=3e-4 --set world_size=8) or pass --allow-unresolved for defaults"
        )
    known = {"world_size", *AUTO_ALIASES, *(n for names, _ in AUTO_ALIASES.values() for n in names)}
    for name in [n for n in side if n not in ctx.used]:
        if name not in known and not _is_auto(raw, name):  # a typo would otherwise vanish
            raise ConfigError(
                f"deepspeed: --set {name}: neither a jaxpar config key (section.field) nor a side input "
                'for an "auto" value (lr, betas, eps, weight_decay, warmup_num_steps, '
                "train_micro_batch_size_per_gpu, ...); check the name or drop it"
            )
        report.approximated(f"--set {name}", side[name], "", 'not used: no "auto" value of this recipe takes it')
    for path, value in ctx.defaulted.items():
        entry = report.find(path) or report.approximated(path, "auto")
        entry.status, entry.note = "approximated", f'unresolved "auto": default {value!r} used (--allow-unresolved)'
    no_model(report, "a DeepSpeed config")
    return build_config(ctx.values, report), report


def no_model(report: Report, what: str) -> None:
    """The model change of a recipe that does not describe its model (DeepSpeed JSON, accelerate YAML):
    resolved by ``--model-config`` or by ``--set`` of every shape field."""
    report.model_change(
        "(model)",
        None,
        f"{what} does not describe the model (the training script builds it): jaxpar's default model (a small "
        "test model) would be trained",
        "give the model with --model-config CONFIG.json (its Hugging Face config.json) or --set each of {needs}",
        needs=SHAPE_FIELDS,
        target="model.*",
    )


def _is_auto(raw: dict, path: str) -> bool:
    """Whether the dotted ``path`` of the recipe holds ``"auto"``."""
    node: Any = raw
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return node == "auto"


def _load(path_or_dict: str | pathlib.Path | dict) -> tuple[dict, str]:
    if isinstance(path_or_dict, dict):
        return path_or_dict, ""
    path = pathlib.Path(path_or_dict)
    text = files.read_text(path, "recipe", "deepspeed", "pass the path of a ds_config.json")

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
        counts = collections.Counter(k for k, _ in pairs)  # one pass: a list.count per key is quadratic
        dup = sorted(k for k, n in counts.items() if n > 1)
        if dup:
            raise ConfigError(
                f"deepspeed: {path.name} repeats key(s) {', '.join(dup)} (DeepSpeed rejects "
                "duplicates); keep one of each"
            )
        return dict(pairs)

    try:
        raw = json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as e:
        names = sorted(
            set(re.findall(r":\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?=[,}\]\n])", text)) - {"true", "false", "null"}
        )
        if names:
            raise ConfigError(
                f"deepspeed: {path.name} is not strict JSON: placeholder(s) {', '.join(names)} (a template the "
                f"launch script fills in, e.g. with sed); substitute real values and port the result"
            ) from None
        raise ConfigError(
            f"deepspeed: {path.name} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); fix the syntax"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(
            f"deepspeed: {path.name} holds a JSON {type(raw).__name__}, not an object; pass a ds_config.json"
        )
    return raw, str(path)


def _int(ctx: _Ctx, path: str) -> int | None:
    if path == "train_batch_size" and ctx.raw.get(path) == "auto" and path not in ctx.side:
        return None  # the HF Trainer derives it from the other two, as DeepSpeed does
    value = ctx.get(path)
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value <= 0:
        raise ConfigError(f"deepspeed: {path}={value!r}: must be a positive integer")
    return int(value)


def _tensor(ctx: _Ctx, tensor: int | None) -> int:
    """The tensor-parallel size: ``--tensor``, else the recipe's AutoTP size (``tensor_parallel.autotp_size``),
    else 1; a ``--tensor`` that contradicts the recipe's size is refused."""
    section = ctx.raw.get("tensor_parallel")
    autotp = section.get("autotp_size") if isinstance(section, dict) else None
    if autotp is not None and (isinstance(autotp, bool) or not isinstance(autotp, int) or autotp < 0):
        raise ConfigError(f"deepspeed: tensor_parallel.autotp_size={autotp!r}: use an integer >= 1 (0: no AutoTP)")
    if tensor is not None and autotp and tensor != autotp:
        raise ConfigError(
            f"deepspeed: --tensor {tensor} contradicts the recipe's tensor_parallel.autotp_size {autotp}; drop "
            "--tensor (the recipe's size is used) or fix the recipe"
        )
    return tensor if tensor is not None else (autotp or 1)


def _batch(ctx: _Ctx, world: int | None, tensor: int, pipeline: int) -> None:
    """DeepSpeed's batch arithmetic (_set_batch_related_parameters + _batch_assertion) on DP."""
    tb, mb, gas = (
        _int(ctx, k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    )
    mp = tensor * pipeline
    if tensor < 1 or pipeline < 1:
        raise ConfigError(f"deepspeed: tensor={tensor}, pipeline={pipeline}: sizes must be >= 1")
    dp = None
    if world is not None:
        if world % mp:
            raise ConfigError(
                f"deepspeed: world size {world} is not divisible by tensor*pipeline = {tensor}*"
                f"{pipeline} = {mp}; pass a world size that is a multiple of {mp}"
            )
        dp = world // mp
    given = {"train_batch_size": tb, "train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": gas}
    if tb is None and mb is None:
        if gas is not None:
            ctx.values["parallel.microbatches"] = gas
            ctx.report.mapped("gradient_accumulation_steps", gas, "parallel.microbatches")
        ctx.report.approximated(
            "(batch size)",
            None,
            "train.global_batch",
            "no train_batch_size or train_micro_batch_size_per_gpu: jaxpar defaults kept",
        )
        if dp is not None:
            ctx.values.update({"mesh.data": dp, "mesh.tensor": tensor, "mesh.pipeline": pipeline})
        return
    if tb is not None and mb is not None and gas is not None and dp is None:
        if tb % (mb * gas):
            raise ConfigError(
                f"deepspeed: train_batch_size={tb} is not train_micro_batch_size_per_gpu={mb} * "
                f"gradient_accumulation_steps={gas} * DP for any integer DP; fix one of the three"
            )
        dp = tb // (mb * gas)
    if dp is None:
        if not ctx.allow:
            ctx.unresolved.append("world_size")
            return
        dp = 1
        ctx.report.approximated("(world size)", None, "mesh.data", "unresolved; assumed DP = 1")
    if tb is not None and mb is not None and gas is None:
        gas = tb // mb // dp
    elif tb is not None and gas is not None and mb is None:
        mb = tb // dp // gas
    elif mb is not None and gas is not None and tb is None:
        tb = mb * gas * dp
    elif tb is not None and mb is None and gas is None:
        gas, mb = 1, tb // dp
    elif mb is not None and tb is None and gas is None:
        tb, gas = mb * dp, 1
    if not mb or not gas or tb != mb * gas * dp:
        shown = ", ".join(f"{k}={v}" for k, v in given.items() if v is not None)
        raise ConfigError(
            f"deepspeed: {shown} with DP={dp} (world {dp * mp} / tensor*pipeline {mp}) breaks "
            f"train_batch_size = micro_batch * gradient_accumulation_steps * DP; fix one of them"
        )
    ctx.values.update(
        {
            "mesh.data": dp,
            "mesh.tensor": tensor,
            "mesh.pipeline": pipeline,
            "train.global_batch": tb,
            "parallel.microbatches": gas,
        }
    )
    ctx.report.mapped("(world size)", dp * mp, "mesh.data", f"DP = world / (tensor*pipeline) = {dp}")
    for key, target, value in (
        ("train_batch_size", "train.global_batch", tb),
        ("train_micro_batch_size_per_gpu", "train.global_batch/(microbatches*data)", mb),
        ("gradient_accumulation_steps", "parallel.microbatches", gas),
    ):
        note = "" if given[key] is not None else "derived as DeepSpeed does"
        ctx.report.mapped(key if key in ctx.raw else f"{key} (derived)", value, target, note)


# DeepSpeed's fp16 loss-scale keys -> train.loss_scale fields (jaxpar.train.loss_scale, rule deepspeed)
FP16_LOSS_SCALE = {
    "initial_scale_power": ("initial_scale_power", int),
    "loss_scale_window": ("window", int),
    "hysteresis": ("hysteresis", int),
    "consecutive_hysteresis": ("consecutive_hysteresis", bool),
    "min_loss_scale": ("min_scale", float),
}


def _precision(ctx: _Ctx) -> None:
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
                ctx.report.approximated(src, value, "", _NOOP + f"{section} is disabled")
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


def _loss_scale(ctx: _Ctx, key: str, value: Any) -> None:
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
            ctx.report.approximated(src, value, "", _NOOP + f"fp16.loss_scale={static} is a fixed scale")
            return
        ctx.values[f"train.loss_scale.{field}"] = kind(value)
        ctx.report.mapped(src, value, f"train.loss_scale.{field}", "DeepSpeed's DynamicLossScaler rule")
    elif key == "fp16_master_weights_and_grads" and not value:
        ctx.report.mapped(src, value, "model.param_dtype", "fp32 master weights, as jaxpar keeps them")
    elif key == "fp16_master_weights_and_grads":
        ctx.report.approximated(src, value, "model.param_dtype", "jaxpar keeps fp32 master weights: memory only")
    else:
        ctx.report.unknown(src, value, ["enabled", "auto_cast", "loss_scale", *FP16_LOSS_SCALE], "DeepSpeed fp16")


def _optimizer(ctx: _Ctx) -> float | None:
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
                src, value, "", _NOOP + "implementation choice; jaxpar's AdamW runs inside the XLA step"
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


def _script_optimizer(ctx: _Ctx) -> float | None:
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


def _scheduler(ctx: _Ctx, opt_lr: float | None) -> None:
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


def _zero(ctx: _Ctx) -> None:
    zero = ctx.raw.get("zero_optimization")
    if isinstance(zero, (bool, int)):
        zero = {"stage": int(zero)}
    zero = zero or {}
    stage = int(zero.get("stage", 0))
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"deepspeed: zero_optimization.stage={stage}: use 0, 1, 2 or 3")
    ctx.values["parallel.zero_stage"] = stage
    ctx.report.mapped(
        "zero_optimization.stage", stage, "parallel.zero_stage", "" if "stage" in zero else "DeepSpeed default 0"
    )
    for key, value in zero.items():
        src = f"zero_optimization.{key}"
        if key == "stage":
            continue
        if key in ZERO_NOOP:
            ctx.report.approximated(src, value, "", ZERO_NOOP[key])
        elif key in ("offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_params"):
            device = value.get("device", "cpu") if isinstance(value, dict) else ("cpu" if value else "none")
            if device == "none":
                ctx.report.approximated(src, value, "", _NOOP + "device 'none' offloads nothing")
            else:
                ctx.report.unsupported(src, value, OFFLOAD + (" (already set)" if stage == 3 else ""))
        elif key == "cpu_offload_use_pin_memory":
            ctx.report.approximated(src, value, "", _NOOP + "no offload in jaxpar")
        elif key == "zero_quantized_gradients" and value:
            ctx.values["parallel.grad_reduce_dtype"] = "bfloat16"
            ctx.report.approximated(
                src,
                value,
                "parallel.grad_reduce_dtype",
                "ZeRO++ qgZ (int4 gradient reduce-scatter) has no jaxpar counterpart; nearest: bf16 gradient reduction",
            )
        elif key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights") and value:
            ctx.report.unsupported(
                src,
                value,
                "ZeRO++ qwZ (int8 weight all-gather): jaxpar gathers weights in "
                "param_dtype/compute dtype; nearest: parallel.zero_stage=3 as configured",
            )
        elif key == "zero_hpz_partition_size" and int(value) > 1:
            ctx.report.unsupported(
                src,
                value,
                "ZeRO++ hpZ (secondary intra-node weight copy): jaxpar shards "
                "parameters over the whole data axis, no secondary partition",
            )
        elif key == "mics_shard_size" and int(value) > 0:
            ctx.report.approximated(
                src,
                value,
                "parallel.zero_stage",
                "MiCS shards within groups of "
                f"{value} and replicates across them; jaxpar shards over the whole data axis "
                "(ZeRO-3): less memory, all-gathers span every data rank",
            )
        elif key in ZERO_OTHER:
            ctx.report.approximated(src, value, "", _NOOP + "disabled")
        else:
            ctx.report.unknown(
                src, value, [f"zero_optimization.{k}" for k in (*ZERO_NOOP, *ZERO_OTHER)], "DeepSpeed ZeRO"
            )


def _misc(ctx: _Ctx) -> None:
    """gradient_clipping, activation checkpointing, pipeline section, comm dtype, tensor_parallel."""
    if "gradient_clipping" in ctx.raw:
        clip = float(ctx.get("gradient_clipping", 0.0) or 0.0)
        ctx.values["optim.clip_norm"] = clip
        ctx.report.mapped(
            "gradient_clipping",
            ctx.raw["gradient_clipping"],
            "optim.clip_norm",
            f"= {clip}" if ctx.raw["gradient_clipping"] == "auto" else "",
        )
    else:
        ctx.values["optim.clip_norm"] = 0.0
        ctx.report.mapped("gradient_clipping (default)", 0.0, "optim.clip_norm", "DeepSpeed default: no clipping")
    ac = ctx.raw.get("activation_checkpointing")
    if isinstance(ac, dict):
        ctx.values["parallel.recompute"] = "full"
        ctx.report.approximated(
            "activation_checkpointing",
            "{...}",
            "parallel.recompute",
            "the section configures the checkpointing the model code calls; jaxpar rematerializes every layer (full)",
        )
    remat = "full" if int((ctx.raw.get("pipeline") or {}).get("activation_checkpoint_interval", 0) or 0) > 0 else None
    if remat:
        ctx.values["parallel.recompute"] = remat
    for section in ("activation_checkpointing", "pipeline"):
        block = ctx.raw.get(section)
        for key, value in block.items() if isinstance(block, dict) else []:
            status, target, note = SECTION_KEYS[section].get(key, ("unknown", "", ""))
            if key in ("partition_activations", "cpu_checkpointing") and not value:
                status, note = "approximated", _NOOP + "disabled"
            if key == "activation_checkpoint_interval" and int(value) > 1:
                status, note = "approximated", "jaxpar rematerializes every layer, not every n-th"
            if status == "unknown":
                ctx.report.unknown(
                    f"{section}.{key}", value, [f"{section}.{k}" for k in SECTION_KEYS[section]], "DeepSpeed"
                )
            else:
                ctx.report.add(f"{section}.{key}", value, status, target, note)
    if "communication_data_type" in ctx.raw:
        value = str(ctx.raw["communication_data_type"]).lower()
        dtype = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}.get(value)
        if dtype:
            ctx.values["parallel.grad_reduce_dtype"] = dtype
            ctx.report.mapped("communication_data_type", value, "parallel.grad_reduce_dtype")
        else:
            ctx.report.unsupported("communication_data_type", value, "jaxpar reduces in float32 or bfloat16")
    section = ctx.raw.get("tensor_parallel")
    for key, value in section.items() if isinstance(section, dict) else []:
        src = f"tensor_parallel.{key}"
        if key == "autotp_size":
            ctx.report.mapped(
                src,
                value,
                "mesh.tensor",
                f"AutoTP over {value} ranks = mesh.tensor (jaxpar splits attention heads and MLP columns, as AutoTP "
                "splits the linear layers)"
                if value
                else "no AutoTP",
            )
        elif key in ("tp_overlap_comm", "keep_module_on_host", "tp_grain_size"):
            ctx.report.approximated(src, value, "", _BUCKET)
        else:
            ctx.report.unknown(
                src, value, [f"tensor_parallel.{k}" for k in ("autotp_size", "tp_overlap_comm")], "DeepSpeed AutoTP"
            )
    if section is not None and not isinstance(section, dict):
        ctx.report.unknown("tensor_parallel", section, ["tensor_parallel.autotp_size"], "DeepSpeed AutoTP")


def _observability(ctx: _Ctx) -> None:
    """``tensorboard`` -> the event files jaxpar always writes in train.workdir; ``flops_profiler`` ->
    a jax.profiler trace of its ``profile_step`` (train.profile_steps)."""
    tb = ctx.raw.get("tensorboard")
    if isinstance(tb, dict) and tb.get("enabled", False):
        ctx.report.approximated(
            "tensorboard",
            tb,
            "train.workdir",
            "jaxpar always writes TensorBoard event files "
            "(loss, grad norm, lr, step time, tokens/s, MFU, validation) into train.workdir beside "
            "metrics.jsonl; output_path/job_name are not used",
        )
    elif "tensorboard" in ctx.raw:
        ctx.report.approximated(
            "tensorboard", tb, "", _NOOP + "disabled (jaxpar writes TensorBoard events to train.workdir anyway)"
        )
    fp = ctx.raw.get("flops_profiler")
    if isinstance(fp, dict) and fp.get("enabled", False):
        # DeepSpeed profiles while engine.global_steps (steps done, from 0) == profile_step (default 1):
        # the (profile_step + 1)-th step, jaxpar's step numbers start at 1
        step = int(fp.get("profile_step", 1)) + 1
        ctx.values["train.profile_steps"] = f"{step},{step}"
        ctx.report.approximated(
            "flops_profiler",
            fp,
            "train.profile_steps",
            f"a jax.profiler trace of step {step} "
            "(per-op times in TensorBoard/Perfetto) instead of DeepSpeed's per-module FLOPs table; "
            "model FLOPs and MFU are logged every step in metrics.jsonl",
        )
    elif "flops_profiler" in ctx.raw:
        ctx.report.approximated("flops_profiler", fp, "", _NOOP + "disabled")
