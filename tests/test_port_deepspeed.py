"""DeepSpeed importer and the ``jaxpar port`` CLI, on the real configs in shared/recipes/deepspeed."""

from __future__ import annotations

import argparse
import json
import pathlib
import re

import pytest

from jaxpar.config import ConfigError, load_config
from jaxpar.port.cli import add_port_arguments, run_port
from jaxpar.port.deepspeed import port_deepspeed
from jaxpar.port.report import schema_has

RECIPES = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "recipes"
DS = RECIPES / "deepspeed"
pytestmark = pytest.mark.skipif(not DS.is_dir(), reason=f"recipes not found at {DS} (clone shared/ beside the repo)")

_WORLD = r"world_size \(needed to split the batch"
# What each recipe does with no side inputs: None = ports; else a regex of its one-line error.
EXPECTED = {
    "DeepSpeed-docs__mics_zero3_rst_snippet_CONVERTED.json": None,
    "DeepSpeed-docs__zeropp_tutorial_snippet.json": None,
    "DeepSpeed-tests__test_pipe_config_dict_CONVERTED.json": _WORLD,
    "DeepSpeedExamples__imagenet_ds_fp16_z1_config.json": _WORLD,
    "DeepSpeedExamples__pipeline_parallelism_ds_config.json": _WORLD,
    "Megatron-DeepSpeed__offload_pp_ds_config_gpt_TEMPLATE.json": r"not strict JSON: placeholder\(s\) CONFIG_BATCH_SIZE, "
    "CONFIG_BF16_ENABLED, CONFIG_FP16_ENABLED, CONFIG_MBSIZE, LOG_INTERVAL",
    "bigscience-Megatron-DeepSpeed__tests_ds_config_bf16.json": _WORLD,
    "bigscience__tr11-176B-ml_ds_config_EXTRACTED.json": _WORLD,
    "hf-accelerate__tests_ds_config_zero3.json": r"bf16\.enabled .*fp16\.enabled .*optimizer\.params\.lr",
    "hf-accelerate__zero_stage2_config.json": r"scheduler\.params\.total_num_steps",
    "hf-accelerate__zero_stage3_offload_config.json": r"optimizer\.params\.weight_decay",
    "stanford_alpaca__configs_default_offload_opt_param.json": r"optimizer\.params\.betas",
}
HF_SIDE = {"lr": 3e-4, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-8, "warmup_num_steps": 100,
           "total_num_steps": 1000, "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 2,
           "gradient_accumulation_steps": 2, "fp16": False, "bf16": True, "world_size": 8}


def _files() -> list[str]:
    return sorted(p.name for p in DS.iterdir() if p.suffix == ".json") if DS.is_dir() else []


@pytest.mark.parametrize("name", _files())
def test_every_recipe_ports_or_fails_with_its_message(name):
    expected = EXPECTED.get(name, "any")
    try:
        cfg, report = port_deepspeed(DS / name)
    except ConfigError as e:
        assert "\n" not in str(e) and str(e).startswith("deepspeed: ")
        assert expected is not None, f"{name} should port but failed: {e}"
        if expected != "any":
            assert re.search(expected, str(e)), str(e)
        return
    assert expected in (None, "any"), f"{name} should fail with /{expected}/"
    assert report.entries and not report.problems


@pytest.mark.parametrize("name", [n for n in _files() if "TEMPLATE" not in n])
def test_every_recipe_ports_with_side_inputs_and_reports_every_key(name):
    world = 4 if "test_pipe" in name else 8
    raw = json.loads((DS / name).read_text())
    cfg, report = port_deepspeed(DS / name, world_size=world, side_inputs=HF_SIDE)
    sources = {e.source.split(" ")[0] for e in report.entries}
    for key, value in raw.items():
        leaves = [f"{key}.{k}" for k in value] if isinstance(value, dict) and key != "activation_checkpointing" else [key]
        for leaf in leaves:
            assert leaf in sources or any(s.startswith(leaf) for s in sources), f"{leaf} not reported"
    assert not report.problems


def test_tr11_batch_arithmetic_uses_data_parallel_size():
    cfg, report = port_deepspeed(DS / "bigscience__tr11-176B-ml_ds_config_EXTRACTED.json", world_size=384, tensor=4,
                                 pipeline=12)
    assert (cfg.mesh.data, cfg.mesh.tensor, cfg.mesh.pipeline) == (8, 4, 12)
    assert (cfg.train.global_batch, cfg.train.microbatches) == (2048, 128)  # 2048 = 2 * 128 * 8
    assert cfg.model.compute_dtype == "bfloat16" and cfg.optim.clip_norm == 1.0 and cfg.parallel.zero_stage == 0


def test_typo_key_is_reported_unknown_with_suggestion():
    cfg, report = port_deepspeed(DS / "DeepSpeed-tests__test_pipe_config_dict_CONVERTED.json", world_size=2)
    entry = report.find("grandient_accumulation_steps")
    assert entry.status == "unknown" and "did you mean 'gradient_accumulation_steps'" in entry.note
    assert cfg.train.microbatches == 1 and cfg.train.global_batch == 4  # DeepSpeed ignores the typo too
    assert cfg.model.remat == "full"  # pipeline.activation_checkpoint_interval = 1
    assert cfg.optim.decoupled_weight_decay and cfg.optim.b2 == 0.999  # "Adam" is AdamW by default


def test_auto_values_are_listed_as_unresolved():
    with pytest.raises(ConfigError) as e:
        port_deepspeed(DS / "hf-accelerate__tests_ds_config_zero3.json", side_inputs={"lr": 3e-4, "world_size": 8})
    message = str(e.value)
    for name in ("bf16.enabled", "fp16.enabled", "gradient_clipping", "optimizer.params.weight_decay",
                 "scheduler.params.warmup_num_steps", "train_micro_batch_size_per_gpu"):
        assert name in message
    assert "optimizer.params.lr" not in message and "\n" not in message  # lr came from the side input


def test_auto_values_filled_from_side_inputs_and_offload_reported():
    cfg, report = port_deepspeed(DS / "hf-accelerate__zero_stage3_offload_config.json", side_inputs=HF_SIDE)
    assert cfg.optim.lr == 3e-4 and cfg.optim.weight_decay == 0.1 and cfg.optim.clip_norm == 1.0
    assert (cfg.mesh.data, cfg.train.global_batch, cfg.train.microbatches) == (8, 16, 1)  # its gas is 1, not "auto"
    assert cfg.parallel.zero_stage == 3 and cfg.model.compute_dtype == "float16"
    assert cfg.optim.warmup_type == "log" and cfg.optim.schedule == "linear" and cfg.train.steps == 1000
    for key in ("zero_optimization.offload_optimizer", "zero_optimization.offload_param"):
        entry = report.find(key)
        assert entry.status == "unsupported" and "ZeRO-3" in entry.note
    assert report.find("fp16.loss_scale_window").status == "unsupported"
    assert report.find("zero_optimization.reduce_bucket_size").status == "approximated"


def test_allow_unresolved_uses_defaults_and_reports_each():
    cfg, report = port_deepspeed(DS / "stanford_alpaca__configs_default_offload_opt_param.json", world_size=4,
                                 allow_unresolved=True)
    assert cfg.optim.lr == 5e-5 and cfg.train.global_batch == 32  # HF defaults: lr 5e-5, 8 per device
    for key in ("optimizer.params.lr", "optimizer.params.betas", "bf16.enabled", "gradient_clipping"):
        entry = report.find(key)
        assert entry.status == "approximated" and "--allow-unresolved" in entry.note


def test_template_placeholder_error_names_the_fix():
    with pytest.raises(ConfigError, match="CONFIG_MBSIZE.*substitute real values"):
        port_deepspeed(DS / "Megatron-DeepSpeed__offload_pp_ds_config_gpt_TEMPLATE.json")


def test_zero_plus_plus_and_mics_are_never_dropped():
    cfg, report = port_deepspeed(DS / "DeepSpeed-docs__zeropp_tutorial_snippet.json")
    assert cfg.parallel.zero_stage == 3 and cfg.parallel.grad_reduce_dtype == "bfloat16"  # qgZ -> bf16 reduction
    assert report.find("zero_optimization.zero_quantized_gradients").status == "approximated"
    assert report.find("zero_optimization.zero_quantized_weights").status == "unsupported"
    assert report.find("zero_optimization.zero_hpz_partition_size").status == "unsupported"
    cfg, report = port_deepspeed(DS / "DeepSpeed-docs__mics_zero3_rst_snippet_CONVERTED.json")
    assert cfg.parallel.zero_stage == 3
    assert report.find("zero_optimization.mics_shard_size").status == "approximated"
    assert report.find("zero_optimization.mics_hierarchical_params_gather") is not None


def test_fp16_and_unknown_keys_in_imagenet_config():
    cfg, report = port_deepspeed(DS / "DeepSpeedExamples__imagenet_ds_fp16_z1_config.json", world_size=8)
    assert cfg.model.compute_dtype == "float16" and cfg.parallel.zero_stage == 1 and cfg.optim.clip_norm == 0.0
    assert (cfg.train.global_batch, cfg.train.microbatches, cfg.optim.b1) == (256, 1, 0.8)
    assert report.find("cuda_visible_devices").status == "unknown"


@pytest.mark.parametrize("cfg_dict, world, match", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 8,
     "train_batch_size=32, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4 with DP=8"),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 2, "train_batch_size=30"),
    ({"train_batch_size": 32}, 6, "world size 6 is not divisible by tensor\\*pipeline"),
    ({"train_batch_size": 32, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, 2, "both true"),
])
def test_inconsistent_batch_settings_raise(cfg_dict, world, match):
    with pytest.raises(ConfigError, match=match):
        port_deepspeed(cfg_dict, world_size=world, tensor=4 if world == 6 else 1)


def test_all_three_batch_settings_determine_the_data_size():
    cfg, _ = port_deepspeed({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2,
                             "gradient_accumulation_steps": 4}, tensor=2)
    assert (cfg.mesh.data, cfg.mesh.tensor, cfg.train.microbatches) == (8, 2, 4)


def test_adam_without_w_mode_is_l2_and_cosine_scheduler_maps():
    cfg, report = port_deepspeed({
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 2e-4, "adam_w_mode": False}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 500, "warmup_num_steps": 50}}},
        world_size=2)
    assert not cfg.optim.decoupled_weight_decay and cfg.optim.lr == 2e-4 and cfg.optim.schedule == "cosine"
    assert cfg.optim.min_lr_ratio == 0.0001 and cfg.optim.warmup_type == "log" and cfg.train.steps == 500
    entry = report.find("scheduler.type")
    if schema_has("optim.schedule_offset") and schema_has("optim.decay_start_step"):
        assert entry.status == "mapped"
    else:
        assert entry.status == "approximated" and "not in this jaxpar's config schema" in entry.note


# --------------------------------------------------------------------------- CLI


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_port_arguments(parser.add_subparsers(dest="command"))
    return run_port(parser.parse_args(["port", *argv]))


def test_cli_writes_a_config_that_loads_and_validates(tmp_path, capsys):
    out = tmp_path / "tr11.py"
    assert _run(["deepspeed", str(DS / "bigscience__tr11-176B-ml_ds_config_EXTRACTED.json"), "--world-size", "384",
                 "--tensor", "4", "--pipeline", "12", "--set", "model.num_layers=72", "-o", str(out)]) == 0
    cfg = load_config(str(out))
    assert (cfg.mesh.data, cfg.train.microbatches, cfg.model.num_layers) == (8, 128, 72)
    text = out.read_text()
    assert "bigscience__tr11-176B-ml_ds_config_EXTRACTED.json" in text and "jaxpar train --config" in text
    assert "mapped" in capsys.readouterr().out
    assert not list(tmp_path.glob(".*.tmp"))  # the atomic write left no temporary file


def test_cli_json_and_side_inputs(capsys):
    name = "hf-accelerate__zero_stage2_config.json"
    sets = [x for k, v in HF_SIDE.items() for x in ("--set", f"{k}={json.dumps(v)}")]
    assert _run(["deepspeed", str(DS / name), "--json", *sets]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["config"]["optim"]["lr"] == 3e-4 and doc["config"]["parallel"]["zero_stage"] == 2
    assert doc["report"]["counts"]["mapped"] > 0 and doc["report"]["kind"] == "deepspeed"


@pytest.mark.parametrize("argv, match", [
    (["megatron", "x.args", "--tensor", "2"], "deepspeed only"),
    (["torchtitan", "x.toml", "--set", "modl.vocab_size=3"], "did you mean 'model.vocab_size'"),
    (["fsdp", "x.yaml", "--var", "A=1"], "Megatron"),
    (["deepspeed", "missing.json"], "not found"),
    (["deepspeed", "{DS}/DeepSpeed-tests__test_pipe_config_dict_CONVERTED.json", "--set", "lr"], "NAME=VALUE"),
])
def test_cli_bad_input_is_one_line_config_error(argv, match):
    argv = [a.replace("{DS}", str(DS)) for a in argv]
    with pytest.raises(ConfigError, match=match) as e:
        _run(argv)
    assert "\n" not in str(e.value)


def test_report_renders_as_text_rich_and_json():
    import io

    from rich.console import Console

    cfg, report = port_deepspeed(DS / "DeepSpeed-tests__test_pipe_config_dict_CONVERTED.json", world_size=2)
    text = report.render_text()
    assert "unknown      grandient_accumulation_steps = 1" in text and "mapped       train_batch_size = 4" in text
    buffer = io.StringIO()
    report.render_rich(Console(file=buffer, width=200))
    assert "grandient_accumulation_steps" in buffer.getvalue()
    doc = json.loads(report.to_json())
    assert doc["counts"]["unknown"] == 1 and {e["status"] for e in doc["entries"]} <= {"mapped", "approximated",
                                                                                      "unsupported", "unknown"}


def test_tensorboard_and_flops_profiler_map_to_events_and_a_trace():
    base = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1}
    cfg, report = port_deepspeed({**base, "tensorboard": {"enabled": True, "output_path": "tb/", "job_name": "x"},
                                  "flops_profiler": {"enabled": True, "profile_step": 3, "top_modules": 1}},
                                 world_size=8)
    assert cfg.train.profile_steps == "4,4"  # DeepSpeed's profile_step counts steps done from 0
    fp, tb = report.find("flops_profiler"), report.find("tensorboard")
    assert (fp.status, fp.target) == ("approximated", "train.profile_steps") and "jax.profiler" in fp.note
    assert (tb.status, tb.target) == ("approximated", "train.workdir") and "TensorBoard event files" in tb.note
    cfg, report = port_deepspeed({**base, "flops_profiler": {"enabled": False}}, world_size=8)
    assert cfg.train.profile_steps == "" and report.find("flops_profiler").note.endswith("disabled")
