"""Causal grouped-query attention: the reference path, a blockwise (flash-style) path, cuDNN.

Shapes: ``q`` (b, sq, n, d), ``k``/``v`` (b, sk, kv, d) with ``n % kv == 0`` (query head ``h``
reads key/value head ``h // (n // kv)``); outputs (b, sq, n, d); per-row log-sum-exp (b, sq, n) fp32.

* :func:`dot_product_attention`: the reference (``model.attention=dot_product``); its fp32 (sq, sk)
  score matrix grows with ``s**2``.
* :func:`blockwise_attention`: FlashAttention in pure JAX, any backend (Dao et al. 2022,
  arXiv:2205.14135; Dao 2023, FlashAttention-2, arXiv:2307.08691): an online softmax over key/value
  blocks and a ``jax.custom_vjp`` that recomputes the blocks from (q, k, v, out, lse). Positions
  are explicit and the log-sum-exp is exposed (:func:`blockwise_attention_with_lse`), so partial
  results over disjoint key sets merge exactly (:func:`merge_partials`), as ring attention needs
  (Liu et al. 2023, arXiv:2310.01889).
* :func:`cudnn_attention`: ``jax.nn.dot_product_attention(implementation="cudnn")`` behind the
  shape checks of cuDNN's fused flash kernel; :func:`resolve_attention` chooses for ``auto``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxpar.compat import vary, vma_union
from jaxpar.errors import ConfigError
from jaxpar.layout import ATTENTION

ATTENTION_IMPLEMENTATIONS = ATTENTION  # model.attention (jaxpar.layout)
_F32 = jnp.float32
_NEG_INF = -jnp.inf
# Positions given to padding rows/columns: a padded query sees no key under the causal mask, a
# padded key is seen by no query (it is also masked explicitly, for the non-causal case).
_Q_PAD = jnp.iinfo(jnp.int32).min
_KV_PAD = jnp.iinfo(jnp.int32).max


# ----------------------------------------------------------------------------------- reference


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    q_offset: int = 0,
    kv_offset: int = 0,
    noise=None,
    q_segments: jax.Array | None = None,
    kv_segments: jax.Array | None = None,
) -> jax.Array:
    """Grouped-query attention through the full (sq, sk) score matrix; softmax in fp32.

    Scale ``1/sqrt(d)``, masked scores ``finfo(float32).min``, probabilities cast to ``v.dtype``
    before the value matmul. Query ``i`` is at ``q_offset + i``, key ``j`` at ``kv_offset + j``; the
    causal mask keeps ``q_pos >= kv_pos`` (a row that sees no key gets the values' mean, not zeros).
    ``noise`` (:class:`jaxpar.ops.dropout.AttentionNoise`, optional): attention dropout on the
    probabilities after the cast, keyed by global (row, head, query position, key position).
    ``q_segments`` (b, sq) / ``kv_segments`` (b, sk), int (document masking,
    ``model.attention_mask=block_causal``): a pair is kept only within one document as well.
    """
    b, sq, n, d = q.shape
    sk, kv = k.shape[1], k.shape[2]
    g = n // kv
    # Head-major operands: (b, kv, g*sq, d) queries against (b, kv, sk, d) keys is a plain batched
    # matmul whose (b, kv, g*sq, sk) scores are in the dot's own row-major layout, so the mask, the
    # softmax and the value matmul read them without a transpose. With (b, s, kv, g, d) operands,
    # XLA:CPU moved the score tensor between layouts 5 times per layer (configs/maxtext_tiny.py);
    # the price here is that the keys' and values' gradients run as 2 Eigen dots per layer instead
    # of YNNPACK ones. Measured (2-core host, 8 simulated devices, median of 20 steps, 2 rounds):
    # FSDP-8 555 / 553 -> 498 / 520 ms, DP-8 528 / 479 -> 503 / 453 ms, the same loss.
    qh = q.reshape(b, sq, kv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * sq, d)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    scores = jnp.einsum("bkqd,bktd->bkqt", qh, kh, preferred_element_type=_F32).reshape(b, kv, g, sq, sk)
    scores = scores / math.sqrt(d)
    if causal:
        if q_offset == kv_offset == 0 and sq == sk:
            mask = jnp.tril(jnp.ones((sq, sk), dtype=bool))
        else:
            mask = (q_offset + jnp.arange(sq))[:, None] >= (kv_offset + jnp.arange(sk))[None, :]
        scores = jnp.where(mask, scores, jnp.finfo(_F32).min)
    if q_segments is not None:
        same = (q_segments[:, :, None] == kv_segments[:, None, :])[:, None, None]  # (b, 1, 1, sq, sk)
        scores = jnp.where(same, scores, jnp.finfo(_F32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    if noise is not None:
        heads = jnp.arange(n, dtype=jnp.int32).reshape(kv, n // kv)
        probs = noise.apply(
            noise.keep(heads, q_offset + jnp.arange(sq, dtype=jnp.int32), kv_offset + jnp.arange(sk, dtype=jnp.int32)),
            probs,
        )
    out = jnp.einsum("bkqt,bktd->bkqd", probs.reshape(b, kv, g * sq, sk), vh)  # (b, kv, g*sq, d)
    return out.reshape(b, kv, g, sq, d).transpose(0, 3, 1, 2, 4).reshape(b, sq, n, d)


def document_ids(tokens: jax.Array, eos_token_id: int) -> jax.Array:
    """(b, s) int32 document ids of packed input ``tokens`` (b, s): the number of ``eos_token_id``
    tokens before each position, so an EOS belongs to the document it ends and the next token
    starts a new one. torchtitan's ``get_document_mask_mod`` (torchtitan/models/attention.py at
    238fa99) numbers the input batch the same way; attention then keeps a pair only within one id."""
    is_eos = (tokens == eos_token_id).astype(jnp.int32)
    return jnp.cumsum(is_eos, axis=1, dtype=jnp.int32) - is_eos


# ----------------------------------------------------------------------------------- blockwise


def _blocks(x: jax.Array, block: int) -> jax.Array:
    """(b, s, ...) -> (s_blocks, b, block, ...), zero-padded to a whole number of blocks."""
    b, s = x.shape[:2]
    nb = -(-s // block)
    x = jnp.pad(x, [(0, 0), (0, nb * block - s)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(b, nb, block, *x.shape[2:]), 1, 0)


def _unblock(x: jax.Array, s: int) -> jax.Array:
    """Inverse of :func:`_blocks`: (s_blocks, b, block, ...) -> (b, s, ...)."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :s]


def _position_blocks(pos: jax.Array, block: int, pad: int) -> jax.Array:
    nb = -(-pos.shape[0] // block)
    return jnp.pad(pos.astype(jnp.int32), (0, nb * block - pos.shape[0]), constant_values=pad).reshape(nb, block)


def _schedule(needed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row of a (rows, cols) block table: the needed column indices first (ascending), and their count."""
    order = jnp.argsort(~needed, axis=1, stable=True).astype(jnp.int32)
    return order, needed.sum(axis=1, dtype=jnp.int32)


def _needed_blocks(qp: jax.Array, kp: jax.Array, sk: int, block_kv: int, causal: bool) -> jax.Array:
    """(q_blocks, kv_blocks) bool: which blocks hold at least one unmasked (query, key) pair. Causal:
    the block's largest query position reaches its smallest key position (padding queries carry
    ``int32.min``, padding keys ``int32.max``); else every block holding a real key."""
    if not causal:
        real = jnp.arange(kp.shape[0]) * block_kv < sk
        return jnp.broadcast_to(real[None, :], (qp.shape[0], kp.shape[0]))
    return qp.max(axis=1)[:, None] >= kp.min(axis=1)[None, :]


def _mask(qp: jax.Array, kp: jax.Array, causal: bool) -> jax.Array:
    """(bq, bk) bool: the pairs a block keeps. Padding keys (position ``int32.max``) never pass."""
    real = (kp != _KV_PAD)[None, :]
    if causal:
        return (qp[:, None] >= kp[None, :]) & real
    return jnp.broadcast_to(real, (qp.shape[0], kp.shape[0]))


def _segment_blocks(segs, block_q: int, block_kv: int):
    """Document ids (q (b, sq), kv (b, sk)) in blocks: (nq, b, bq), (nk, b, bk); None stays None."""
    if segs is None:
        return None, None
    return _blocks(segs[0].astype(jnp.int32), block_q), _blocks(segs[1].astype(jnp.int32), block_kv)


def _block_mask(qp, kp, causal: bool, qs, ks) -> jax.Array:
    """:func:`_mask` for a (b, kv, g, bq, bk) score block; with document ids ``qs`` (b, bq) / ``ks``
    (b, bk), only pairs of one document pass as well."""
    mask = _mask(qp, kp, causal)
    if qs is None:
        return mask
    return (mask[None] & (qs[:, :, None] == ks[:, None, :]))[:, None, None]


def flash_forward(q, k, v, q_pos, kv_pos, block_q, block_kv, causal, out_dtype=None, noise=None, segs=None):
    """Online-softmax forward pass: out (b, sq, n, d) in ``out_dtype`` (default q.dtype), lse (b, sq,
    n) fp32. ``noise`` (:class:`jaxpar.ops.dropout.AttentionNoise`): the running sum (hence ``lse``)
    takes the undropped probabilities, the value accumulator the dropped ones, so ``out =
    dropout(softmax) @ v`` exactly; each block's mask comes from its global (row, head, query
    position, key position) indices, so the backward redraws it. ``segs``: (q, kv) document ids
    (b, sq), (b, sk), or None (:func:`_block_mask`)."""
    out_dtype = q.dtype if out_dtype is None else out_dtype
    b, sq, n, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    g = n // kvh
    vma = vma_union(q, k, v, q_pos, kv_pos, *jax.tree.leaves(noise), *jax.tree.leaves(segs))
    heads = jnp.arange(n, dtype=jnp.int32).reshape(kvh, g)
    qb = _blocks(q.reshape(b, sq, kvh, g, d), block_q)  # (nq, b, bq, kv, g, d)
    kb, vb = _blocks(k, block_kv), _blocks(v, block_kv)  # (nk, b, bk, kv, d)
    qp = _position_blocks(q_pos, block_q, _Q_PAD)
    kp = _position_blocks(kv_pos, block_kv, _KV_PAD)
    order, count = _schedule(_needed_blocks(qp, kp, sk, block_kv, causal))
    qsb, ksb = _segment_blocks(segs, block_q, block_kv)
    scale = math.sqrt(d)

    def q_block(xs):
        qi, qpi, order_i, count_i, qsi = xs

        def kv_step(t, carry):
            m, total, acc = carry
            j = order_i[t]
            kj = lax.dynamic_index_in_dim(kb, j, keepdims=False)
            vj = lax.dynamic_index_in_dim(vb, j, keepdims=False)
            kpj = lax.dynamic_index_in_dim(kp, j, keepdims=False)
            ksj = None if ksb is None else lax.dynamic_index_in_dim(ksb, j, keepdims=False)
            s = jnp.einsum("bqkgd,btkd->bkgqt", qi, kj, preferred_element_type=_F32) / scale
            s = jnp.where(_block_mask(qpi, kpj, causal, qsi, ksj), s, _NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=-1))
            m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)  # a row with no key yet: exp(-inf - 0) = 0
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            total = alpha * total + p.sum(axis=-1)
            if noise is not None:
                p = noise.apply(noise.keep(heads, qpi, kpj), p)
            pv = jnp.einsum("bkgqt,btkd->bkgqd", p.astype(v.dtype), vj, preferred_element_type=_F32)
            return m_new, total, alpha[..., None] * acc + pv

        rows = (b, kvh, g, qi.shape[1])
        init = (jnp.full(rows, _NEG_INF, _F32), jnp.zeros(rows, _F32), jnp.zeros((*rows, d), _F32))
        m, total, acc = lax.fori_loop(0, count_i, kv_step, tuple(vary(x, vma) for x in init))
        seen = total > 0
        total_safe = jnp.where(seen, total, 1.0)
        out = (acc / total_safe[..., None]).astype(out_dtype)
        lse = jnp.where(seen, m + jnp.log(total_safe), _NEG_INF)
        return jnp.moveaxis(out, 3, 1), jnp.moveaxis(lse, 3, 1)  # (b, bq, kv, g, d), (b, bq, kv, g)

    out, lse = lax.map(q_block, (qb, qp, order, count, qsb))
    return _unblock(out, sq).reshape(b, sq, n, d), _unblock(lse, sq).reshape(b, sq, n)


def flash_backward(
    q, k, v, q_pos, kv_pos, out, lse, dout, dlse, block_q, block_kv, causal, out_dtype=None, noise=None, segs=None
):
    """FlashAttention-2 backward pass (Dao 2023, Algorithm 2): recompute each needed block's
    probabilities from ``lse``; the outer loop runs over key/value blocks and keeps their dK, dV in
    the carry, the inner loop over the query blocks that see them and adds into dQ.

    A cotangent on ``lse`` enters through ``d lse_i / d s_ij = p_ij``: it is subtracted from
    ``D_i = rowsum(dO_i * O_i)``, so ``dS = P * (dP - D + dlse)``.

    With attention dropout (``noise``; mask ``M``, rate ``r``) the block's mask is redrawn from its
    indices (nothing is saved): ``dV = (M P / (1-r))^T dO``, ``dP = M (dO V^T) / (1-r)``, and ``D``
    is unchanged (``rowsum(P * dP) = rowsum(dO * O)`` still holds with ``O = (M P / (1-r)) V``).
    """
    b, sq, n, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    g = n // kvh
    vma = vma_union(q, k, v, q_pos, kv_pos, out, lse, dout, dlse, *jax.tree.leaves(noise), *jax.tree.leaves(segs))
    heads = jnp.arange(n, dtype=jnp.int32).reshape(kvh, g)
    delta = jnp.sum(dout.astype(_F32) * out.astype(_F32), axis=-1) - dlse  # (b, sq, n)
    lse = jnp.where(jnp.isinf(lse), 0.0, lse)  # rows without keys: every score is -inf, so p = 0
    qb = _blocks(q.reshape(b, sq, kvh, g, d), block_q)  # (nq, b, bq, kv, g, d)
    dob = _blocks(dout.reshape(b, sq, kvh, g, d), block_q)
    rowb = _blocks(jnp.stack([lse, delta], axis=-1).reshape(b, sq, kvh, g, 2), block_q)  # (nq, b, bq, kv, g, 2)
    kb, vb = _blocks(k, block_kv), _blocks(v, block_kv)  # (nk, b, bk, kv, d)
    qp = _position_blocks(q_pos, block_q, _Q_PAD)
    kp = _position_blocks(kv_pos, block_kv, _KV_PAD)
    order, count = _schedule(_needed_blocks(qp, kp, sk, block_kv, causal).T)  # per kv block: its q blocks
    qsb, ksb = _segment_blocks(segs, block_q, block_kv)
    scale = math.sqrt(d)

    def kv_block(dq, xs):
        kj, vj, kpj, order_j, count_j, ksj = xs

        def q_step(t, carry):
            dq, dk, dv = carry
            i = order_j[t]
            qi = lax.dynamic_index_in_dim(qb, i, keepdims=False)
            doi = lax.dynamic_index_in_dim(dob, i, keepdims=False)
            rows = jnp.moveaxis(lax.dynamic_index_in_dim(rowb, i, keepdims=False), 1, 3)  # (b, kv, g, bq, 2)
            qpi = lax.dynamic_index_in_dim(qp, i, keepdims=False)
            qsi = None if qsb is None else lax.dynamic_index_in_dim(qsb, i, keepdims=False)
            s = jnp.einsum("bqkgd,btkd->bkgqt", qi, kj, preferred_element_type=_F32) / scale
            s = jnp.where(_block_mask(qpi, kpj, causal, qsi, ksj), s, _NEG_INF)
            p = jnp.exp(s - rows[..., 0:1])
            keep = None if noise is None else noise.keep(heads, qpi, kpj)
            p_v = p if keep is None else noise.apply(keep, p)
            dv = dv + jnp.einsum("bkgqt,bqkgd->btkd", p_v.astype(v.dtype), doi, preferred_element_type=_F32)
            dp = jnp.einsum("bqkgd,btkd->bkgqt", doi, vj, preferred_element_type=_F32)
            if keep is not None:
                dp = noise.apply(keep, dp)
            ds = (p * (dp - rows[..., 1:2]) / scale).astype(q.dtype)
            dk = dk + jnp.einsum("bkgqt,bqkgd->btkd", ds, qi, preferred_element_type=_F32)
            dqi = jnp.einsum("bkgqt,btkd->bqkgd", ds, kj, preferred_element_type=_F32)
            dq = lax.dynamic_update_index_in_dim(dq, lax.dynamic_index_in_dim(dq, i, keepdims=False) + dqi, i, 0)
            return dq, dk, dv

        zeros = vary(jnp.zeros(kj.shape, _F32), vma)
        dq, dk, dv = lax.fori_loop(0, count_j, q_step, (dq, zeros, zeros))
        return dq, (dk, dv)

    dq0 = vary(jnp.zeros(qb.shape, _F32), vma)
    dq, (dk, dv) = lax.scan(kv_block, dq0, (kb, vb, kp, order, count, ksb))
    dq = _unblock(dq, sq).reshape(b, sq, n, d).astype(out_dtype or q.dtype)
    return dq, _unblock(dk, sk).astype(out_dtype or k.dtype), _unblock(dv, sk).astype(out_dtype or v.dtype)


# ``segs``: None or (q, kv) document ids (integers: no cotangent)
@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _flash(q, k, v, q_pos, kv_pos, segs, block_q, block_kv, causal):
    return flash_forward(q, k, v, q_pos, kv_pos, block_q, block_kv, causal, segs=segs)


def _flash_fwd(q, k, v, q_pos, kv_pos, segs, block_q, block_kv, causal):
    out, lse = flash_forward(q, k, v, q_pos, kv_pos, block_q, block_kv, causal, segs=segs)
    return (out, lse), (q, k, v, q_pos, kv_pos, out, lse, segs)


def _flash_bwd(block_q, block_kv, causal, res, cts):
    *res, segs = res
    grads = flash_backward(*res, *cts, block_q, block_kv, causal, segs=segs)
    return (*grads, None, None, jax.tree.map(lambda _: None, segs))  # no cotangent for positions, documents


_flash.defvjp(_flash_fwd, _flash_bwd)


# With attention dropout: the same kernel, the noise (integer arrays: no cotangent) as an argument.
# A separate custom_vjp so the path without dropout stays exactly the one above.
@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _flash_dropout(q, k, v, q_pos, kv_pos, segs, noise, block_q, block_kv, causal):
    return flash_forward(q, k, v, q_pos, kv_pos, block_q, block_kv, causal, noise=noise, segs=segs)


def _flash_dropout_fwd(q, k, v, q_pos, kv_pos, segs, noise, block_q, block_kv, causal):
    out, lse = flash_forward(q, k, v, q_pos, kv_pos, block_q, block_kv, causal, noise=noise, segs=segs)
    return (out, lse), (q, k, v, q_pos, kv_pos, out, lse, segs, noise)


def _flash_dropout_bwd(block_q, block_kv, causal, res, cts):
    *res, segs, noise = res
    grads = flash_backward(*res, *cts, block_q, block_kv, causal, noise=noise, segs=segs)
    return (*grads, None, None, jax.tree.map(lambda _: None, segs), jax.tree.map(lambda _: None, noise))


_flash_dropout.defvjp(_flash_dropout_fwd, _flash_dropout_bwd)


def blockwise_attention_with_lse(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    block_q: int,
    block_kv: int,
    causal: bool = True,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    noise=None,
    q_segments: jax.Array | None = None,
    kv_segments: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`blockwise_attention` that also returns the per-row log-sum-exp (b, sq, n), fp32:
    ``lse[b, i, h] = log sum_j exp(s_ij)`` over the keys row ``i`` sees (``-inf``, with a zero output
    row, where it sees none). Both outputs are differentiable (a cotangent on ``lse`` is folded into
    the backward), so :func:`merge_partials` of partial results differentiates exactly like attention
    over the union of their keys. ``noise``: attention dropout, its masks redrawn in the backward."""
    b, sq, n, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or n % k.shape[2]:
        raise ValueError(
            f"attention shapes q {q.shape}, k {k.shape}, v {v.shape}: want (b,sq,n,d), (b,sk,kv,d), n % kv == 0"
        )
    sk = k.shape[1]
    q_pos = jnp.arange(sq, dtype=jnp.int32) if q_positions is None else jnp.asarray(q_positions, jnp.int32)
    kv_pos = jnp.arange(sk, dtype=jnp.int32) if kv_positions is None else jnp.asarray(kv_positions, jnp.int32)
    if q_pos.shape != (sq,) or kv_pos.shape != (sk,):
        raise ValueError(f"positions {q_pos.shape}, {kv_pos.shape}: want ({sq},), ({sk},) (shared by the batch)")
    segs = None
    if q_segments is not None:
        segs = (jnp.asarray(q_segments, jnp.int32), jnp.asarray(kv_segments, jnp.int32))
        if segs[0].shape != (b, sq) or segs[1].shape != (b, sk):
            raise ValueError(f"document ids {segs[0].shape}, {segs[1].shape}: want ({b}, {sq}), ({b}, {sk})")
    if noise is not None:
        return _flash_dropout(q, k, v, q_pos, kv_pos, segs, noise, min(block_q, sq), min(block_kv, sk), causal)
    return _flash(q, k, v, q_pos, kv_pos, segs, min(block_q, sq), min(block_kv, sk), causal)


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    block_q: int,
    block_kv: int,
    causal: bool = True,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    noise=None,
    q_segments: jax.Array | None = None,
    kv_segments: jax.Array | None = None,
) -> jax.Array:
    """Flash-style grouped-query attention in pure JAX: never builds an (sq, sk) buffer.

    Same result as :func:`dot_product_attention` (fp32 scores; fp32 online softmax with a running
    max, running sum and accumulator per query block; probabilities cast to ``v.dtype`` for the value
    matmul). Queries are grouped as (kv, n // kv), so each key/value block is read once per group.
    The backward is a ``jax.custom_vjp`` (FlashAttention-2) recomputing each block from (q, k, v,
    out, lse): both passes hold O(s * d) residuals and O(block_q * block_kv) scores.

    ``q_positions`` (sq,) and ``kv_positions`` (sk,) (default ``arange``), shared by the batch,
    define the causal mask ``q_pos >= kv_pos``; they need not be contiguous or sorted (a
    context-parallel rank holds chunks ``i`` and ``2c-1-i``), and
    :func:`blockwise_attention_with_lse` with :func:`merge_partials` combine partial results.
    ``q_segments`` (b, sq) / ``kv_segments`` (b, sk): document ids per row; a pair of two documents
    is masked too (``model.attention_mask=block_causal``).

    Masked blocks are skipped by trip count, not ``lax.cond``: a table of the blocks holding an
    unmasked pair is compacted per row to the needed blocks and their count, the inner
    ``fori_loop``'s trip count (a ``while`` loop, legal because JAX never differentiates through
    it). Fully masked blocks cost nothing for any positions (the causal default runs
    ``nb*(nb+1)/2`` of ``nb**2``); ``lax.cond`` would still iterate over every block, and under
    ``vmap`` computes both branches. The backward uses the transposed table. ``sq`` and ``sk`` need
    not be multiples of the blocks: the tail is zero-padded and masked.

    Query blocks run one after another (``lax.map``), unlike a fused GPU kernel: this path trades
    speed for memory on any backend; on NVIDIA GPUs :func:`cudnn_attention` is the fast path.
    """
    return blockwise_attention_with_lse(
        q,
        k,
        v,
        block_q=block_q,
        block_kv=block_kv,
        causal=causal,
        q_positions=q_positions,
        kv_positions=kv_positions,
        noise=noise,
        q_segments=q_segments,
        kv_segments=kv_segments,
    )[0]


def merge_partials(
    out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Exact attention over keys A ∪ B from attention over A and over B (disjoint key sets):
    ``out = (exp(lse_a) * out_a + exp(lse_b) * out_b) / (exp(lse_a) + exp(lse_b))``,
    ``lse = log(exp(lse_a) + exp(lse_b))``, computed relative to the larger lse (its gradient stopped:
    the result does not depend on it). Rows with ``lse = -inf`` on both sides stay zero with
    ``-inf``, without NaN in values or gradients. out: (b, s, n, d), lse: (b, s, n) fp32.
    """
    m = lax.stop_gradient(jnp.maximum(lse_a, lse_b))
    m = jnp.where(jnp.isinf(m), 0.0, m)
    wa, wb = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
    total = wa + wb
    seen = total > 0
    total_safe = jnp.where(seen, total, 1.0)
    out = out_a.astype(_F32) * (wa / total_safe)[..., None] + out_b.astype(_F32) * (wb / total_safe)[..., None]
    return out.astype(out_a.dtype), jnp.where(seen, m + jnp.log(total_safe), _NEG_INF)


# ----------------------------------------------------------------------------------- cuDNN

DROPOUT_CUDNN = (
    "model.attention=cudnn cannot take model.attention_dropout > 0 (cuDNN draws its own mask, not "
    "jaxpar's per-index one); use model.attention=blockwise or auto, or model.attention_dropout=0"
)
DOCUMENTS_CUDNN = (
    "model.attention=cudnn cannot take model.attention_mask=block_causal (jax.nn.dot_product_attention's cuDNN "
    "path has no per-row document mask short of an s x s bias); use model.attention=blockwise or auto"
)


def cudnn_unsupported_reason(head_dim: int, compute_dtype: str, compute_capability: str | None) -> str | None:
    """Why cuDNN's fused flash attention cannot take these shapes (one line naming field and fix), or
    None. The rules of ``jax._src.cudnn.fused_attention_stablehlo.check_is_flash_attention`` /
    ``check_layout``: fp16/bf16; head dim a multiple of 8, at most 128, or 256 from Hopper (sm_90) on.
    """
    if compute_dtype not in ("bfloat16", "float16"):
        return (
            f"model.compute_dtype={compute_dtype} is not supported by cuDNN attention (fp16/bf16 only); "
            "set model.compute_dtype=bfloat16 or model.attention=blockwise"
        )
    hopper = compute_capability is not None and tuple(int(x) for x in compute_capability.split(".")) >= (9, 0)
    limit = 256 if hopper else 128
    if head_dim % 8 or head_dim > limit:
        return (
            f"model.head_dim={head_dim} is not supported by cuDNN attention (a multiple of 8, at most {limit} on "
            f"this GPU); use a head_dim like {min(limit, max(8, head_dim // 8 * 8))} or model.attention=blockwise"
        )
    return None


def _gpu_compute_capability() -> str | None:
    try:
        return getattr(jax.devices("gpu")[0], "compute_capability", None)
    except RuntimeError:  # no GPU backend in this process
        return None


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True) -> jax.Array:
    """cuDNN fused flash attention (NVIDIA GPUs) through ``jax.nn.dot_product_attention``: (b, s, n, d)
    with grouped-query K/V, scale ``1/sqrt(d)``, causal on aligned positions (no offsets). Shapes and
    dtypes the kernel does not take are a :class:`ConfigError`, not the backend's late error."""
    reason = cudnn_unsupported_reason(q.shape[-1], jnp.dtype(q.dtype).name, _gpu_compute_capability())
    if reason:
        raise ConfigError(reason)
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


def resolve_attention(
    name: str,
    backend: str,
    head_dim: int,
    *,
    compute_dtype: str = "bfloat16",
    compute_capability: str | None = None,
    attention_dropout: float = 0.0,
    attention_mask: str = "causal",
) -> str:
    """The implementation ``model.attention=name`` runs on ``backend`` (``jax.default_backend()``).

    ``auto``: ``cudnn`` on a GPU whose kernel takes the head dim and dtype, else ``blockwise``; an
    explicit ``cudnn`` off GPU or with unsupported shapes is a :class:`ConfigError`.
    ``compute_capability`` (e.g. "9.0") defaults to the first GPU's. With ``attention_dropout`` > 0,
    ``auto`` is ``blockwise`` and ``cudnn`` refused: cuDNN draws its mask from a seed and offset, not
    jaxpar's per-index hash, so its masks would differ between layouts (:mod:`jaxpar.ops.dropout`).
    With ``attention_mask=block_causal`` likewise: ``auto`` is ``blockwise``, ``cudnn`` refused.
    """
    if name not in ATTENTION_IMPLEMENTATIONS:
        raise ConfigError(f"model.attention={name!r} is unknown; choose one of {', '.join(ATTENTION_IMPLEMENTATIONS)}")
    if name in ("dot_product", "blockwise"):
        return name
    if attention_dropout > 0:
        if name == "cudnn":
            raise ConfigError(DROPOUT_CUDNN)
        return "blockwise"
    if attention_mask == "block_causal":
        if name == "cudnn":
            raise ConfigError(DOCUMENTS_CUDNN)
        return "blockwise"
    on_gpu = backend in ("gpu", "cuda")
    if name == "cudnn" and not on_gpu:
        raise ConfigError(
            f"model.attention=cudnn needs an NVIDIA GPU, the backend is {backend}; "
            "use model.attention=auto or blockwise"
        )
    if not on_gpu:
        return "blockwise"
    cc = compute_capability if compute_capability is not None else _gpu_compute_capability()
    reason = cudnn_unsupported_reason(head_dim, compute_dtype, cc)
    if reason and name == "cudnn":
        raise ConfigError(reason)
    return "blockwise" if reason else "cudnn"


def make_attention(name: str, *, block_q: int = 512, block_kv: int = 512, noise=None) -> Callable[..., jax.Array]:
    """The causal attention function ``(q, k, v) -> out`` of a resolved implementation name;
    ``noise``: attention dropout (:mod:`jaxpar.ops.dropout`), not taken by cuDNN."""
    if noise is not None:
        if name == "dot_product":
            return functools.partial(dot_product_attention, noise=noise)
        if name == "blockwise":
            return functools.partial(blockwise_attention, block_q=block_q, block_kv=block_kv, noise=noise)
        raise ConfigError(DROPOUT_CUDNN)
    if name == "dot_product":
        return dot_product_attention
    if name == "blockwise":
        return functools.partial(blockwise_attention, block_q=block_q, block_kv=block_kv)
    if name == "cudnn":
        return cudnn_attention
    raise ConfigError(f"model.attention={name!r} must be resolved first (one of dot_product, blockwise, cudnn)")
