"""``jaxpar port megatron`` on mixture-of-experts recipes: Megatron-core's MoE flags and Megatron-DeepSpeed's.

The real Megatron-LM Mixtral 8x7B example (``examples/mixtral/train_mixtral_8x7b_distributed.sh``, verbatim
in the recipe corpus) ports to ``model.name=mixtral`` with its experts, router, aux-loss weight and expert
parallelism; every unsupported MoE setting is refused with one line naming the flag; the performance-only
flags are approximated rows. Megatron-DeepSpeed's MoE-64 GPT recipe is refused with its true reason.
"""

from __future__ import annotations

import pytest

from jaxpar.cli import main
from jaxpar.config import ConfigError
from jaxpar.port.megatron import port_megatron
from tests.helpers import ROOT

CORPUS = ROOT / "tests" / "fixtures" / "recipes" / "corpus"
MIXTRAL = CORPUS / "megatron" / "mixtral_8x7b.sh"
MOE64 = CORPUS / "megatron_deepspeed" / "moe_gpt_125M_MoE64.sh"
# the script's $1..$3, and the environment its `if [ -n "${WANDB_API_KEY}" ]` reads (unset: no W&B)
ARGS = {"1": "/ckpt", "2": "/tok.model", "3": "/data/text_document", "WANDB_API_KEY": ""}
# a small Megatron-core MoE recipe; each case below adds flags to it
BASE = """GPUS=8
torchrun --nproc_per_node $GPUS pretrain_gpt.py --num-layers 4 --hidden-size 256 --num-attention-heads 8 \\
  --seq-length 128 --micro-batch-size 1 --global-batch-size 16 --lr 1e-4 --train-iters 100 --swiglu \\
  --normalization RMSNorm --position-embedding-type rope --disable-bias-linear --vocab-size 1000 --bf16 \\
  --num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 2 --use-distributed-optimizer """


def _port(extra: str = "", **kw):
    return port_megatron(BASE + extra + "\n", **kw)


def test_mixtral_8x7b_example_ports_to_mixtral(tmp_path, capsys):
    cfg, report = port_megatron(MIXTRAL, variables={**ARGS, "SLURM_NNODES": "4"})  # 32 GPUs: DP 8 = EP 8
    m = cfg.model
    assert (m.name, m.num_experts, m.experts_per_token, m.mlp_dim) == ("mixtral", 8, 2, 14336)
    assert (m.router_score, m.router_norm_topk, m.moe_aux_loss_coeff, m.moe_z_loss_coeff) == ("softmax", True, 1e-2, 0)
    assert (cfg.mesh.data, cfg.mesh.expert, cfg.mesh.pipeline, cfg.mesh.tensor) == (1, 8, 4, 1)
    assert cfg.parallel.microbatches == 256 // (1 * 8)  # GBS / (MBS * DP), DP = data * expert
    assert report.valid, report.problems
    rows = {e.source: e for e in report.entries}
    for flag in ("--num-experts", "--moe-router-topk", "--moe-aux-loss-coeff", "--expert-model-parallel-size"):
        assert rows[flag].status == "mapped", rows[flag]
    for flag in ("--moe-grouped-gemm", "--moe-token-dispatcher-type", "--moe-router-load-balancing-type"):
        assert rows[flag].status == "approximated" and rows[flag].note, rows[flag]
    assert "allgather" in rows["--moe-token-dispatcher-type"].note
    assert "ragged_dot" in rows["--moe-grouped-gemm"].note
    assert not report.by_status("unsupported") and not report.by_status("unknown")
    out = tmp_path / "mixtral.py"
    argv = ["port", "megatron", str(MIXTRAL), *(f"--var={k}={v}" for k, v in ARGS.items()), "--var=SLURM_NNODES=4"]
    assert main([*argv, "-o", str(out)]) == 0, capsys.readouterr().err
    assert "c.model.name = 'mixtral'" in out.read_text()


def test_mixtral_example_on_one_node_is_refused_as_megatron_refuses_it():
    # as the script runs by default: 8 GPUs, PP 4 -> DP 2, but EP 8 (Megatron: world % (ETP*EP*PP) = 8 % 32)
    with pytest.raises(ConfigError) as e:
        port_megatron(MIXTRAL, variables=ARGS)
    msg = str(e.value)
    assert "\n" not in msg and "--expert-model-parallel-size 8 does not divide DP = 2" in msg
    assert "Megatron-core refuses it too" in msg


def test_small_moe_recipe_maps_router_and_expert_mesh():
    cfg, report = _port("--moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 1e-3 --moe-router-dtype fp32")
    assert (cfg.model.name, cfg.model.num_experts, cfg.mesh.data, cfg.mesh.expert) == ("mixtral", 8, 4, 2)
    assert (cfg.model.moe_aux_loss_coeff, cfg.model.moe_z_loss_coeff) == (0.01, 1e-3)
    assert report.valid, report.problems
    assert report.find("--moe-router-dtype").status == "approximated"
    assert report.find("--moe-router-topk (default)") is None  # given


@pytest.mark.parametrize(
    "flags, score, norm, name",
    [
        ("", "softmax", True, "mixtral"),  # softmax over the top-k logits
        ("--moe-router-pre-softmax", "softmax", False, "llama"),  # softmax over all, not renormalised
        ("--moe-router-score-function sigmoid", "sigmoid", True, "llama"),  # renormalised as k = 2 > 1
        ("--moe-router-score-function sigmoid --moe-router-topk 1", "sigmoid", False, "llama"),
    ],
)
def test_router_weights_follow_megatron(flags, score, norm, name):
    cfg, report = _port(flags)  # a second --moe-router-topk wins, as in argparse
    assert (cfg.model.router_score, cfg.model.router_norm_topk, cfg.model.name) == (score, norm, name)
    assert report.valid, report.problems


def test_shared_expert_maps():
    cfg, report = _port("--moe-shared-expert-intermediate-size 512")
    assert cfg.model.shared_expert_dim == 512 and cfg.model.name == "llama"  # HF Mixtral has no shared expert
    assert report.find("--moe-shared-expert-intermediate-size").status == "mapped"


def test_moe_ffn_size_and_all_moe_layer_pattern_map():
    cfg, report = _port("--ffn-hidden-size 1024 --moe-ffn-hidden-size 512 --moe-layer-freq ([1]*2)*2")
    assert cfg.model.mlp_dim == 512 and report.find("--moe-layer-freq").status == "mapped"


@pytest.mark.parametrize(
    "flags, named",
    [
        ("--moe-expert-capacity-factor 1.0", "--moe-expert-capacity-factor 1.0: a capacity factor drops tokens"),
        ("--moe-pad-expert-input-to-capacity", "--moe-pad-expert-input-to-capacity: pads"),
        ("--moe-layer-freq 2", "--moe-layer-freq 2: dense layers"),
        ("--moe-layer-freq ([0]+[1]*3)", "--moe-layer-freq ([0]+[1]*3): a dense prefix then MoE layers: only in"),
        ("--moe-layer-freq [1,0,1,1]", "--moe-layer-freq [1,0,1,1]: dense layers between or after the MoE layers"),
        ("--moe-router-enable-expert-bias", "--moe-router-enable-expert-bias: Megatron adds the bias to sigmoid"),
        (
            "--moe-router-enable-expert-bias --moe-router-score-function sigmoid",
            "--moe-router-enable-expert-bias: aux-loss-free balancing; jaxpar has it in its deepseek_v3 family only",
        ),
        ("--moe-router-topk-scaling-factor 2.5", "--moe-router-topk-scaling-factor 2.5: a route scale; jaxpar has"),
        ("--moe-router-num-groups 4 --moe-router-group-topk 2", "--moe-router-group-topk 2: group-limited routing;"),
        ("--moe-router-group-topk 2", "--moe-router-group-topk without --moe-router-num-groups; give both"),
        ("--moe-router-force-load-balancing", "--moe-router-force-load-balancing: random router logits"),
        ("--moe-router-load-balancing-type sinkhorn", "--moe-router-load-balancing-type sinkhorn"),
        (
            "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 0.01",
            "--moe-router-load-balancing-type seq_aux_loss: the balance loss per sequence",
        ),
        ("--moe-router-score-function sqrtsoftplus", "--moe-router-score-function sqrtsoftplus"),
        ("--tensor-model-parallel-size 2 --expert-tensor-parallel-size 1", "--expert-tensor-parallel-size 1 differs"),
        ("--expert-tensor-parallel-size 2", "--expert-tensor-parallel-size 2 differs"),
        ("--num-experts 5", "--num-experts 5 is not divisible by the expert-parallel size 2"),
    ],
)
def test_unsupported_moe_flags_are_refused_by_name(flags, named):
    with pytest.raises(ConfigError) as e:
        _port(flags)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("megatron: ") and named in msg, msg


def test_gelu_experts_are_refused():
    with pytest.raises(ConfigError, match=r"--num-experts 8 without --swiglu: the recipe's experts are GeLU"):
        port_megatron(BASE.replace("--swiglu", "") + "\n")


def test_moe_flags_without_experts_are_no_ops():
    cfg, report = port_megatron(BASE.replace("--num-experts 8", "") + "\n")
    assert cfg.model.num_experts == 0 and cfg.mesh.expert == 1 and cfg.mesh.data == 8
    for flag in ("--moe-router-topk", "--expert-model-parallel-size"):
        assert report.find(flag).status == "approximated" and "no mixture of experts" in report.find(flag).note


def test_refusal_exits_2_with_one_line(tmp_path, capsys):
    recipe = tmp_path / "r.sh"
    recipe.write_text(_BASE_CAP)
    code = main(["port", "megatron", str(recipe), "-o", str(tmp_path / "o.py")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--moe-expert-capacity-factor" in err


_BASE_CAP = BASE + "--moe-expert-capacity-factor 1.25\n"

# Megatron-DeepSpeed (DeepSpeed MoE): a dropless, every-layer, SwiGLU top-1 recipe that ports
DS = BASE.replace("--expert-model-parallel-size", "--moe-expert-parallel-size").replace("--moe-router-topk 2", "")
DS_OK = DS + "--deepspeed --expert-interval 1 --disable-moe-token-dropping --moe-loss-coeff 0.01 "


def test_megatron_deepspeed_top1_dropless_ports():
    cfg, report = port_megatron(DS_OK + "\n")
    m = cfg.model
    assert (m.num_experts, m.experts_per_token, m.router_norm_topk, m.moe_aux_loss_coeff) == (8, 1, False, 0.01)
    assert (m.name, cfg.mesh.expert, cfg.mesh.data) == ("llama", 2, 4)  # top-1 weights by the probability
    assert report.find("--moe-loss-coeff").status == "approximated"  # the same loss at DP = 1 only
    assert report.find("--topk (default)").value == 1


@pytest.mark.parametrize(
    "flags, named",
    [
        ("--topk 2", "--topk 2: DeepSpeed picks the second expert by Gumbel sampling"),
        ("--topk 2 --disable-moe-top2-2nd-expert-sampling", "--topk 2 with --moe-loss-coeff 0.01: DeepSpeed's top-2"),
        ("--mlp-type residual", "--mlp-type residual"),
        ("--num-experts 8 16", "--num-experts 8 16: a different expert count per MoE layer"),
    ],
)
def test_megatron_deepspeed_refusals(flags, named):
    with pytest.raises(ConfigError) as e:
        port_megatron(
            DS_OK.replace("--num-experts 8", "") + flags + ("" if "num-experts" in flags else " --num-experts 8")
        )
    assert "\n" not in str(e.value) and named in str(e.value), str(e.value)


def test_megatron_deepspeed_defaults_drop_tokens_and_skip_layers():
    with pytest.raises(ConfigError) as e:
        port_megatron(DS + "--deepspeed\n")
    msg = str(e.value)
    assert "--expert-interval 2 (Megatron-DeepSpeed's default)" in msg
    assert "--moe-train-capacity-factor 1 with token dropping" in msg


def test_megatron_deepspeed_moe64_recipe_is_refused_with_its_reason():
    # its $(ds_ssh nvidia-smi ...) GPU count, `pwd`, $(date) and $HOSTNAME need values to reach the command
    variables = {"DIR": "/w", "NUM_GPUS": "64", "current_time": "t", "HOSTNAME": "h"}
    with pytest.raises(ConfigError) as e:
        port_megatron(MOE64, variables=variables, world_size=64)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("megatron: --num-experts 64 with --expert-interval 2 (Megatron-DeepSpeed's default)")
    assert "without --swiglu" in msg  # GPT-3 125M's GeLU experts, the second reason
