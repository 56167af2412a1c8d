"""jaxpar.models.matmul.dense: the same values and gradients as the einsum it replaces, saved by
remat "selective" like any weight matmul, and on XLA:CPU a train step whose every dot runs in a
fusion (YNNPACK), none in Eigen's fallback GEMM."""

from __future__ import annotations

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.analysis.compiled import mesh_for
from jaxpar.analysis.hlo import fused_computations, parse_hlo
from jaxpar.config import load_config
from jaxpar.models.matmul import dense
from jaxpar.parallel.zero import DENSE_NAME, remat_policy
from jaxpar.train.state import Setup
from tests.helpers import ROOT

MAXTEXT = str(ROOT / "configs" / "maxtext_tiny.py")


def _einsum(x, w):
    return jnp.einsum("bsi,io->bso", x, w)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_values_and_gradients_match_the_einsum(dtype):
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (2, 16, 32), dtype)
    w = jax.random.normal(kw, (32, 48), dtype)
    dy = jax.random.normal(kd, (2, 16, 48), dtype)
    y, vjp = jax.vjp(dense, x, w)
    y_ref, vjp_ref = jax.vjp(_einsum, x, w)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32), rtol=tol, atol=tol)
    for got, want in zip(vjp(dy), vjp_ref(dy)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol * 10)


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
    """Dots outside fused computations: XLA:CPU runs those with Eigen, fused ones with YNNPACK."""
    _, comps = parse_hlo(text)
    fused = fused_computations(comps)
    return [i.name for name, instrs in comps.items() if name not in fused for i in instrs if i.opcode == "dot"]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the Eigen fallback is XLA:CPU's")
def test_train_step_has_no_eigen_dot():
    """Before dense, XLA:CPU ran 13 dots a step in Eigen for this model (the weight gradients of w_gate,
    w_up and w_down in each of 4 layers, and of the output layer); MaxText 0.2.5's step has none."""
    cfg = load_config(f"{MAXTEXT}:dp8")
    text = Setup(cfg, mesh_for(cfg)).lower_train_step().compile().as_text()
    assert _top_level_dots(text) == []
