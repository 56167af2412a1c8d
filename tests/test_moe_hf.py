"""A tiny HF ``MixtralForCausalLM`` imported into jaxpar computes the same logits (fp32), and
jaxpar -> HF -> jaxpar is bitwise exact. Needs torch and transformers; skipped without them."""

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


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        attn_implementation="eager",
        dtype=torch.float32,
    )
    model = transformers.MixtralForCausalLM(config).float()
    with torch.no_grad():  # norm scales away from 1 so a mixed-up norm mapping shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("hf") / "tiny_mixtral"
    model.save_pretrained(path)
    return path


def test_mixtral_config_is_read(hf_dir):
    m = weights.model_config_from_hf(hf_dir)
    assert (m.name, m.num_experts, m.experts_per_token, m.mlp_dim) == ("mixtral", 4, 2, 48)
    assert m.moe_aux_loss_coeff == 0.0  # output_router_logits is off: HF trains without it


def test_mixtral_logits_match_transformers(hf_dir):
    model_cfg = weights.model_config_from_hf(hf_dir)
    model_cfg.compute_dtype = "float32"
    params = weights.load_checked(hf_dir, model_cfg)
    tokens = np.random.default_rng(0).integers(0, 64, size=(2, 16))
    ctx = llama.context_for(model_cfg)
    x = llama.embed_tokens(params, jnp.asarray(tokens), ctx)
    x = llama.run_blocks(x, params["blocks"], jnp.arange(16), ctx)
    got = np.asarray(llama.logits_local(params, x, ctx))
    hf = transformers.MixtralForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


def test_mixtral_round_trip_is_bitwise(hf_dir, tmp_path):
    model_cfg = weights.model_config_from_hf(hf_dir)
    params = weights.load_checked(hf_dir, model_cfg)
    assert params["blocks"]["moe"]["w_up"].shape == (2, 4, 32, 48)
    out = weights.save_hf(params, model_cfg, tmp_path / "out")
    a, b = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert weights.model_config_from_hf(out).num_experts == 4


def test_wrong_expert_count_names_the_field(hf_dir):
    model_cfg = weights.model_config_from_hf(hf_dir)
    model_cfg.num_experts = 8
    with pytest.raises(ConfigError, match="num_local_experts giving model.num_experts=4"):
        weights.check_hf_model(hf_dir, model_cfg)
