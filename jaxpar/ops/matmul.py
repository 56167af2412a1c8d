"""The dense layer's matmul, ``x @ w``, with a weight gradient XLA:CPU runs as a plain GEMM.

Autodiff of ``y = x @ w`` gives the second operand's gradient ``dW = x^T dy``, a dot that contracts
the leading (row) dim of both operands. XLA:CPU sends a dot to its fast matmul library (YNNPACK)
only when the left operand contracts its last dim; for ``x^T dy`` it runs Eigen's slower GEMM
instead (13 dots a step for ``configs/maxtext_tiny.py``: the weight gradients of the three MLP
matmuls per layer and of the output layer; MaxText 0.2.5's step for the same model has none).
Asking for ``dW^T = dy^T x`` instead is worse: XLA then writes ``dy^T`` from inside the fusion that
produces ``dy`` (the SwiGLU backward), a transposed, strided write that was the single most
expensive op of the ZeRO-3 step (a profile of ``configs/maxtext_tiny.py:fsdp8``: 22 ms per
execution for a 1 MB gradient).

:func:`dense`'s weight gradient transposes the smaller of two things, explicitly, behind an
``optimization_barrier`` (on CPU only: it keeps XLA from folding the transpose back into the dot;
cuBLAS and the TPU compiler take transposed operands at no cost, so elsewhere no barrier):

* ``x^T`` (rows x in values), then ``dW = x^T @ dy``, a GEMM YNNPACK takes; or
* ``dy^T`` (rows x out values), then ``dW^T = dy^T @ x`` and its transpose (in x out values),

whichever writes fewer values (rows = tokens; with in <= out it is ``x^T``, and ``x^T`` also for
the SwiGLU down projection of ``configs/maxtext_tiny.py``, in = 4 out). The input gradient
``dx = dy @ w^T`` contracts the last dims of both operands, a form YNNPACK takes.

Measured (2-core CPU host, ``configs/maxtext_tiny.py``, 8 simulated devices, jax 0.10.2, median step
of 20, two alternating rounds): against ``dW^T = dy^T x``, FSDP-8 640 / 627 -> 555 / 553 ms and
DP-8 695 / 601 -> 528 / 479 ms; loss, compiled collective bytes and memory unchanged.
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
