"""The model interface (jaxpar.models): registry, families, derived inventory, a third family end to end."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar.models as models
from jaxpar.config import ConfigError, load_config
from jaxpar.models import inventory
from jaxpar.models.base import Model, ShardContext
from jaxpar.ops import zero3
from jaxpar.port import weights
from tests.helpers import ROOT, make_setup, run_steps, tiny_config

CONFIGS = sorted((ROOT / "configs").glob("*.py"))


# --------------------------------------------------------------------------- registry


def test_unknown_model_name_is_one_line_listing_the_known_ones():
    with pytest.raises(
        ConfigError,
        match=r"^model.name='bogus' is not a known model; use one of deepseek_v3, gpt, llama, mixtral, qwen3, qwen3_moe$",
    ) as e:
        tiny_config("--config.model.name=bogus")
    assert "\n" not in str(e.value)


def test_gpt_family_pins_the_classic_block():
    with pytest.raises(ConfigError, match=r"model.norm='rmsnorm': model.name=gpt .* needs model.norm='layernorm'"):
        models.get_model(tiny_config("--config.model.name=gpt").model)
    gpt = tiny_config(
        "--config.model.name=gpt",
        "--config.model.norm=layernorm",
        "--config.model.mlp_activation=gelu",
        "--config.model.position=learned",
    ).model
    assert type(models.get_model(gpt)).__name__ == "GptModel"
    # the llama family keeps every switch combination (e.g. LLaMA with learned positions)
    assert models.get_model(tiny_config("--config.model.position=learned").model).name == "llama"
    with pytest.raises(ConfigError, match=r"model.name='gpt' has no HF checkpoint format"):
        weights.hf_config_from_model(gpt)


def test_configs_name_their_family():
    names = {path.stem: load_config(str(path)).model.name for path in CONFIGS}
    assert names.pop("gpt3_175b") == "gpt"
    assert {names.pop("mixtral_8x7b"), names.pop("tiny_mixtral")} == {"mixtral"}
    assert names.pop("qwen3_30b_a3b") == "qwen3_moe"
    assert {names.pop("deepseek_v3_671b"), names.pop("tiny_deepseek_v3")} == {"deepseek_v3"}
    assert set(names.values()) == {"llama"}


# --------------------------------------------------------------------------- inventory


def closed_form_count(m) -> int:
    """The parameter count written by hand (what the removed jaxpar.config.param_count_estimate was)."""
    h, f, v = m.embed_dim, m.mlp_dim, m.vocab_size
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    norm = 2 if m.norm == "layernorm" else 1
    mlp = (3 if m.mlp_activation == "swiglu" else 2) * h * f
    if m.num_experts:  # the experts and the router
        mlp = m.num_experts * mlp + h * m.num_experts + 3 * h * m.shared_expert_dim
    per_layer = 2 * h * q + 2 * h * kv + mlp + 2 * h * norm + (2 * m.head_dim if m.qk_norm else 0)
    positions = m.max_seq_len * h if m.position == "learned" else 0
    return m.num_layers * per_layer + v * h * (1 if m.tie_embeddings else 2) + h * norm + positions


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_inventory_equals_the_real_parameter_tree(path):
    m = load_config(str(path)).model
    model = models.get_model(m)
    abstract = model.abstract_params()
    real = sum(math.prod(a.shape) for a in jax.tree.leaves(abstract))
    tensors = inventory.param_tensors(m)
    assert inventory.count_params(m) == real == (real if m.name == "deepseek_v3" else closed_form_count(m))
    assert len(tensors) == len(jax.tree.leaves(abstract))
    stacked = [t for t in tensors if t.place == "layer"]
    assert inventory.stacked_layers(m) * sum(t.size for t in stacked) == sum(
        math.prod(a.shape) for a in jax.tree.leaves(abstract[model.stacked])
    )
    assert all("layers" not in dict(t.dims) for t in tensors)  # the scan dim is dropped per layer
    names = {t.name for t in tensors}
    assert ("positions" in names) == (m.position == "learned")
    assert ("mlp_w_gate" in names) == (m.mlp_activation == "swiglu" and not m.num_experts)
    assert ("moe_w_gate" in names) == bool(m.num_experts)
    assert ("output" in names) != m.tie_embeddings


def test_inventory_is_cached_per_model_config():
    m = load_config(str(ROOT / "configs" / "llama2_70b.py")).model
    assert inventory.param_tensors(m) is inventory.param_tensors(m.copy_and_resolve_references())


def test_zero3_dims_tree_matches_the_layouts():

    cfg = tiny_config("--config.mesh.data=4", "--config.mesh.tensor=2", "--config.parallel.zero_stage=3")
    setup = make_setup(cfg)
    dims = zero3.zero3_dims(setup.train_form.placements)
    assert jax.tree.structure(dims) == jax.tree.structure(setup.train_form.abstract)
    assert dims["blocks"]["attn"]["wq"] == 1 and dims["embed"] == 1  # embed dim (tensor splits heads / vocab)
    assert zero3.layer_dims(dims["blocks"])["attn"]["wq"] == 0
    assert setup.builder.shard_context().zero3
    assert zero3.zero3_dims(make_setup(tiny_config()).train_form.placements) is None


def test_no_module_outside_models_imports_a_family():
    pattern = re.compile(
        r"^\s*(from jaxpar\.models import (llama|gpt)\b|from jaxpar\.models\.(llama|gpt) import"
        r"|import jaxpar\.models\.(llama|gpt))|\bllama\._",
        re.M,
    )
    hits = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "jaxpar").rglob("*.py")
        if p.parent.name != "models" and pattern.search(p.read_text())
    ]
    assert hits == []


# --------------------------------------------------------------------------- a third family


class ToyMlp(Model):
    """A family written against the interface alone: embedding, residual tanh MLP layers, output
    layer. Data parallel / ZeRO only: with mesh.tensor=1 the sums over ``tensor`` (which the
    interface asks of the embedding output, each block's output and the loss) are identities."""

    name = "toy_mlp"
    roles = {"embed": "embedding", "head": "output"}

    @classmethod
    def validate(cls, cfg) -> None:
        if cfg.tie_embeddings:
            raise ConfigError("model.tie_embeddings=true: toy_mlp has an untied head")

    def init(self, key):
        m, ks = self.cfg, jax.random.split(key, 4)
        L, h, f, v = m.num_layers, m.embed_dim, m.mlp_dim, m.vocab_size
        return {
            "embed": 0.02 * jax.random.normal(ks[0], (v, h)),
            "blocks": {
                "w_in": 0.02 * jax.random.normal(ks[1], (L, h, f)),
                "w_out": 0.02 * jax.random.normal(ks[2], (L, f, h)),
            },
            "head": 0.02 * jax.random.normal(ks[3], (h, v)),
        }

    def logical_axes(self):
        return {
            "embed": ("vocab", "embed"),
            "blocks": {"w_in": ("layers", "embed", "mlp"), "w_out": ("layers", "mlp", "embed")},
            "head": ("embed", "vocab"),
        }

    def shard_context(self, **parallel):
        return ShardContext(compute_dtype=self.cfg.compute_dtype, **parallel)

    def embed(self, params, tokens, ctx):
        x = jnp.take(params["embed"], tokens, axis=0).astype(ctx.compute_dtype)
        return x if ctx.tensor_axis is None else jax.lax.psum(x, ctx.tensor_axis)

    def block(self, x, layer, positions, ctx):  # mlp-split weights: the output is summed over tensor
        y = jnp.tanh(x @ layer["w_in"].astype(x.dtype)) @ layer["w_out"].astype(x.dtype)
        return x + (y if ctx.tensor_axis is None else jax.lax.psum(y, ctx.tensor_axis))

    def head_loss(self, params, x, targets, ctx):
        logits = (x @ params["head"].astype(x.dtype)).astype(jnp.float32)
        loss = -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1))
        return loss if ctx.tensor_axis is None else jax.lax.psum(loss, ctx.tensor_axis)


@pytest.fixture(scope="module")
def toy():
    models.register(ToyMlp)
    yield [
        "--config.model.name=toy_mlp",
        "--config.mesh.data=2",
        "--config.mesh.tensor=1",
        "--config.model.num_layers=2",
        "--config.model.mlp_dim=256",
    ]
    models.unregister("toy_mlp")


@pytest.fixture(scope="module")
def toy_replicated(toy):
    """Two steps of the toy family on data=2 without ZeRO: (history, params)."""
    history, params, _ = run_steps(tiny_config(*toy), 2)  # step 1 runs at lr 0 (warm-up)
    return history, params


@pytest.mark.parametrize(
    "layout",
    [
        ("--config.parallel.zero_stage=3",),
        ("--config.mesh.data=1", "--config.mesh.pipeline=2", "--config.parallel.microbatches=2"),
    ],
    ids=["zero3_d2", "pipeline_p2_m2"],
)
def test_a_third_family_trains_on_two_devices(toy, toy_replicated, layout):
    """ZeRO-3 (data=2) and a 1F1B pipeline (2 stages) through the interface alone: the first loss is
    the plain single-device loss of the same parameters, and two steps land where the replicated
    data-parallel run lands."""
    cfg = tiny_config(*toy, *layout)
    m = cfg.model
    assert inventory.count_params(m) == 2 * m.vocab_size * m.embed_dim + 2 * m.num_layers * m.embed_dim * m.mlp_dim
    history, params, setup = run_steps(cfg, 2)
    assert setup.builder.shard_context().zero3 == (cfg.parallel.zero_stage == 3)  # ZeRO-3: layers gathered from shards
    assert (setup.pipeline is not None) == (cfg.mesh.pipeline == 2)
    model = models.get_model(m)
    rng = np.random.default_rng(0)  # the batch run_steps drew
    rows = rng.integers(0, m.vocab_size, size=(cfg.train.global_batch, cfg.train.seq_len + 1))
    want = model.loss_sum(model.init(jax.random.key(0)), jnp.asarray(rows), model.shard_context())
    assert history[0]["loss"] == pytest.approx(float(want) / rows[:, 1:].size, rel=1e-5)
    assert history[0]["loss"] == pytest.approx(toy_replicated[0][0]["loss"], rel=1e-6)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(toy_replicated[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert not np.allclose(params["head"], np.asarray(model.init(jax.random.key(0))["head"]))


def test_an_unregistered_family_is_unknown_again(toy):
    assert "toy_mlp" in models.known_models()
    models.unregister("toy_mlp")
    try:
        with pytest.raises(ConfigError, match="model.name='toy_mlp' is not a known model"):
            tiny_config(*toy)
    finally:
        models.register(ToyMlp)
