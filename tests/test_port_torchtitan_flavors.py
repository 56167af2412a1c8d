"""torchtitan's dense Qwen3 flavors port to the qwen3 family (QK-norm) and its 2024 Llama 2 flavors
to llama, each with the flavor's shape, from verbatim torchtitan recipes; its MoE flavors stay
refused, naming the expert bias."""

from __future__ import annotations

from jaxpar.models.inventory import count_params
from jaxpar.port.torchtitan import port_torchtitan
from tests.helpers import ROOT

CORPUS = ROOT / "tests" / "fixtures" / "recipes" / "corpus" / "torchtitan"


def test_qwen3_32b_ports_with_its_shape():
    cfg, report = port_torchtitan(CORPUS / "qwen3_32b.toml", world_size=8)
    m = cfg.model
    assert (m.name, m.qk_norm, m.embed_dim, m.num_layers, m.num_heads, m.num_kv_heads) == (
        "qwen3",
        True,
        5120,
        64,
        64,
        8,
    )
    assert (m.head_dim, m.mlp_dim, m.vocab_size, m.rope_theta, m.norm_eps) == (128, 25600, 151936, 1e6, 1e-6)
    assert count_params(m) == 32_762_123_264  # Qwen3-32B: 32.8B (Qwen Team 2025)
    assert report.find("model.flavor").status == "mapped"
    assert (cfg.mesh.data, cfg.parallel.zero_stage, cfg.train.seq_len) == (8, 3, 4096)


def test_qwen3_moe_flavor_names_the_expert_bias():
    _, report = port_torchtitan(CORPUS / "qwen3_moe_debug.toml", world_size=8)
    entry = report.find("model.name")
    assert entry.status == "unsupported" and "load_balance_coeff" in entry.note


def test_torchtitan_2024_llama2_flavors_port_with_their_shape():
    """The 2024 schema's ``llama2`` 7B: Llama 2 7B's 6,738,415,616 parameters (Touvron et al. 2023),
    the vocabulary assumed from the Llama 2 tokenizer and said so."""
    cfg, report = port_torchtitan(CORPUS / "2024_llama2_7b.toml", world_size=8)
    assert count_params(cfg.model) == 6_738_415_616
    row = report.find("model.flavor")
    assert row.status == "approximated" and "32000" in row.note and "not read" in row.note
