"""What the DeepSpeed importer does with each key of a ``ds_config.json``: the tables of no-op,
unsupported and handled keys, the ``"auto"`` aliases, and the parsed config the section handlers share."""

from __future__ import annotations

from typing import Any

from jaxpar.port.report import (
    Report,
)

NOOP = "no-op in jaxpar: "
_LOGGING = NOOP + "logging/profiling only; jaxpar logs under train.workdir"
BUCKET = NOOP + "XLA schedules, fuses and overlaps the collectives; there are no buckets to size"
TOP_NOOP = {
    "steps_per_print": None,
    "wall_clock_breakdown": _LOGGING,
    "memory_breakdown": _LOGGING,
    "dump_state": _LOGGING,
    "wandb": _LOGGING,
    "csv_monitor": _LOGGING,
    "comet": _LOGGING,
    "timers": _LOGGING,
    "zero_allow_untested_optimizer": NOOP + "jaxpar's ZeRO works with its one optimizer (AdamW)",
    "zero_force_ds_cpu_optimizer": NOOP + "no CPU optimizer in jaxpar",
    "prescale_gradients": NOOP + "gradients are averaged in parallel.grad_reduce_dtype; pre-division only "
    "guards fp16 overflow",
    "gradient_predivide_factor": NOOP + "gradients are averaged in parallel.grad_reduce_dtype",
    "disable_allgather": BUCKET,
    "checkpoint": NOOP + "orbax checkpoints are sharded and restore onto any mesh",
    "compile": NOOP + "XLA always compiles the whole step",
    "seq_parallel_communication_data_type": BUCKET,
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
    k: BUCKET
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
        "stage3_param_persistence_threshold": NOOP + "1-D parameters (norms) stay replicated by jaxpar's rules; "
        "parallel.max_replicated_fraction bounds the replicated share",
        "stage3_model_persistence_threshold": NOOP + "see stage3_param_persistence_threshold",
        "stage3_gather_16bit_weights_on_model_save": NOOP + "orbax saves sharded checkpoints; no gather on save",
        "stage3_gather_fp16_weights_on_model_save": NOOP + "orbax saves sharded checkpoints; no gather on save",
        "elastic_checkpoint": NOOP + "orbax checkpoints restore onto any mesh",
        "load_from_fp32_weights": NOOP + "master weights are param_dtype=float32 already",
        "ignore_unused_parameters": NOOP + "jax differentiates the whole tree",
        "legacy_stage1": BUCKET,
        "pipeline_loading_checkpoint": BUCKET,
        "override_module_apply": BUCKET,
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
_XLA_REMAT = NOOP + "XLA plans the rematerialized buffers"
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
            ("approximated", "", NOOP + "jaxpar seeds and partitions by construction"),
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


class Ctx:
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
