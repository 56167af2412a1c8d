"""A tiny HF ``DeepseekV3ForCausalLM`` (MLA with a query latent, one dense first layer, 8 experts
in 4 groups with a random selection bias, a shared expert) imported into jaxpar computes the same
logits (fp32, within 1e-5), and jaxpar -> HF -> jaxpar is bitwise exact. Needs torch and
transformers; skipped without them."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch not installed: pip install -e '.[torch]' for the HF parity tests")
transformers = pytest.importorskip(
    "transformers", reason="transformers not installed: pip install -e '.[torch]' for the HF parity tests"
)
if not hasattr(transformers, "DeepseekV3ForCausalLM"):
    pytest.skip("this transformers has no DeepseekV3ForCausalLM", allow_module_level=True)
from safetensors.numpy import load_file  # noqa: E402

from jaxpar.config import ConfigError  # noqa: E402
from jaxpar.models import get_model, llama  # noqa: E402
from jaxpar.port import weights  # noqa: E402

SHAPE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    routed_scaling_factor=2.5,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    v_head_dim=8,
    qk_nope_head_dim=8,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    max_position_embeddings=64,
    num_mtp_layers=0,
    attn_implementation="eager",
    dtype=torch.float32,
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**SHAPE)).float()
    with torch.no_grad():  # norms away from 1, a spread router and bias: a mixed-up mapping shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            if name.endswith("gate.weight"):
                p.copy_(0.5 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    path = tmp_path_factory.mktemp("hf") / "deepseek_v3"
    model.save_pretrained(path)
    return path


def test_config_is_read(hf_dir):
    m = weights.model_config_from_hf(hf_dir)
    assert (m.name, m.num_experts, m.moe_mlp_dim, m.mlp_dim, m.shared_expert_dim) == ("deepseek_v3", 8, 16, 48, 16)
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (24, 16, 8, 8, 8)
    assert (m.router_groups, m.router_group_topk, m.router_scale, m.first_dense_layers) == (4, 2, 2.5, 1)


def test_logits_match_transformers(hf_dir):
    model_cfg = weights.model_config_from_hf(hf_dir)
    model_cfg.compute_dtype = "float32"
    params = weights.load_checked(hf_dir, model_cfg)
    assert float(jnp.abs(params["blocks"]["moe"]["expert_bias"]).max()) > 0.01  # the bias was read
    tokens = np.random.default_rng(0).integers(0, 64, size=(2, 16))
    model = get_model(model_cfg)
    ctx = model.shard_context()
    x = model.embed(params, jnp.asarray(tokens), ctx)
    x = model.run_blocks(x, params["blocks"], jnp.arange(16), ctx)
    got = np.asarray(llama.logits_local(params, x, ctx))
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


def test_round_trip_is_bitwise(hf_dir, tmp_path):
    model_cfg = weights.model_config_from_hf(hf_dir)
    params = weights.load_checked(hf_dir, model_cfg)
    out = weights.save_hf(params, model_cfg, tmp_path / "out")
    a, b = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    again = weights.model_config_from_hf(out)
    assert again.to_dict() == model_cfg.to_dict()


def test_yarn_is_refused_by_name():
    config = transformers.DeepseekV3Config(**SHAPE).to_dict()
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 40.0, "rope_theta": 10000.0}
    with pytest.raises(ConfigError, match="yarn"):
        weights.model_config_from_hf(config)
