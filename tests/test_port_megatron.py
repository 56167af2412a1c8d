"""Megatron-LM importer on the real recipes in shared/recipes/megatron, plus launch-script parsing."""

from __future__ import annotations

import argparse
import pathlib
import re

import pytest

from jaxpar.config import ConfigError, load_config
from jaxpar.port import Shell, show, split_assignment
from jaxpar.port.cli import add_port_arguments, run_port
from jaxpar.port.megatron import port_megatron
from jaxpar.port.report import schema_type

RECIPES = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "recipes"
MEG = RECIPES / "megatron"
pytestmark = pytest.mark.skipif(not MEG.is_dir(), reason=f"recipes not found at {MEG} (clone shared/ beside the repo)")

GPT3 = "NVIDIA-Megatron-LM__examples_gpt3_train_gpt3_175b_distributed.args"
LLAMA3 = "NVIDIA-Megatron-LM__examples_llama_train_llama3_8b_h100_fp8.args"
MIXTRAL = "NVIDIA-Megatron-LM__examples_mixtral_train_mixtral_8x7b_distributed.args"
SC21 = "NVIDIA-Megatron-LM__examples_academic_paper_scripts_sc21_CONFIG.args"
TR11 = "bigscience__train_tr11-176B-ml_tr11-176B-ml.args"
LLAMA2 = "microsoft-Megatron-DeepSpeed__examples_deepspeed_pretrain_llama2_distributed.args"
# What each recipe does with no --var: None = ports; else a regex of its one-line error.
EXPECTED = {
    SC21: r"unresolved shell variables: TP .*PP .*MBS .*GBS .*WORLD_SIZE .*NLS .*HS .*NAH ",
    GPT3: r"world size 8 \(--nproc_per_node 8 \* --nnodes 1\) is not divisible by TP\*PP\*CP = 8\*16\*1 = 128",
    LLAMA3: None,
    MIXTRAL: None,
    TR11: r"NNODES \(needs SLURM_NNODES; used by --nnodes\)",
    LLAMA2: None,
}


def _files() -> list[str]:
    return sorted(p.name for p in MEG.iterdir() if p.suffix == ".args") if MEG.is_dir() else []


def _flag_names(name: str) -> list[str]:
    lines = (MEG / name).read_text().split("# flags", 1)[1].splitlines()
    return [line.split()[0].split("=")[0] for line in lines if line.strip().startswith("--")]


@pytest.mark.parametrize("name", _files())
def test_every_recipe_ports_or_fails_with_its_message(name):
    expected = EXPECTED.get(name, "any")
    try:
        cfg, report = port_megatron(MEG / name)
    except ConfigError as e:
        assert "\n" not in str(e) and str(e).startswith("megatron: ")
        assert expected is not None, f"{name} should port but failed: {e}"
        assert expected == "any" or re.search(expected, str(e)), str(e)
        return
    assert expected in (None, "any"), f"{name} should fail with /{expected}/"
    sources = {e.source for e in report.entries}
    missing = [f for f in _flag_names(name) if f not in sources]
    assert not missing, f"flags not reported: {missing}"
    assert not report.problems, report.problems


def test_bloom_tr11_layout_on_384_gpus():
    cfg, report = port_megatron(MEG / TR11, variables={"SLURM_NNODES": "48"})
    assert (cfg.mesh.tensor, cfg.mesh.pipeline, cfg.mesh.data) == (4, 12, 8)  # 384 / (4 * 12)
    assert (cfg.train.global_batch, cfg.train.microbatches) == (2048, 128)  # 2048 / (2 * 8)
    m = cfg.model
    assert (m.num_layers, m.embed_dim, m.num_heads, m.head_dim, m.vocab_size) == (70, 14336, 112, 128, 250880)
    assert (m.mlp_dim, m.mlp_activation, m.norm, m.tie_embeddings, m.remat) == (57344, "gelu", "layernorm", True, "full")
    assert cfg.train.steps == 220_000_000 // 2048 and cfg.optim.lr == 6e-5 and cfg.optim.b2 == 0.95
    assert report.find("--position-embedding-type").status == "unsupported"  # ALiBi
    assert report.find("--rampup-batch-size").status == "approximated"
    assert any("num_layers=70" in p for p in report.problems)  # 70 layers do not split over 12 stages
    cfg, report = port_megatron(MEG / TR11, world_size=384)  # an explicit world size makes NNODES unnecessary
    assert (cfg.mesh.data, cfg.train.microbatches) == (8, 128) and "overridden" in report.find("--nnodes").note


def test_gpt3_175b_shape_and_schedule():
    cfg, report = port_megatron(MEG / GPT3, variables={"NUM_NODES": "16"})
    assert (cfg.mesh.data, cfg.mesh.tensor, cfg.mesh.pipeline, cfg.train.microbatches) == (1, 8, 16, 1536)
    m = cfg.model
    assert (m.num_layers, m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim) == (96, 12288, 96, 96, 128)
    assert (m.mlp_dim, m.mlp_activation, m.norm, m.position, m.tie_embeddings) == (49152, "gelu", "layernorm",
                                                                                   "learned", True)
    assert m.vocab_size == 51200 and m.compute_dtype == "float16" and m.init_std == 0.006  # GPT-2 BPE padded to 8*128
    o = cfg.optim
    assert (o.schedule, o.warmup_steps, o.decay_steps, o.lr, o.b2) == ("cosine", 430, 430000, 6e-5, 0.95)
    assert o.min_lr_ratio == pytest.approx(0.1) and cfg.train.steps == 500000
    assert report.find("--lr-decay-style").status == "mapped"  # .001 * 430000 = 430 whole iterations: exact
    assert report.find("--attention-dropout (default)").status == "approximated"
    assert not report.problems


def test_llama3_8b_shape_and_sample_based_schedule():
    cfg, report = port_megatron(MEG / LLAMA3)
    m = cfg.model
    assert (m.num_layers, m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim) == (32, 4096, 32, 8, 128,
                                                                                               14336)
    assert (m.mlp_activation, m.norm, m.position, m.rope_theta, m.tie_embeddings) == ("swiglu", "rmsnorm", "rope",
                                                                                      1e6, False)
    assert (cfg.mesh.data, cfg.train.microbatches, cfg.parallel.zero_stage) == (8, 16, 1)
    assert not cfg.parallel.sequence_parallel and report.find("--sequence-parallel").status == "approximated"
    assert cfg.parallel.grad_reduce_dtype == "bfloat16" and cfg.train.steps == 1953125000 // 128
    warmup = 3906252 / 128  # samples / global batch = 30517.59375 iterations
    if schema_type("optim.warmup_steps") is float:
        assert cfg.optim.warmup_steps == warmup
    else:
        assert cfg.optim.warmup_steps == round(warmup)
        assert "rounded" in report.find("--lr-decay-style").note
    assert report.find("--decoupled-lr").status == "unsupported"
    assert report.find("(vocabulary)").status == "approximated"


def test_mixtral_moe_flags_are_unsupported():
    cfg, report = port_megatron(MEG / MIXTRAL)
    for flag in ("--num-experts", "--moe-router-topk", "--moe-grouped-gemm", "--expert-model-parallel-size"):
        entry = report.find(flag)
        assert entry.status == "unsupported" and "mixture-of-experts" in entry.note
    assert (cfg.mesh.data, cfg.mesh.pipeline, cfg.train.microbatches) == (2, 4, 128)
    assert cfg.model.vocab_size == 32000 and cfg.optim.b2 == 0.999  # Megatron's default beta2


def test_megatron_deepspeed_llama2():
    cfg, report = port_megatron(MEG / LLAMA2)
    assert (cfg.mesh.data, cfg.mesh.tensor, cfg.mesh.pipeline, cfg.train.microbatches) == (2, 2, 2, 4)
    assert (cfg.model.num_kv_heads, cfg.model.mlp_dim, cfg.model.norm) == (4, 5504, "rmsnorm")
    assert (cfg.data.source, cfg.data.path) == ("megatron", "./tmp/data/bookcorpus_train_1m_text_sentence")


def test_sc21_ports_once_its_variables_are_given():
    variables = {"TP": "2", "PP": "2", "MBS": "1", "GBS": "64", "NLS": "24", "HS": "2048", "NAH": "16",
                 "WORLD_SIZE": "16"}
    cfg, report = port_megatron(MEG / SC21, variables=variables)
    assert (cfg.mesh.data, cfg.train.microbatches, cfg.optim.schedule) == (4, 16, "cosine")
    assert cfg.model.compute_dtype == "float16" and report.find("--loss-scale").status == "unsupported"
    assert report.find("(line 36)").note == "unbalanced quote removed"


def _text(*flags: str, world: int = 8) -> str:
    return "\n".join(["# flags", f"--nproc_per_node {world}", "--num-layers 32", "--hidden-size 4096",
                      "--num-attention-heads 32", "--seq-length 1024", "--lr 1e-4", "--train-iters 100", *flags])


@pytest.mark.parametrize("hidden, ffn", [(4096, 10880), (5120, 13632), (2048, 5440)])
def test_swiglu_default_ffn_rounds_down_to_64(hidden, ffn):
    cfg, report = port_megatron(_text("--swiglu").replace("--hidden-size 4096", f"--hidden-size {hidden}"))
    assert cfg.model.mlp_dim == ffn == int(4 * hidden * 2 / 3 / 64) * 64


def test_virtual_pipeline_sequence_and_context_parallel():
    cfg, report = port_megatron(_text("--pipeline-model-parallel-size 2", "--num-layers-per-virtual-pipeline-stage 4",
                                      "--tensor-model-parallel-size 2", "--sequence-parallel", "--global-batch-size 64",
                                      "--context-parallel-size 2", world=16))
    assert (cfg.pipeline.virtual_stages, cfg.pipeline.schedule) == (4, "interleaved")  # 32 / (2 * 4)
    assert cfg.parallel.sequence_parallel and cfg.mesh.tensor == 2
    assert cfg.mesh.data == 4 and report.find("--context-parallel-size").status == "unsupported"  # DP 2 * CP 2
    with pytest.raises(ConfigError, match="--num-layers-per-virtual-pipeline-stage 5"):
        port_megatron(_text("--pipeline-model-parallel-size 2", "--num-layers-per-virtual-pipeline-stage 5"))
    with pytest.raises(ConfigError, match="--global-batch-size 12 is not divisible"):
        port_megatron(_text("--global-batch-size 12", "--micro-batch-size 1"))


def test_unknown_flag_gets_a_suggestion():
    cfg, report = port_megatron(_text("--num-layer 3"))
    entry = report.find("--num-layer")
    assert entry.status == "unknown" and "'--num-layers'" in entry.note


def test_raw_launch_script_with_arrays_continuations_and_defaults():
    script = """#!/bin/bash
GPUS_PER_NODE=8
NNODES=${SLURM_NNODES:-2}
WORLD_SIZE=$(($GPUS_PER_NODE*$NNODES))
MODEL_ARGS=(
    --num-layers 24
    --hidden-size 1024 --num-attention-heads 16
)
TRAIN_ARGS="--micro-batch-size 2 --global-batch-size 256 --lr 3e-4 --train-iters 1000 \\
    --lr-decay-style linear --lr-warmup-iters 10"
torchrun --nproc_per_node $GPUS_PER_NODE --nnodes $NNODES pretrain_gpt.py \\
    ${MODEL_ARGS[@]} $TRAIN_ARGS \\
    --seq-length "$((512*2))" --tensor-model-parallel-size 2 --save '/ckpt dir'
"""
    cfg, report = port_megatron(script)
    assert (cfg.mesh.data, cfg.mesh.tensor, cfg.train.microbatches) == (8, 2, 16)  # 16 / 2; 256 / (2 * 8)
    assert (cfg.model.num_layers, cfg.model.embed_dim, cfg.train.seq_len) == (24, 1024, 1024)
    assert (cfg.optim.schedule, cfg.optim.warmup_steps, cfg.train.workdir) == ("linear", 10, "/ckpt dir")
    with pytest.raises(ConfigError, match="no '# flags' section"):
        port_megatron("echo hello\nA=1 --x")


def test_shell_expansion_subset():
    shell = Shell({"USER_SET": "7"})
    for line in ("A=3", 'B="x ${A}"', "C=${MISSING:-'dflt'}", "D=$((A*4 + USER_SET))", "E=$(hostname)",
                 "USER_SET=1", "F=<placeholder>"):
        shell.assign(*split_assignment(line))
    assert shell.env["B"] == "x 3" and shell.env["C"] == "dflt" and shell.env["D"] == "19"
    assert shell.env["USER_SET"] == "7"  # --var wins over the script
    assert [show(w) for w in shell.words("--a $B --b $E '$A' \"$F\" # comment")] == ["--a", "x", "3", "--b", "$E",
                                                                                      "$A", "$F"]
    assert shell.why["E"].startswith("needs $(hostname") and shell.why["F"].startswith("placeholder")


def test_cli_megatron_output_loads(tmp_path):
    out = tmp_path / "llama3.py"
    parser = argparse.ArgumentParser()
    add_port_arguments(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["port", "megatron", str(MEG / LLAMA3), "--set", "model.vocab_size=128256",
                              "-o", str(out)])
    assert run_port(args) == 0
    cfg = load_config(str(out))
    assert cfg.model.vocab_size == 128256 and cfg.model.mlp_dim == 14336 and cfg.train.microbatches == 16
    args = parser.parse_args(["port", "megatron", str(MEG / TR11), "--var", "SLURM_NNODES=48", "-o", str(out)])
    with pytest.raises(ConfigError, match="does not validate: model.num_layers=70"):
        run_port(args)


def test_profile_and_tensorboard_flags_map_to_a_trace_and_events():
    cfg, report = port_megatron(MEG / LLAMA3)  # --profile --profile-step-start 4 --profile-step-end 6
    assert cfg.train.profile_steps == "5,6"  # Megatron traces iterations 4, 5 counted from 0
    assert report.find("--profile").status == "mapped"
    assert report.find("--profile-step-start").target == "train.profile_steps"
    tb = report.find("--tensorboard-dir")
    assert (tb.status, tb.target) == ("approximated", "train.workdir") and "TensorBoard event files" in tb.note
    cfg, report = port_megatron(MEG / TR11, variables={"SLURM_NNODES": "48"}, allow_unresolved=True)
    assert cfg.train.profile_steps == ""
    assert "TensorBoard event files" in report.find("--log-timers-to-tensorboard").note
