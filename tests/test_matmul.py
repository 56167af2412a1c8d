"""jaxpar.ops.matmul.dense: the same values and gradients as the einsum it replaces (both
weight-gradient forms), saved by remat "selective" like any weight matmul, and on XLA:CPU a train
step that runs every weight matmul in a fusion (YNNPACK), none in Eigen's fallback GEMM, and moves
no attention score tensor between layouts."""

from __future__ import annotations

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.analysis.hlo import array_dims, fused_computations, parse_hlo
from jaxpar.config import load_config
from jaxpar.ops.matmul import DENSE_NAME, dense
from jaxpar.ops.remat import remat_policy
from tests.helpers import ROOT, make_setup

MAXTEXT = str(ROOT / "configs" / "maxtext_tiny.py")


def _einsum(x, w):
    return jnp.einsum("bsi,io->bso", x, w)


def _check_vjp(f, ref, args, dy, dtype):
    """``f``'s value and gradients in ``dtype`` against ``ref``'s computed in float32 from the same
    (``dtype``-valued) inputs, the result a float32 accumulator gives. Not against ``ref`` run in
    bfloat16: jax 0.12's XLA:CPU runs the einsum's own weight-gradient dot (a bf16 ``dot`` contracting
    the rows of both operands) without a float32 accumulator, so the reference, not :func:`dense`,
    was the one off the exact product."""
    y, vjp = jax.vjp(f, *args)
    y_ref, vjp_ref = jax.vjp(ref, *(a.astype(jnp.float32) for a in args))
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    assert y.dtype == dtype and y.shape == y_ref.shape
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32), rtol=tol, atol=tol)
    cotangent = dy.astype(dtype)
    for arg, got, want in zip(args, vjp(cotangent), vjp_ref(cotangent.astype(jnp.float32))):
        assert got.dtype == arg.dtype and got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol * 10)


# (in, out): in <= out transposes x for the weight gradient, in > out (with few rows) dy and dW^T
@pytest.mark.parametrize("dims", [(32, 48), (64, 8)], ids=["transpose_x", "transpose_dy"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_values_and_gradients_match_the_einsum(dtype, dims):
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    i, o = dims
    x = jax.random.normal(kx, (2, 16, i), dtype)
    w = jax.random.normal(kw, (i, o), dtype)
    dy = jax.random.normal(kd, (2, 16, o), jnp.float32)
    _check_vjp(dense, _einsum, (x, w), dy, dtype)


def test_selective_remat_saves_the_output():
    x, w1, w2 = jnp.ones((1, 8, 16)), jnp.ones((16, 32)), jnp.ones((32, 16))

    def f(x, w1, w2):
        return jnp.sum(jnp.tanh(dense(jnp.tanh(dense(x, w1)), w2)))  # tanh' needs both outputs

    def saved(remat):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(f, policy=remat_policy(remat)), x, w1, w2)
        return [line for line in out.getvalue().splitlines() if f"'{DENSE_NAME}'" in line]

    assert len(saved("selective")) == 2  # both matmul outputs, as the dot policy keeps a plain einsum's
    assert saved("full") == []


def _top_level_dots(text: str) -> list[str]:
    """Dots without batch dims outside fused computations: XLA:CPU runs those with Eigen, fused ones
    with YNNPACK. (Attention's batched key and value gradients, 2 per layer, still run in Eigen.)"""
    _, comps = parse_hlo(text)
    fused = fused_computations(comps)
    return [
        i.name
        for name, instrs in comps.items()
        if name not in fused
        for i in instrs
        if i.opcode == "dot" and "lhs_batch_dims" not in i.attrs
    ]


def _score_transposes(text: str, seq: int) -> list[str]:
    """Transposes of an attention score tensor: rank >= 4 with two dims of the sequence length."""
    _, comps = parse_hlo(text)
    return [
        i.type_text
        for instrs in comps.values()
        for i in instrs
        if i.opcode == "transpose" and len(dims := array_dims(i.type_text)) >= 4 and dims.count(seq) >= 2
    ]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the Eigen fallback is XLA:CPU's")
def test_train_step_has_no_eigen_dot_and_no_score_transpose():
    """Before dense, XLA:CPU ran 13 dots a step in Eigen for this model (the weight gradients of w_gate,
    w_up and w_down in each of 4 layers, and of the output layer); MaxText 0.2.5's step has none.
    Before the head-major attention (jaxpar.ops.attention.dot_product_attention), the (b, kv, g, s, s)
    scores were transposed 5 times per layer (checked on that commit's HLO)."""
    cfg = load_config(f"{MAXTEXT}:dp8")
    text = make_setup(cfg).lower_train_step().compile().as_text()
    assert _top_level_dots(text) == []
    assert _score_transposes(text, cfg.train.seq_len) == []
