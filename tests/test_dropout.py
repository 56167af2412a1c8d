"""Dropout (``model.dropout``, ``model.attention_dropout``; :mod:`jaxpar.ops.dropout`).

The masks are a pure function of (seed, step, layer, site, global indices), so every layout trains
exactly what one device trains (fp32, relative 1e-5 on loss, gradient norm and parameters after
three steps), a resumed run is bitwise the uninterrupted one, and the masks drop the configured
share of elements, differently per step, layer and seed. The default suite holds the unit tests
(masks, rates, slices, the blockwise kernel, refusals, nothing traced at 0, importers); for the
test budget, ``JAXPAR_SLOW=1`` runs the layouts against one device (ZeRO-3 + TP + SP, a 1F1B
pipeline, the context ring with accumulation, each feature alone, the rest of the grid) and the
bitwise resume.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import ConfigError, validate
from jaxpar.models.llama import shard_context_for
from jaxpar.ops import attention as attn
from jaxpar.ops import dropout
from jaxpar.parallel import pipeline
from jaxpar.port import weights
from jaxpar.port.megatron import port_megatron
from tests.helpers import max_rel_error, run_steps, tiny_config

STEPS = 3
SLOW = os.environ.get("JAXPAR_SLOW") == "1"
RATES = ["--config.model.dropout=0.1", "--config.model.attention_dropout=0.1"]
BLOCKWISE = ["--config.model.attention=blockwise", "--config.model.attention_block=16"]


def _cfg(*overrides: str):
    # optim.eps 1e-4: with dropout a few embedding-gradient entries are ~1e-8 (a token seen once or twice,
    # most of its paths dropped), where Adam's 1/(sqrt(v) + 1e-8) turns reduction-order roundoff into a
    # 1% difference of that entry's update (measured: 2 of 32768 entries at 4e-5 relative, ZeRO-3 d8);
    # at 1e-4 every entry agrees to ~1e-7. Loss and gradient norm are compared at 1e-5 either way.
    return tiny_config("--config.mesh.tensor=1", "--config.optim.eps=1e-4", *RATES, *overrides)


# (name, overrides) against one device with the dot-product attention. The default suite combines
# features to keep its cost small (each layout compiles a step): every mask index is exercised
# (data rows, tensor heads and SP's sequence split, pipeline stages' layers and microbatch rows);
# context ranks' positions with the ring's blockwise kernel and accumulation's rows run under JAXPAR_SLOW.
LAYOUTS = [
    (
        "d4_t2_sp_zero3",
        [
            "--config.mesh.data=4",
            "--config.mesh.tensor=2",
            "--config.parallel.sequence_parallel=true",
            "--config.parallel.zero_stage=3",
        ],
    ),
    ("pp2_1f1b_d2_m4", ["--config.mesh.data=2", "--config.mesh.pipeline=2", "--config.parallel.microbatches=4"]),
]
SLOW_LAYOUTS = [  # the context ring with accumulation left the default suite for its budget (its blockwise compile)
    (
        "c2_d2_ring_accumulate4",
        [*BLOCKWISE, "--config.mesh.data=2", "--config.mesh.context=2", "--config.parallel.microbatches=4"],
    ),
    ("zero3_d8", ["--config.mesh.data=8", "--config.parallel.zero_stage=3"]),
    ("d4_t2_sp", ["--config.mesh.data=4", "--config.mesh.tensor=2", "--config.parallel.sequence_parallel=true"]),
    ("d2_accumulate4", ["--config.mesh.data=2", "--config.parallel.microbatches=4"]),
    ("c2_ring", [*BLOCKWISE, "--config.mesh.context=2"]),
    ("blockwise_one_device", [*BLOCKWISE, "--config.mesh.data=1"]),
    ("d4_t2_no_sp_zero1", ["--config.mesh.data=4", "--config.mesh.tensor=2", "--config.parallel.zero_stage=1"]),
    ("zero2_d4_m2", ["--config.mesh.data=4", "--config.parallel.zero_stage=2", "--config.parallel.microbatches=2"]),
    (
        "d2_t2_zero3_sp_m2",
        [
            "--config.mesh.data=2",
            "--config.mesh.tensor=2",
            "--config.parallel.zero_stage=3",
            "--config.parallel.sequence_parallel=true",
            "--config.parallel.microbatches=2",
        ],
    ),
    (
        "pp2_gpipe_d2_t2_m2",
        [
            "--config.mesh.data=2",
            "--config.mesh.tensor=2",
            "--config.mesh.pipeline=2",
            "--config.parallel.pipeline_schedule=gpipe",
            "--config.parallel.microbatches=2",
        ],
    ),
    (
        "pp2_interleaved_m4",
        [
            "--config.mesh.data=2",
            "--config.mesh.pipeline=2",
            "--config.parallel.microbatches=4",
            "--config.parallel.pipeline_schedule=interleaved",
            "--config.parallel.virtual_stages=2",
        ],
    ),
    (
        "pp2_1f1b_full_remat",
        [
            "--config.mesh.data=2",
            "--config.mesh.pipeline=2",
            "--config.parallel.microbatches=2",
            "--config.parallel.recompute=full",
        ],
    ),
    (
        "pp2_zero2_m4",
        [
            "--config.mesh.data=2",
            "--config.mesh.pipeline=2",
            "--config.parallel.microbatches=4",
            "--config.parallel.zero_stage=2",
        ],
    ),
    ("selective_remat_d8", ["--config.mesh.data=8", "--config.parallel.recompute=selective"]),
    (
        "c2_t2_sp_ring_z3",
        [
            *BLOCKWISE,
            "--config.mesh.context=2",
            "--config.mesh.tensor=2",
            "--config.mesh.data=2",
            "--config.parallel.sequence_parallel=true",
            "--config.parallel.zero_stage=3",
        ],
    ),
    (
        "c4_d2_all_gather",
        [
            *BLOCKWISE,
            "--config.mesh.context=4",
            "--config.mesh.data=2",
            "--config.parallel.context_exchange=all_gather",
        ],
    ),
]


@pytest.fixture(scope="module")
def reference():
    history, params, _ = run_steps(_cfg("--config.mesh.data=1"), STEPS)
    return history, params


def _matches(reference, name, overrides):
    ref_history, ref_params = reference
    history, params, setup = run_steps(_cfg(*overrides), STEPS)
    cfg = setup.cfg
    if cfg.mesh.pipeline > 1:  # stage form -> model form (layers in model order, embedding and head apart)
        params = pipeline.to_model_form(params, cfg.mesh.pipeline, cfg.parallel.virtual_stages)
    for got, want in zip(history, ref_history, strict=True):
        assert abs(got["loss"] - want["loss"]) / want["loss"] < 1e-5, (name, got, want)
        assert abs(got["grad_norm"] - want["grad_norm"]) / want["grad_norm"] < 1e-5, (name, got, want)
    assert max_rel_error(params, ref_params) < 1e-5, name
    assert setup.train_step._cache_size() == 1


@pytest.mark.skipif(not SLOW, reason="JAXPAR_SLOW=1: dropout layouts against one device (test budget)")
@pytest.mark.parametrize("name, overrides", LAYOUTS, ids=[n for n, _ in LAYOUTS])
def test_layout_with_dropout_matches_single_device(reference, name, overrides):
    _matches(reference, name, overrides)


@pytest.mark.skipif(not SLOW, reason="JAXPAR_SLOW=1: the rest of the dropout grid")
@pytest.mark.parametrize("name, overrides", SLOW_LAYOUTS, ids=[n for n, _ in SLOW_LAYOUTS])
def test_layout_with_dropout_matches_single_device_slow(reference, name, overrides):
    _matches(reference, name, overrides)


@pytest.mark.skipif(not SLOW, reason="JAXPAR_SLOW=1: the learned-position (gpt) grid")
def test_gpt_with_dropout_matches_single_device_slow():
    gpt = [
        "--config.model.name=gpt",
        "--config.model.norm=layernorm",
        "--config.model.mlp_activation=gelu",
        "--config.model.position=learned",
        *BLOCKWISE,
    ]
    ref_history, ref_params, _ = run_steps(_cfg("--config.mesh.data=1", *gpt), STEPS)
    history, params, _ = run_steps(
        _cfg(
            "--config.mesh.data=2",
            "--config.mesh.tensor=2",
            "--config.mesh.context=2",
            "--config.parallel.sequence_parallel=true",
            *gpt,
        ),
        STEPS,
    )
    for got, want in zip(history, ref_history, strict=True):
        assert abs(got["loss"] - want["loss"]) / want["loss"] < 1e-5
    assert max_rel_error(params, ref_params) < 1e-5


# --------------------------------------------------------------------------- it drops


@pytest.mark.skipif(not SLOW, reason="JAXPAR_SLOW=1: needs the one-device reference run (test budget)")
def test_dropout_changes_the_loss(reference):
    """The first step's loss (same parameters, same batch) moves with dropout on."""
    ref_history, _ = reference
    off, _, _ = run_steps(tiny_config("--config.mesh.data=1", "--config.mesh.tensor=1"), 1)
    assert abs(ref_history[0]["loss"] - off[0]["loss"]) / off[0]["loss"] > 1e-4, (ref_history[0], off[0])


def _ctx(rate=0.0, attention_rate=0.0, seed=0, step=0, layer=0, rows=None):
    ctx = dataclasses.replace(shard_context_for(tiny_config().model), dropout=rate, attention_dropout=attention_rate)
    noise = dropout.Noise(
        dropout.step_key(seed, jnp.int32(step)), jnp.arange(8, dtype=jnp.int32) if rows is None else rows, layer
    )
    return dataclasses.replace(ctx, noise=noise)


def _hidden_mask(rate=0.1, site=dropout.ATTENTION_OUT, **kw):
    x = jnp.ones((8, 64, 128), jnp.float32)
    y = dropout.hidden(x, jnp.arange(64, dtype=jnp.int32), site, _ctx(rate, **kw))
    return np.asarray(y)


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_hidden_mask_drops_its_rate_and_scales_the_rest(rate):
    y = _hidden_mask(rate)
    n = y.size  # 65536 elements: the share of zeros is rate within 5 standard deviations
    zeros = float(np.mean(y == 0))
    assert abs(zeros - rate) < 5 * math.sqrt(rate * (1 - rate) / n), zeros
    np.testing.assert_allclose(y[y != 0], 1 / (1 - rate), rtol=1e-6)


def test_attention_mask_drops_its_rate():
    noise = dropout.AttentionNoise(jnp.uint32(12345), jnp.arange(4, dtype=jnp.int32), 0, 0.25)
    keep = np.asarray(noise.keep(jnp.arange(8).reshape(2, 4), jnp.arange(64), jnp.arange(64)))
    assert keep.shape == (4, 2, 4, 64, 64)
    dropped = 1 - float(keep.mean())
    assert abs(dropped - 0.25) < 5 * math.sqrt(0.25 * 0.75 / keep.size), dropped
    # the head offset (tensor parallelism) selects the global heads' bits
    shifted = dropout.AttentionNoise(jnp.uint32(12345), jnp.arange(4, dtype=jnp.int32), 4, 0.25)
    np.testing.assert_array_equal(
        np.asarray(shifted.keep(jnp.arange(4).reshape(1, 4), jnp.arange(64), jnp.arange(64)))[:, 0], keep[:, 1]
    )


def test_masks_differ_by_step_layer_seed_site_and_row():
    base = _hidden_mask() == 0
    others = {
        "step": _hidden_mask(step=1),
        "layer": _hidden_mask(layer=1),
        "seed": _hidden_mask(seed=1),
        "site": _hidden_mask(site=dropout.MLP_OUT),
        "rows": _hidden_mask(rows=jnp.arange(8, 16, dtype=jnp.int32)),
    }
    for name, other in others.items():
        differ = float(np.mean(base != (other == 0)))
        # independent masks disagree on 2p(1-p) = 18% of the elements
        assert abs(differ - 0.18) < 0.02, (name, differ)
    np.testing.assert_array_equal(_hidden_mask() == 0, base)  # and the same inputs give the same mask


def test_mask_slices_are_the_global_mask():
    """A shard's mask (its rows, positions) is the slice of the whole batch's mask: what makes layouts agree."""
    whole = dropout.keep_mask(jnp.uint32(7), *dropout.outer(jnp.arange(8), jnp.arange(64), jnp.arange(16)), rate=0.3)
    part = dropout.keep_mask(
        jnp.uint32(7), *dropout.outer(jnp.arange(2, 4), jnp.arange(32, 48), jnp.arange(16)), rate=0.3
    )
    np.testing.assert_array_equal(np.asarray(whole)[2:4, 32:48], np.asarray(part))


@pytest.mark.parametrize("seq", [40, *([64] if SLOW else [])])
def test_blockwise_attention_dropout_matches_dot_product(seq):
    """Forward and gradients of the blockwise kernel (mask redrawn per block in the custom VJP) against
    autodiff of the reference path with the same mask; GQA, ragged blocks at seq 40."""
    kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (2, seq, 4, 16), jnp.float32)
    k = jax.random.normal(kk, (2, seq, 2, 16), jnp.float32)
    v = jax.random.normal(kv, (2, seq, 2, 16), jnp.float32)
    w = jax.random.normal(kd, (2, seq, 4, 16), jnp.float32)
    noise = dropout.AttentionNoise(jnp.uint32(99), jnp.array([3, 5], jnp.int32), 0, 0.2)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w)

    ref = loss(lambda q, k, v: attn.dot_product_attention(q, k, v, noise=noise))
    blk = loss(lambda q, k, v: attn.blockwise_attention(q, k, v, block_q=16, block_kv=16, noise=noise))
    plain = loss(lambda q, k, v: attn.dot_product_attention(q, k, v))
    assert abs(float(ref(q, k, v)) - float(plain(q, k, v))) > 1e-2  # the mask does something
    assert abs(float(blk(q, k, v)) - float(ref(q, k, v))) < 1e-4 * abs(float(ref(q, k, v)))
    for g_blk, g_ref in zip(jax.grad(blk, (0, 1, 2))(q, k, v), jax.grad(ref, (0, 1, 2))(q, k, v), strict=True):
        np.testing.assert_allclose(np.asarray(g_blk), np.asarray(g_ref), rtol=1e-4, atol=1e-4)


def test_cudnn_refuses_attention_dropout():
    with pytest.raises(ConfigError, match="attention_dropout") as info:
        attn.resolve_attention(
            "cudnn", "gpu", 64, compute_dtype="bfloat16", compute_capability="9.0", attention_dropout=0.1
        )
    assert "\n" not in str(info.value)
    assert (
        attn.resolve_attention(
            "auto", "gpu", 64, compute_dtype="bfloat16", compute_capability="9.0", attention_dropout=0.1
        )
        == "blockwise"
    )
    assert attn.resolve_attention("auto", "gpu", 64, compute_dtype="bfloat16", compute_capability="9.0") == "cudnn"


def test_rates_zero_trace_no_dropout():
    """At 0 the step is the old code path: no uint32 hash op in its jaxpr; with a rate there is."""

    def has_hash(*overrides):
        _, _, setup = run_steps(tiny_config("--config.mesh.data=2", "--config.mesh.tensor=1", *overrides), 0)
        params, opt = setup.init(0)
        batch = setup.feed.make_batch(np.zeros((8, 65), np.int32))
        guard = jnp.zeros(2, jnp.float32)
        text = str(jax.make_jaxpr(setup.train_step.jitted)(params, opt, batch, guard))
        return "u32" in text

    assert not has_hash()
    assert has_hash("--config.model.attention_dropout=0.1")


# --------------------------------------------------------------------------- resume, config, importers


@pytest.mark.skipif(not SLOW, reason="JAXPAR_SLOW=1: a preempted and resumed run with dropout (test budget)")
def test_resume_with_dropout_is_bitwise_identical(tmp_path):
    from jaxpar.train.loop import Trainer
    from tests.test_checkpoint import _losses

    def trainer(workdir):
        cfg = tiny_config(
            "--config.mesh.data=4",
            "--config.mesh.tensor=2",
            "--config.train.steps=3",
            f"--config.train.workdir={workdir}",
            "--config.checkpoint.every=1",
            *RATES,
        )
        return Trainer(cfg, validate(cfg), echo=lambda _: None, progress=False)

    straight = trainer(tmp_path / "a")
    straight.run()
    first = trainer(tmp_path / "b")
    step_fn = first.train_step

    def preempt_after_one():
        row = step_fn()
        if first.step == 1:
            first.stop_signal = signal.SIGTERM
        return row

    first.train_step = preempt_after_one
    assert first.run() == {"preempted": True, "step": 1}
    resumed = trainer(tmp_path / "b")
    resumed.run()
    assert len(_losses(tmp_path / "a")) == 3
    assert _losses(tmp_path / "b") == _losses(tmp_path / "a")  # the masks of steps 2-3 redrawn from the step
    for a, b in zip(
        jax.tree.leaves(jax.device_get(straight.params)), jax.tree.leaves(jax.device_get(resumed.params)), strict=True
    ):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("field", ["dropout", "attention_dropout"])
@pytest.mark.parametrize("value", ["-0.1", "1.0", "1.5", "nan", "inf"])
def test_bad_rates_are_one_line_errors(field, value):
    with pytest.raises(ConfigError, match=rf"model\.{field}=.*\[0, 1\)") as info:
        tiny_config(f"--config.model.{field}={value}")
    assert "\n" not in str(info.value)


def test_megatron_dropout_flags_map(tmp_path):
    from tests.test_port_megatron import LLAMA3, MEG

    cfg, report = port_megatron(MEG / LLAMA3)  # --attention-dropout 0.0 --hidden-dropout 0.0
    assert (cfg.model.dropout, cfg.model.attention_dropout) == (0.0, 0.0)
    assert report.find("--hidden-dropout").status == "mapped"
    assert report.find("--hidden-dropout").target == "model.dropout"
    text = (
        (MEG / LLAMA3)
        .read_text()
        .replace("--attention-dropout 0.0", "--attention-dropout 0.15")
        .replace("--hidden-dropout 0.0", "")
    )
    changed = tmp_path / "llama3.args"
    changed.write_text(text)
    cfg, report = port_megatron(changed)
    assert (cfg.model.dropout, cfg.model.attention_dropout) == (0.1, 0.15)  # Megatron's default hidden rate
    default = report.find("--hidden-dropout (default)")
    assert (default.status, default.value, default.target) == ("mapped", 0.1, "model.dropout")
    assert report.find("--attention-dropout").status == "mapped"


def test_hf_config_dropout_fields_map():
    hf = weights.hf_config_from_model(tiny_config("--config.model.attention_dropout=0.2").model)
    assert hf["attention_dropout"] == 0.2
    m = weights.model_config_from_hf(hf)
    assert (m.attention_dropout, m.dropout) == (0.2, 0.0)
    assert weights.model_config_from_hf({**hf, "hidden_dropout": 0.05}).dropout == 0.05
    assert (
        weights.model_config_from_hf({k: v for k, v in hf.items() if k != "attention_dropout"}).attention_dropout == 0.0
    )
    for bad in (1.0, -0.5, "x"):
        with pytest.raises(ConfigError, match="attention_dropout|wrong type"):
            weights.model_config_from_hf({**hf, "attention_dropout": bad})
