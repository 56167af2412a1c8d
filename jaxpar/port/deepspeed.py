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
import pathlib
import re
from typing import Any

from jaxpar import files
from jaxpar.config import ConfigDict, ConfigError
from jaxpar.port.deepspeed_keys import (
    AUTO_ALIASES,
    BUCKET,
    KNOWN_TOP,
    NOOP,
    OFFLOAD,
    SECTION_KEYS,
    TOP_HANDLED,
    TOP_NOOP,
    TOP_OBSERVABILITY,
    TOP_UNSUPPORTED,
    ZERO_NOOP,
    ZERO_OTHER,
    Ctx,
)
from jaxpar.port.deepspeed_optim import optimizer, precision, scheduler
from jaxpar.port.deepspeed_optim import schedule_fields as schedule_fields
from jaxpar.port.report import (
    SHAPE_FIELDS,
    Report,
    build_config,
)


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
    ctx = Ctx(raw, report, side, allow_unresolved)
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
    precision(ctx)
    opt_lr = optimizer(ctx)
    scheduler(ctx, opt_lr)
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


def _int(ctx: Ctx, path: str) -> int | None:
    if path == "train_batch_size" and ctx.raw.get(path) == "auto" and path not in ctx.side:
        return None  # the HF Trainer derives it from the other two, as DeepSpeed does
    value = ctx.get(path)
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value <= 0:
        raise ConfigError(f"deepspeed: {path}={value!r}: must be a positive integer")
    return int(value)


def _tensor(ctx: Ctx, tensor: int | None) -> int:
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


def _batch(ctx: Ctx, world: int | None, tensor: int, pipeline: int) -> None:
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


def _zero(ctx: Ctx) -> None:
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
                ctx.report.approximated(src, value, "", NOOP + "device 'none' offloads nothing")
            else:
                ctx.report.unsupported(src, value, OFFLOAD + (" (already set)" if stage == 3 else ""))
        elif key == "cpu_offload_use_pin_memory":
            ctx.report.approximated(src, value, "", NOOP + "no offload in jaxpar")
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
            ctx.report.approximated(src, value, "", NOOP + "disabled")
        else:
            ctx.report.unknown(
                src, value, [f"zero_optimization.{k}" for k in (*ZERO_NOOP, *ZERO_OTHER)], "DeepSpeed ZeRO"
            )


def _misc(ctx: Ctx) -> None:
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
                status, note = "approximated", NOOP + "disabled"
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
            ctx.report.approximated(src, value, "", BUCKET)
        else:
            ctx.report.unknown(
                src, value, [f"tensor_parallel.{k}" for k in ("autotp_size", "tp_overlap_comm")], "DeepSpeed AutoTP"
            )
    if section is not None and not isinstance(section, dict):
        ctx.report.unknown("tensor_parallel", section, ["tensor_parallel.autotp_size"], "DeepSpeed AutoTP")


def _observability(ctx: Ctx) -> None:
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
            "tensorboard", tb, "", NOOP + "disabled (jaxpar writes TensorBoard events to train.workdir anyway)"
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
        ctx.report.approximated("flops_profiler", fp, "", NOOP + "disabled")
