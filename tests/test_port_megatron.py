"""Megatron-LM importer on the recipes in tests/fixtures/recipes/megatron, plus launch-script parsing.

The ``.args`` format: the shell variable assignments a launch script makes, a ``# flags`` line, then
one command-line flag per line (``$VAR`` / ``${VAR}`` / ``${VAR:-default}`` / ``$((...))`` expand as
bash would; a variable nobody sets must come from ``--var``). The fixtures are hand-written in the
shapes of real launch scripts: a sweep template whose sizes are all variables, SLURM node counts,
``$(scontrol ...)`` command substitutions, an unbalanced quote, MoE flags, fp8, sample-based schedules.
"""

from __future__ import annotations

import argparse
import re

import pytest

from jaxpar.cli.port import add_port_arguments, run_port
from jaxpar.config import ConfigError, load_config
from jaxpar.port.bash import Shell, show, split_assignment
from jaxpar.port.megatron import port_megatron
from jaxpar.port.report import schema_type
from tests.port_recipes import FIXTURES, recipe_params

MEG = FIXTURES / "megatron"
GPT13 = "gpt3_13b_distributed.args"
LLAMA3 = "llama3_8b_fp8_single_node.args"
MIXTRAL = "mixtral_8x22b_moe.args"
SWEEP = "sweep_CONFIG.args"
BLOOM = "bloom_style_104b_slurm.args"
LLAMA2 = "megatron_ds_llama2_tp2_pp2.args"
INTERLEAVED = "gpt_1b_interleaved_sp.args"
# What each recipe does with no --var: None = ports; else a regex of its one-line error.
EXPECTED = {
    SWEEP: r"unresolved shell variables: TP .*PP .*MBS .*GBS .*WORLD_SIZE .*NLS .*HS .*NAH ",
    GPT13: r"world size 8 \(--nproc_per_node 8 \* --nnodes 1\) is not divisible by TP\*PP\*CP = 4\*4\*1 = 16",
    LLAMA3: None,
    MIXTRAL: r"--expert-model-parallel-size 8 does not divide DP = 2",  # one node: Megatron refuses EP 8 too
    BLOOM: r"NNODES \(needs SLURM_NNODES; used by --nnodes\)",
    LLAMA2: None,
    INTERLEAVED: None,
}


def _flag_names(path) -> list[str]:
    lines = path.read_text().split("# flags", 1)[1].splitlines()
    return [line.split()[0].split("=")[0] for line in lines if line.strip().startswith("--")]


@pytest.mark.parametrize("path, expected", recipe_params("megatron", (".args",), EXPECTED))
def test_every_recipe_ports_or_fails_with_its_message(path, expected):
    try:
        cfg, report = port_megatron(path)
    except ConfigError as e:
        assert "\n" not in str(e) and str(e).startswith("megatron: ")
        assert expected is not None, f"{path.name} should port but failed: {e}"
        assert expected == "any" or re.search(expected, str(e)), str(e)
        return
    assert expected in (None, "any"), f"{path.name} should fail with /{expected}/"
    sources = {e.source for e in report.entries}
    missing = [f for f in _flag_names(path) if f not in sources]
    assert not missing, f"flags not reported: {missing}"
    assert not report.problems, report.problems


def test_every_fixture_has_an_expectation():
    assert sorted(p.name for p in MEG.iterdir()) == sorted(EXPECTED)


def test_bloom_style_layout_on_256_gpus():
    cfg, report = port_megatron(MEG / BLOOM, variables={"SLURM_NNODES": "32"})
    assert (cfg.mesh.tensor, cfg.mesh.pipeline, cfg.mesh.data) == (4, 8, 8)  # 256 / (4 * 8)
    assert (cfg.train.global_batch, cfg.parallel.microbatches) == (1024, 128)  # 1024 / (1 * 8)
    m = cfg.model
    assert (m.num_layers, m.embed_dim, m.num_heads, m.head_dim, m.vocab_size) == (66, 11600, 80, 145, 250880)
    assert (m.mlp_dim, m.mlp_activation, m.norm, m.tie_embeddings, cfg.parallel.recompute) == (
        46400,
        "gelu",
        "layernorm",
        True,
        "full",
    )
    assert cfg.train.steps == 150_000_000 // 1024 and cfg.optim.lr == 6e-5 and cfg.optim.b2 == 0.95
    assert cfg.parallel.zero_stage == 1 and cfg.train.seed == 43  # --deepspeed --zero-stage ${ZERO_STAGE}
    assert report.find("--position-embedding-type").status == "unsupported"  # ALiBi
    assert report.find("--rampup-batch-size").status == "approximated"
    assert report.find("--embed-layernorm").status == "unsupported"
    # ALiBi is unsupported, so the port keeps RoPE, whose head dim must be even: the first problem validation
    # names (66 layers over 8 stages would be the next)
    assert any("model.head_dim=145: RoPE needs an even head dim" in p for p in report.problems)
    cfg, report = port_megatron(MEG / BLOOM, world_size=256)  # an explicit world size makes NNODES unnecessary
    assert (cfg.mesh.data, cfg.parallel.microbatches) == (8, 128) and "overridden" in report.find("--nnodes").note


def test_gpt3_13b_shape_and_schedule():
    cfg, report = port_megatron(MEG / GPT13, variables={"NUM_NODES": "4"})
    assert (cfg.mesh.data, cfg.mesh.tensor, cfg.mesh.pipeline, cfg.parallel.microbatches) == (2, 4, 4, 256)
    m = cfg.model
    assert (m.num_layers, m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim) == (40, 5120, 40, 40, 128)
    assert (m.mlp_dim, m.mlp_activation, m.norm, m.position, m.tie_embeddings) == (
        20480,
        "gelu",
        "layernorm",
        "learned",
        True,
    )
    assert m.vocab_size == 50688 and m.init_std == 0.008  # 50257 padded to 128*4
    # --fp16: float16 with Megatron's dynamic loss scaling at its defaults (initial 2**32, window 1000, hysteresis 2)
    ls = cfg.train.loss_scale
    assert m.compute_dtype == "float16" and report.find("--fp16").status == "mapped"
    assert (ls.rule, ls.static, ls.initial_scale_power, ls.window, ls.hysteresis, ls.min_scale) == (
        "megatron",
        0.0,
        32,
        1000,
        2,
        1.0,
    )
    assert report.find("(initial loss scale)").value == "2**32"
    bias = report.find("--add-bias-linear (default)")  # GPT-3's linear layers have biases, jaxpar's none
    assert bias.model and bias.status == "unsupported" and report.model_changes == [bias]
    o = cfg.optim
    assert (o.schedule, o.warmup_steps, o.decay_steps, o.lr, o.b2) == ("cosine", 1000, 100000, 1e-4, 0.95)
    assert o.min_lr_ratio == pytest.approx(0.1) and cfg.train.steps == 150000
    assert report.find("--lr-decay-style").status == "mapped"  # .01 * 100000 = 1000 whole iterations: exact
    assert report.find("--attention-dropout (default)").status == "mapped"  # Megatron default 0.1
    assert (cfg.model.dropout, cfg.model.attention_dropout) == (0.1, 0.1)
    assert report.find("--step-batch-size-schedule").status == "approximated"
    assert not report.problems


def test_llama3_8b_fp8_shape_and_sample_based_schedule():
    cfg, report = port_megatron(MEG / LLAMA3)
    m = cfg.model
    assert (m.num_layers, m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim) == (
        32,
        4096,
        32,
        8,
        128,
        14336,
    )
    assert (m.mlp_activation, m.norm, m.position, m.rope_theta, m.tie_embeddings) == (
        "swiglu",
        "rmsnorm",
        "rope",
        5e5,
        False,
    )
    assert (cfg.mesh.data, cfg.parallel.microbatches, cfg.parallel.zero_stage) == (8, 4, 1)  # 64 / (2 * 8)
    assert not cfg.parallel.sequence_parallel and report.find("--sequence-parallel").status == "approximated"
    assert cfg.parallel.grad_reduce_dtype == "bfloat16" and cfg.train.steps == 6400000 // 64
    assert cfg.data.source == "synthetic"  # --mock-data
    warmup = 10000 / 64  # samples / global batch = 156.25 iterations
    if schema_type("optim.warmup_steps") is float:
        assert cfg.optim.warmup_steps == warmup
    else:
        assert cfg.optim.warmup_steps == round(warmup)
        assert "rounded" in report.find("--lr-decay-style").note
    for flag in ("--decoupled-lr", "--fp8-format", "--fp8-amax-history-len"):
        assert report.find(flag).status == "unsupported"
    vocab = report.find("(vocabulary)")  # HuggingFaceTokenizer: the size is the tokenizer file's
    assert vocab.model and vocab.needs == ("model.vocab_size",) and report.model_changes == [vocab]


def test_mixtral_moe_flags_map_on_four_nodes():
    cfg, report = port_megatron(MEG / MIXTRAL, variables={"SLURM_NNODES": "4"})
    assert (cfg.model.num_experts, cfg.model.experts_per_token) == (8, 2)
    assert (cfg.mesh.data, cfg.mesh.expert, cfg.mesh.pipeline, cfg.parallel.microbatches) == (1, 8, 4, 16)
    for flag in ("--num-experts", "--moe-router-topk", "--expert-model-parallel-size"):
        assert report.find(flag).status == "mapped", (flag, report.find(flag))
    assert report.find("--moe-grouped-gemm").status == "approximated"
    assert cfg.model.vocab_size == 32000 and cfg.optim.b2 == 0.999  # Megatron's default beta2


def test_megatron_deepspeed_llama2():
    cfg, report = port_megatron(MEG / LLAMA2)
    assert (cfg.mesh.data, cfg.mesh.tensor, cfg.mesh.pipeline, cfg.parallel.microbatches) == (2, 2, 2, 4)  # 16/(2*2)
    assert (cfg.model.num_kv_heads, cfg.model.mlp_dim, cfg.model.norm) == (4, 5632, "rmsnorm")
    assert (cfg.data.source, cfg.data.path) == ("megatron", "./work/data/wiki_text_document")  # "1 PREFIX" blend
    assert cfg.data.val_fraction == pytest.approx(0.02)  # --split 98,1,1
    assert "given more than once" in report.find("--nproc_per_node").note


def test_sweep_template_ports_once_its_variables_are_given():
    variables = {
        "TP": "2",
        "PP": "2",
        "MBS": "1",
        "GBS": "64",
        "NLS": "24",
        "HS": "2048",
        "NAH": "16",
        "WORLD_SIZE": "16",
    }
    cfg, report = port_megatron(MEG / SWEEP, variables=variables)
    assert (cfg.mesh.data, cfg.parallel.microbatches, cfg.optim.schedule) == (4, 16, "cosine")  # 16/(2*2); 64/(1*4)
    assert cfg.model.compute_dtype == "float16" and cfg.train.loss_scale.static == 4096.0  # a fixed scale
    assert report.find("--loss-scale").status == "mapped" and report.find("--fp16").status == "mapped"
    lines = (MEG / SWEEP).read_text().splitlines()
    unbalanced = next(i for i, line in enumerate(lines, 1) if line.startswith("--loss-scale"))
    assert report.find(f"(line {unbalanced})").note == "unbalanced quote removed"


def test_interleaved_pipeline_with_sequence_parallel_and_selective_recompute():
    cfg, report = port_megatron(MEG / INTERLEAVED)
    assert (cfg.mesh.data, cfg.mesh.tensor, cfg.mesh.pipeline, cfg.parallel.microbatches) == (2, 2, 2, 32)
    assert (cfg.parallel.pipeline_schedule, cfg.parallel.virtual_stages) == ("interleaved", 4)  # 24 / (2 * 3)
    assert cfg.parallel.sequence_parallel and cfg.parallel.recompute == "selective"
    assert cfg.model.vocab_size == 50304  # NullTokenizer: 50257 + 1, padded to a multiple of 64 * TP 2
    assert (cfg.data.path, cfg.train.seed) == ("/data/pile/pile_text_document", 1234)
    assert not report.problems


def _text(*flags: str, world: int = 8) -> str:
    return "\n".join(
        [
            "# flags",
            f"--nproc_per_node {world}",
            "--num-layers 32",
            "--hidden-size 4096",
            "--num-attention-heads 32",
            "--seq-length 1024",
            "--lr 1e-4",
            "--train-iters 100",
            *flags,
        ]
    )


BASE = ("--disable-bias-linear", "--tokenizer-type NullTokenizer", "--vocab-size 1000")  # no other model change
LLAMA31 = (*BASE, "--swiglu", "--normalization RMSNorm", "--position-embedding-type rope", "--rotary-base 500000")


def test_use_rope_scaling_maps_to_llama3_rope():
    """--use-rope-scaling: Llama 3.1's scaled RoPE, factor 8 (Megatron-LM d98e8a6: --rope-scaling-factor's
    default in arguments.py, GPTModel's default, and what pretrain_gpt.py builds), low/high 1/4, context 8192
    (RotaryEmbedding._apply_scaling's defaults)."""
    want = ("llama3", 8.0, 1.0, 4.0, 8192)
    for extra in ((), ("--rope-scaling-factor 8",), ("--rope-scaling-factor 8.0",)):
        cfg, report = port_megatron(_text(*LLAMA31, "--use-rope-scaling", *extra))
        m = cfg.model
        got = (m.rope_scaling, m.rope_scaling_factor, m.rope_low_freq_factor, m.rope_high_freq_factor)
        assert (*got, m.rope_original_max_seq_len) == want and m.rope_theta == 5e5
        assert report.find("--use-rope-scaling").status == "mapped" and not report.model_changes
        source = "--rope-scaling-factor" if extra else "--rope-scaling-factor (default)"
        assert (report.find(source).status, report.find(source).target) == ("mapped", "model.rope_scaling_factor")
        assert not report.problems


def test_rope_scaling_factor_is_what_pretrain_gpt_builds():
    """pretrain_gpt.py never passes --rope-scaling-factor to GPTModel (factor 8 whatever it says): the port
    trains what Megatron trains and says so; without --use-rope-scaling, or without RoPE, it does nothing."""
    cfg, report = port_megatron(_text(*LLAMA31, "--use-rope-scaling", "--rope-scaling-factor 32"))
    row = report.find("--rope-scaling-factor")
    assert cfg.model.rope_scaling_factor == 8.0 and row.status == "approximated" and not row.model
    assert "does not pass it to the model" in row.note and "--set model.rope_scaling_factor=32" in row.note
    cfg, report = port_megatron(_text(*LLAMA31, "--rope-scaling-factor 32"))
    assert cfg.model.rope_scaling == "none" and report.find("--rope-scaling-factor").status == "approximated"
    assert "only with --use-rope-scaling" in report.find("--rope-scaling-factor").note
    cfg, report = port_megatron(_text(*BASE, "--use-rope-scaling", "--position-embedding-type learned_absolute"))
    assert (cfg.model.position, cfg.model.rope_scaling) == ("learned", "none") and not report.problems
    assert "scales RoPE only" in report.find("--use-rope-scaling").note
    # YaRN and interpolated positions stay model changes
    for flag in ("--rotary-scaling-factor 40", "--rotary-seq-len-interpolation-factor 2"):
        _, report = port_megatron(_text(*LLAMA31, flag))
        assert [e.source for e in report.model_changes] == [flag.split()[0]]


@pytest.mark.parametrize("hidden, ffn", [(4096, 10880), (5120, 13632), (2048, 5440)])
def test_swiglu_default_ffn_rounds_down_to_64(hidden, ffn):
    cfg, report = port_megatron(_text("--swiglu").replace("--hidden-size 4096", f"--hidden-size {hidden}"))
    assert cfg.model.mlp_dim == ffn == int(4 * hidden * 2 / 3 / 64) * 64


def test_virtual_pipeline_sequence_and_context_parallel():
    cfg, report = port_megatron(
        _text(
            "--pipeline-model-parallel-size 2",
            "--num-layers-per-virtual-pipeline-stage 4",
            "--tensor-model-parallel-size 2",
            "--sequence-parallel",
            "--global-batch-size 64",
            "--context-parallel-size 2",
            world=16,
        )
    )
    assert (cfg.parallel.virtual_stages, cfg.parallel.pipeline_schedule) == (4, "interleaved")  # 32 / (2 * 4)
    assert cfg.parallel.sequence_parallel and cfg.mesh.tensor == 2
    assert (cfg.mesh.data, cfg.mesh.context) == (2, 2) and cfg.parallel.microbatches == 32  # DP = 16 / (2*2*2)
    assert report.find("--context-parallel-size").status == "mapped" and cfg.model.attention == "blockwise"
    # p2p is the ring, which jaxpar runs only outside pipeline stages: all-gathered here, said in the report
    assert cfg.parallel.context_exchange == "all_gather" and not report.problems
    assert report.find("--cp-comm-type (default)").status == "approximated"
    with pytest.raises(ConfigError, match="--num-layers-per-virtual-pipeline-stage 5"):
        port_megatron(_text("--pipeline-model-parallel-size 2", "--num-layers-per-virtual-pipeline-stage 5"))
    with pytest.raises(ConfigError, match="--global-batch-size 12 is not divisible"):
        port_megatron(_text("--global-batch-size 12", "--micro-batch-size 1"))


@pytest.mark.parametrize(
    "kind, exchange, status",
    [
        ("p2p", "ring", "mapped"),
        ("all_gather", "all_gather", "mapped"),
        ("a2a", "ring", "approximated"),
        ("a2a+p2p", "ring", "approximated"),
    ],
)
def test_context_parallel_comm_types(kind, exchange, status):
    cfg, report = port_megatron(_text("--context-parallel-size 4", f"--cp-comm-type {kind}", world=8))
    assert (cfg.mesh.data, cfg.mesh.context, cfg.parallel.context_exchange) == (2, 4, exchange)
    row = report.find("--cp-comm-type")
    assert row.status == status and row.target == "parallel.context_exchange"
    assert status == "mapped" or "ring (p2p) runs instead" in row.note


def test_context_parallel_sequence_must_split_in_2cp_chunks():
    text = _text("--context-parallel-size 4", world=8).replace("--seq-length 1024", "--seq-length 1028")
    with pytest.raises(ConfigError, match=r"--seq-length 1028 is not divisible by 2 \* --context-parallel-size 4") as e:
        port_megatron(text)
    assert "\n" not in str(e.value)
    cfg, report = port_megatron(_text("--cp-comm-type all_gather"))  # no CP: the type changes nothing
    assert cfg.mesh.context == 1 and report.find("--cp-comm-type").status == "approximated"


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
    assert (cfg.mesh.data, cfg.mesh.tensor, cfg.parallel.microbatches) == (8, 2, 16)  # 16 / 2; 256 / (2 * 8)
    assert (cfg.model.num_layers, cfg.model.embed_dim, cfg.train.seq_len) == (24, 1024, 1024)
    assert (cfg.optim.schedule, cfg.optim.warmup_steps, cfg.train.workdir) == ("linear", 10, "/ckpt dir")
    with pytest.raises(ConfigError, match="no '# flags' section"):
        port_megatron("echo hello\nA=1 --x")


def test_shell_expansion_subset():
    shell = Shell({"USER_SET": "7"})
    for line in (
        "A=3",
        'B="x ${A}"',
        "C=${MISSING:-'dflt'}",
        "D=$((A*4 + USER_SET))",
        "E=$(hostname)",
        "USER_SET=1",
        "F=<placeholder>",
    ):
        shell.assign(*split_assignment(line))
    assert shell.env["B"] == "x 3" and shell.env["C"] == "dflt" and shell.env["D"] == "19"
    assert shell.env["USER_SET"] == "7"  # --var wins over the script
    assert [show(w) for w in shell.words("--a $B --b $E '$A' \"$F\" # comment")] == [
        "--a",
        "x",
        "3",
        "--b",
        "$E",
        "$A",
        "$F",
    ]
    assert shell.why["E"].startswith("needs $(hostname") and shell.why["F"].startswith("placeholder")


def test_cli_megatron_output_loads(tmp_path):
    out = tmp_path / "llama3.py"
    parser = argparse.ArgumentParser()
    add_port_arguments(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["port", "megatron", str(MEG / LLAMA3), "--set", "model.vocab_size=128256", "-o", str(out)]
    )
    assert run_port(args) == 0
    cfg = load_config(str(out))
    assert cfg.model.vocab_size == 128256 and cfg.model.mlp_dim == 14336 and cfg.parallel.microbatches == 4
    bloom = ["port", "megatron", str(MEG / BLOOM), "--var", "SLURM_NNODES=32", "-o", str(tmp_path / "bloom.py")]
    with pytest.raises(ConfigError, match=r"--position-embedding-type = alibi: alibi positions") as e:
        run_port(parser.parse_args(bloom))  # BLOOM's ALiBi, biases and embedding norm: not jaxpar's model
    assert "--add-bias-linear (default), --embed-layernorm" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="does not validate: model.head_dim=145: RoPE needs an even head dim"):
        run_port(parser.parse_args([*bloom, "--approximate"]))


def test_profile_and_tensorboard_flags_map_to_a_trace_and_events():
    cfg, report = port_megatron(MEG / LLAMA3)  # --profile --profile-step-start 4 --profile-step-end 6
    assert cfg.train.profile_steps == "5,6"  # Megatron traces iterations 4, 5 counted from 0
    assert report.find("--profile").status == "mapped"
    assert report.find("--profile-step-start").target == "train.profile_steps"
    tb = report.find("--tensorboard-dir")
    assert (tb.status, tb.target) == ("approximated", "train.workdir") and "TensorBoard event files" in tb.note
    cfg, report = port_megatron(MEG / BLOOM, variables={"SLURM_NNODES": "32"})
    assert cfg.train.profile_steps == ""
    assert "TensorBoard event files" in report.find("--log-timers-to-tensorboard").note


def test_eval_iters_zero_trains_without_validation(tmp_path):
    """``--eval-iters 0`` turns validation off in Megatron whatever ``--eval-interval`` says: it ports to
    train.eval_batches=0 with train.eval_every=0 (the pair jaxpar accepts), not to a refused config."""
    cfg, _ = port_megatron(MEG / LLAMA3)
    assert (cfg.train.eval_every, cfg.train.eval_batches) == (200, 16)
    changed = tmp_path / "llama3.args"
    changed.write_text((MEG / LLAMA3).read_text().replace("--eval-iters 16", "--eval-iters 0"))
    cfg, report = port_megatron(changed)
    assert (cfg.train.eval_every, cfg.train.eval_batches) == (0, 0)
    assert report.find("--eval-iters").status == "mapped"
