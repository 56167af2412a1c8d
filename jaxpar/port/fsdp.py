"""Import an HF accelerate config (``accelerate config`` YAML: FSDP, DDP or an inline DeepSpeed config)
into a jaxpar config.

FSDP sharding strategies map onto ZeRO stages over jaxpar's data axis (PyTorch FSDP's ShardingStrategy docs; Rajbhandari et al. 2020, ZeRO):
FULL_SHARD ~ ZeRO-3, SHARD_GRAD_OP ~ ZeRO-2, NO_SHARD ~ DDP (ZeRO-0), HYBRID_SHARD ~ ZeRO-3
inside a node and replicated across nodes (approximated: jaxpar shards over the whole data
axis). accelerate also accepts the torch enum numbers 1..5 for the strategies; a
``parallelism_config`` (TP x data replicate x data shard x CP) is the mesh. ``distributed_type:
DEEPSPEED`` with an inline ``deepspeed_config`` ports as accelerate's DeepSpeedPlugin builds the
DeepSpeed config from it (ZeRO stage, accumulation, clipping; offload is unsupported); one that names a
``deepspeed_config_file`` is refused naming the JSON to port; MEGATRON_LM is refused. The YAML holds no model,
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
from jaxpar.port.deepspeed_keys import OFFLOAD
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
    "tpu_name",
    "tpu_zone",
    "tpu_vm",
    "command_file",
    "commands",
    "mpirun_config",
)
# accelerate's DistributedType values that run plain DDP over the processes (on their device kind)
DDP_KINDS = (
    "MULTI_GPU",
    "MULTI_CPU",
    "MULTI_NPU",
    "MULTI_MLU",
    "MULTI_SDAA",
    "MULTI_MUSA",
    "MULTI_XPU",
    "MULTI_HPU",
    "MULTI_NEURON",
    "XLA",
)
KINDS = ("NO", "FSDP", "DEEPSPEED", "MEGATRON_LM", *DDP_KINDS)
MULTI_DEVICE = tuple(k for k in DDP_KINDS if k not in ("MULTI_CPU", "XLA"))  # Accelerator.multi_device
# fp8_config keys (accelerate launch's --fp8_* options without the prefix, and the names `accelerate config`
# writes): settings of fp8 matmuls, which this port computes in bf16 (see mixed_precision)
FP8_KEYS = (
    "backend",
    "use_autocast_during_eval",
    "margin",
    "interval",
    "fp8_format",
    "amax_history_len",
    "amax_history_length",
    "amax_compute_algo",
    "amax_compute_algorithm",
    "override_linear_precision",
    "opt_level",
    "optimization_level",
    "enable_fsdp_float8_all_gather",
    "pad_inner_dim",
)
FSDP_KEYS = (
    *FSDP_NOOP,
    "fsdp_sharding_strategy",
    "fsdp_reshard_after_forward",
    "fsdp_offload_params",
    "fsdp_activation_checkpointing",
)


# deepspeed_config (accelerate's DeepSpeedPlugin without a JSON file: accelerate/utils/dataclasses.py)
_LAUNCHER = _NOOP + "multi-node launcher setting; jaxpar's processes come from the cluster (jaxpar.distributed)"
DS_NOOP = {
    "zero3_init_flag": _NOOP + "deepspeed.zero.Init builds ZeRO-3 shards at construction; jaxpar initializes "
    "each shard directly on its device",
    "zero3_save_16bit_model": _NOOP + "orbax saves sharded checkpoints; no 16-bit gather on save",
    "deepspeed_multinode_launcher": _LAUNCHER,
    "deepspeed_hostfile": _LAUNCHER,
    "deepspeed_exclusion_filter": _LAUNCHER,
    "deepspeed_inclusion_filter": _LAUNCHER,
    "deepspeed_moe_layer_cls_names": _NOOP + "ZeRO-3 leaf modules; jaxpar shards expert weights by its rules",
    "seq_parallel_communication_data_type": _NOOP + "accelerate does not pass it on to DeepSpeed (not one of its "
    "launch options); jaxpar's context exchange runs in the compute dtype",
}
DS_OFFLOAD_DEVICES = ("none", "cpu", "nvme")
DS_KEYS = (
    "zero_stage",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_optimizer_nvme_path",
    "offload_param_nvme_path",
    "deepspeed_config_file",
    *DS_NOOP,
)
DS_FP16 = (
    "DeepSpeed fp16 (accelerate enables fp16 with auto_cast) with DeepSpeed's dynamic loss scaler: "
    "train.loss_scale defaults are DeepSpeed's (2**16, window 1000, hysteresis 2, minimum 1)"
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
    if kind not in KINDS:
        raise ConfigError(f"fsdp: distributed_type {kind!r} is not accelerate's; use one of {', '.join(KINDS)}")
    if kind == "MEGATRON_LM":
        raise ConfigError(
            f"fsdp: {path.name} uses distributed_type MEGATRON_LM: accelerate's Megatron-LM plugin "
            "(megatron_lm_config) is not read by this port; write its settings as Megatron-LM flags in an .args "
            "file and port that with `jaxpar port megatron`"
        )
    world = world_size if world_size is not None else int(raw.get("num_processes", 1))
    machines = int(raw.get("num_machines", 1))
    fsdp = raw.get("fsdp_config", {}) or {}
    ds = raw.get("deepspeed_config", {}) or {}
    for name, section in (("fsdp_config", fsdp), ("deepspeed_config", ds)):
        if not isinstance(section, dict):
            raise ConfigError(f"fsdp: {name} is a {type(section).__name__}; write it as a mapping")
    if kind == "DEEPSPEED":
        stage = _deepspeed_stage(ds, path.name)
        strategy = ""
    else:
        strategy = _strategy(fsdp, kind)
        stage = ZERO_STAGE[strategy]
    if world_size is None and "num_processes" not in raw and kind != "NO":
        raise ConfigError(
            f"fsdp: {path.name} has no num_processes: accelerate then takes the process count from the launch "
            "line (accelerate launch --num_processes N); pass --world-size N"
        )
    values.update({"mesh.data": world, "mesh.tensor": 1, "mesh.pipeline": 1, "parallel.zero_stage": stage})
    parallel = raw.get("parallelism_config") or None
    fsdp2 = kind == "FSDP" and str(fsdp.get("fsdp_version", 1)) == "2"
    if parallel is not None and world > 1 and not (fsdp2 or kind == "DEEPSPEED" or kind in MULTI_DEVICE):
        raise ConfigError(
            f"fsdp: {path.name} sets parallelism_config with distributed_type {kind}"
            + (f" and fsdp_version {fsdp.get('fsdp_version', 1)}" if kind == "FSDP" else "")
            + ": accelerate's ParallelismConfig stops on it (it takes FSDP version 2, DEEPSPEED or multi-device "
            "DDP); set fsdp_config.fsdp_version 2, or drop parallelism_config"
        )
    data = _parallelism(parallel, world, stage, values, report, kind)
    if kind == "DEEPSPEED":
        _deepspeed(ds, stage, values, report)
    per_step = data * values.get("parallel.microbatches", 1)
    if values.get("train.global_batch", 16) % per_step:
        values["train.global_batch"] = per_step
        report.approximated(
            "(batch size)",
            None,
            "train.global_batch",
            f"not in the accelerate config; one sequence per device and microbatch ({per_step}) so the "
            "batch divides the data axis and the accumulation steps",
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
        if key in ("fsdp_config", "parallelism_config", "deepspeed_config"):
            continue
        if key == "distributed_type":
            note = {"DEEPSPEED": "DeepSpeed ZeRO over the data axis (deepspeed_config)", "NO": "one process"}
            report.mapped(key, value, "parallel.zero_stage", note.get(kind, "" if kind == "FSDP" else "DDP: ZeRO-0"))
        elif key == "num_processes":
            notes = [f"overridden: --world-size {world}"] * (world_size is not None) + [
                f"parallelism_config splits them: mesh.data {values['mesh.data']}"
            ] * (values["mesh.data"] != world)
            report.mapped(key, value, "mesh.data", "; ".join(notes))
        elif key == "num_machines":
            report.mapped(key, value, "", "nodes; jaxpar's data axis spans them all")
        elif key == "mixed_precision":
            dtype = DTYPES.get(str(value))
            if str(value) == "fp16" and kind == "DEEPSPEED":  # accelerate writes fp16.enabled, auto_cast
                values.update({"model.compute_dtype": "float16", "train.loss_scale.rule": "deepspeed"})
                report.mapped(key, value, "model.compute_dtype", DS_FP16)
            elif str(value) == "fp16":  # accelerate's fp16 scales the loss (torch GradScaler)
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
        elif key in ("fp8_config", "megatron_lm_config"):
            _fp8(key, value, str(raw.get("mixed_precision")), kind, report)
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
                    "deepspeed_config",
                    "parallelism_config",
                    "fp8_config",
                    "megatron_lm_config",
                ],
                "accelerate",
            )
    for key, value in fsdp.items() if kind != "FSDP" else ():
        report.approximated(
            f"fsdp_config.{key}", value, "", _NOOP + f"accelerate reads fsdp_config only with FSDP ({kind})"
        )
    for key, value in ds.items() if kind != "DEEPSPEED" else ():
        report.approximated(
            f"deepspeed_config.{key}",
            value,
            "",
            _NOOP + f"accelerate reads deepspeed_config only with DEEPSPEED ({kind})",
        )
    for key, value in fsdp.items() if kind == "FSDP" else ():
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
            values["parallel.recompute"] = "full" if value else "none"
            report.mapped(src, value, "parallel.recompute")
        elif key in FSDP_NOOP:
            report.approximated(src, value, "", FSDP_NOOP[key])
        else:
            report.unknown(src, value, [f"fsdp_config.{k}" for k in FSDP_KEYS], "accelerate FSDP")
    return build_config(values, report), report


PARALLELISM_KEYS = ("tp_size", "dp_replicate_size", "dp_shard_size", "cp_size", "sp_size")
# accelerate launch's other parallelism_config_* options (commands/launch.py): how they port
CP_COMM = {"allgather": "all_gather", "alltoall": "ring"}  # torch CP's rotate methods -> parallel.context_exchange
PARALLELISM_OTHER = {
    "cp_backend": "torch context parallel (the only backend)",
    "sp_backend": "DeepSpeed ALST/Ulysses (the only backend)",
    "sp_seq_length": _NOOP + "jaxpar's sequence length is train.seq_len (the training script's)",
    "sp_seq_length_is_variable": _NOOP + "jaxpar trains on fixed-length sequences",
    "sp_attn_implementation": _NOOP + "the attention kernel is model.attention (blockwise with a context axis)",
}


def _parallelism(section: Any, world: int, stage: int, values: dict[str, Any], report: Report, kind: str) -> int:
    """accelerate's ``parallelism_config`` (ParallelismConfig: tensor x data replicate x data shard x context
    x sequence = the processes; all 1: every process replicates, as accelerate's ``_validate_accelerator``
    sets; DeepSpeed's Ulysses SP: data = processes / (tensor x SP), DeepSpeed forms the groups):
    ``mesh.tensor``, ``mesh.context`` (CP or Ulysses SP) and ``mesh.data`` = replicate * shard. FSDP
    shards over shard x context ranks as jaxpar's ZeRO does over data x context (HSDP when replicating
    too: jaxpar shards over all data ranks); DeepSpeed's ZeRO stage stays. Returns the data size."""
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
    tp, rep, shard, cp, sp = (sizes[k] for k in PARALLELISM_KEYS)
    everyone = tp * rep * shard * cp * sp == 1
    if everyone:
        rep = world
    if cp > 1 and sp > 1:
        raise ConfigError(
            f"fsdp: parallelism_config_cp_size {cp} and parallelism_config_sp_size {sp}: accelerate takes one of "
            "context (CP) and sequence (SP) parallel; set the other to 1"
        )
    ds_sp = kind == "DEEPSPEED" and sp > 1  # accelerate skips the size check: DeepSpeed builds the SP groups
    if ds_sp and world % (tp * sp):
        raise ConfigError(
            f"fsdp: parallelism_config_sp_size {sp} * tp_size {tp} does not divide the {world} processes; make it divide"
        )
    if not ds_sp and tp * rep * shard * cp * sp != world:
        raise ConfigError(
            f"fsdp: parallelism_config sizes tp {tp} * dp_replicate {rep} * dp_shard {shard} * cp {cp} * sp {sp} = "
            f"{tp * rep * shard * cp * sp}, not the {world} processes; make them equal (or pass --world-size)"
        )
    data, context = (world // (tp * sp) if ds_sp else rep * shard), cp * sp
    values.update({"mesh.data": data, "mesh.tensor": tp, "mesh.context": context})
    if kind == "FSDP" and shard * cp == 1:  # FSDP shards over dp_shard x cp (ParallelismConfig.dp_shard_cp_dim_names)
        values["parallel.zero_stage"] = 0 if stage == 3 else stage
    comm = str(section.get("parallelism_config_cp_comm_strategy", "allgather"))
    if context > 1:
        if comm not in CP_COMM:
            raise ConfigError(f"fsdp: parallelism_config_cp_comm_strategy={comm!r}: use allgather or alltoall")
        values["model.attention"] = "blockwise"
        values["parallel.context_exchange"] = CP_COMM[comm] if cp > 1 else "ring"
    sharded = kind == "FSDP" and shard * cp > 1  # HSDP notes: FSDP only
    shard_note = {
        "FSDP": f"FSDP over {shard * cp} shard x context ranks" if sharded else "no sharding",
        "DEEPSPEED": f"data ranks; DeepSpeed's ZeRO-{stage} shards over the {data} x {context} data x sequence ranks, "
        "as jaxpar's ZeRO over data x context",
    }.get(kind, "data ranks (DDP)")
    notes = {
        "tp_size": f"tensor parallel over {tp} ranks",
        "dp_replicate_size": (
            f"all sizes 1: accelerate replicates over all {world} processes" if everyone else "replicas of the model"
        )
        + (f"; HSDP: jaxpar shards over all {data * cp} data x context ranks" if rep > 1 and sharded else ""),
        "dp_shard_size": shard_note,
        "cp_size": f"the sequence over {cp} context ranks (blockwise attention)" if cp > 1 else "no context parallel",
        "sp_size": f"Ulysses (all-to-all) sequence parallel over {sp} ranks: jaxpar splits the sequence over "
        f"{sp} context ranks and passes keys and values in a ring instead (the same attention, different messages)"
        if sp > 1
        else "no sequence parallel",
    }
    target = {
        "tp_size": "mesh.tensor",
        "dp_replicate_size": "mesh.data",
        "dp_shard_size": "mesh.data, parallel.zero_stage",
        "cp_size": "mesh.context",
        "sp_size": "mesh.context",
    }
    for key, value in section.items():
        name = key.removeprefix("parallelism_config_")
        src = f"parallelism_config.{key}"
        if name in notes:
            approx = (name == "dp_replicate_size" and rep > 1 and sharded) or (name == "sp_size" and sp > 1)
            report.add(src, value, "approximated" if approx else "mapped", target[name], notes[name])
        elif name == "cp_comm_strategy":
            exchange = CP_COMM.get(comm, "")
            note = "no effect without cp_size > 1" if cp == 1 else f"torch CP's {comm}: jaxpar's {exchange} exchange"
            report.mapped(src, value, "parallel.context_exchange", note)
        elif name in PARALLELISM_OTHER:
            only = {"cp_backend": "torch", "sp_backend": "deepspeed"}.get(name, value)
            if value != only:
                raise ConfigError(f"fsdp: {key}={value!r}: accelerate takes only {only!r}; use it or drop the key")
            note = PARALLELISM_OTHER[name]
            report.add(src, value, "approximated" if note.startswith(_NOOP) else "mapped", "", note)
        else:
            report.unknown(
                src,
                value,
                [
                    f"parallelism_config.parallelism_config_{k}"
                    for k in (*PARALLELISM_KEYS, "cp_comm_strategy", *PARALLELISM_OTHER)
                ],
                "accelerate",
            )
    if context > 1 and "parallelism_config_cp_comm_strategy" not in section and cp > 1:
        report.mapped(
            "parallelism_config.parallelism_config_cp_comm_strategy (default)",
            "allgather",
            "parallel.context_exchange",
            "accelerate's default: keys and values all-gathered",
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


def _deepspeed_stage(ds: dict, name: str) -> int:
    """The ZeRO stage of an inline ``deepspeed_config`` (accelerate's default 2); a config file is refused."""
    file = ds.get("deepspeed_config_file")
    if file not in (None, "none"):
        raise ConfigError(
            f"fsdp: {name} uses distributed_type DEEPSPEED; port its DeepSpeed JSON with `jaxpar port deepspeed "
            f"{file}` (deepspeed_config.deepspeed_config_file: accelerate takes the whole DeepSpeed config from it)"
        )
    stage = ds.get("zero_stage", 2)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ConfigError(f"fsdp: deepspeed_config.zero_stage={stage!r}: use 0, 1, 2 or 3")
    return stage


def _deepspeed(ds: dict, stage: int, values: dict[str, Any], report: Report) -> None:
    """An inline ``deepspeed_config``, key by key, as accelerate's DeepSpeedPlugin builds the DeepSpeed
    config from it (absent keys: accelerate's defaults, reported as ``(default)`` rows)."""
    values["parallel.zero_stage"] = stage
    if "zero_stage" not in ds:
        report.mapped("deepspeed_config.zero_stage (default)", 2, "parallel.zero_stage", "accelerate's default")
    if "gradient_accumulation_steps" not in ds:
        report.approximated(
            "deepspeed_config.gradient_accumulation_steps (default)",
            None,
            "parallel.microbatches",
            "not in the config: the training script's Accelerator(gradient_accumulation_steps=...) decides; "
            "jaxpar's 1 kept",
        )
    if "gradient_clipping" not in ds:
        values["optim.clip_norm"] = 1.0
        report.mapped(
            "deepspeed_config.gradient_clipping (default)",
            1.0,
            "optim.clip_norm",
            "accelerate fills DeepSpeed's 1.0 (an HF Trainer its max_grad_norm, 1.0 by default)",
        )
    for key, value in ds.items():
        src = f"deepspeed_config.{key}"
        if key == "zero_stage":
            report.mapped(src, value, "parallel.zero_stage", f"ZeRO-{stage} over the data axis")
        elif key == "gradient_accumulation_steps":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"fsdp: {src}={value!r}: use an integer >= 1")
            values["parallel.microbatches"] = value
            report.mapped(src, value, "parallel.microbatches")
        elif key == "gradient_clipping":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ConfigError(f"fsdp: {src}={value!r}: use a number >= 0 (0: no clipping)")
            values["optim.clip_norm"] = float(value)
            report.mapped(src, value, "optim.clip_norm", "global-norm clipping" if value else "0: no clipping")
        elif key in ("offload_optimizer_device", "offload_param_device"):
            device = str(value).lower()
            if device not in DS_OFFLOAD_DEVICES:
                raise ConfigError(f"fsdp: {src}={value!r}: use one of {', '.join(DS_OFFLOAD_DEVICES)}")
            if device == "none":
                report.mapped(src, value, "", "no offload, as in jaxpar")
            else:
                report.unsupported(src, value, OFFLOAD + (" (already set)" if stage == 3 else ""))
        elif key in ("offload_optimizer_nvme_path", "offload_param_nvme_path"):
            report.approximated(src, value, "", _NOOP + "no NVMe offload in jaxpar (see the offload device row)")
        elif key in DS_NOOP:
            report.approximated(src, value, "", DS_NOOP[key])
        else:
            report.unknown(src, value, [f"deepspeed_config.{k}" for k in DS_KEYS], "accelerate DeepSpeed")


def _fp8(name: str, section: Any, precision: str, kind: str, report: Report) -> None:
    """``fp8_config`` keys (no-op rows: jaxpar computes fp8's matmuls in bf16) and a ``megatron_lm_config``
    that accelerate does not read (``distributed_type`` is not MEGATRON_LM)."""
    if not isinstance(section, dict):
        raise ConfigError(f"fsdp: {name} is a {type(section).__name__}; write it as a mapping")
    for key, value in section.items():
        src = f"{name}.{key}"
        if name == "megatron_lm_config":
            report.approximated(
                src, value, "", _NOOP + f"accelerate reads megatron_lm_config only with MEGATRON_LM ({kind})"
            )
        elif key.removeprefix("fp8_") not in FP8_KEYS and key not in FP8_KEYS:
            report.unknown(src, value, [f"fp8_config.{k}" for k in FP8_KEYS], "accelerate fp8")
        elif precision == "fp8":
            report.approximated(
                src, value, "", _NOOP + "an fp8 setting; this port computes in bf16 (mixed_precision row)"
            )
        else:
            report.approximated(
                src, value, "", _NOOP + f"accelerate uses fp8_config only with mixed_precision fp8 ({precision})"
            )
