"""accelerate YAML with ``distributed_type: DEEPSPEED`` and an inline ``deepspeed_config``: each key as
accelerate's DeepSpeedPlugin turns it into the DeepSpeed config (accelerate/utils/dataclasses.py), and
``parallelism_config`` as accelerate's ParallelismConfig builds the mesh."""

from __future__ import annotations

import pytest

from jaxpar.config import ConfigError
from jaxpar.port.fsdp import port_fsdp
from tests.port_recipes import ROOT

CORPUS = ROOT / "tests" / "fixtures" / "recipes" / "corpus" / "accelerate"


def _port(tmp_path, ds: str, top: str = "num_processes: 8\nmixed_precision: bf16\n"):
    path = tmp_path / "ds.yaml"
    path.write_text("distributed_type: DEEPSPEED\n" + top + ("deepspeed_config:\n" + ds if ds else ""))
    return port_fsdp(path)


def _error(tmp_path, ds: str, top: str = "num_processes: 8\n") -> str:
    with pytest.raises(ConfigError) as e:
        _port(tmp_path, ds, top)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_is_the_zero_stage(tmp_path, stage):
    cfg, report = _port(tmp_path, f"  zero_stage: {stage}\n")
    assert (cfg.mesh.data, cfg.parallel.zero_stage) == (8, stage)
    assert report.find("deepspeed_config.zero_stage").status == "mapped"


def test_zero_stage_absent_is_accelerates_default_2(tmp_path):
    cfg, report = _port(tmp_path, "")
    assert cfg.parallel.zero_stage == 2
    assert report.find("deepspeed_config.zero_stage (default)").value == 2


def test_zero_stage_out_of_range_is_one_line(tmp_path):
    assert "deepspeed_config.zero_stage=4: use 0, 1, 2 or 3" in _error(tmp_path, "  zero_stage: 4\n")


def test_gradient_accumulation_steps_are_microbatches(tmp_path):
    cfg, report = _port(tmp_path, "  zero_stage: 1\n  gradient_accumulation_steps: 4\n")
    assert cfg.parallel.microbatches == 4
    assert cfg.train.global_batch == 32  # jaxpar's 16 does not divide 8 ranks x 4 steps: one sequence each
    assert report.find("deepspeed_config.gradient_accumulation_steps").target == "parallel.microbatches"
    assert "gradient_accumulation_steps=0: use an integer >= 1" in _error(
        tmp_path, "  gradient_accumulation_steps: 0\n"
    )


def test_gradient_clipping_is_the_clip_norm_and_defaults_to_1(tmp_path):
    cfg, _ = _port(tmp_path, "  gradient_clipping: 0.3\n")
    assert cfg.optim.clip_norm == 0.3
    cfg, report = _port(tmp_path, "  zero_stage: 2\n")
    assert cfg.optim.clip_norm == 1.0 and report.find("deepspeed_config.gradient_clipping (default)")
    assert "gradient_clipping='x': use a number >= 0" in _error(tmp_path, "  gradient_clipping: x\n")


@pytest.mark.parametrize("key", ["offload_optimizer_device", "offload_param_device"])
def test_offload_none_maps_and_cpu_is_unsupported_by_name(tmp_path, key):
    _, report = _port(tmp_path, f"  zero_stage: 3\n  {key}: none\n")
    assert report.find(f"deepspeed_config.{key}").status == "mapped"
    cfg, report = _port(tmp_path, f"  zero_stage: 3\n  {key}: cpu\n")
    entry = report.find(f"deepspeed_config.{key}")
    assert entry.status == "unsupported" and "keeps all training state on the accelerators" in entry.note
    assert cfg.parallel.zero_stage == 3  # a memory change only: the port goes on
    assert f"{key}='disk': use one of none, cpu, nvme" in _error(tmp_path, f"  {key}: disk\n")


@pytest.mark.parametrize(
    "key",
    [
        "zero3_init_flag",
        "zero3_save_16bit_model",
        "deepspeed_multinode_launcher",
        "deepspeed_hostfile",
        "deepspeed_moe_layer_cls_names",
        "offload_param_nvme_path",
    ],
)
def test_no_effect_keys_say_so(tmp_path, key):
    cfg, report = _port(tmp_path, f"  {key}: true\n")
    entry = report.find(f"deepspeed_config.{key}")
    assert entry.status == "approximated" and entry.note.startswith("no-op in jaxpar")


def test_a_typo_is_unknown_with_a_suggestion(tmp_path):
    _, report = _port(tmp_path, "  zero_stag: 3\n")
    entry = report.find("deepspeed_config.zero_stag")
    assert entry.status == "unknown" and "deepspeed_config.zero_stage" in entry.note


def test_config_file_is_refused_naming_the_file(tmp_path):
    err = _error(tmp_path, "  deepspeed_config_file: ds.json\n")
    assert "port its DeepSpeed JSON with `jaxpar port deepspeed ds.json`" in err


def test_mixed_precision_fp16_is_deepspeeds_loss_scaled_fp16(tmp_path):
    cfg, report = _port(tmp_path, "  zero_stage: 2\n", "num_processes: 8\nmixed_precision: fp16\n")
    assert (cfg.model.compute_dtype, cfg.train.loss_scale.rule) == ("float16", "deepspeed")
    assert report.find("mixed_precision").status == "mapped"
    cfg, _ = _port(tmp_path, "  zero_stage: 2\n", "num_processes: 8\n")
    assert cfg.model.compute_dtype == "float32"  # accelerate's default "no"


def test_the_other_sections_key_is_no_effect(tmp_path):
    """accelerate reads fsdp_config only with FSDP: under DEEPSPEED its keys change nothing."""
    cfg, report = _port(
        tmp_path, "  zero_stage: 1\n", "num_processes: 8\nfsdp_config:\n  fsdp_activation_checkpointing: true\n"
    )
    assert cfg.parallel.recompute == "none" and cfg.parallel.zero_stage == 1
    assert report.find("fsdp_config.fsdp_activation_checkpointing").note.startswith("no-op in jaxpar")


def test_trl_zero3_recipe_ports_with_approximate():
    cfg, report = port_fsdp(CORPUS / "trl_deepspeed_zero3.yaml")
    assert (cfg.mesh.data, cfg.parallel.zero_stage, cfg.model.compute_dtype) == (8, 3, "bfloat16")
    assert [e.source for e in report.model_changes] == ["(model)"]
    assert not report.by_status("unknown")


def _fsdp2(tmp_path, parallel: str, world: int = 8):
    path = tmp_path / "p.yaml"
    path.write_text(
        f"distributed_type: FSDP\nnum_processes: {world}\nfsdp_config:\n  fsdp_version: 2\n"
        "  fsdp_reshard_after_forward: true\nparallelism_config:\n" + parallel
    )
    return port_fsdp(path)


def test_context_parallel_shards_over_the_context_ranks():
    """CP 8 with dp_shard 1: accelerate's FSDP shards over dp_shard x cp (8 ranks), as jaxpar's ZeRO-3
    over data x context; torch CP's default allgather is jaxpar's all_gather exchange."""
    cfg, report = port_fsdp(CORPUS / "torch_native_cp.yaml")
    assert (cfg.mesh.data, cfg.mesh.context, cfg.parallel.zero_stage) == (1, 8, 3)
    assert (cfg.parallel.context_exchange, cfg.model.attention, cfg.parallel.recompute) == (
        "all_gather",
        "blockwise",
        "full",
    )
    assert report.find("parallelism_config.parallelism_config_cp_comm_strategy (default)").value == "allgather"


def test_cp_comm_strategy_alltoall_is_the_ring(tmp_path):
    cfg, _ = _fsdp2(
        tmp_path,
        "  parallelism_config_cp_size: 4\n  parallelism_config_dp_shard_size: 2\n"
        "  parallelism_config_cp_comm_strategy: alltoall\n",
    )
    assert (cfg.mesh.data, cfg.mesh.context, cfg.parallel.context_exchange) == (2, 4, "ring")


def test_all_sizes_one_replicate_over_every_process(tmp_path):
    cfg, report = _fsdp2(tmp_path, "  parallelism_config_tp_size: 1\n")
    assert (cfg.mesh.data, cfg.mesh.tensor, cfg.parallel.zero_stage) == (8, 1, 0)


def test_sequence_parallel_is_a_context_axis_approximated(tmp_path):
    cfg, report = _fsdp2(tmp_path, "  parallelism_config_sp_size: 4\n  parallelism_config_dp_shard_size: 2\n")
    assert (cfg.mesh.data, cfg.mesh.context, cfg.parallel.context_exchange) == (2, 4, "ring")
    assert report.find("parallelism_config.parallelism_config_sp_size").status == "approximated"


def test_parallelism_config_where_accelerate_stops_is_refused(tmp_path):
    """ParallelismConfig takes FSDP version 2, DEEPSPEED or multi-device DDP; FSDP1 and CPU DDP stop."""
    path = tmp_path / "p.yaml"
    for head in ("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 1\n", "distributed_type: MULTI_CPU\n"):
        path.write_text(head + "num_processes: 8\nparallelism_config:\n  parallelism_config_tp_size: 2\n")
        with pytest.raises(ConfigError, match="ParallelismConfig stops on it .it takes FSDP version 2, DEEPSPEED"):
            port_fsdp(path)


def test_deepspeed_ulysses_is_data_times_sequence():
    """trl's ALST recipe: DeepSpeed ZeRO-3 on 4 processes with Ulysses SP 2: data 2 x context 2 (DeepSpeed forms
    the groups, accelerate skips its size check), the SP row approximated (the ring instead of all-to-all)."""
    cfg, report = port_fsdp(CORPUS / "trl_alst_ulysses_4gpu.yaml")
    assert (cfg.mesh.data, cfg.mesh.context, cfg.parallel.zero_stage, cfg.parallel.context_exchange) == (
        2,
        2,
        3,
        "ring",
    )
    assert report.find("parallelism_config.parallelism_config_sp_size").status == "approximated"
    assert not report.by_status("unknown")


def test_fp8_config_keys_are_fp8_settings_not_unknown():
    """accelerate's own fp8 template: each fp8_config key is a no-op row of the fp8 -> bf16 port."""
    cfg, report = port_fsdp(CORPUS / "tmpl_fp8.yaml")
    assert cfg.model.compute_dtype == "bfloat16" and not report.by_status("unknown")
    assert report.find("fp8_config.amax_history_len").note.endswith("this port computes in bf16 (mixed_precision row)")


@pytest.mark.parametrize("kind", ["MULTI_XPU", "MULTI_CPU", "XLA"])
def test_other_ddp_kinds_are_data_parallel(tmp_path, kind):
    path = tmp_path / "d.yaml"
    path.write_text(f"distributed_type: {kind}\nnum_processes: 4\nmixed_precision: bf16\n")
    cfg, report = port_fsdp(path)
    assert (cfg.mesh.data, cfg.parallel.zero_stage) == (4, 0)
    assert report.find("distributed_type").status == "mapped"


def test_megatron_lm_and_unknown_kinds_are_refused(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(
        "distributed_type: MEGATRON_LM\nnum_processes: 8\nmegatron_lm_config:\n  megatron_lm_tp_degree: 2\n"
    )
    with pytest.raises(ConfigError, match="port that with `jaxpar port megatron`"):
        port_fsdp(path)
    path.write_text("distributed_type: MULTI_TPU\nnum_processes: 8\n")
    with pytest.raises(ConfigError, match="distributed_type 'MULTI_TPU' is not accelerate's; use one of NO, FSDP"):
        port_fsdp(path)
