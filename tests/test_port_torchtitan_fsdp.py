"""torchtitan and accelerate-FSDP importers on the real configs in shared/recipes."""

from __future__ import annotations

import pathlib

import pytest

from jaxpar.config import ConfigError
from jaxpar.port.fsdp import port_fsdp
from jaxpar.port.torchtitan import ffn_dim, port_torchtitan

RECIPES = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "recipes"
TT, FSDP = RECIPES / "torchtitan", RECIPES / "fsdp"
pytestmark = pytest.mark.skipif(not RECIPES.is_dir(), reason=f"recipes not found at {RECIPES} (clone shared/ beside "
                                "the repo)")
FSDP_YAML = "hf-accelerate__examples_config_yaml_templates_fsdp.yaml"
# world sizes the presets were written for (their comments), where given
WORLD = {"llama3_8b.toml": 64, "llama3_70b.toml": 64, "llama3_405b.toml": 128, "llama4_17bx128e.toml": 64,
         "deepseek_v3_16b.toml": 8}


def _files(folder: pathlib.Path, suffixes: tuple[str, ...]) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix in suffixes) if folder.is_dir() else []


@pytest.mark.parametrize("name", _files(TT, (".toml",)))
def test_every_torchtitan_recipe_needs_the_world_size_then_ports(name):
    with pytest.raises(ConfigError, match="data_parallel_shard_degree = -1 takes the remaining ranks") as e:
        port_torchtitan(TT / name)
    assert "\n" not in str(e.value)
    cfg, report = port_torchtitan(TT / name, world_size=WORLD.get(name, 64))
    assert cfg.mesh.data * cfg.mesh.tensor * cfg.mesh.pipeline == WORLD.get(name, 64)
    raw = __import__("tomllib").loads((TT / name).read_text())
    sources = [e.source for e in report.entries]
    for section, body in raw.items():
        keys = [f"{section}.{k}" for k in body] if section in ("parallelism", "training", "optimizer", "model") \
            else [section]
        for key in keys:
            assert any(s.split(" ")[0] == key or s.startswith(key) for s in sources), f"{key} not reported"


@pytest.mark.parametrize("name", _files(FSDP, (".yaml", ".yml")))
def test_every_fsdp_recipe_ports(name):
    cfg, report = port_fsdp(FSDP / name)
    assert cfg.parallel.zero_stage in (0, 2, 3) and not report.problems


@pytest.mark.parametrize("flavor, dim, mult, multiple, ffn", [("8B", 4096, 1.3, 1024, 14336),
                                                              ("70B", 8192, 1.3, 4096, 28672),
                                                              ("405B", 16384, 1.2, 4096, 53248)])
def test_llama3_ffn_sizes(flavor, dim, mult, multiple, ffn):
    assert ffn_dim(dim, mult, multiple) == ffn


def test_llama3_8b_on_64_gpus():
    cfg, report = port_torchtitan(TT / "llama3_8b.toml", world_size=64)
    assert (cfg.mesh.data, cfg.mesh.tensor, cfg.parallel.zero_stage) == (64, 1, 3)  # FSDP over all 64 ranks
    assert (cfg.train.global_batch, cfg.train.microbatches, cfg.train.seq_len, cfg.train.steps) == (64, 1, 8192, 1000)
    m = cfg.model
    assert (m.num_layers, m.embed_dim, m.num_heads, m.num_kv_heads, m.mlp_dim, m.vocab_size) == (32, 4096, 32, 8,
                                                                                                 14336, 128256)
    assert m.rope_theta == 500000.0 and m.remat == "selective" and m.compute_dtype == "bfloat16"
    o = cfg.optim
    assert (o.lr, o.eps, o.b2, o.weight_decay, o.schedule, o.min_lr_ratio) == (3e-4, 1e-8, 0.95, 0.1, "linear", 0.0)
    assert (o.warmup_steps, o.warmup_init_lr) == (199, pytest.approx(3e-4 / 200))  # (k + 1) / 200 over 199 steps
    assert report.find("optimizer.weight_decay (default)").status == "approximated"


def test_llama3_70b_and_405b_tensor_parallel():
    cfg, _ = port_torchtitan(TT / "llama3_70b.toml", world_size=64)
    assert (cfg.mesh.data, cfg.mesh.tensor, cfg.model.mlp_dim, cfg.model.num_layers) == (8, 8, 28672, 80)
    assert cfg.train.global_batch == 64 and cfg.model.remat == "full"
    cfg, report = port_torchtitan(TT / "llama3_405b.toml", world_size=128)
    assert (cfg.mesh.data, cfg.mesh.tensor, cfg.model.mlp_dim, cfg.model.num_heads) == (16, 8, 53248, 128)
    assert report.find("model.converters").status == "unsupported"  # float8
    assert report.find("quantize").status == "unsupported"


@pytest.mark.parametrize("name", ["llama4_17bx128e.toml", "deepseek_v3_16b.toml"])
def test_moe_models_are_reported_unsupported(name):
    cfg, report = port_torchtitan(TT / name, world_size=WORLD[name])
    assert report.find("model.name").status == "unsupported" and "mixture-of-experts" in report.find("model.name").note


def test_torchtitan_degrees_must_multiply_to_the_world_size(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[parallelism]\ndata_parallel_shard_degree = 4\ntensor_parallel_degree = 2\n"
                    "[training]\nlocal_batch_size = 2\nglobal_batch_size = 32\nsteps = 10\n")
    with pytest.raises(ConfigError, match="multiply to 8 but the world size is 16"):
        port_torchtitan(path, world_size=16)
    cfg, report = port_torchtitan(path)
    assert (cfg.mesh.data, cfg.mesh.tensor, cfg.train.global_batch, cfg.train.microbatches) == (4, 2, 32, 4)
    path.write_text("[parallelism]\ndata_parallel_shard_degree = 3\n[trainig]\nsteps = 10\n")
    cfg, report = port_torchtitan(path)
    assert report.find("trainig").status == "unknown" and "'training'" in report.find("trainig").note


def test_fsdp_full_shard_template():
    cfg, report = port_fsdp(FSDP / FSDP_YAML)
    assert (cfg.mesh.data, cfg.parallel.zero_stage, cfg.model.compute_dtype, cfg.model.remat) == (2, 3, "bfloat16",
                                                                                                  "none")
    for key in ("fsdp_config.fsdp_auto_wrap_policy", "fsdp_config.fsdp_state_dict_type",
                "fsdp_config.fsdp_backward_prefetch"):
        assert report.find(key).status == "approximated"
    assert report.find("fsdp_config.fsdp_sharding_strategy").status == "mapped"


@pytest.mark.parametrize("strategy, stage, status", [("FULL_SHARD", 3, "mapped"), ("SHARD_GRAD_OP", 2, "mapped"),
                                                     ("NO_SHARD", 0, "mapped"), ("HYBRID_SHARD", 3, "approximated"),
                                                     ("1", 3, "mapped"), ("2", 2, "mapped"), ("3", 0, "mapped"),
                                                     ("4", 3, "approximated"), ("5", 2, "approximated")])
def test_fsdp_strategies(tmp_path, strategy, stage, status):
    path = tmp_path / "fsdp.yaml"
    path.write_text(f"distributed_type: FSDP\nnum_machines: 2\nnum_processes: 16\nfsdp_config:\n"
                    f"  fsdp_sharding_strategy: {strategy}\n  fsdp_offload_params: true\n"
                    f"  fsdp_activation_checkpointing: true\n  fsdp_bogus: 1\n")
    cfg, report = port_fsdp(path)
    assert cfg.parallel.zero_stage == stage and cfg.mesh.data == 16 and cfg.model.remat == "full"
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
    cfg, report = port_torchtitan(TT / "llama3_8b.toml", world_size=64)  # enable_profiling, profile_freq = 100
    assert cfg.train.profile_steps == "100,100"
    assert report.find("profiling.enable_profiling").target == "train.profile_steps"
    tb = report.find("metrics.enable_tensorboard")
    assert (tb.status, tb.target) == ("approximated", "train.workdir") and "TensorBoard event files" in tb.note
