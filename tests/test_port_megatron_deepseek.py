"""``jaxpar port megatron`` on DeepSeek-V3-style recipes: ``--multi-latent-attention`` with MoE ports to
``model.name=deepseek_v3``, each MLA / router flag onto its field (Megatron-LM at 00611e6:
moe_utils.py's routing and expert-bias update, multi_latent_attention.py); what jaxpar does not
compute (YaRN, MTP, the sequence-wise aux loss, random routing, group scores of other than the top 2)
is refused naming that difference. Each case is a small script.
"""

from __future__ import annotations

import pytest

from jaxpar.cli import main
from jaxpar.config import ConfigError, validate
from jaxpar.port.megatron import port_megatron
from tests.helpers import ROOT

# a small DeepSeek-V3-like Megatron-core recipe (8 GPUs, EP 2); each case adds flags to it
BASE = """GPUS=8
torchrun --nproc_per_node $GPUS pretrain_gpt.py --num-layers 4 --hidden-size 256 --num-attention-heads 8 \\
  --seq-length 128 --micro-batch-size 1 --global-batch-size 16 --lr 1e-4 --train-iters 100 --swiglu \\
  --normalization RMSNorm --norm-epsilon 1e-6 --position-embedding-type rope --disable-bias-linear \\
  --vocab-size 1000 --bf16 --ffn-hidden-size 512 --num-experts 8 --moe-router-topk 2 \\
  --expert-model-parallel-size 2 --use-distributed-optimizer --moe-ffn-hidden-size 128 \\
  --moe-router-score-function sigmoid --multi-latent-attention --qk-layernorm --kv-lora-rank 64 \\
  --qk-head-dim 32 --qk-pos-emb-head-dim 16 --v-head-dim 32 --hidden-dropout 0 --attention-dropout 0 """


def _port(extra: str = ""):
    return port_megatron(BASE + extra + "\n")


def _refusal(extra: str) -> str:
    with pytest.raises(ConfigError) as e:
        _port(extra)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("megatron: "), msg
    return msg


def test_mla_with_experts_ports_to_deepseek_v3():
    cfg, report = _port()
    m = cfg.model
    assert (m.name, m.num_heads, m.num_kv_heads, m.head_dim) == ("deepseek_v3", 8, 8, 48)
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (0, 64, 32, 16, 32)
    assert (m.mlp_dim, m.moe_mlp_dim, m.first_dense_layers) == (512, 128, 0)  # dense width kept for dense layers
    assert (m.router_score, m.router_norm_topk, m.router_scale, m.router_bias_rate) == ("sigmoid", True, 1.0, 0.0)
    assert report.find("--qk-layernorm").status == "mapped" and "latents" in report.find("--qk-layernorm").note
    assert report.find("--q-lora-rank (default)").value == 0
    assert not report.model_changes
    validate(cfg, num_devices=8)


def test_query_latent_maps():
    cfg, _ = _port("--q-lora-rank 96")
    assert cfg.model.q_lora_rank == 96


def test_expert_bias_and_its_rate_map():
    cfg, report = _port("--moe-router-enable-expert-bias --moe-router-bias-update-rate 2e-3")
    assert cfg.model.router_bias_rate == 2e-3
    assert report.find("--moe-router-bias-update-rate").status == "mapped"
    cfg, report = _port("--moe-router-enable-expert-bias")
    assert cfg.model.router_bias_rate == 1e-3  # Megatron's default rate
    assert report.find("--moe-router-bias-update-rate (default)").value == 1e-3


def test_topk_scaling_factor_maps_to_the_route_scale():
    cfg, _ = _port("--moe-router-topk-scaling-factor 2.5")
    assert cfg.model.router_scale == 2.5


def test_group_limited_routing_maps_when_the_group_score_is_the_top_2():
    cfg, _ = _port("--moe-router-num-groups 4 --moe-router-group-topk 1")  # topk 2 // 1 = 2
    assert (cfg.model.router_groups, cfg.model.router_group_topk) == (4, 1)
    msg = _refusal("--moe-router-num-groups 2 --moe-router-group-topk 2")  # topk 2 // 2 = 1
    assert "--moe-router-group-topk 2: Megatron scores a group by the sum of its top topk // group_topk = 1" in msg


def test_dense_prefix_maps_to_first_dense_layers():
    cfg, report = _port("--moe-layer-freq [0]*1+[1]*3")
    assert cfg.model.first_dense_layers == 1 and report.find("--moe-layer-freq").status == "mapped"
    assert _port("--moe-layer-freq [1]*4")[0].model.first_dense_layers == 0
    assert "--moe-layer-freq 2: dense layers between or after" in _refusal("--moe-layer-freq 2")
    assert "lists 3 layers, --num-layers is 4" in _refusal("--moe-layer-freq [0]+[1]*2")
    assert "not an int or a list expression" in _refusal("--moe-layer-freq [1]*9**9")


def test_shared_expert_width_maps():
    cfg, _ = _port("--moe-shared-expert-intermediate-size 256")
    assert (cfg.model.shared_expert_dim, cfg.model.moe_mlp_dim) == (256, 128)


def test_mla_without_latent_norms_is_a_model_change():
    _, report = port_megatron(BASE.replace("--qk-layernorm ", "") + "\n", approximate=True)
    assert [e.source for e in report.model_changes] == ["(--qk-layernorm)"]
    assert "without --qk-layernorm Megatron's MLA has no latent norms" in report.model_changes[0].note


def test_yarn_and_mtp_are_refused_for_what_they_compute():
    _, report = _port_approx("--rotary-scaling-factor 40 --mscale-all-dim 1.0 --mtp-num-layers 1")
    notes = {e.source: e.note for e in report.model_changes}
    assert "interpolated by 40 at every sequence length" in notes["--rotary-scaling-factor"]
    assert "mscale^2 = 1.874" in notes["--rotary-scaling-factor"]  # (0.1 * ln 40 + 1)^2
    assert "multi-token prediction" in notes["--mtp-num-layers"]


def _port_approx(extra: str):
    return port_megatron(BASE + extra + "\n", approximate=True)


def test_dropout_is_a_model_change_of_deepseek_v3():
    cfg, report = port_megatron(BASE.replace("--hidden-dropout 0 ", "") + "\n", approximate=True)
    assert [e.source for e in report.model_changes] == ["(hidden-dropout)"]
    assert (
        "--hidden-dropout 0.1 (Megatron's default): jaxpar's deepseek_v3 trains without" in report.model_changes[0].note
    )
    assert cfg.model.dropout == 0.0


def test_dense_mla_is_refused_for_its_dense_mlps():
    _, report = port_megatron(BASE.replace("--num-experts 8 ", "") + "\n", approximate=True)
    notes = {e.source: e.note for e in report.model_changes}
    assert "jaxpar's MLA is in its deepseek_v3 family, whose MLPs are experts" in notes["--multi-latent-attention"]


def test_mla_dims_must_be_given():
    with pytest.raises(ConfigError, match=r"--multi-latent-attention without --kv-lora-rank; give it"):
        port_megatron(BASE.replace("--kv-lora-rank 64 ", "") + "\n")


def test_deepseek_v3_recipe_ports_with_the_671b_shape():
    recipe = ROOT / "tests" / "fixtures" / "recipes" / "corpus" / "megatron" / "mfsdp_deepseek_v3.sh"
    cfg, report = port_megatron(recipe, world_size=256, approximate=True)
    m = cfg.model
    shape = (m.num_layers, m.first_dense_layers, m.embed_dim, m.mlp_dim, m.moe_mlp_dim, m.shared_expert_dim)
    assert shape == (61, 3, 7168, 18432, 2048, 2048)
    assert (m.q_lora_rank, m.kv_lora_rank, m.head_dim, m.v_head_dim) == (1536, 512, 192, 128)
    assert (m.num_experts, m.experts_per_token, m.router_groups, m.router_group_topk) == (256, 8, 8, 4)
    assert (m.router_scale, m.router_bias_rate) == (2.5, 1e-3)
    cfg.model.vocab_size = 129280  # the tokenizer's, which the recipe leaves to the user
    validate(cfg, num_devices=256)
    changes = [e.source for e in report.model_changes]
    assert changes == [
        "(vocabulary)",
        "--rotary-scaling-factor",
        "--mtp-num-layers",
        "--moe-router-force-load-balancing",
        "--moe-router-load-balancing-type",
    ]


def test_qwen3_moe_flavor_is_refused_for_its_routing_bias(capsys):
    toml = ROOT / "tests" / "fixtures" / "recipes" / "corpus" / "torchtitan" / "qwen3_moe_debug.toml"
    assert main(["port", "torchtitan", str(toml)]) == 2
    err = capsys.readouterr().err
    assert "per-expert routing bias (MoEArgs' load_balance_coeff 1e-3 at 238fa99, aux-loss-free), which " in err
    assert "jaxpar's qwen3_moe lacks (jaxpar has that bias in deepseek_v3 only)" in err
