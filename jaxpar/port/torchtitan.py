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

# torchtitan's Llama 3 flavors at 238fa99 (torchtitan/models/llama3/__init__.py and model/args.py there:
# TransformerModelArgs defaults n_kv_heads = n_heads, multiple_of 256, ffn_dim_multiplier None, norm_eps
# 1e-5, vocab_size 128256): flavor -> (dim, layers, heads, kv_heads, ffn_dim_multiplier, multiple_of,
# vocabulary); rope_theta 500000 in all. Since 5bbda42 (2025-10, "Add scaled RoPE support for Llama 3
# and 4") every flavor rotates with Llama 3.1's scaled RoPE (TransformerModelArgs.rope_scaling_args =
# RoPEScalingArgs(): scaling_factor 8, low_freq_factor 1, high_freq_factor 4,
# original_max_position_embeddings 8192, applied in precompute_freqs_cis): model.rope_scaling=llama3
# (LLAMA3_ROPE_SCALING).
LLAMA3_FLAVORS = {
    "debugmodel": (256, 6, 16, 16, None, 256, 2048),
    "debugmodel_flex_attn": (256, 6, 16, 16, None, 256, 2048),
    "debugmodel_varlen_attn": (256, 6, 16, 16, None, 256, 2048),
    "8B": (4096, 32, 32, 8, 1.3, 1024, 128256),
    "8B_flex": (4096, 32, 32, 8, 1.3, 1024, 128256),
    "8B_varlen": (4096, 32, 32, 8, 1.3, 1024, 128256),
    "70B": (8192, 80, 64, 8, 1.3, 4096, 128256),
    "405B": (16384, 126, 128, 8, 1.2, 4096, 128256),
}
# flavors with attn_mask_type="block_causal": attention stops at document boundaries (model.attention_mask)
LLAMA3_BLOCK_CAUSAL = ("debugmodel_flex_attn", "debugmodel_varlen_attn", "8B_flex", "8B_varlen")
LLAMA3_ROPE_SCALING = {
    "model.rope_scaling": "llama3",
    "model.rope_scaling_factor": 8.0,
    "model.rope_low_freq_factor": 1.0,
    "model.rope_high_freq_factor": 4.0,
    "model.rope_original_max_seq_len": 8192,
}
# the 2024 schema's Llama 3 flavors (torchtitan/models/llama/__init__.py at a99d2e5, llama3_configs;
# plain RoPE, theta 500000): flavor -> (dim, layers, heads, kv_heads, ffn_dim_multiplier, multiple_of);
# the vocabulary is the tokenizer's (ModelArgs.vocab_size = tokenizer.n_words in train.py there)
LLAMA3_2024_FLAVORS = {
    "debugmodel": (256, 8, 16, 16, None, 256),
    "8B": (4096, 32, 32, 8, 1.3, 1024),
    "70B": (8192, 80, 64, 8, 1.3, 4096),
    "405B": (16384, 126, 128, 8, 1.2, 4096),
}
LLAMA3_VOCAB = 128256  # the Llama 3 tokenizer: 128000 BPE ranks + 256 special tokens
# a99d2e5's test/assets/test_tiktoken.model: 2000 BPE ranks + the TikTokenizer's 256 special tokens
TEST_TIKTOKEN_VOCAB = 2256
# torchtitan's 2024 Llama 2 flavors (torchtitan/models/llama/__init__.py at a99d2e5; ModelArgs
# defaults: n_kv_heads = n_heads, multiple_of 256, rope_theta 10000): flavor ->
# (dim, layers, heads, kv_heads, ffn_dim_multiplier, multiple_of); vocabulary: the Llama 2
# tokenizer's 32000 (the tokenizer file is not read)
LLAMA2_FLAVORS = {
    "debugmodel": (256, 8, 16, 16, None, 256),
    "271M": (1024, 16, 8, 8, None, 256),
    "1B": (2048, 18, 16, 16, None, 256),
    "7B": (4096, 32, 32, 32, None, 256),
    "13B": (5120, 40, 40, 40, None, 256),
    "26B": (5120, 80, 40, 40, None, 256),
    "70B": (8192, 80, 64, 8, 1.3, 4096),
}
LLAMA2_VOCAB = 32000
# torchtitan's dense Qwen3 flavors (torchtitan/models/qwen3/__init__.py at 238fa99): flavor ->
# (dim, layers, heads, kv_heads, hidden_dim, tied embeddings); every one: head_dim 128, QK-norm,
# RoPE 1e6, RMSNorm eps 1e-6, vocabulary 151936 (debugmodel: 2048)
QWEN3_FLAVORS = {
    "debugmodel": (256, 8, 16, 8, 3072, True),
    "0.6B": (1024, 28, 16, 8, 3072, True),
    "1.7B": (2048, 28, 16, 8, 6144, True),
    "4B": (2560, 36, 32, 8, 9728, True),
    "8B": (4096, 36, 32, 8, 12288, False),
    "14B": (5120, 40, 40, 8, 17408, False),
    "32B": (5120, 64, 64, 8, 25600, False),
}
# torchtitan's DeepSeek-V3 flavors (torchtitan/models/deepseek_v3/__init__.py and model/args.py at 238fa99):
# flavor -> (vocab, dim, inter_dim, moe_inter_dim, n_layers, n_dense_layers, n_heads, num_experts,
# num_shared_experts, top_k, score_func, route_norm, route_scale, num_expert_groups, num_limited_groups,
# q_lora_rank, kv_lora_rank, qk_nope, qk_rope, v_head_dim). Every one: RMSNorm eps 1e-5, RoPE theta 10000
# with YaRN (rope_factor 40) only past original_seq_len 4096, score_before_experts False, load_balance_coeff
# 1e-3 (MoEArgs' default), attn_mask_type block_causal.
DEEPSEEK_V3_FLAVORS = {
    "16B": (102400, 2048, 10944, 1408, 27, 1, 16, 64, 2, 6, "softmax", False, 1.0, 1, 1, 0, 512, 128, 64, 128),
    "671B": (129280, 7168, 18432, 2048, 61, 3, 128, 256, 1, 8, "sigmoid", True, 2.5, 8, 4, 1536, 512, 128, 64, 128),
}
# block_causal ends each document at tokenizer.eos_id (get_document_mask_mod in torchtitan/models/attention.py at
# 238fa99), the EOS of the tokenizer under model.hf_assets_path, which jaxpar does not read: the EOS ids
# of the tokenizers torchtitan's own TOMLs name there (each repository's config.json eos_token_id, the id
# of its tokenizer_config.json eos_token), by the path's last component
EOS_IDS = {
    "deepseek-moe-16b-base": 100001,  # deepseek-ai/deepseek-moe-16b-base (deepseek_v3_16b.toml)
    "DeepSeek-V3.1-Base": 1,  # deepseek-ai/DeepSeek-V3.1-Base (deepseek_v3_671b.toml)
    "Llama-3.1-8B": 128001,  # meta-llama/Llama-3.1-8B (llama3_8b.toml), <|end_of_text|>
}
DEEPSEEK_V3_ORIGINAL_SEQ = 4096  # original_seq_len: YaRN scales RoPE past it
DEEPSEEK_V3_BALANCE = 1e-3  # MoEArgs.load_balance_coeff's default at 238fa99
# torchtitan's MoE families: what keeps each from jaxpar's Mixtral-like MoE (model.num_experts); without
# --approximate each is refused (its dense stand-in would not be the recipe's model)
MOE_FAMILIES = {
    # reached only by a flavor without a row in DEEPSEEK_V3_FLAVORS (the family itself maps to deepseek_v3)
    "deepseek_v3": "a DeepSeek-V3 flavor whose shapes jaxpar has no table for (it knows 16B and 671B): "
    "port it with --approximate and set the model.* shapes",
    "llama4": "the router's sigmoid score multiplies each expert's input, not its output (MoEArgs'"
    " score_before_experts, True by default), and a shared expert with an aux-loss-free routing bias in a"
    " grouped-query-attention model (jaxpar has those two only in deepseek_v3, with MLA)",
    "qwen3": "its MoE flavors balance experts with a per-expert routing bias (MoEArgs' load_balance_coeff 1e-3 at "
    "238fa99, aux-loss-free), which jaxpar's qwen3_moe lacks (jaxpar has that bias in deepseek_v3 only); the dense flavors "
    "port (model.name=qwen3)",
    "gpt_oss": "attention sinks and biased experts",
}
_NOOP = "no-op in jaxpar: "
_LOG = _NOOP + "logging/profiling only; jaxpar logs under train.workdir"
_TB = (
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
    "comm": _NOOP + "XLA manages collectives and their timeouts",
    "memory_estimation": _NOOP + "use `jaxpar plan` for memory estimates",
    "compile": _NOOP + "XLA always compiles the whole step",
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
SCHEDULES = {"1F1B": "1f1b", "GPipe": "gpipe", "Interleaved1F1B": "interleaved"}
# torchtitan's split of the layers over pipeline stages (pipeline_parallel.generate_llm_fqn_per_model_part)
STAGE_KEYS = (
    "pipeline_parallel_first_stage_less_layers",
    "pipeline_parallel_last_stage_less_layers",
    "pipeline_parallel_layers_per_stage",
)


def torchtitan_stage_layers(num_layers: int, stages: int, first_less: int = 1, last_less: int = 1) -> list[int]:
    """Layers of each pipeline stage as torchtitan cuts them: the embedding counts as ``first_less``
    layers and the output as ``last_less`` (both 1 by default), the total split as evenly as it
    goes with the extra ones on the first stages, then the embedding's and output's shares taken
    off the first and last stage."""
    per, extra = divmod(num_layers + first_less + last_less, stages)
    counts = [per + (1 if i < extra else 0) for i in range(stages)]
    counts[0] -= first_less
    counts[-1] -= last_less
    return counts


def _stage_split(p: dict, values: dict, report: Report, pp: int, schedule: str) -> None:
    """torchtitan's stage split (:func:`torchtitan_stage_layers`) onto ``parallel.layers_per_stage``."""
    first = _count(p, "parallelism.pipeline_parallel_first_stage_less_layers", 1, zero=True)
    last = _count(p, "parallelism.pipeline_parallel_last_stage_less_layers", 1, zero=True)
    layers, single = values.get("model.num_layers"), schedule in ("1F1B", "GPipe")
    per_stage = p.get("pipeline_parallel_layers_per_stage")
    stages = pp * (1 if single else 2)
    if per_stage is not None:
        per_stage = _count(p, "parallelism.pipeline_parallel_layers_per_stage", 1)
        stages = -(-(layers + first + last) // per_stage)
        if single and stages != pp:
            raise ConfigError(
                f"torchtitan: parallelism.pipeline_parallel_layers_per_stage = {per_stage} gives {stages} stages "
                f"for {layers} layers (+{first} for the embedding, +{last} for the output), but {schedule} runs "
                f"one stage per rank of pipeline_parallel_degree {pp}; fix one of them"
            )
    given = {key: p[key] for key in STAGE_KEYS if key in p}
    if pp <= 1 or not layers:
        for key, value in given.items():
            report.approximated(f"parallelism.{key}", value, "", "no-op: pipeline_parallel_degree = 1")
        return
    counts = torchtitan_stage_layers(layers, stages, first, last)
    shown = ",".join(map(str, counts))
    if single:
        if len(set(counts)) > 1:
            values["parallel.layers_per_stage"] = shown
        target, status, note = "parallel.layers_per_stage", "mapped", f"torchtitan's split: {shown} layers per stage"
    else:
        virtual = stages // pp
        values["parallel.virtual_stages"] = virtual
        even = len(set(counts)) == 1
        target, status = "parallel.virtual_stages", "mapped" if even else "approximated"
        note = f"{virtual} virtual stages per rank" + (
            "" if even else f"; torchtitan cuts {shown}, jaxpar equal chunks of num_layers / {stages}"
        )
    if not given and len(set(counts)) > 1:  # the defaults (1 and 1) made the split uneven
        given = {f"{STAGE_KEYS[0]} (default)": first, f"{STAGE_KEYS[1]} (default)": last}
    for key, value in given.items():
        report.add(f"parallelism.{key}", value, status, target, note)


def ffn_dim(dim: int, multiplier: float | None, multiple_of: int) -> int:
    """torchtitan/Meta LLaMA FeedForward hidden size: 2/3 of 4*dim, scaled, rounded up to multiple_of."""
    hidden = int(2 * (4 * dim) / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


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

    A model jaxpar cannot train (see :func:`_model`) is a model change in the report;
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
    _model(sec["model"], sec["training"], values, report, old=old)
    if approximate is False:
        refuse_model_changes(report, "torchtitan", approximate=False, final=True)
    _parallel(sec["parallelism"], sec["training"], world_size, allow_unresolved, values, report)
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


def _count(section: dict, key: str, default: int, auto: bool = False, zero: bool = False) -> int:
    """``section[key]`` (``key`` is ``table.field``) as an integer >= 1 (-1 too with ``auto``, 0 with ``zero``);
    a one-line ConfigError naming the field otherwise (a degree of -2 is the recipe's error, not mesh.data's)."""
    value = section.get(key.split(".", 1)[1], default)
    allowed = ">= 1" + (" or -1 (the rest)" if auto else "") + (" or 0" if zero else "")
    ok = type(value) is int and (value >= 1 or (auto and value == -1) or (zero and value == 0))
    if not ok:
        raise ConfigError(f"torchtitan: {key} = {value!r}: use an integer {allowed}")
    return value


def _parallel(p: dict, t: dict, world: int | None, allow: bool, values: dict, report: Report) -> None:
    rep, shard = (
        _count(p, "parallelism.data_parallel_replicate_degree", 1),
        _count(p, "parallelism.data_parallel_shard_degree", -1, auto=True),
    )
    tp, pp = _count(p, "parallelism.tensor_parallel_degree", 1), _count(p, "parallelism.pipeline_parallel_degree", 1)
    cp = _count(p, "parallelism.context_parallel_degree", 1)
    fixed = rep * tp * pp * cp
    if shard == -1:
        if world is None and not allow:
            raise ConfigError(
                "torchtitan: parallelism.data_parallel_shard_degree = -1 takes the remaining ranks, so "
                "the world size is needed; pass --world-size N (the GPUs the preset was written for)"
            )
        world = world if world is not None else fixed
        if world % fixed:
            raise ConfigError(
                f"torchtitan: world size {world} is not divisible by replicate*tensor*pipeline*context "
                f"= {rep}*{tp}*{pp}*{cp} = {fixed}; pass a multiple of {fixed}"
            )
        shard = world // fixed
    elif world is not None and world != fixed * shard:
        raise ConfigError(
            f"torchtitan: the parallelism degrees multiply to {fixed * shard} but the world size is "
            f"{world}; make their product equal the world size (or set data_parallel_shard_degree=-1)"
        )
    dp = rep * shard
    local = _count(t, "training.local_batch_size", _count(t, "training.batch_size", 8))
    global_batch = _count(t, "training.global_batch_size", -1, auto=True, zero=True)
    global_batch = local * dp if global_batch in (-1, 0) else global_batch
    if global_batch % (local * dp):
        raise ConfigError(
            f"torchtitan: training.global_batch_size {global_batch} is not a multiple of "
            f"local_batch_size {local} * data-parallel degree {dp}; fix one of them"
        )
    accum = global_batch // (local * dp)
    pp_micro = _count(p, "parallelism.pipeline_parallel_microbatch_size", 1)
    micro = accum * (local // pp_micro if pp > 1 and local % pp_micro == 0 else 1)
    values.update(
        {
            "mesh.data": dp,
            "mesh.tensor": tp,
            "mesh.pipeline": pp,
            "mesh.context": cp,
            "train.global_batch": global_batch,
            "parallel.microbatches": micro,
            "parallel.zero_stage": 3 if shard > 1 else 0,
        }
    )
    rotate = _context(p, t, cp, values, report)
    note = {
        "data_parallel_shard_degree": f"FSDP over {shard} ranks = ZeRO-3 on mesh.data"
        if shard > 1
        else "no FSDP sharding: ZeRO-0",
        "data_parallel_replicate_degree": ""
        if rep == 1 or shard == 1
        else f"HSDP: jaxpar shards over all {dp} data ranks instead of {shard} and replicating {rep}x",
        "context_parallel_degree": ""
        if cp == 1
        else f"the sequence split over {cp} context ranks in {2 * cp} "
        "load-balanced chunks; blockwise attention; FSDP and gradients over data x context",
        "context_parallel_rotate_method": rotate,
        "pipeline_parallel_microbatch_size": f"microbatches = local/microbatch size * accumulation = {micro}",
    }
    target = {
        "data_parallel_replicate_degree": "mesh.data",
        "data_parallel_shard_degree": "mesh.data, parallel.zero_stage",
        "tensor_parallel_degree": "mesh.tensor",
        "pipeline_parallel_degree": "mesh.pipeline",
        "context_parallel_degree": "mesh.context, model.attention",
        "context_parallel_rotate_method": "parallel.context_exchange",
        "pipeline_parallel_microbatch_size": "parallel.microbatches",
    }
    schedule = str(p.get("pipeline_parallel_schedule", "1F1B"))
    if pp > 1 and schedule in SCHEDULES:
        values["parallel.pipeline_schedule"] = SCHEDULES[schedule]
        if schedule == "Interleaved1F1B":
            values["parallel.virtual_stages"] = 2
    split = pp <= 1 or schedule in SCHEDULES  # else the schedule is approximated and so is its split
    if split:
        _stage_split(p, values, report, pp, schedule)
    for key, value in p.items():
        src = f"parallelism.{key}"
        if key in STAGE_KEYS and split:
            continue
        if key in target:
            bad = (key == "context_parallel_rotate_method" and (cp == 1 or str(value) not in ROTATE_METHODS)) or (
                key == "data_parallel_replicate_degree" and note[key]
            )
            report.add(src, value, "approximated" if bad else "mapped", target[key], note.get(key, ""))
        elif key == "pipeline_parallel_schedule":
            ok = pp == 1 or schedule in ("1F1B", "GPipe")
            report.add(
                src,
                value,
                "mapped" if ok else "approximated",
                "parallel.pipeline_schedule",
                ""
                if pp > 1
                else "no-op: pipeline_parallel_degree = 1"
                if ok
                else "interleaved with 2 virtual stages per rank",
            )
        elif key == "expert_parallel_degree" and int(value) > 1 and values.get("model.name") == "deepseek_v3":
            ep = int(value)
            if dp % ep:
                raise ConfigError(
                    f"torchtitan: parallelism.expert_parallel_degree {ep} does not divide the data-parallel "
                    f"degree {dp}; jaxpar's expert axis takes its ranks from data: use a divisor of {dp}"
                )
            values.update({"mesh.data": dp // ep, "mesh.expert": ep})
            report.mapped(
                src,
                value,
                "mesh.expert, mesh.data",
                f"experts over {ep} expert ranks taken from data: data = {dp} / {ep} = {dp // ep}; attention "
                f"and dense layers still data-parallel over data x expert = {dp}",
            )
        elif key in ("expert_parallel_degree", "expert_tensor_parallel_degree") and int(value) > 1:
            report.unsupported(
                src,
                value,
                "mixture-of-experts parallelism: no torchtitan MoE family ports to jaxpar's MoE (see model.name), "
                "so mesh.expert stays 1 (torchtitan borrows its expert ranks from the other degrees: the mesh "
                "keeps its size)",
            )
        elif key == "fsdp_reshard_after_forward":
            report.approximated(
                src,
                value,
                "parallel.zero_stage",
                "jaxpar's ZeRO-3 re-gathers parameters in the backward pass (reshard after forward)",
            )
        elif key in KNOWN["parallelism"]:
            report.approximated(src, value, "", _NOOP + "XLA decides this (or it is off)")
        else:
            report.unknown(src, value, [f"parallelism.{k}" for k in KNOWN["parallelism"]], "torchtitan")
    split = (
        f" = data x expert ({values['mesh.data']} x {values['mesh.expert']})"
        if values.get("mesh.expert", 1) > 1
        else ""
    )
    report.mapped("(world size)", dp * cp * tp * pp, "mesh.data", f"data = replicate*shard = {dp}{split}")
    report.mapped(
        "training.local_batch_size",
        local,
        "train.global_batch",
        f"global batch = {global_batch} ({accum} accumulation step(s))",
    )


# parallelism.context_parallel_rotate_method -> parallel.context_exchange (jaxpar.ops.context_parallel)
ROTATE_METHODS = {"allgather": "all_gather"}


def _context(p: dict, t: dict, cp: int, values: dict, report: Report) -> str:
    """Context parallelism: ``context_parallel_degree`` -> ``mesh.context`` with blockwise attention;
    the rotate method -> the exchange: ``allgather`` (torchtitan's default) the all-gather,
    ``alltoall`` (keys and values passed on by all-to-all) the ring, its nearest counterpart.
    Returns the rotate method's report note."""
    seq = _count(t, "training.seq_len", 2048)
    if cp > 1 and seq % (2 * cp):
        raise ConfigError(
            f"torchtitan: training.seq_len {seq} is not divisible by 2 * "
            f"parallelism.context_parallel_degree {cp} = {2 * cp} (each context rank holds two chunks "
            f"of the sequence); use a multiple of {2 * cp}"
        )
    method = str(p.get("context_parallel_rotate_method", "allgather"))
    exchange = ROTATE_METHODS.get(method, "ring")
    if cp == 1:
        return "no effect: context_parallel_degree = 1"
    if exchange == "ring" and values.get("mesh.pipeline", 1) > 1:  # the ring runs only outside pipeline stages
        values.update({"model.attention": "blockwise", "parallel.context_exchange": "all_gather"})
        return (
            f"{method}: jaxpar runs the ring only outside pipeline stages; with pipeline parallelism keys "
            "and values are all-gathered instead (the same attention, different messages)"
        )
    values.update({"model.attention": "blockwise", "parallel.context_exchange": exchange})
    if "context_parallel_rotate_method" not in p:
        report.mapped(
            "parallelism.context_parallel_rotate_method (default)",
            method,
            "parallel.context_exchange",
            "torchtitan's default: keys and values all-gathered",
        )
    if method in ROTATE_METHODS:
        return "keys and values all-gathered over the context ranks"
    return (
        f"{method}: no all-to-all rotation in jaxpar; the ring (keys and values passed rank to rank by "
        "collective-permute) runs instead: the same attention, different messages"
    )


def _llama_shape(
    dim: int, layers: int, heads: int, kv: int, mult: float | None, multiple: int, theta: float, vocab: int
) -> dict[str, Any]:
    """The ``model.*`` shape of a torchtitan Llama flavor (head dim = dim / heads, untied, eps 1e-5)."""
    return {
        "model.embed_dim": dim,
        "model.num_layers": layers,
        "model.num_heads": heads,
        "model.num_kv_heads": kv,
        "model.head_dim": dim // heads,
        "model.mlp_dim": ffn_dim(dim, mult, multiple),
        "model.rope_theta": theta,
        "model.vocab_size": vocab,
        "model.norm_eps": 1e-5,
        "model.tie_embeddings": False,
    }


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


def _flavors(name: str, old: bool) -> str:
    """The flavors jaxpar knows for family ``name`` (``old``: in the 2024 schema's tables)."""
    llama3 = LLAMA3_2024_FLAVORS if old else LLAMA3_FLAVORS
    table = {"llama3": llama3, "llama2": LLAMA2_FLAVORS, "llama": LLAMA2_FLAVORS, "qwen3": QWEN3_FLAVORS}
    return ", ".join(table.get(name, {})) or "none"


def _block_causal(flavor: str, assets: str, values: dict, report: Report) -> None:
    """A flavor with ``attn_mask_type="block_causal"``: ``model.attention_mask=block_causal`` with
    the EOS id of the tokenizer ``assets`` (``model.hf_assets_path``) names (:data:`EOS_IDS`); an
    unknown tokenizer is a model change that ``--set model.eos_token_id=`` resolves."""
    values["model.attention_mask"] = "block_causal"
    report.mapped(
        "(attention mask)",
        "block_causal",
        "model.attention_mask",
        f"flavor {flavor}: attention also stops at document boundaries (each document ends at the tokenizer's EOS)",
    )
    name = assets.rstrip("/").rsplit("/", 1)[-1]
    if name in EOS_IDS:
        values["model.eos_token_id"] = EOS_IDS[name]
        report.mapped(
            "(document separator)",
            name,
            "model.eos_token_id",
            f"EOS id {EOS_IDS[name]} of the {name} tokenizer (its config.json eos_token_id), which torchtitan's "
            "tokenizer.eos_id is; jaxpar does not read the tokenizer: another one needs --set model.eos_token_id=",
        )
        return
    values["model.attention_mask"] = "causal"  # until the separator is given (or --approximate keeps it so)
    report.model_change(
        "(document separator)",
        assets or "(no model.hf_assets_path)",
        f"flavor {flavor} masks attention at document boundaries (attn_mask_type block_causal), which end at the "
        "tokenizer's EOS id; jaxpar does not read the tokenizer and does not know this one's",
        "give --set model.attention_mask=block_causal --set model.eos_token_id=<the tokenizer's EOS id>",
        needs=("model.attention_mask", "model.eos_token_id"),
        target="model.eos_token_id",
    )


def _deepseek_v3(flavor: str, seq: int, values: dict, report: Report, assets: str = "") -> None:
    """A DeepSeek-V3 flavor: ``model.name=deepseek_v3`` with the flavor's shape (:data:`DEEPSEEK_V3_FLAVORS`)."""
    (vocab, dim, inter, moe_inter, layers, dense, heads, experts, shared, top_k, score, norm, scale, groups,
     limited, q_lora, kv_lora, nope, rope, v) = DEEPSEEK_V3_FLAVORS[flavor]  # fmt: skip
    values.update(
        {
            "model.name": "deepseek_v3",
            "model.vocab_size": vocab,
            "model.embed_dim": dim,
            "model.mlp_dim": inter,
            "model.moe_mlp_dim": moe_inter,
            "model.num_layers": layers,
            "model.first_dense_layers": dense,
            "model.num_heads": heads,
            "model.num_kv_heads": heads,
            "model.head_dim": nope + rope,
            "model.num_experts": experts,
            "model.shared_expert_dim": shared * moe_inter,
            "model.experts_per_token": top_k,
            "model.router_score": score,
            "model.router_norm_topk": norm,
            "model.router_scale": scale,
            "model.router_groups": groups,
            "model.router_group_topk": limited,
            "model.q_lora_rank": q_lora,
            "model.kv_lora_rank": kv_lora,
            "model.qk_nope_head_dim": nope,
            "model.qk_rope_head_dim": rope,
            "model.v_head_dim": v,
            "model.norm_eps": 1e-5,
            "model.rope_theta": 10000.0,
            "model.router_bias_rate": DEEPSEEK_V3_BALANCE,
        }
    )
    report.mapped("model.name", "deepseek_v3", "model.name", "deepseek_v3: MLA, DeepSeekMoE, dense first layers")
    report.mapped(
        "model.flavor",
        flavor,
        "model.*",
        f"DeepSeek-V3 {flavor} (torchtitan's table at 238fa99): {layers} layers ({dense} dense), {experts} experts "
        f"top-{top_k} {score}, {shared} shared; vocabulary {vocab}",
    )
    report.approximated(
        "(load_balance_coeff)",
        DEEPSEEK_V3_BALANCE,
        "model.router_bias_rate",
        "torchtitan's default aux-loss-free bias update; torchtitan also subtracts the update's mean over the "
        "experts, jaxpar applies the paper's rate * sign(mean load - load) as it is",
    )
    if seq > DEEPSEEK_V3_ORIGINAL_SEQ:
        report.model_change(
            "training.seq_len",
            seq,
            f"past original_seq_len {DEEPSEEK_V3_ORIGINAL_SEQ} torchtitan's DeepSeek-V3 rotates with YaRN "
            "(rope_factor 40, mscale), which jaxpar does not implement",
            f"train at seq_len <= {DEEPSEEK_V3_ORIGINAL_SEQ}",
            target="model.rope_scaling",
        )
    _block_causal(flavor, assets, values, report)


def _model(m: dict, t: dict, values: dict, report: Report, old: bool = False) -> None:
    """The model: a flavor of torchtitan's tables with its shape, or a model change naming why not
    (``old``: the TOML is in the 2024 schema, whose tables are a99d2e5's)."""
    name, flavor = str(m.get("name", "llama3")), str(m.get("flavor", "debugmodel"))
    seq = _count(t, "training.seq_len", 2048)
    values.update({"train.seq_len": seq, "model.max_seq_len": seq})
    report.mapped("training.seq_len", seq, "train.seq_len, model.max_seq_len")
    tokenizer = str(m.get("tokenizer_path", ""))
    if name in ("llama2", "llama") and flavor in LLAMA2_FLAVORS:  # the 2024 schema names it llama2 (or llama)
        values.update(_llama_shape(*LLAMA2_FLAVORS[flavor], 10000.0, LLAMA2_VOCAB))
        report.mapped("model.name", name, "model.*")
        report.approximated(
            "model.flavor",
            flavor,
            "model.*",
            f"Llama 2 {flavor} (torchtitan's 2024 table); vocabulary {LLAMA2_VOCAB}, the Llama 2 tokenizer's, "
            "assumed: the tokenizer file is not read (set --set model.vocab_size= for another)",
        )
    elif name == "llama3" and old and flavor in LLAMA3_2024_FLAVORS:
        test_tokenizer = tokenizer.endswith("test_tiktoken.model")
        vocab = TEST_TIKTOKEN_VOCAB if test_tokenizer else LLAMA3_VOCAB
        values.update(
            _llama_shape(*LLAMA3_2024_FLAVORS[flavor], 500000.0, vocab)
            | {"model.mlp_activation": "swiglu", "model.norm": "rmsnorm", "model.position": "rope"}
        )
        report.mapped("model.name", name, "model.*")
        report.mapped(
            "model.flavor",
            flavor,
            "model.*",
            f"Llama 3 {flavor} (torchtitan's 2024 table at a99d2e5, plain RoPE); vocabulary {vocab} from "
            + (
                "torchtitan's test tokenizer (2000 ranks + 256 special tokens)"
                if test_tokenizer
                else "the Llama 3 tokenizer"
            ),
        )
    elif name == "llama3" and not old and flavor in LLAMA3_FLAVORS:
        dim, layers, heads, kv, mult, multiple, vocab = LLAMA3_FLAVORS[flavor]
        values.update(
            _llama_shape(dim, layers, heads, kv, mult, multiple, 500000.0, vocab)
            | {"model.mlp_activation": "swiglu", "model.norm": "rmsnorm", "model.position": "rope"}
        )
        report.mapped("model.name", name, "model.*")
        report.mapped(
            "model.flavor",
            flavor,
            "model.*",
            f"Llama 3 {flavor}'s shape (torchtitan's table at 238fa99); vocabulary {vocab}",
        )
        values.update(LLAMA3_ROPE_SCALING)
        report.mapped(
            "(rope scaling)",
            "Llama 3.1",
            "model.rope_scaling",
            "torchtitan's Llama 3 (this TOML is in its current schema; since 5bbda42, 2025-10) rotates with Llama "
            "3.1's scaled RoPE (RoPEScalingArgs at 238fa99: factor 8, low/high frequency factors 1/4, original "
            "context 8192), as model.rope_scaling=llama3 does; for a torchtitan before 5bbda42 (plain RoPE) "
            "--set model.rope_scaling=none",
        )
        if flavor in LLAMA3_BLOCK_CAUSAL:
            _block_causal(flavor, str(m.get("hf_assets_path", "")), values, report)
    elif name == "qwen3" and flavor in QWEN3_FLAVORS:
        dim, layers, heads, kv, hidden, tied = QWEN3_FLAVORS[flavor]
        vocab = 2048 if flavor == "debugmodel" else 151936
        values.update(
            {
                "model.name": "qwen3",
                "model.qk_norm": True,
                "model.embed_dim": dim,
                "model.num_layers": layers,
                "model.num_heads": heads,
                "model.num_kv_heads": kv,
                "model.head_dim": 128,
                "model.mlp_dim": hidden,
                "model.rope_theta": 1e6,
                "model.vocab_size": vocab,
                "model.norm_eps": 1e-6,
                "model.tie_embeddings": tied,
                "model.mlp_activation": "swiglu",
                "model.norm": "rmsnorm",
                "model.position": "rope",
            }
        )
        report.mapped("model.name", name, "model.name", "qwen3: LLaMA's block with QK-norm")
        report.mapped("model.flavor", flavor, "model.*", f"Qwen3 {flavor} (torchtitan's table); vocabulary {vocab}")
    elif name == "deepseek_v3" and flavor in DEEPSEEK_V3_FLAVORS:
        _deepseek_v3(flavor, seq, values, report, str(m.get("hf_assets_path", "")))
    elif name in MOE_FAMILIES:
        unlike = MOE_FAMILIES[name]
        if name == "llama4" and flavor.endswith("_irope"):  # every_n_layers_nope=4 in these flavors only
            unlike += ", and every 4th layer without positions beside chunked attention in the others (iRoPE)"
        why = (
            f"a mixture-of-experts model unlike jaxpar's MoE families ({unlike}; jaxpar's are mixtral "
            "and qwen3_moe: softmax-routed SwiGLU experts in every layer, and deepseek_v3); no jaxpar model computes "
            "it, jaxpar's default model would be trained"
        )
        report.model_change("model.name", name, why, target="model.*")
        report.unsupported("model.flavor", flavor, f"a {name} flavor: see model.name")
    else:
        known = name in ("llama3", "llama2", "llama", "qwen3")
        table = "the 2024 table (a99d2e5)" if old else "the current table (238fa99)"
        if known:
            why = f"{name} flavor '{flavor}' is not in torchtitan's {name} flavors jaxpar knows ({table})"
        else:
            why = f"model family '{name}' is not one jaxpar ports (llama3, llama2 and qwen3)"
        report.model_change(
            "model.flavor" if known else "model.name",
            flavor if known else name,
            why + ": no known shape, jaxpar's default model would be trained",
            f"use one of the flavors {_flavors(name, old)}" if known else "",
            target="model.*",
        )
        report.unsupported("model.name" if known else "model.flavor", name if known else flavor, "see the model change")
    converters = list(m.get("converters", []))
    for key, value in m.items():
        if key == "converters":
            report.add(
                f"model.{key}",
                value,
                "unsupported" if converters else "mapped",
                "",
                "no float8/MX training in jaxpar" if converters else "none",
            )
        elif key == "norm_type" and str(value) in ("rmsnorm", "compiled_rmsnorm", "fused_rmsnorm", "layernorm"):
            norm = "layernorm" if value == "layernorm" else "rmsnorm"
            values["model.norm"] = norm
            report.mapped(f"model.{key}", value, "model.norm", "2024 schema: the norm (compiled/fused: kernels)")
        elif key == "norm_type":
            report.model_change(
                f"model.{key}", value, f"norm '{value}' (2024 schema); jaxpar's norms are RMSNorm and LayerNorm"
            )
        elif key not in ("name", "flavor"):
            status = "approximated" if key in KNOWN["model"] else "unknown"
            if status == "unknown":
                report.unknown(f"model.{key}", value, [f"model.{k}" for k in KNOWN["model"]], "torchtitan")
            else:
                note = _NOOP + "asset/tokenizer location"
                if key == "hf_assets_path" and values.get("model.attention_mask") == "block_causal":
                    note += " (its tokenizer's EOS id: see (document separator))"
                report.approximated(f"model.{key}", value, "", note)


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
                report.approximated(f"optimizer.{key}", value, "", _NOOP + "implementation choice")
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
                report.approximated(src, value, "", _NOOP + "runtime detail")
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
                    _TB + ("; the folder given is not used" if key == "save_tb_folder" else ""),
                )
            elif key in KNOWN[section]:
                report.approximated(src, value, "", _LOG if section in ("job", "metrics") else _NOOP + "detail")
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
                "no float8/MX training in jaxpar" if converters else _NOOP + "model.converters does not enable it",
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
            report.approximated(src, value, "", _NOOP + "profiling is disabled")
        else:
            report.unknown(src, value, [f"profiling.{k}" for k in PROFILING_KEYS], "torchtitan")
