"""What the torchtitan importer does with each section and key of a job config: the tables of no-op,
unsupported and known keys, and the reader of an integer degree."""

from __future__ import annotations

from jaxpar.config import ConfigError

NOOP = "no-op in jaxpar: "
LOG = NOOP + "logging/profiling only; jaxpar logs under train.workdir"
TB = (
    "jaxpar always writes TensorBoard event files into train.workdir, every step (loss, grad norm, lr, step time, "
    "tokens/s, MFU, validation)"
)
PROFILING_KEYS = (
    "enable_profiling",
    "save_traces_folder",
    "profile_freq",
    "enable_memory_snapshot",
    "save_memory_snapshot_folder",
)
NOOP_SECTIONS = {
    "comm": NOOP + "XLA manages collectives and their timeouts",
    "memory_estimation": NOOP + "use `jaxpar plan` for memory estimates",
    "compile": NOOP + "XLA always compiles the whole step",
}
UNSUPPORTED_SECTIONS = {
    "fault_tolerance": "no fault-tolerant replica groups in jaxpar",
    "experimental": "experimental torchtitan features have no jaxpar counterpart",
}
KNOWN = {
    "job": (
        "config_file",
        "dump_folder",
        "description",
        "print_args",
        "print_config",
        "custom_config_module",
        "use_for_integration_test",
    ),
    "metrics": (
        "log_freq",
        "enable_tensorboard",
        "disable_color_printing",
        "enable_color_printing",
        "save_tb_folder",
        "save_for_all_ranks",
        "enable_wandb",
    ),
    "model": (
        "name",
        "flavor",
        "hf_assets_path",
        "tokenizer_path",
        "converters",
        "print_after_conversion",
        "norm_type",
    ),
    "optimizer": ("name", "lr", "beta1", "beta2", "eps", "weight_decay", "implementation", "early_step_in_backward"),
    "lr_scheduler": ("warmup_steps", "decay_ratio", "decay_type", "min_lr_factor", "lr_min"),
    "training": (
        "compile",
        "dataset",
        "dataset_path",
        "local_batch_size",
        "global_batch_size",
        "seq_len",
        "max_norm",
        "steps",
        "enable_cpu_offload",
        "mixed_precision_param",
        "mixed_precision_reduce",
        "gc_freq",
        "gc_debug",
        "seed",
        "deterministic",
        "batch_size",
    ),
    "parallelism": (
        "data_parallel_replicate_degree",
        "data_parallel_shard_degree",
        "fsdp_reshard_after_forward",
        "tensor_parallel_degree",
        "disable_loss_parallel",
        "enable_async_tensor_parallel",
        "pipeline_parallel_degree",
        "pipeline_parallel_split_points",
        "pipeline_parallel_schedule",
        "pipeline_parallel_schedule_csv",
        "pipeline_parallel_microbatch_size",
        "pipeline_parallel_layers_per_stage",
        "pipeline_parallel_first_stage_less_layers",
        "pipeline_parallel_last_stage_less_layers",
        "module_fqns_per_model_part",
        "context_parallel_degree",
        "context_parallel_rotate_method",
        "expert_parallel_degree",
        "expert_tensor_parallel_degree",
        "enable_compiled_autograd",
    ),
    "checkpoint": (
        "enable",
        "enable_checkpoint",
        "interval_type",
        "model_weights_only",
        "folder",
        "interval",
        "last_save_model_only",
        "export_dtype",
        "async_mode",
        "keep_latest_k",
        "load_step",
        "exclude_from_loading",
        "initial_load_path",
        "initial_load_model_only",
        "initial_load_in_hf",
        "last_save_in_hf",
        "create_seed_checkpoint",
        "enable_first_step_checkpoint",
    ),
    "activation_checkpoint": (
        "mode",
        "selective_ac_option",
        "per_op_sac_force_recompute_mm_shapes_by_fqns",
        "early_stop",
        "memory_budget",
        "visualize_memory_budget_pareto",
    ),
    "validation": ("enable", "dataset", "dataset_path", "local_batch_size", "seq_len", "freq", "steps"),
}


def count(section: dict, key: str, default: int, auto: bool = False, zero: bool = False) -> int:
    """``section[key]`` (``key`` is ``table.field``) as an integer >= 1 (-1 too with ``auto``, 0 with ``zero``);
    a one-line ConfigError naming the field otherwise (a degree of -2 is the recipe's error, not mesh.data's)."""
    value = section.get(key.split(".", 1)[1], default)
    allowed = ">= 1" + (" or -1 (the rest)" if auto else "") + (" or 0" if zero else "")
    ok = type(value) is int and (value >= 1 or (auto and value == -1) or (zero and value == 0))
    if not ok:
        raise ConfigError(f"torchtitan: {key} = {value!r}: use an integer {allowed}")
    return value
