"""The quiet defaults of issue 28, each now acted on or said: accelerate's world size without
``num_processes`` (asked for, not 1), DeepSpeed's ``tensor_parallel.autotp_size`` (the tensor size,
not ignored), ``--set lr=`` for a DeepSpeed config without an optimizer section (sets optim.*, not
ignored), and fp16 without loss scaling (ported as bf16, an approximated row that says why).

Only names the importers had before issue 28 are imported, so this module runs against the code
before it too (where every test here fails).
"""

from __future__ import annotations

import pytest

from jaxpar.config import ConfigError
from jaxpar.port.deepspeed import port_deepspeed
from jaxpar.port.fsdp import port_fsdp
from jaxpar.port.megatron import port_megatron
from tests.port_recipes import FIXTURES

CORPUS = FIXTURES / "corpus"
MEGATRON = "\n".join(
    [
        "# flags",
        "--nproc_per_node 8",
        "--num-layers 4",
        "--hidden-size 256",
        "--num-attention-heads 4",
        "--seq-length 512",
        "--micro-batch-size 1",
        "--global-batch-size 8",
        "--lr 1e-4",
        "--train-iters 10",
        "--vocab-size 1000",
        "--tokenizer-type NullTokenizer",
        "--disable-bias-linear",
        "--fp16",
        "--loss-scale-window 500",
    ]
)


def test_accelerate_without_num_processes_asks_for_the_world_size(tmp_path):
    """``num_processes`` absent: accelerate takes it from the launch line; the port no longer assumes 1."""
    path = CORPUS / "accelerate" / "slurm_fsdp_config.yaml"  # launched with --num_processes by its sbatch script
    with pytest.raises(ConfigError, match="has no num_processes.*pass --world-size N") as e:
        port_fsdp(path)
    assert "\n" not in str(e.value)
    cfg, report = port_fsdp(path, world_size=16)
    assert (cfg.mesh.data, cfg.parallel.zero_stage) == (16, 3)
    cfg, report = port_fsdp(CORPUS / "accelerate" / "tmpl_fp8.yaml")  # distributed_type NO: one process
    assert cfg.mesh.data == 1 and cfg.model.compute_dtype == "bfloat16"
    assert report.find("mixed_precision").status == "approximated"  # fp8 -> bf16: precision only


def test_deepspeed_autotp_size_sets_the_tensor_size():
    path = CORPUS / "deepspeed" / "tensor_parallel_hf_bf16_z2.json"
    side = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "total_num_steps": 100}
    side |= {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 10, "bf16": True}
    side |= {"gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 2}
    cfg, report = port_deepspeed(path, world_size=16, side_inputs=side)
    assert (cfg.mesh.tensor, cfg.mesh.data, cfg.train.global_batch) == (4, 4, 8)  # autotp_size 4: DP = 16 / 4
    row = report.find("tensor_parallel.autotp_size")
    assert (row.status, row.target) == ("mapped", "mesh.tensor")
    with pytest.raises(ConfigError, match="--tensor 2 contradicts the recipe's tensor_parallel.autotp_size 4"):
        port_deepspeed(path, world_size=16, tensor=2, side_inputs=side)
    assert port_deepspeed(path, world_size=16, tensor=4, side_inputs=side)[0].mesh.tensor == 4


def test_deepspeed_set_lr_without_an_optimizer_section_sets_optim():
    """No optimizer section: the training script's optimizer (the HF Trainer's AdamW) takes --set lr=."""
    raw = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}}
    cfg, report = port_deepspeed(raw, world_size=8, side_inputs={"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6})
    assert (cfg.optim.lr, cfg.optim.b1, cfg.optim.b2, cfg.optim.eps) == (3e-4, 0.9, 0.95, 1e-6)
    row = report.find("--set lr")
    assert (row.status, row.target) == ("mapped", "optim.lr") and "no optimizer section" in row.note
    assert "lr, betas, eps from --set" in report.find("(optimizer)").note


def test_fp16_keeps_its_loss_scale_and_grad_scaler_fp16_is_bf16(tmp_path):
    """DeepSpeed's and Megatron's fp16 port as float16 with their loss scaling (train.loss_scale), each
    setting mapped; fp16 under torch's GradScaler (accelerate) ports to bf16, approximated (a precision
    change only, exit 0), the row says why."""
    cfg, report = port_megatron(MEGATRON)
    row = report.find("--fp16")
    assert cfg.model.compute_dtype == "float16" and (row.status, row.target) == ("mapped", "model.compute_dtype")
    assert (cfg.train.loss_scale.rule, cfg.train.loss_scale.window) == ("megatron", 500)
    assert report.find("--loss-scale-window").status == "mapped"
    cfg, report = port_megatron(MEGATRON.replace("--fp16", "--bf16"))  # no fp16: the loss-scale flag does nothing
    assert report.find("--loss-scale-window").status == "approximated" and cfg.train.loss_scale.window == 1000
    raw = {"train_batch_size": 16, "fp16": {"enabled": True, "initial_scale_power": 10, "loss_scale": 0}}
    cfg, report = port_deepspeed(raw, world_size=8)
    assert cfg.model.compute_dtype == "float16" and report.find("fp16.enabled").status == "mapped"
    assert cfg.train.loss_scale.initial_scale_power == 10 and cfg.train.loss_scale.rule == "deepspeed"
    raw["fp16"] |= {"loss_scale": 128, "hysteresis": 4}  # a fixed scale: the dynamic fields do nothing
    cfg, report = port_deepspeed(raw, world_size=8)
    assert (cfg.train.loss_scale.static, cfg.train.loss_scale.hysteresis) == (128.0, 2)
    assert (
        report.find("fp16.hysteresis").status == "approximated" and "fixed scale" in report.find("fp16.hysteresis").note
    )
    path = tmp_path / "a.yaml"
    path.write_text("distributed_type: MULTI_GPU\nnum_processes: 4\nmixed_precision: fp16\n")
    cfg, report = port_fsdp(path)
    assert cfg.model.compute_dtype == "bfloat16" and report.find("mixed_precision").status == "approximated"
    assert "GradScaler" in report.find("mixed_precision").note


def test_accelerate_without_mixed_precision_is_fp32():
    """accelerate's mixed_precision defaults to "no": fp32, not jaxpar's default bf16."""
    cfg, report = port_fsdp(CORPUS / "accelerate" / "tmpl_multi_node.yaml")  # MULTI_GPU, 8 processes, no precision
    assert (cfg.mesh.data, cfg.parallel.zero_stage, cfg.model.compute_dtype) == (8, 0, "float32")
    assert report.find("mixed_precision (default)").target == "model.compute_dtype"


def test_accelerate_parallelism_config_is_the_mesh():
    """ParallelismConfig: TP 2 x (replicate 2 x shard 2) on 8 processes, not ZeRO-3 over 8."""
    cfg, report = port_fsdp(CORPUS / "accelerate" / "torch_native_tp_hsdp.yaml")
    assert (cfg.mesh.tensor, cfg.mesh.data, cfg.parallel.zero_stage) == (2, 4, 3)
    assert report.find("parallelism_config.parallelism_config_dp_replicate_size").status == "approximated"  # HSDP
