"""The dense layer's matmul, ``x @ w``, with a weight gradient XLA:CPU runs as a plain GEMM.

Autodiff of ``einsum("bsi,io->bso", x, w)`` gives the weight gradient ``dW = x^T dy``, a dot that
contracts the leading (token) dim of both operands. XLA:CPU sends a dot to its fast matmul
library (YNNPACK) only in the forms that library takes; for ``x^T dy`` it emits a dot whose left
operand contracts its major dim and runs it with Eigen's slower GEMM instead, three times per
layer for a SwiGLU MLP plus once for the output layer (13 dots a step for
``configs/maxtext_tiny.py``; MaxText 0.2.5's step for the same model has none).

:func:`dense` writes the backward by hand: ``dW^T = dy^T x``, a dot in the form YNNPACK takes, then
the transpose of that weight-sized result. On CPU an ``optimization_barrier`` keeps XLA from
folding the transpose back into the dot; elsewhere the barrier is left out (cuBLAS and the TPU
compiler take transposed operands at no cost). Measured on this repository's 2-core CPU host,
``configs/maxtext_tiny.py`` with 8 simulated devices, jax 0.10.2, three alternating pairs of
20-step runs: step time x0.92-0.98 on DP-8 and x0.85-1.01 on FSDP-8; the final loss, the
compiled collective bytes and the compiled memory are the same as with the plain einsum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxpar.parallel.zero import DENSE_NAME


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` over the last dim of ``x`` (any leading dims) and a 2-D weight ``w`` (in, out).

    The output is named ``DENSE_NAME``, which remat ``selective`` saves as it saves every other
    weight matmul's output (:func:`jaxpar.parallel.zero.remat_policy`)."""
    return checkpoint_name(_dense(x, w), DENSE_NAME)


@jax.custom_vjp
def _dense(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum("...i,io->...o", x, w)


def _dense_fwd(x: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return _dense(x, w), (x, w)


def _dense_bwd(saved: tuple[jax.Array, jax.Array], dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w = saved
    dx = jnp.einsum("...o,io->...i", dy, w).astype(x.dtype)
    dw_t = jnp.einsum("...o,...i->oi", dy, x)
    if jax.default_backend() == "cpu":
        dw_t = jax.lax.optimization_barrier(dw_t)
    return dx, dw_t.T.astype(w.dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)
