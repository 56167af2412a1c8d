"""The dense layer's matmul, ``x @ w``, with a weight gradient XLA:CPU runs as a plain GEMM.

Autodiff of ``y = x @ w`` gives ``dW = x^T dy``, a dot that contracts the leading (row) dim of both
operands. XLA:CPU sends a dot to its fast matmul library (YNNPACK) only when the left operand
contracts its last dim, and runs ``x^T dy`` in Eigen's slower GEMM. Asking for ``dW^T = dy^T x``
instead is worse: XLA then writes ``dy^T`` strided from inside the fusion that produces ``dy``.

:func:`dense`'s weight gradient transposes explicitly, behind an ``optimization_barrier`` (on CPU
only: it keeps XLA from folding the transpose back into the dot; cuBLAS and the TPU compiler take
transposed operands at no cost), whichever of two writes fewer values (rows = tokens):

* ``x^T`` (rows x in values), then ``dW = x^T @ dy``, a GEMM YNNPACK takes; or
* ``dy^T`` (rows x out values), then ``dW^T = dy^T @ x`` and its transpose (in x out values).

The input gradient ``dx = dy @ w^T`` contracts the last dims of both operands, a form YNNPACK takes.
The profile and step times behind this: experiments/README.md, section 5.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

DENSE_NAME = "dense"  # checkpoint_name of a weight matmul's output: saved by remat "selective"


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` over the last dim of ``x`` (any leading dims) and a 2-D weight ``w`` (in, out).

    The output is named ``DENSE_NAME``, which remat ``selective`` saves as it saves every other
    weight matmul's output (:func:`jaxpar.ops.remat.remat_policy`)."""
    return checkpoint_name(_dense(x, w), DENSE_NAME)


def _barrier(x: jax.Array) -> jax.Array:
    return jax.lax.optimization_barrier(x) if jax.default_backend() == "cpu" else x


def _weight_grad(x: jax.Array, dy: jax.Array) -> jax.Array:
    """``x^T @ dy`` for ``x`` (m, k) and ``dy`` (m, n), (k, n) out, in the cheaper form (module docstring)."""
    (m, k), n = x.shape, dy.shape[1]
    if m * k <= m * n + k * n:
        return _barrier(x.T) @ dy
    return _barrier(_barrier(dy.T) @ x).T


@jax.custom_vjp
def _dense(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum("...i,io->...o", x, w)


def _dense_fwd(x: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return _dense(x, w), (x, w)


def _dense_bwd(saved: tuple[jax.Array, jax.Array], dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w = saved
    dx = jnp.einsum("...o,io->...i", dy, w).astype(x.dtype)
    dw = _weight_grad(x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1]))
    return dx, dw.astype(w.dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)
