"""Import an HF accelerate FSDP config (``accelerate config`` YAML) into a jaxpar config.

FSDP sharding strategies map onto ZeRO stages over jaxpar's data axis (PyTorch FSDP's ShardingStrategy docs; Rajbhandari et al. 2020, ZeRO):
FULL_SHARD ~ ZeRO-3, SHARD_GRAD_OP ~ ZeRO-2, NO_SHARD ~ DDP (ZeRO-0), HYBRID_SHARD ~ ZeRO-3
inside a node and replicated across nodes (approximated: jaxpar shards over the whole data
axis). accelerate also accepts the torch enum numbers 1..5 for the strategies; a
``parallelism_config`` (TP x data replicate x data shard x CP) is the mesh. The YAML holds no model,
optimizer or batch: the model is a model change (``(model)``: ``jaxpar port`` refuses it unless
``--model-config`` or ``--approximate``), the optimizer and batch stay at jaxpar defaults and the
report says so. ``num_processes`` absent (and ``distributed_type`` not ``NO``): the launch line gives
it, so the world size must be passed.
"""

from __future__ import annotations

import pathlib
from typing import Any

from jaxpar import files
from jaxpar.config import ConfigDict, ConfigError
from jaxpar.port.deepspeed import no_model
from jaxpar.port.report import FP16_AS_BF16, Report, build_config

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
ZERO_STAGE = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0, "HYBRID_SHARD": 3, "HYBRID_SHARD_ZERO2": 2}
DTYPES = {"no": "float32", "bf16": "bfloat16"}  # fp16 and fp8: computed in bf16 (approximated)
_NOOP = "no-op in jaxpar: "
FSDP_NOOP = {
    "fsdp_auto_wrap_policy": _NOOP + "jaxpar shards every layer's parameters by its rules (the wrap unit is the layer)",
    "fsdp_transformer_layer_cls_to_wrap": _NOOP + "the wrap unit is always the transformer layer",
    "fsdp_min_num_params": _NOOP + "the wrap unit is always the transformer layer",
    "fsdp_backward_prefetch": _NOOP + "XLA schedules the all-gathers and overlaps them with compute",
    "fsdp_backward_prefetch_policy": _NOOP + "XLA schedules the all-gathers and overlaps them with compute",
    "fsdp_forward_prefetch": _NOOP + "XLA schedules the all-gathers and overlaps them with compute",
    "fsdp_state_dict_type": _NOOP + "orbax saves sharded checkpoints that restore onto any mesh",
    "fsdp_cpu_ram_efficient_loading": _NOOP + "jaxpar initializes each shard directly on its device",
    "fsdp_sync_module_states": _NOOP + "every device initializes from the same seed",
    "fsdp_use_orig_params": _NOOP + "jax parameters are a plain pytree",
    "fsdp_version": _NOOP + "FSDP1 and FSDP2 shard the same way here",
}
TOP_NOOP = (
    "compute_environment",
    "debug",
    "downcast_bf16",
    "enable_cpu_affinity",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "main_training_function",
    "rdzv_backend",
    "same_network",
    "tpu_env",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "use_cpu",
    "gpu_ids",
    "dynamo_config",
)
FSDP_KEYS = (
    *FSDP_NOOP,
    "fsdp_sharding_strategy",
    "fsdp_reshard_after_forward",
    "fsdp_offload_params",
    "fsdp_activation_checkpointing",
)


def port_fsdp(path: str | pathlib.Path, *, world_size: int | None = None) -> tuple[ConfigDict, Report]:
    """Port an accelerate FSDP YAML; ``world_size`` overrides ``num_processes``."""
    try:
        import yaml
    except ImportError:  # pragma: no cover - PyYAML ships with the test environment
        raise ConfigError("fsdp: reading accelerate YAML needs PyYAML; pip install pyyaml") from None
    path = pathlib.Path(path)
    text = files.read_text(path, "recipe", "fsdp", "pass an accelerate config .yaml")
    try:
        raw = files.load_yaml(text, f"fsdp: {path.name}") or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"fsdp: {path.name} is not valid YAML ({str(e).splitlines()[0]}); fix the syntax") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"fsdp: {path.name} is not a YAML mapping; pass an accelerate config")
    report = Report("fsdp", str(path))
    values: dict[str, Any] = {}
    kind = str(raw.get("distributed_type", "NO"))
    if kind == "DEEPSPEED":
        raise ConfigError(
            f"fsdp: {path.name} uses distributed_type DEEPSPEED; port its DeepSpeed JSON with `jaxpar port deepspeed`"
        )
    world = world_size if world_size is not None else int(raw.get("num_processes", 1))
    machines = int(raw.get("num_machines", 1))
    fsdp = raw.get("fsdp_config", {}) or {}
    strategy = _strategy(fsdp, kind)
    if world_size is None and "num_processes" not in raw and kind != "NO":
        raise ConfigError(
            f"fsdp: {path.name} has no num_processes: accelerate then takes the process count from the launch "
            "line (accelerate launch --num_processes N); pass --world-size N"
        )
    stage = ZERO_STAGE[strategy]
    values.update({"mesh.data": world, "mesh.tensor": 1, "mesh.pipeline": 1, "parallel.zero_stage": stage})
    data = _parallelism(raw.get("parallelism_config"), world, stage, values, report)
    if values.get("train.global_batch", 16) % data:
        values["train.global_batch"] = data
        report.approximated(
            "(batch size)",
            None,
            "train.global_batch",
            f"not in the accelerate config; one "
            f"sequence per device ({data}) so the jaxpar default divides the data axis",
        )
    else:
        report.approximated(
            "(batch size)",
            None,
            "train.global_batch",
            "not in the accelerate config (the training script decides); jaxpar default kept",
        )
    report.approximated(
        "(optimizer)",
        None,
        "optim.*",
        "not in the accelerate config (the training script builds it); jaxpar defaults kept: set them with "
        "--set optim.FIELD=VALUE or edit the generated config",
    )
    no_model(report, "an accelerate config")
    if "mixed_precision" not in raw:
        values["model.compute_dtype"] = "float32"
        report.mapped("mixed_precision (default)", "no", "model.compute_dtype", "accelerate's default: fp32")
    for key, value in raw.items():
        if key in ("fsdp_config", "parallelism_config"):
            continue
        if key == "distributed_type":
            ok = kind in ("FSDP", "MULTI_GPU", "NO")
            report.add(
                key,
                value,
                "mapped" if ok else "unsupported",
                "parallel.zero_stage",
                "" if ok else "only FSDP / MULTI_GPU / NO map onto jaxpar",
            )
        elif key == "num_processes":
            report.mapped(key, value, "mesh.data", "" if world_size is None else f"overridden: --world-size {world}")
        elif key == "num_machines":
            report.mapped(key, value, "", "nodes; jaxpar's data axis spans them all")
        elif key == "mixed_precision":
            dtype = DTYPES.get(str(value))
            if str(value) == "fp16":  # accelerate's fp16 scales the loss (torch GradScaler)
                values["model.compute_dtype"] = "bfloat16"
                report.approximated(key, value, "model.compute_dtype", FP16_AS_BF16)
            elif str(value) == "fp8":
                values["model.compute_dtype"] = "bfloat16"
                report.approximated(
                    key,
                    value,
                    "model.compute_dtype",
                    "no fp8 training in jaxpar: the matmuls fp8 would run compute in bf16 (a precision change only)",
                )
            elif dtype:
                values["model.compute_dtype"] = dtype
                report.mapped(key, value, "model.compute_dtype")
            else:
                report.unsupported(key, value, "jaxpar computes in float32, bfloat16 or float16; default kept")
        elif key in TOP_NOOP:
            report.approximated(key, value, "", _NOOP + "launcher/environment setting")
        else:
            report.unknown(
                key,
                value,
                [
                    *TOP_NOOP,
                    "distributed_type",
                    "num_processes",
                    "num_machines",
                    "mixed_precision",
                    "fsdp_config",
                    "parallelism_config",
                ],
                "accelerate",
            )
    for key, value in fsdp.items():
        src = f"fsdp_config.{key}"
        if key in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward"):
            hybrid = strategy.startswith("HYBRID")
            note = f"{strategy} ~ ZeRO-{stage}" + (
                f" inside each node and replicated across {machines} node(s); "
                f"jaxpar shards over the whole data axis ({world} ranks): less memory per device, all-gathers "
                "cross nodes"
                if hybrid
                else ""
            )
            report.add(src, value, "approximated" if hybrid else "mapped", "parallel.zero_stage", note)
        elif key == "fsdp_offload_params":
            if value:
                report.unsupported(
                    src,
                    value,
                    "jaxpar keeps parameters on the accelerators; nearest: ZeRO-3 "
                    f"(parallel.zero_stage=3{', already set' if stage == 3 else ''})",
                )
            else:
                report.mapped(src, value, "", "no offload, as in jaxpar")
        elif key == "fsdp_activation_checkpointing":
            values["model.remat"] = "full" if value else "none"
            report.mapped(src, value, "model.remat")
        elif key in FSDP_NOOP:
            report.approximated(src, value, "", FSDP_NOOP[key])
        else:
            report.unknown(src, value, [f"fsdp_config.{k}" for k in FSDP_KEYS], "accelerate FSDP")
    return build_config(values, report), report


PARALLELISM_KEYS = ("tp_size", "dp_replicate_size", "dp_shard_size", "cp_size")


def _parallelism(section: Any, world: int, stage: int, values: dict[str, Any], report: Report) -> int:
    """accelerate's ``parallelism_config`` (ParallelismConfig: tensor x data replicate x data shard x context
    = the processes): ``mesh.tensor``, ``mesh.context`` and ``mesh.data`` = replicate * shard, FSDP over the
    shard ranks (HSDP when replicating too: jaxpar shards over all data ranks). Returns the data size."""
    if section is None:
        return world
    if not isinstance(section, dict):
        raise ConfigError(f"fsdp: parallelism_config is a {type(section).__name__}; write it as a mapping")
    sizes = {}
    for key in PARALLELISM_KEYS:
        value = section.get(f"parallelism_config_{key}", 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"fsdp: parallelism_config_{key}={value!r}: use an integer >= 1")
        sizes[key] = value
    tp, rep, shard, cp = (sizes[k] for k in PARALLELISM_KEYS)
    if tp * rep * shard * cp != world:
        raise ConfigError(
            f"fsdp: parallelism_config sizes tp {tp} * dp_replicate {rep} * dp_shard {shard} * cp {cp} = "
            f"{tp * rep * shard * cp}, not the {world} processes; make them equal (or pass --world-size)"
        )
    data = rep * shard
    values.update({"mesh.data": data, "mesh.tensor": tp, "mesh.context": cp})
    if shard == 1:
        values["parallel.zero_stage"] = 0 if stage == 3 else stage
    if cp > 1:
        values["model.attention"] = "blockwise"
    notes = {
        "tp_size": f"tensor parallel over {tp} ranks",
        "dp_replicate_size": "replicas of the sharded model"
        + (f"; HSDP: jaxpar shards over all {data} data ranks instead of {shard}" if rep > 1 and shard > 1 else ""),
        "dp_shard_size": f"FSDP over {shard} ranks" if shard > 1 else "no sharding",
        "cp_size": f"the sequence over {cp} context ranks (blockwise attention)" if cp > 1 else "no context parallel",
    }
    target = {
        "tp_size": "mesh.tensor",
        "dp_replicate_size": "mesh.data",
        "dp_shard_size": "mesh.data, parallel.zero_stage",
        "cp_size": "mesh.context",
    }
    for key, value in section.items():
        name = key.removeprefix("parallelism_config_")
        src = f"parallelism_config.{key}"
        if name in notes:
            hsdp = name == "dp_replicate_size" and rep > 1 and shard > 1
            report.add(src, value, "approximated" if hsdp else "mapped", target[name], notes[name])
        else:
            report.unknown(
                src, value, [f"parallelism_config.parallelism_config_{k}" for k in PARALLELISM_KEYS], "accelerate"
            )
    return data


def _strategy(fsdp: dict, kind: str) -> str:
    """The FSDP sharding strategy name (accepts names, torch enum numbers 1..5, FSDP2's reshard flag)."""
    if kind != "FSDP":
        return "NO_SHARD"
    value = fsdp.get("fsdp_sharding_strategy")
    if value is None:
        reshard = fsdp.get("fsdp_reshard_after_forward", True)
        if isinstance(reshard, str) and reshard.upper() in STRATEGIES:
            return reshard.upper()
        return "FULL_SHARD" if reshard in (True, "true", "True") else "SHARD_GRAD_OP"
    text = str(value).strip().upper()
    if text.isdigit() and 1 <= int(text) <= len(STRATEGIES):
        return STRATEGIES[int(text) - 1]
    if text in STRATEGIES:
        return text
    raise ConfigError(
        f"fsdp: fsdp_config.fsdp_sharding_strategy={value!r}: use one of {', '.join(STRATEGIES)} (or 1..5)"
    )
