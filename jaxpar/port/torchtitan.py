"""Import a torchtitan TOML job config into a jaxpar config, with a report.

torchtitan builds its mesh from degrees whose product is the world size;
``data_parallel_shard_degree = -1`` takes the remaining ranks, so the world size must be
known. Dense parameters are FSDP-sharded over dp_shard (ZeRO-3 on jaxpar's data axis).
``local_batch_size`` is per data-parallel rank; ``global_batch_size`` (-1: local * DP) adds
gradient accumulation. The LR schedule is torchtitan's warmup-stable-decay ``LambdaLR``,
evaluated at ``last_epoch = k`` for update k.
"""

from __future__ import annotations

import pathlib
import tomllib
from typing import Any

from jaxpar import files
from jaxpar.config import ConfigDict, ConfigError
from jaxpar.port.report import Report, apply_schedule_fields, build_config, refuse_model_changes
from jaxpar.port.torchtitan_keys import KNOWN, LOG, NOOP, NOOP_SECTIONS, PROFILING_KEYS, TB, UNSUPPORTED_SECTIONS
from jaxpar.port.torchtitan_model import ffn_dim as ffn_dim
from jaxpar.port.torchtitan_model import model_section
from jaxpar.port.torchtitan_parallel import parallel_section
from jaxpar.port.torchtitan_parallel import torchtitan_stage_layers as torchtitan_stage_layers


def schedule_fields(
    lr: float,
    warmup: int,
    steps: int,
    decay_ratio: float | None = None,
    decay_type: str = "linear",
    min_lr_factor: float = 0.0,
) -> dict[str, Any]:
    """optim fields reproducing torchtitan's linear_warmup_stable_decay (current, min_lr_factor version)."""
    warmup = min(int(warmup), steps)
    decay = round(steps * decay_ratio) if decay_ratio is not None else steps - warmup
    decay = min(decay, steps - warmup)
    return {
        "lr": lr,
        "warmup_steps": max(warmup - 1, 0),
        "warmup_init_lr": lr / warmup if warmup else 0.0,
        "warmup_type": "linear",
        "schedule": decay_type,
        "min_lr_ratio": float(min_lr_factor),
        "decay_start_step": steps - decay,
        "decay_steps": steps,
        "schedule_offset": 0,
    }


def port_torchtitan(
    path: str | pathlib.Path,
    *,
    world_size: int | None = None,
    allow_unresolved: bool = False,
    approximate: bool | None = None,
) -> tuple[ConfigDict, Report]:
    """Port a torchtitan ``.toml`` job config; ``world_size`` resolves ``data_parallel_shard_degree = -1``.

    A model jaxpar cannot train (see :func:`jaxpar.port.torchtitan_model.model_section`) is a model change in the report;
    ``approximate=False`` refuses it at once, before asking for anything else (the world size); None
    leaves the decision to the caller (:func:`jaxpar.port.recipe.port_recipe`)."""
    path = pathlib.Path(path)
    text = files.read_text(path, "recipe", "torchtitan", "pass a torchtitan .toml job config")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"torchtitan: {path.name} is not valid TOML ({e}); fix the syntax") from None
    report = Report("torchtitan", str(path))
    values: dict[str, Any] = {}
    old = schema_2024(raw)
    renamed = _from_2024(raw) if old else {}
    sec = {name: raw.get(name, {}) for name in KNOWN}
    for name, table in sec.items():
        if not isinstance(table, dict):
            raise ConfigError(
                f"torchtitan: [{name}] is a {type(table).__name__}, not a table; write it as [{name}] "
                "with key = value lines"
            )
    model_section(sec["model"], sec["training"], values, report, old=old)
    if approximate is False:
        refuse_model_changes(report, "torchtitan", approximate=False, final=True)
    parallel_section(sec["parallelism"], sec["training"], world_size, allow_unresolved, values, report)
    _optim(sec["optimizer"], sec["lr_scheduler"], sec["training"], values, report)
    _rest(raw, sec, values, report)
    if "lr_scheduler.warmup_steps" in renamed:
        report.mapped(
            "training.warmup_steps",
            sec["lr_scheduler"]["warmup_steps"],
            "optim.warmup_steps",
            "2024 schema: the scheduler's warm-up (lr_scheduler.warmup_steps now)",
        )
    for entry in report.entries:  # the 2024 names, as the recipe writes them
        if entry.source.split(" ")[0] in renamed:
            name = entry.source.split(" ")[0]
            entry.source = renamed[name] + entry.source[len(name) :]
            entry.note = f"2024 schema, now {name}" + (f"; {entry.note}" if entry.note else "")
    return build_config(values, report), report


# torchtitan's 2024 schema (config_manager.py at a99d2e5) kept the parallel degrees and the warmup in
# [training] and the pipeline in [experimental]: 2024 name -> current name
SCHEMA_2024 = {
    "training.data_parallel_degree": "parallelism.data_parallel_shard_degree",
    "training.tensor_parallel_degree": "parallelism.tensor_parallel_degree",
    "training.enable_loss_parallel": "parallelism.disable_loss_parallel",
    "training.warmup_steps": "lr_scheduler.warmup_steps",
    "experimental.pipeline_parallel_degree": "parallelism.pipeline_parallel_degree",
    "experimental.pipeline_parallel_split_points": "parallelism.pipeline_parallel_split_points",
    "experimental.pipeline_parallel_schedule": "parallelism.pipeline_parallel_schedule",
    "experimental.pipeline_parallel_microbatches": "parallelism.pipeline_parallel_microbatch_size",
    "experimental.enable_async_tensor_parallel": "parallelism.enable_async_tensor_parallel",
    "experimental.enable_compiled_autograd": "parallelism.enable_compiled_autograd",
}


def _from_2024(raw: dict) -> dict[str, str]:
    """Move a 2024-schema job's settings to their current places (in ``raw``, in place); returns
    current name -> 2024 name for the report rows. ``enable_loss_parallel`` is inverted into
    ``disable_loss_parallel``; ``pipeline_parallel_microbatches`` (a count) has no current
    counterpart and stays where it is (reported as unknown)."""
    renamed: dict[str, str] = {}
    for old, new in SCHEMA_2024.items():
        section, key = old.split(".")
        table = raw.get(section)
        if not isinstance(table, dict) or key not in table or old == "experimental.pipeline_parallel_microbatches":
            continue
        value = table.pop(key)
        if key == "enable_loss_parallel":
            value = not value
        target_section, target_key = new.split(".")
        raw.setdefault(target_section, {})[target_key] = value
        renamed[new] = old
    for section in ("experimental",):
        if raw.get(section) == {}:
            del raw[section]
    return renamed


def schema_2024(raw: dict) -> bool:
    """Whether a job TOML is in torchtitan's 2024 schema (a99d2e5): ``training.batch_size`` /
    ``data_parallel_degree`` / ``model.tokenizer_path``, renamed since (``local_batch_size``,
    ``data_parallel_shard_degree``, ``hf_assets_path``)."""
    model, training = raw.get("model", {}), raw.get("training", {})
    if not isinstance(model, dict) or not isinstance(training, dict):
        return False
    if "hf_assets_path" in model or "local_batch_size" in training:
        return False
    return "tokenizer_path" in model or "batch_size" in training or "data_parallel_degree" in training


def _optim(o: dict, s: dict, t: dict, values: dict, report: Report) -> None:
    name = str(o.get("name", "AdamW"))
    if name not in ("AdamW", "Adam"):
        report.unsupported(
            "optimizer.name",
            name,
            "this port maps AdamW/Adam only; optim.* left at jaxpar defaults, pick optim.name by hand",
        )
        return
    lr = float(o.get("lr", 8e-4))
    values.update(
        {
            "optim.decoupled_weight_decay": name == "AdamW",
            "optim.lr": lr,
            "optim.b1": float(o.get("beta1", 0.9)),
            "optim.b2": float(o.get("beta2", 0.95)),
            "optim.eps": float(o.get("eps", 1e-8)),
            "optim.weight_decay": float(o.get("weight_decay", 0.1)),
            "optim.clip_norm": float(t.get("max_norm", 1.0)),
            "train.steps": int(t.get("steps", 10000)),
        }
    )
    targets = {
        "name": "optim.decoupled_weight_decay",
        "lr": "optim.lr",
        "beta1": "optim.b1",
        "beta2": "optim.b2",
        "eps": "optim.eps",
        "weight_decay": "optim.weight_decay",
    }
    for key, target in targets.items():
        note = "torchtitan decays every parameter; jaxpar skips norms (1-D)" if key == "weight_decay" else ""
        report.add(
            f"optimizer.{key}" + ("" if key in o else " (default)"),
            o.get(key, values.get(target)),
            "approximated" if note else "mapped",
            target,
            note,
        )
    for key, value in o.items():
        if key not in targets:
            if key in KNOWN["optimizer"]:
                report.approximated(f"optimizer.{key}", value, "", NOOP + "implementation choice")
            else:
                report.unknown(f"optimizer.{key}", value, [f"optimizer.{k}" for k in KNOWN["optimizer"]], "torchtitan")
    steps = values["train.steps"]
    fields = schedule_fields(
        lr,
        int(s.get("warmup_steps", 200)),
        steps,
        s.get("decay_ratio"),
        str(s.get("decay_type", "linear")),
        float(s.get("min_lr_factor", s.get("lr_min", 0.0))),
    )
    notes = apply_schedule_fields(fields, values)
    report.add(
        "lr_scheduler",
        dict(s),
        "approximated" if notes else "mapped",
        "optim.*",
        "; ".join(notes) or "exact: LambdaLR factor at last_epoch = k for update k",
    )
    for key, value in s.items():
        if key not in KNOWN["lr_scheduler"]:
            report.unknown(
                f"lr_scheduler.{key}", value, [f"lr_scheduler.{k}" for k in KNOWN["lr_scheduler"]], "torchtitan"
            )


def _rest(raw: dict, sec: dict, values: dict, report: Report) -> None:
    """Training extras, checkpointing, activation checkpointing, logging, validation, other sections."""
    t = sec["training"]
    param = str(t.get("mixed_precision_param", "bfloat16"))
    values["model.compute_dtype"] = param if param in ("float32", "bfloat16", "float16") else "bfloat16"
    values["parallel.grad_reduce_dtype"] = "bfloat16" if t.get("mixed_precision_reduce") == "bfloat16" else "float32"
    report.mapped(
        "training.mixed_precision_param" + ("" if "mixed_precision_param" in t else " (default)"),
        param,
        "model.compute_dtype",
        "torchtitan's FSDP mixed precision",
    )
    handled = {
        "local_batch_size",
        "batch_size",
        "global_batch_size",
        "seq_len",
        "max_norm",
        "steps",
        "mixed_precision_param",
    }
    for key, value in t.items():
        src = f"training.{key}"
        if key in ("max_norm", "steps", "global_batch_size", "mixed_precision_reduce"):
            report.mapped(
                src,
                value,
                {
                    "max_norm": "optim.clip_norm",
                    "steps": "train.steps",
                    "global_batch_size": "train.global_batch",
                    "mixed_precision_reduce": "parallel.grad_reduce_dtype",
                }[key],
            )
        elif key == "seed" and value is not None:
            values["train.seed"] = int(value)
            report.mapped(src, value, "train.seed")
        elif key in ("dataset", "dataset_path"):
            report.approximated(
                src,
                value,
                "data.source",
                "no torchtitan dataset loaders in jaxpar; point data.path at a token .bin or Megatron prefix",
            )
        elif key == "enable_cpu_offload" and value:
            report.unsupported(src, value, "jaxpar keeps state on the accelerators; nearest: ZeRO-3 (already used)")
        elif key not in handled:
            if key in KNOWN["training"]:
                report.approximated(src, value, "", NOOP + "runtime detail")
            else:
                report.unknown(src, value, [f"training.{k}" for k in KNOWN["training"]], "torchtitan")
    ac = sec["activation_checkpoint"]
    mode = str(ac.get("mode", "selective"))
    values["parallel.recompute"] = mode if mode in ("none", "full", "selective") else "full"
    report.mapped("activation_checkpoint.mode" + ("" if "mode" in ac else " (default)"), mode, "parallel.recompute")
    for key, value in ac.items():
        if key != "mode":
            report.approximated(
                f"activation_checkpoint.{key}",
                value,
                "parallel.recompute",
                "jaxpar's selective policy keeps matmul outputs and recomputes the rest, on every layer",
            )
    ck, job, metrics, val = sec["checkpoint"], sec["job"], sec["metrics"], sec["validation"]
    if ck.get("enable", ck.get("enable_checkpoint", False)):
        values["checkpoint.every"] = int(ck.get("interval", 500))
    if "dump_folder" in job:
        values["train.workdir"] = str(job["dump_folder"])
    if "log_freq" in metrics:
        values["train.log_every"] = int(metrics["log_freq"])
    if val.get("enable"):
        values.update({"train.eval_every": int(val.get("freq", 500)), "train.eval_batches": int(val.get("steps", 8))})
    mapped = {
        "checkpoint.enable": "checkpoint.every",
        "checkpoint.interval": "checkpoint.every",
        "job.dump_folder": "train.workdir",
        "metrics.log_freq": "train.log_every",
        "validation.enable": "train.eval_every",
        "validation.freq": "train.eval_every",
        "validation.steps": "train.eval_batches",
    }
    for section in ("checkpoint", "job", "metrics", "validation"):
        for key, value in sec[section].items():
            src = f"{section}.{key}"
            if src in mapped:
                report.mapped(src, value, mapped[src])
            elif src in ("metrics.enable_tensorboard", "metrics.save_tb_folder"):
                report.approximated(
                    src,
                    value,
                    "train.workdir" if value else "",
                    TB + ("; the folder given is not used" if key == "save_tb_folder" else ""),
                )
            elif key in KNOWN[section]:
                report.approximated(src, value, "", LOG if section in ("job", "metrics") else NOOP + "detail")
            else:
                report.unknown(src, value, [f"{section}.{k}" for k in KNOWN[section]], "torchtitan")
    _profiling(raw.get("profiling"), values, report)
    converters = sec["model"].get("converters", [])
    for name, value in raw.items():
        if name in KNOWN or name == "profiling":
            continue
        if name in NOOP_SECTIONS:
            report.approximated(name, value, "", NOOP_SECTIONS[name])
        elif name in UNSUPPORTED_SECTIONS:
            report.unsupported(name, value, UNSUPPORTED_SECTIONS[name])
        elif name in ("quantize", "float8", "mx"):
            report.add(
                name,
                value,
                "unsupported" if converters else "approximated",
                "",
                "no float8/MX training in jaxpar" if converters else NOOP + "model.converters does not enable it",
            )
        else:
            report.unknown(
                name, value, [*KNOWN, "profiling", *NOOP_SECTIONS, *UNSUPPORTED_SECTIONS, "quantize"], "torchtitan"
            )


def _profiling(prof: Any, values: dict[str, Any], report: Report) -> None:
    """[profiling] -> train.profile_steps: torchtitan's torch.profiler schedule (wait = profile_freq - 4,
    warmup 3, active 1) traces step ``profile_freq`` and every ``profile_freq`` steps after; jaxpar
    traces that first one."""
    if prof is None:
        return
    if not isinstance(prof, dict):
        report.unknown("profiling", prof, list(PROFILING_KEYS), "torchtitan")
        return
    enabled = bool(prof.get("enable_profiling", False))
    freq = int(prof.get("profile_freq", 10))
    if enabled:
        values["train.profile_steps"] = f"{freq},{freq}"
    for key, value in prof.items():
        src = f"profiling.{key}"
        if key in ("enable_profiling", "profile_freq") and enabled:
            report.approximated(
                src,
                value,
                "train.profile_steps",
                f"a jax.profiler trace of step {freq}, once (torchtitan repeats it every profile_freq steps)",
            )
        elif key == "save_traces_folder" and enabled:
            report.approximated(src, value, "train.profile_steps", "the trace goes to <train.workdir>/profile")
        elif key in ("enable_memory_snapshot", "save_memory_snapshot_folder") and prof.get("enable_memory_snapshot"):
            report.unsupported(
                src, value, "no CUDA memory snapshots in jaxpar; nearest: `jaxpar inspect` (compiled per-device memory)"
            )
        elif key in PROFILING_KEYS:
            report.approximated(src, value, "", NOOP + "profiling is disabled")
        else:
            report.unknown(src, value, [f"profiling.{k}" for k in PROFILING_KEYS], "torchtitan")
