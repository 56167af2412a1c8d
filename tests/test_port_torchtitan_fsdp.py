"""torchtitan and accelerate-FSDP importers on the recipes in tests/fixtures/recipes/{torchtitan,fsdp}.

The torchtitan fixtures are job TOMLs in the shape of torchtitan's presets: FSDP over the remaining
ranks (``data_parallel_shard_degree = -1``, so the world size must be given), tensor and pipeline
degrees, float8 converters, MoE models, gradient accumulation. The FSDP fixtures are accelerate
``config.yaml`` files: FULL_SHARD, HYBRID_SHARD across nodes, FSDP2's reshard flag.
"""

from __future__ import annotations

import tomllib

import pytest

from jaxpar.config import ConfigError
from jaxpar.port.fsdp import port_fsdp
from jaxpar.port.recipe import port_recipe
from jaxpar.port.torchtitan import ffn_dim, port_torchtitan
from tests.port_recipes import EXTRA_WORLD, FIXTURES, recipe_params

TT, FSDP = FIXTURES / "torchtitan", FIXTURES / "fsdp"
# world sizes the fixture jobs were written for (their comments); None: the degrees fix it
WORLD = {
    "llama3_8b_32gpu.toml": 32,
    "llama3_70b_tp8_64gpu.toml": 64,
    "llama3_405b_fp8_128gpu.toml": 128,
    "llama4_moe_pp4_tp8.toml": 64,
    "deepseek_v3_moe_ep8.toml": 16,
    "llama3_8b_pp2_interleaved_16gpu.toml": None,
}


@pytest.mark.parametrize("path, expected", recipe_params("torchtitan", (".toml",), WORLD))
def test_every_torchtitan_recipe_ports_and_reports_every_key(path, expected):
    world = expected if expected != "any" else EXTRA_WORLD.get(path.name, 64)  # extra files: the preset's size
    raw = tomllib.loads(path.read_text())
    if raw.get("parallelism", {}).get("data_parallel_shard_degree", -1) == -1:
        with pytest.raises(ConfigError, match="data_parallel_shard_degree = -1 takes the remaining ranks") as e:
            port_torchtitan(path)
        assert "\n" not in str(e.value)
    cfg, report = port_torchtitan(path, world_size=world)
    if world is not None:
        assert cfg.mesh.data * cfg.mesh.tensor * cfg.mesh.pipeline * cfg.mesh.context * cfg.mesh.expert == world
    sources = [e.source for e in report.entries]
    for section, body in raw.items():
        keys = (
            [f"{section}.{k}" for k in body]
            if section in ("parallelism", "training", "optimizer", "model")
            else [section]
        )
        for key in keys:
            assert any(s.split(" ")[0] == key or s.startswith(key) for s in sources), f"{key} not reported"


@pytest.mark.parametrize(
    "path, expected",
    recipe_params(
        "fsdp",
        (".yaml", ".yml"),
        {
            "accelerate_fsdp_full_shard.yaml": 3,
            "accelerate_fsdp_hybrid_2nodes.yaml": 3,
            "accelerate_fsdp2_no_reshard.yaml": 2,
        },
    ),
)
def test_every_fsdp_recipe_ports(path, expected):
    cfg, report = port_fsdp(path)
    assert cfg.parallel.zero_stage == expected if expected != "any" else cfg.parallel.zero_stage in (0, 2, 3)
    assert not report.problems


def test_every_fixture_is_listed():
    assert sorted(p.name for p in TT.iterdir()) == sorted(WORLD)


@pytest.mark.parametrize(
    "flavor, dim, mult, multiple, ffn",
    [("8B", 4096, 1.3, 1024, 14336), ("70B", 8192, 1.3, 4096, 28672), ("405B", 16384, 1.2, 4096, 53248)],
)
def test_llama3_ffn_sizes(flavor, dim, mult, multiple, ffn):
    assert ffn_dim(dim, mult, multiple) == ffn


def test_llama3_8b_on_32_gpus():
    cfg, report = port_torchtitan(TT / "llama3_8b_32gpu.toml", world_size=32)
    # torchtitan's current Llama 3 scales RoPE as Llama 3.1 does, and so does the port: no model change
    assert report.model_changes == [] and report.find("(rope scaling)").status == "mapped"
    assert (cfg.model.rope_scaling, cfg.model.rope_scaling_factor, cfg.model.rope_original_max_seq_len) == (
        "llama3",
        8.0,
        8192,
    )
    assert (cfg.model.rope_low_freq_factor, cfg.model.rope_high_freq_factor) == (1.0, 4.0)
    assert (cfg.mesh.data, cfg.mesh.tensor, cfg.parallel.zero_stage) == (32, 1, 3)  # FSDP over all 32 ranks
    assert (cfg.train.global_batch, cfg.parallel.microbatches, cfg.train.seq_len, cfg.train.steps) == (
        64,
        1,
        4096,
        2000,
    )
    m = cfg.model
    assert (m.num_layers, m.embed_dim, m.num_heads, m.num_kv_heads, m.mlp_dim, m.vocab_size) == (
        32,
        4096,
        32,
        8,
        14336,
        128256,
    )
    assert m.rope_theta == 500000.0 and cfg.parallel.recompute == "selective" and m.compute_dtype == "bfloat16"
    o = cfg.optim
    assert (o.lr, o.eps, o.b2, o.weight_decay, o.schedule, o.min_lr_ratio) == (2e-4, 1e-8, 0.95, 0.1, "linear", 0.0)
    assert (o.warmup_steps, o.warmup_init_lr) == (99, pytest.approx(2e-4 / 100))  # (k + 1) / 100 over 99 steps
    assert report.find("optimizer.weight_decay (default)").status == "approximated"
    assert (cfg.checkpoint.every, cfg.train.workdir) == (250, "./outputs/llama3_8b")
    assert report.find("quantize").status == "approximated"  # float8 settings, but no converter enables them


def test_llama3_70b_and_405b_tensor_parallel():
    cfg, report = port_torchtitan(TT / "llama3_70b_tp8_64gpu.toml", world_size=64)
    assert (cfg.mesh.data, cfg.mesh.tensor, cfg.model.mlp_dim, cfg.model.num_layers) == (8, 8, 28672, 80)
    assert cfg.train.global_batch == 32 and cfg.parallel.recompute == "full" and cfg.optim.weight_decay == 0.05
    o = cfg.optim  # warmup 300, then stable, then cosine decay over the last half (decay_ratio 0.5) to 0.1 * lr
    assert (o.schedule, o.decay_start_step, o.decay_steps, o.min_lr_ratio) == ("cosine", 1500, 3000, 0.1)
    assert (cfg.train.eval_every, cfg.train.eval_batches) == (250, 50)
    cfg, report = port_torchtitan(TT / "llama3_405b_fp8_128gpu.toml", world_size=128)
    assert (cfg.mesh.data, cfg.mesh.tensor, cfg.model.mlp_dim, cfg.model.num_heads) == (16, 8, 53248, 128)
    assert report.find("model.converters").status == "unsupported"  # float8
    assert report.find("quantize").status == "unsupported"


def test_deepseek_v3_16b_ports_with_experts_over_expert_ranks():
    """torchtitan's DeepSeek-V3 16B flavor: model.name=deepseek_v3 with the flavor's shape; its 8 expert
    ranks come from data (16 = data 2 x expert 8); the one model change is the document mask."""
    name = "deepseek_v3_moe_ep8.toml"
    cfg, report = port_torchtitan(TT / name, world_size=WORLD[name])
    m = cfg.model
    assert (m.name, m.num_layers, m.first_dense_layers, m.embed_dim, m.num_experts, m.experts_per_token) == (
        "deepseek_v3",
        27,
        1,
        2048,
        64,
        6,
    )
    assert (m.router_score, m.router_norm_topk, m.shared_expert_dim, m.moe_mlp_dim, m.q_lora_rank) == (
        "softmax",
        False,
        2816,
        1408,
        0,
    )
    assert (m.kv_lora_rank, m.head_dim, m.v_head_dim, m.router_bias_rate) == (512, 192, 128, 1e-3)
    assert (cfg.mesh.data, cfg.mesh.expert, cfg.parallel.zero_stage) == (2, 8, 3)
    assert report.find("parallelism.expert_parallel_degree").status == "mapped"
    assert report.model_changes == [] and (m.attention_mask, m.eos_token_id) == ("block_causal", 100001)


@pytest.mark.parametrize("name", ["llama4_moe_pp4_tp8.toml"])
def test_moe_models_are_reported_unsupported(name):
    cfg, report = port_torchtitan(TT / name, world_size=WORLD[name])
    row = report.find("model.name")
    assert row.status == "unsupported" and "mixture-of-experts" in row.note
    assert report.model_changes == [row]  # not a dense stand-in: jaxpar port refuses it without --approximate
    degree = "expert_tensor_parallel_degree" if "llama4" in name else "expert_parallel_degree"
    assert report.find(f"parallelism.{degree}").status == "unsupported"
    with pytest.raises(ConfigError, match=f"port torchtitan: model.name = {name.split('_moe')[0]}: a mixture") as e:
        port_recipe("torchtitan", str(TT / name), world_size=WORLD[name])
    assert "\n" not in str(e.value) and "pass --approximate" in str(e.value)
    _, report = port_recipe("torchtitan", str(TT / name), world_size=WORLD[name], approximate=True)
    assert report.ordered()[0] is report.find("model.name")


def test_pipeline_interleaved_with_accumulation():
    path = TT / "llama3_8b_pp2_interleaved_16gpu.toml"
    cfg, report = port_torchtitan(path)  # explicit degrees: no world size needed
    assert (cfg.mesh.data, cfg.mesh.tensor, cfg.mesh.pipeline, cfg.parallel.zero_stage) == (4, 2, 2, 3)
    # 64 = 4 per rank * 4 ranks * 4 accumulation steps; each step's 4 sequences run as 4 pipeline microbatches
    assert (cfg.train.global_batch, cfg.parallel.microbatches) == (64, 16)
    assert (cfg.parallel.pipeline_schedule, cfg.parallel.virtual_stages) == ("interleaved", 2)
    assert (cfg.train.seed, cfg.parallel.recompute, cfg.parallel.grad_reduce_dtype) == (7, "none", "float32")
    assert report.find("parallelism.pipeline_parallel_schedule").status == "approximated"
    with pytest.raises(ConfigError, match="multiply to 16 but the world size is 8"):
        port_torchtitan(path, world_size=8)


def test_torchtitan_degrees_must_multiply_to_the_world_size(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(
        "[parallelism]\ndata_parallel_shard_degree = 4\ntensor_parallel_degree = 2\n"
        "[training]\nlocal_batch_size = 2\nglobal_batch_size = 32\nsteps = 10\n"
    )
    with pytest.raises(ConfigError, match="multiply to 8 but the world size is 16"):
        port_torchtitan(path, world_size=16)
    cfg, report = port_torchtitan(path)
    assert (cfg.mesh.data, cfg.mesh.tensor, cfg.train.global_batch, cfg.parallel.microbatches) == (4, 2, 32, 4)
    path.write_text("[parallelism]\ndata_parallel_shard_degree = 3\n[trainig]\nsteps = 10\n")
    cfg, report = port_torchtitan(path)
    assert report.find("trainig").status == "unknown" and "'training'" in report.find("trainig").note


@pytest.mark.parametrize(
    "rotate, exchange, status",
    [(None, "all_gather", "mapped"), ("allgather", "all_gather", "mapped"), ("alltoall", "ring", "approximated")],
)
def test_torchtitan_context_parallel(tmp_path, rotate, exchange, status):
    path = tmp_path / "job.toml"
    method = "" if rotate is None else f'context_parallel_rotate_method = "{rotate}"\n'
    path.write_text(
        f"[parallelism]\ndata_parallel_shard_degree = -1\ncontext_parallel_degree = 4\n{method}"
        "[training]\nlocal_batch_size = 2\nseq_len = 8192\nsteps = 10\n"
    )
    cfg, report = port_torchtitan(path, world_size=16)
    assert (cfg.mesh.data, cfg.mesh.context, cfg.train.global_batch, cfg.parallel.zero_stage) == (4, 4, 8, 3)
    assert cfg.model.attention == "blockwise" and cfg.parallel.context_exchange == exchange and not report.problems
    assert report.find("parallelism.context_parallel_degree").status == "mapped"
    row = report.find("parallelism.context_parallel_rotate_method" + (" (default)" if rotate is None else ""))
    assert row.status == status and row.target == "parallel.context_exchange"
    assert status == "mapped" or "the ring" in row.note
    path.write_text(path.read_text().replace("seq_len = 8192", "seq_len = 8196"))
    with pytest.raises(ConfigError, match="training.seq_len 8196 is not divisible by 2 \\* parallelism") as e:
        port_torchtitan(path, world_size=16)
    assert "\n" not in str(e.value)


def test_fsdp_full_shard():
    cfg, report = port_fsdp(FSDP / "accelerate_fsdp_full_shard.yaml")
    assert (cfg.mesh.data, cfg.parallel.zero_stage, cfg.model.compute_dtype, cfg.parallel.recompute) == (
        4,
        3,
        "bfloat16",
        "none",
    )
    for key in (
        "fsdp_config.fsdp_auto_wrap_policy",
        "fsdp_config.fsdp_state_dict_type",
        "fsdp_config.fsdp_backward_prefetch",
        "fsdp_config.fsdp_transformer_layer_cls_to_wrap",
        "compute_environment",
        "rdzv_backend",
    ):
        assert report.find(key).status == "approximated"
    assert report.find("fsdp_config.fsdp_sharding_strategy").status == "mapped"


def test_fsdp_hybrid_across_nodes_and_fsdp2_reshard_flag():
    cfg, report = port_fsdp(FSDP / "accelerate_fsdp_hybrid_2nodes.yaml")
    assert (cfg.mesh.data, cfg.parallel.zero_stage, cfg.model.compute_dtype, cfg.parallel.recompute) == (
        16,
        3,
        "bfloat16",  # accelerate's fp16 runs torch's GradScaler, not a rule jaxpar has: bf16, said by the row
        "full",
    )
    precision = report.find("mixed_precision")
    assert (precision.status, precision.target) == ("approximated", "model.compute_dtype")
    assert "GradScaler" in precision.note
    entry = report.find("fsdp_config.fsdp_sharding_strategy")
    assert entry.status == "approximated" and "replicated across 2 node(s)" in entry.note
    cfg, report = port_fsdp(FSDP / "accelerate_fsdp2_no_reshard.yaml")
    assert (cfg.mesh.data, cfg.parallel.zero_stage, cfg.model.compute_dtype) == (8, 2, "float32")  # SHARD_GRAD_OP
    assert report.find("fsdp_config.fsdp_version").status == "approximated"


@pytest.mark.parametrize(
    "strategy, stage, status",
    [
        ("FULL_SHARD", 3, "mapped"),
        ("SHARD_GRAD_OP", 2, "mapped"),
        ("NO_SHARD", 0, "mapped"),
        ("HYBRID_SHARD", 3, "approximated"),
        ("1", 3, "mapped"),
        ("2", 2, "mapped"),
        ("3", 0, "mapped"),
        ("4", 3, "approximated"),
        ("5", 2, "approximated"),
    ],
)
def test_fsdp_strategies(tmp_path, strategy, stage, status):
    path = tmp_path / "fsdp.yaml"
    path.write_text(
        f"distributed_type: FSDP\nnum_machines: 2\nnum_processes: 16\nfsdp_config:\n"
        f"  fsdp_sharding_strategy: {strategy}\n  fsdp_offload_params: true\n"
        f"  fsdp_activation_checkpointing: true\n  fsdp_bogus: 1\n"
    )
    cfg, report = port_fsdp(path)
    assert cfg.parallel.zero_stage == stage and cfg.mesh.data == 16 and cfg.parallel.recompute == "full"
    entry = report.find("fsdp_config.fsdp_sharding_strategy")
    assert entry.status == status and (status == "mapped" or "replicated across 2 node(s)" in entry.note)
    assert report.find("fsdp_config.fsdp_offload_params").status == "unsupported"
    assert report.find("fsdp_config.fsdp_bogus").status == "unknown"


def test_fsdp_bad_strategy_is_one_line_error(tmp_path):
    path = tmp_path / "fsdp.yaml"
    path.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: 9\n")
    with pytest.raises(ConfigError, match="fsdp_sharding_strategy=9: use one of FULL_SHARD"):
        port_fsdp(path)


def test_profiling_and_tensorboard_sections_map_to_a_trace_and_events():
    cfg, report = port_torchtitan(TT / "llama3_405b_fp8_128gpu.toml", world_size=128)  # profile_freq = 100
    assert cfg.train.profile_steps == "100,100"
    assert report.find("profiling.enable_profiling").target == "train.profile_steps"
    cfg, report = port_torchtitan(TT / "llama3_8b_32gpu.toml", world_size=32)  # enable_profiling = false
    assert cfg.train.profile_steps == ""
    tb = report.find("metrics.enable_tensorboard")
    assert (tb.status, tb.target) == ("approximated", "train.workdir") and "TensorBoard event files" in tb.note
