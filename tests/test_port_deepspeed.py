"""DeepSpeed importer and the ``jaxpar port`` CLI, on the recipes in tests/fixtures/recipes/deepspeed.

The fixtures are hand-written in the shapes real projects ship: HF accelerate/Trainer configs full of
``"auto"``, a launch-script template that is not strict JSON, a key with a typo that DeepSpeed ignores,
batches that need the world size, ZeRO-1/2/3 with offload, ZeRO++ and MiCS, pipeline sections.
"""

from __future__ import annotations

import argparse
import json
import re

import pytest

from jaxpar.cli.port import add_port_arguments, run_port
from jaxpar.config import ConfigError, load_config
from jaxpar.port.deepspeed import port_deepspeed
from jaxpar.port.report import schema_has
from tests.port_recipes import EXTRA_WORLD, FIXTURES, recipe_params

DS = FIXTURES / "deepspeed"
_WORLD = r"world_size \(needed to split the batch"
# What each fixture does with no side inputs: None = ports; else a regex of its one-line error.
EXPECTED = {
    "adam_l2_cosine_autocast.json": _WORLD,
    "finetune_zero3_offload_bf16_auto.json": r"bf16\.enabled .*gradient_accumulation_steps .*optimizer\.params\.betas",
    "hf_zero2_fp16.json": r"scheduler\.params\.total_num_steps",
    "hf_zero3_all_auto.json": r"bf16\.enabled .*fp16\.enabled .*optimizer\.params\.lr",
    "hf_zero3_offload_fp16.json": r"optimizer\.params\.weight_decay",
    "megatron_ds_bf16_zero1.json": _WORLD,
    "mics_zero3.json": None,
    "offload_pp_TEMPLATE.json": r"not strict JSON: placeholder\(s\) BF16_ON, FP16_ON, GBSIZE, MBSIZE, PRINT_EVERY, "
    "ZERO_STAGE",
    "pipe_module_typo.json": _WORLD,
    "pipeline_parallel_micro.json": _WORLD,
    "smoke_bf16_zero0.json": _WORLD,
    "vision_fp16_zero1.json": _WORLD,
    "zeropp_hpz_qwz_qgz.json": None,
}
HF_SIDE = {
    "lr": 3e-4,
    "weight_decay": 0.1,
    "betas": [0.9, 0.95],
    "eps": 1e-8,
    "warmup_num_steps": 100,
    "total_num_steps": 1000,
    "gradient_clipping": 1.0,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "fp16": False,
    "bf16": True,
    "world_size": 8,
}


@pytest.mark.parametrize("path, expected", recipe_params("deepspeed", (".json",), EXPECTED))
def test_every_recipe_ports_or_fails_with_its_message(path, expected):
    try:
        cfg, report = port_deepspeed(path)
    except ConfigError as e:
        assert "\n" not in str(e) and str(e).startswith("deepspeed: ")
        assert expected is not None, f"{path.name} should port but failed: {e}"
        if expected != "any":
            assert re.search(expected, str(e)), str(e)
        return
    assert expected in (None, "any"), f"{path.name} should fail with /{expected}/"
    assert report.entries and not report.problems


@pytest.mark.parametrize(
    "path, expected", recipe_params("deepspeed", (".json",), EXPECTED, keep=lambda name: "TEMPLATE" not in name)
)
def test_every_recipe_ports_with_side_inputs_and_reports_every_key(path, expected):
    raw = json.loads(path.read_text())
    cfg, report = port_deepspeed(path, world_size=EXTRA_WORLD.get(path.name, 8), side_inputs=HF_SIDE)
    sources = {e.source.split(" ")[0] for e in report.entries}
    for key, value in raw.items():
        leaves = (
            [f"{key}.{k}" for k in value] if isinstance(value, dict) and key != "activation_checkpointing" else [key]
        )
        for leaf in leaves:
            assert leaf in sources or any(s.startswith(leaf) for s in sources), f"{leaf} not reported"
    assert not report.problems


def test_every_fixture_has_an_expectation():
    assert sorted(p.name for p in DS.iterdir()) == sorted(EXPECTED)


def test_megatron_deepspeed_batch_arithmetic_uses_data_parallel_size():
    cfg, report = port_deepspeed(DS / "megatron_ds_bf16_zero1.json", world_size=256, tensor=4, pipeline=8)
    assert (cfg.mesh.data, cfg.mesh.tensor, cfg.mesh.pipeline) == (8, 4, 8)  # DP = 256 / (4 * 8)
    assert (cfg.train.global_batch, cfg.parallel.microbatches) == (1024, 128)  # 1024 = 1 * 128 * 8
    assert cfg.model.compute_dtype == "bfloat16" and cfg.optim.clip_norm == 1.0 and cfg.parallel.zero_stage == 1
    assert cfg.parallel.grad_reduce_dtype == "float32" and cfg.parallel.recompute == "full"  # fp32 comm; checkpointing
    assert report.find("activation_checkpointing.partition_activations").status == "approximated"  # false: no-op
    assert report.find("zero_optimization.allgather_bucket_size").status == "approximated"
    with pytest.raises(ConfigError, match="world size 250 is not divisible by tensor\\*pipeline = 4\\*8 = 32"):
        port_deepspeed(DS / "megatron_ds_bf16_zero1.json", world_size=250, tensor=4, pipeline=8)


def test_typo_key_is_reported_unknown_with_suggestion():
    cfg, report = port_deepspeed(DS / "pipe_module_typo.json", world_size=2)
    entry = report.find("gradient_accumulation_step")
    assert entry.status == "unknown" and "did you mean 'gradient_accumulation_steps'" in entry.note
    assert cfg.parallel.microbatches == 1 and cfg.train.global_batch == 8  # DeepSpeed ignores the typo (2) too
    assert cfg.parallel.recompute == "full"  # pipeline.activation_checkpoint_interval = 1
    assert cfg.optim.decoupled_weight_decay and cfg.optim.b2 == 0.999  # "Adam" is AdamW by default


def test_auto_values_are_listed_as_unresolved():
    with pytest.raises(ConfigError) as e:
        port_deepspeed(DS / "hf_zero3_all_auto.json", side_inputs={"lr": 3e-4, "world_size": 8})
    message = str(e.value)
    for name in (
        "bf16.enabled",
        "fp16.enabled",
        "gradient_clipping",
        "optimizer.params.weight_decay",
        "scheduler.params.warmup_num_steps",
        "train_micro_batch_size_per_gpu",
    ):
        assert name in message
    assert "optimizer.params.lr" not in message and "\n" not in message  # lr came from the side input


def test_auto_values_filled_from_side_inputs_and_offload_reported():
    cfg, report = port_deepspeed(DS / "hf_zero3_offload_fp16.json", side_inputs=HF_SIDE)
    assert cfg.optim.lr == 3e-4 and cfg.optim.weight_decay == 0.1 and cfg.optim.clip_norm == 1.0
    assert (cfg.mesh.data, cfg.train.global_batch, cfg.parallel.microbatches) == (8, 16, 1)  # its gas is 1, not "auto"
    # fp16 with DeepSpeed's dynamic loss scaling, field by field
    assert cfg.parallel.zero_stage == 3 and cfg.model.compute_dtype == "float16"
    fp16 = report.find("fp16.enabled")
    assert (fp16.status, fp16.target) == ("mapped", "model.compute_dtype") and "loss scaling" in fp16.note
    ls = cfg.train.loss_scale
    assert (ls.rule, ls.static, ls.initial_scale_power, ls.window, ls.hysteresis, ls.min_scale) == (
        "deepspeed",
        0.0,
        12,
        500,
        2,
        1.0,
    )
    assert cfg.optim.warmup_type == "log" and cfg.optim.schedule == "linear" and cfg.train.steps == 1000
    for key in ("zero_optimization.offload_optimizer", "zero_optimization.offload_param"):
        entry = report.find(key)
        assert entry.status == "unsupported" and "ZeRO-3" in entry.note
    assert report.find("fp16.loss_scale_window").target == "train.loss_scale.window"
    assert report.find("zero_optimization.reduce_bucket_size").status == "approximated"
    cfg, report = port_deepspeed(DS / "hf_zero3_all_auto.json", side_inputs=HF_SIDE)
    assert report.find("zero_optimization.offload_param").status == "approximated"  # device "none"
    assert report.find("zero_optimization.offload_optimizer").status == "unsupported"
    assert cfg.model.compute_dtype == "bfloat16" and cfg.optim.schedule == "constant"  # bf16 side input; WarmupLR


def test_allow_unresolved_uses_defaults_and_reports_each():
    cfg, report = port_deepspeed(DS / "finetune_zero3_offload_bf16_auto.json", world_size=4, allow_unresolved=True)
    assert cfg.optim.lr == 5e-5 and cfg.train.global_batch == 32  # HF defaults: lr 5e-5, 8 per device
    for key in ("optimizer.params.lr", "optimizer.params.betas", "bf16.enabled", "gradient_clipping"):
        entry = report.find(key)
        assert entry.status == "approximated" and "--allow-unresolved" in entry.note


def test_template_placeholder_error_names_the_fix():
    with pytest.raises(ConfigError, match="MBSIZE.*substitute real values"):
        port_deepspeed(DS / "offload_pp_TEMPLATE.json")


def test_zero_plus_plus_and_mics_are_never_dropped():
    cfg, report = port_deepspeed(DS / "zeropp_hpz_qwz_qgz.json")
    assert cfg.parallel.zero_stage == 3 and cfg.parallel.grad_reduce_dtype == "bfloat16"  # qgZ -> bf16 reduction
    assert report.find("zero_optimization.zero_quantized_gradients").status == "approximated"
    assert report.find("zero_optimization.zero_quantized_weights").status == "unsupported"
    assert report.find("zero_optimization.zero_hpz_partition_size").status == "unsupported"
    cfg, report = port_deepspeed(DS / "mics_zero3.json")
    assert cfg.parallel.zero_stage == 3
    assert report.find("zero_optimization.mics_shard_size").status == "approximated"
    assert report.find("zero_optimization.mics_hierarchical_params_gather") is not None


def test_fp16_and_unknown_keys_in_vision_config():
    cfg, report = port_deepspeed(DS / "vision_fp16_zero1.json", world_size=8)
    assert cfg.model.compute_dtype == "float16" and cfg.parallel.zero_stage == 1 and cfg.optim.clip_norm == 0.0
    assert report.find("fp16.enabled").status == "mapped" and "float16" in report.find("fp16.enabled").note
    assert (cfg.train.global_batch, cfg.parallel.microbatches, cfg.optim.b1) == (128, 1, 0.85)
    assert report.find("local_rank").status == "unknown"
    assert report.find("fp16.auto_cast").status == "approximated"


def test_pipeline_section_and_stages_from_the_command_line():
    cfg, report = port_deepspeed(DS / "pipeline_parallel_micro.json", world_size=8, pipeline=2)
    assert (cfg.mesh.data, cfg.mesh.pipeline, cfg.train.global_batch, cfg.parallel.microbatches) == (4, 2, 64, 4)
    assert report.find("pipeline.stages").status == "approximated" and cfg.parallel.recompute == "none"  # interval 0
    assert report.find("(scheduler)").status == "approximated" and cfg.optim.schedule == "constant"


def test_warmup_cosine_adam_l2_and_torch_autocast_from_a_file():
    cfg, report = port_deepspeed(DS / "adam_l2_cosine_autocast.json", world_size=8)
    assert (cfg.mesh.data, cfg.train.global_batch, cfg.parallel.microbatches) == (8, 64, 2)  # 4 * 2 * 8
    assert not cfg.optim.decoupled_weight_decay and cfg.optim.schedule == "cosine" and cfg.train.steps == 2000
    assert cfg.optim.min_lr_ratio == 0.01 and cfg.optim.warmup_init_lr == pytest.approx(1e-5)  # 0.1 * lr
    assert cfg.model.compute_dtype == "bfloat16" and cfg.parallel.zero_stage == 2 and cfg.optim.clip_norm == 0.5
    assert report.find("torch_autocast.dtype").status == "mapped"


@pytest.mark.parametrize(
    "cfg_dict, world, match",
    [
        (
            {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4},
            8,
            "train_batch_size=32, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4 with DP=8",
        ),
        ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 2, "train_batch_size=30"),
        ({"train_batch_size": 32}, 6, "world size 6 is not divisible by tensor\\*pipeline"),
        ({"train_batch_size": 32, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, 2, "both true"),
    ],
)
def test_inconsistent_batch_settings_raise(cfg_dict, world, match):
    with pytest.raises(ConfigError, match=match):
        port_deepspeed(cfg_dict, world_size=world, tensor=4 if world == 6 else 1)


def test_all_three_batch_settings_determine_the_data_size():
    cfg, _ = port_deepspeed(
        {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, tensor=2
    )
    assert (cfg.mesh.data, cfg.mesh.tensor, cfg.parallel.microbatches) == (8, 2, 4)


def test_adam_without_w_mode_is_l2_and_cosine_scheduler_maps():
    cfg, report = port_deepspeed(
        {
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "Adam", "params": {"lr": 2e-4, "adam_w_mode": False}},
            "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 500, "warmup_num_steps": 50}},
        },
        world_size=2,
    )
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
    out = tmp_path / "mds.py"
    argv = [
        "deepspeed",
        str(DS / "megatron_ds_bf16_zero1.json"),
        "--world-size",
        "256",
        "--tensor",
        "4",
        "--pipeline",
        "8",
        "--set",
        "model.num_layers=48",
        "-o",
        str(out),
    ]
    with pytest.raises(ConfigError, match=r"\(model\): a DeepSpeed config does not describe the model") as e:
        _run(argv)  # only num_layers given: the rest of the shape would be jaxpar's test model
    assert "--set each of model.embed_dim, model.num_heads" in str(e.value) and "\n" not in str(e.value)
    assert not out.exists()
    argv.append("--approximate")  # ports with jaxpar's default shape (48 layers), the report says so first
    assert _run(argv) == 0
    cfg = load_config(str(out))
    assert (cfg.mesh.data, cfg.parallel.microbatches, cfg.model.num_layers) == (8, 128, 48)
    text = out.read_text()
    assert "megatron_ds_bf16_zero1.json" in text and "jaxpar train --config" in text
    printed = capsys.readouterr().out
    assert "mapped" in printed and printed.splitlines()[1].startswith("  MODEL CHANGE (model) = null")
    assert "MODEL CHANGED (1: (model))" in printed and "MODEL CHANGED" in text
    assert not list(tmp_path.glob(".*.tmp"))  # the atomic write left no temporary file


def test_cli_output_is_not_overwritten_without_the_flag(tmp_path, capsys):
    out = tmp_path / "mds.py"
    out.write_text("# the user's own file\n")
    argv = [
        "port",
        "deepspeed",
        str(DS / "megatron_ds_bf16_zero1.json"),
        "--world-size",
        "256",
        "--tensor",
        "4",
        "--pipeline",
        "8",
        "--set",
        "model.num_layers=48",
        "--approximate",
        "-o",
        str(out),
    ]
    from jaxpar.cli import main

    capsys.readouterr()
    assert main(argv) == 2  # the CLI's exit code for bad input
    captured = capsys.readouterr()
    assert (
        captured.err == f"error: port -o {out}: the file exists; pass --overwrite to replace it or choose "
        "another path\n"
    )
    assert captured.out == ""  # refused before porting: no report printed
    assert out.read_text() == "# the user's own file\n" and not list(tmp_path.glob(".*.tmp"))
    assert main([*argv, "--overwrite"]) == 2  # --overwrite replaces only a file port wrote (jaxpar.write_guard)
    assert (
        capsys.readouterr().err == f"error: port -o {out}: jaxpar did not write this file; --overwrite replaces "
        "only a file jaxpar wrote: move it or pick another path\n"
    )
    assert out.read_text() == "# the user's own file\n"
    out.unlink()
    assert main(argv) == 0 and main([*argv, "--overwrite"]) == 0  # its own earlier output: replaced
    assert load_config(str(out)).model.num_layers == 48 and "--overwrite" in out.read_text()
    assert not list(tmp_path.glob(".*.tmp"))


def test_cli_json_and_side_inputs(capsys):
    name = "hf_zero2_fp16.json"
    sets = [x for k, v in HF_SIDE.items() for x in ("--set", f"{k}={json.dumps(v)}")]
    assert _run(["deepspeed", str(DS / name), "--json", *sets, "--approximate"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["config"]["optim"]["lr"] == 3e-4 and doc["config"]["parallel"]["zero_stage"] == 2
    assert doc["report"]["counts"]["mapped"] > 0 and doc["report"]["kind"] == "deepspeed"
    assert doc["report"]["model_changes"] == ["(model)"] and doc["report"]["entries"][0]["model_change"]
    assert doc["report"]["closing"].startswith("MODEL CHANGED (1: (model))")


@pytest.mark.parametrize(
    "argv, match",
    [
        (["megatron", "x.args", "--tensor", "2"], "deepspeed only"),
        (["torchtitan", "x.toml", "--set", "modl.vocab_size=3"], "did you mean 'model.vocab_size'"),
        (["fsdp", "x.yaml", "--var", "A=1"], "Megatron"),
        (["deepspeed", "missing.json"], "not found"),
        (["deepspeed", "{DS}/pipe_module_typo.json", "--set", "lr"], "NAME=VALUE"),
    ],
)
def test_cli_bad_input_is_one_line_config_error(argv, match):
    argv = [a.replace("{DS}", str(DS)) for a in argv]
    with pytest.raises(ConfigError, match=match) as e:
        _run(argv)
    assert "\n" not in str(e.value)


def test_report_renders_as_text_rich_and_json():
    import io

    from rich.console import Console

    cfg, report = port_deepspeed(DS / "pipe_module_typo.json", world_size=2)
    text = report.render_text()
    assert "unknown      gradient_accumulation_step = 2" in text and "mapped       train_batch_size = 8" in text
    buffer = io.StringIO()
    report.render_rich(Console(file=buffer, width=200))
    assert "gradient_accumulation_step" in buffer.getvalue()
    doc = json.loads(report.to_json())
    assert doc["counts"]["unknown"] == 1 and {e["status"] for e in doc["entries"]} <= {
        "mapped",
        "approximated",
        "unsupported",
        "unknown",
    }


def test_tensorboard_and_flops_profiler_map_to_events_and_a_trace():
    base = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1}
    cfg, report = port_deepspeed(
        {
            **base,
            "tensorboard": {"enabled": True, "output_path": "tb/", "job_name": "x"},
            "flops_profiler": {"enabled": True, "profile_step": 3, "top_modules": 1},
        },
        world_size=8,
    )
    assert cfg.train.profile_steps == "4,4"  # DeepSpeed's profile_step counts steps done from 0
    fp, tb = report.find("flops_profiler"), report.find("tensorboard")
    assert (fp.status, fp.target) == ("approximated", "train.profile_steps") and "jax.profiler" in fp.note
    assert (tb.status, tb.target) == ("approximated", "train.workdir") and "TensorBoard event files" in tb.note
    cfg, report = port_deepspeed({**base, "flops_profiler": {"enabled": False}}, world_size=8)
    assert cfg.train.profile_steps == "" and report.find("flops_profiler").note.endswith("disabled")
