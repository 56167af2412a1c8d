"""Tiny HF ``MixtralForCausalLM``, ``Qwen3ForCausalLM`` and ``Qwen3MoeForCausalLM`` models imported
into jaxpar compute the same logits (fp32), and jaxpar -> HF -> jaxpar is bitwise exact. Needs torch
and transformers; skipped without them."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch not installed: pip install -e '.[torch]' for the HF parity tests")
transformers = pytest.importorskip(
    "transformers", reason="transformers not installed: pip install -e '.[torch]' for the HF parity tests"
)
from safetensors.numpy import load_file  # noqa: E402

from jaxpar.config import ConfigError  # noqa: E402
from jaxpar.models import llama  # noqa: E402
from jaxpar.port import weights  # noqa: E402

SHAPE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    attn_implementation="eager",
    dtype=torch.float32,
)
# family -> (HF model class, its config with the family's own fields, (num_experts, mlp_dim) jaxpar reads)
FAMILIES = {
    "mixtral": (
        "MixtralForCausalLM",
        transformers.MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2),
        (4, 48),
    ),
    "qwen3": ("Qwen3ForCausalLM", transformers.Qwen3Config(**SHAPE), (0, 48)),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        transformers.Qwen3MoeConfig(
            **SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=False
        ),
        (4, 24),
    ),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def hf_dir(request, tmp_path_factory):
    cls, config, _ = FAMILIES[request.param]
    torch.manual_seed(0)
    model = getattr(transformers, cls)(config).float()
    with torch.no_grad():  # norm scales away from 1 so a mixed-up norm mapping shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("hf") / request.param
    model.save_pretrained(path)
    return request.param, path


def test_config_is_read(hf_dir):
    family, path = hf_dir
    m = weights.model_config_from_hf(path)
    assert (m.name, (m.num_experts, m.mlp_dim)) == (family, FAMILIES[family][2])
    assert m.qk_norm == family.startswith("qwen3")
    assert m.moe_aux_loss_coeff == 0.0  # output_router_logits is off: HF trains without it
    if family == "qwen3_moe":
        assert m.router_norm_topk is False  # norm_topk_prob


def test_logits_match_transformers(hf_dir):
    family, path = hf_dir
    model_cfg = weights.model_config_from_hf(path)
    model_cfg.compute_dtype = "float32"
    params = weights.load_checked(path, model_cfg)
    tokens = np.random.default_rng(0).integers(0, 64, size=(2, 16))
    ctx = llama.shard_context_for(model_cfg)
    x = llama.embed_tokens(params, jnp.asarray(tokens), ctx)
    x = llama.run_blocks(x, params["blocks"], jnp.arange(16), ctx)
    got = np.asarray(llama.logits_local(params, x, ctx))
    hf = getattr(transformers, FAMILIES[family][0]).from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


def test_round_trip_is_bitwise(hf_dir, tmp_path):
    family, path = hf_dir
    model_cfg = weights.model_config_from_hf(path)
    params = weights.load_checked(path, model_cfg)
    out = weights.save_hf(params, model_cfg, tmp_path / "out")
    a, b = load_file(path / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    again = weights.model_config_from_hf(out)
    assert (again.name, again.num_experts, again.mlp_dim) == (family, *FAMILIES[family][2])


def test_wrong_expert_count_names_the_field(hf_dir):
    family, path = hf_dir
    model_cfg = weights.model_config_from_hf(path)
    if not model_cfg.num_experts:
        pytest.skip("a dense family")
    model_cfg.num_experts = 8
    with pytest.raises(ConfigError, match="giving model.num_experts=4"):
        weights.check_hf_model(path, model_cfg)


def test_qwen3_moe_with_dense_layers_is_refused():
    config = FAMILIES["qwen3_moe"][1].to_dict() | {"decoder_sparse_step": 2}
    with pytest.raises(ConfigError, match="decoder_sparse_step=2"):
        weights.model_config_from_hf(config)
