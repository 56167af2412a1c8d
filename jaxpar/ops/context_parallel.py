"""Context parallelism: the sequence split over the ``context`` axis, attention exchanged around it.

With ``mesh.context = c > 1`` every layer runs on ``s / c`` tokens of each sequence, so activation
memory falls by ``c`` (Liu et al. 2023, "Ring Attention with Blockwise Transformers",
arXiv:2310.01889; Megatron-LM's context parallelism; torchtitan's ``context_parallel``); only
attention needs the other ranks' keys and values. The sequence is cut into ``2c`` chunks and rank
``i`` holds chunks ``i`` and ``2c-1-i`` (:func:`rank_positions`), one early and one late, so under
the causal mask every rank does the same work (the "load-balanced" sharding of Megatron-LM and
torchtitan). Every device receives the whole token batch and keeps its positions (:func:`split_tokens`).

Exchanges (``parallel.context_exchange``):

* ``ring`` (:func:`ring_attention`): keys and values travel around the ring with ``ppermute``
  (``c - 1`` hops), each hop's blockwise attention merged exactly
  (:func:`~jaxpar.ops.attention.merge_partials`); the next send is issued before the block in hand
  is computed, so asynchronous collectives overlap. The backward (``jax.custom_vjp``) sends the keys
  and values around again with the accumulating key/value gradients (``c`` hops: they end at their
  owner), recomputing each hop from the saved output and log-sum-exp: no rank holds more than two
  ranks' keys and values.
* ``all_gather`` (:func:`all_gather_attention`): keys and values gathered, one blockwise attention,
  gradients reduce-scattered. Fewer, larger messages: better for short sequences and few key/value
  heads (Megatron-LM's ``--cp-comm-type all_gather``, torchtitan's ``allgather``).

Bytes per layer and device (``kvb`` = one rank's keys and values, ``2 * b * s/c * kv_heads/t *
head_dim * dtype``): ring forward ``(c-1) * kvb``, backward ``(c-1) * kvb + c * kvb`` (gradients in
fp32: :func:`ring_bytes_per_layer`); all-gather ``(c-1) * kvb`` forward (again if recomputed),
``(c-1) * kvb`` reduce-scattered backward.

Document masking (``model.attention_mask=block_causal``): every rank holds the whole token batch,
so it computes the document ids of the whole sequence (``segments`` (b, s),
:func:`jaxpar.ops.attention.document_ids`) and takes those of its queries and of each exchanged
key/value block by their positions; nothing more travels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpar.compat import vary, vma_union
from jaxpar.errors import ConfigError
from jaxpar.ops import attention as attn

_F32 = jnp.float32


def chunk_positions(rank: jax.Array | int, c: int, n_local: int) -> jax.Array:
    """Positions of the two chunks context rank ``rank`` holds: ``i`` and ``2c-1-i`` of ``n_local/2``."""
    half = n_local // 2
    first = rank * half + jnp.arange(half, dtype=jnp.int32)
    second = (2 * c - 1 - rank) * half + jnp.arange(half, dtype=jnp.int32)
    return jnp.concatenate([first, second])


def all_positions(c: int, n_local: int) -> np.ndarray:
    """Positions of every rank's tokens in rank order (what a tiled all-gather over ``context`` holds)."""
    half = n_local // 2
    return np.concatenate(
        [
            np.concatenate([np.arange(i * half, (i + 1) * half), np.arange((2 * c - 1 - i) * half, (2 * c - i) * half)])
            for i in range(c)
        ]
    ).astype(np.int32)


def rank_positions(axis: str | None, n_local: int) -> jax.Array:
    """Positions of this context rank's ``n_local`` tokens (``arange`` without ``axis``)."""
    if axis is None:
        return jnp.arange(n_local)
    return chunk_positions(lax.axis_index(axis), lax.axis_size(axis), n_local)


def split_tokens(tokens: jax.Array, axis: str | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(inputs, targets, positions) of this context rank from ``tokens`` (b, s+1): next-token pairs
    at the rank's positions (all of them, in order, without ``axis``)."""
    if axis is None:
        return tokens[:, :-1], tokens[:, 1:], jnp.arange(tokens.shape[1] - 1)
    pos = rank_positions(axis, (tokens.shape[1] - 1) // lax.axis_size(axis))
    return jnp.take(tokens, pos, axis=1), jnp.take(tokens, pos + 1, axis=1), pos


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    *,
    implementation: str,
    block: int,
    axis: str | None = None,
    exchange: str = "ring",
    noise=None,
    segments: jax.Array | None = None,
) -> jax.Array:
    """A layer's causal attention as the layout runs it: ``implementation`` (resolved:
    ``dot_product`` | ``blockwise`` | ``cudnn``, :func:`jaxpar.ops.attention.resolve_attention`) on
    this rank's tokens at ``positions``; with a context ``axis``, the ``exchange`` over it
    (:func:`ring_attention` or :func:`all_gather_attention`, both blockwise). ``noise``: attention
    dropout (:class:`jaxpar.ops.dropout.AttentionNoise`; keyed by global positions, so every
    exchange draws the mask a single device draws). ``segments`` (b, s): the document ids of the
    whole sequence (None: causal over the whole sequence)."""
    extra = {} if noise is None else {"noise": noise}
    if axis is not None:
        fn = ring_attention if exchange == "ring" else all_gather_attention
        return fn(q, k, v, positions, axis, block_q=block, block_kv=block, segments=segments, **extra)
    fn = attn.make_attention(implementation, block_q=block, block_kv=block, **extra)
    if segments is None:
        return fn(q, k, v)
    if implementation == "cudnn":
        raise ConfigError(attn.DOCUMENTS_CUDNN)
    own = jnp.take(segments, positions, axis=1)
    return fn(q, k, v, q_segments=own, kv_segments=own)


# ----------------------------------------------------------------------------------- all-gather


def all_gather_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    axis: str,
    *,
    block_q: int,
    block_kv: int,
    noise=None,
    segments: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of this rank's queries over every rank's keys and values, gathered over
    ``axis``; ``segments`` (b, s): the whole sequence's document ids, or None."""
    c = lax.axis_size(axis)
    k_all = lax.all_gather(k, axis, axis=1, tiled=True)
    v_all = lax.all_gather(v, axis, axis=1, tiled=True)
    kv_pos = jnp.asarray(all_positions(c, k.shape[1]))
    docs = {}
    if segments is not None:
        docs = {"q_segments": jnp.take(segments, positions, axis=1), "kv_segments": jnp.take(segments, kv_pos, axis=1)}
    return attn.blockwise_attention(
        q,
        k_all,
        v_all,
        block_q=block_q,
        block_kv=block_kv,
        q_positions=positions,
        kv_positions=kv_pos,
        noise=noise,
        **docs,
    )


# ----------------------------------------------------------------------------------- ring


def _ring_perm(c: int) -> list[tuple[int, int]]:
    return [(r, (r + 1) % c) for r in range(c)]


def _send(xs: tuple[jax.Array, ...], axis: str, c: int) -> tuple[jax.Array, ...]:
    return tuple(lax.ppermute(x, axis, _ring_perm(c)) for x in xs)


def _hop_segments(segments, positions, kv_pos):
    """(q, kv) document ids of one hop, from the whole sequence's ``segments`` (None: None)."""
    if segments is None:
        return None
    return jnp.take(segments, positions, axis=1), jnp.take(segments, kv_pos, axis=1)


# ``segments``: None or the whole sequence's document ids (integers: no cotangent)
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _ring(q, k, v, positions, segments, axis, block_q, block_kv):
    return _ring_fwd(q, k, v, positions, segments, axis, block_q, block_kv)[0]


def _ring_fwd(q, k, v, positions, segments, axis, block_q, block_kv, noise=None):
    c = lax.axis_size(axis)
    me = lax.axis_index(axis)
    n_local = k.shape[1]

    def hop(j, kk, vv):  # partial attention over the block that started at rank (me - j) mod c
        kv_pos = chunk_positions((me - j) % c, c, n_local)
        segs = _hop_segments(segments, positions, kv_pos)
        return attn.flash_forward(
            q, kk, vv, positions, kv_pos, block_q, block_kv, True, out_dtype=_F32, noise=noise, segs=segs
        )

    kk, vv = k, v
    out = lse = None
    for j in range(c):  # c is static inside shard_map; c - 1 sends
        if j < c - 1:  # issued before this hop's attention, which does not depend on it: they can overlap
            nk, nv = _send((kk, vv), axis, c)
        o, l_o = hop(j, kk, vv)
        out, lse = (o, l_o) if out is None else attn.merge_partials(out, lse, o, l_o)  # fp32 partials
        if j < c - 1:
            kk, vv = nk, nv
    vma = vma_union(q, k, v, positions, out, lse, *jax.tree.leaves(noise), *jax.tree.leaves(segments))
    out = vary(out.astype(q.dtype), vma)
    return out, (q, k, v, positions, segments, out, vary(lse, vma))


def _ring_bwd(axis, block_q, block_kv, res, dout, noise=None):
    q, k, v, positions, segments, out, lse = res
    c = lax.axis_size(axis)
    me = lax.axis_index(axis)
    n_local = k.shape[1]
    zero_lse = jnp.zeros(lse.shape, _F32)
    dq = jnp.zeros(q.shape, _F32)
    kk, vv = k, v
    dk, dv = jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32)
    for j in range(c):
        if j < c - 1:  # the next block's keys and values travel while this one's gradients are computed
            nk, nv = _send((kk, vv), axis, c)
        kv_pos = chunk_positions((me - j) % c, c, n_local)
        dq_j, dk_j, dv_j = attn.flash_backward(
            q,
            kk,
            vv,
            positions,
            kv_pos,
            out,
            lse,
            dout,
            zero_lse,
            block_q,
            block_kv,
            True,
            out_dtype=_F32,
            noise=noise,
            segs=_hop_segments(segments, positions, kv_pos),
        )
        dq, dk, dv = dq + dq_j, dk + dk_j, dv + dv_j
        dk, dv = _send((dk, dv), axis, c)  # with their block: after c hops they are home
        if j < c - 1:
            kk, vv = nk, nv
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, jax.tree.map(lambda _: None, segments)


_ring.defvjp(_ring_fwd, _ring_bwd)


# With attention dropout: the ring with the noise (integer arrays, no cotangent) as an argument; each
# hop's kernel draws its blocks' masks from their global positions, forward and backward.
@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _ring_dropout(q, k, v, positions, segments, noise, axis, block_q, block_kv):
    return _ring_fwd(q, k, v, positions, segments, axis, block_q, block_kv, noise)[0]


def _ring_dropout_fwd(q, k, v, positions, segments, noise, axis, block_q, block_kv):
    out, res = _ring_fwd(q, k, v, positions, segments, axis, block_q, block_kv, noise)
    return out, (res, noise)


def _ring_dropout_bwd(axis, block_q, block_kv, res, dout):
    res, noise = res
    dq, dk, dv, _, segs = _ring_bwd(axis, block_q, block_kv, res, dout, noise)
    return dq, dk, dv, None, segs, jax.tree.map(lambda _: None, noise)


_ring_dropout.defvjp(_ring_dropout_fwd, _ring_dropout_bwd)


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    axis: str,
    *,
    block_q: int,
    block_kv: int,
    noise=None,
    segments: jax.Array | None = None,
) -> jax.Array:
    """Causal ring attention over ``axis``: this rank's queries ``q`` (b, n, heads, d) at
    ``positions`` (n,) (:func:`rank_positions`) against every rank's keys and values, passed around
    the ring; exact (fp32 merge of the partial results) and never holding more than two ranks'
    keys and values. ``noise``: attention dropout (:class:`jaxpar.ops.dropout.AttentionNoise`);
    ``segments`` (b, s): the whole sequence's document ids, or None."""
    if lax.axis_size(axis) == 1:
        docs = {}
        if segments is not None:
            own = jnp.take(segments, positions, axis=1)
            docs = {"q_segments": own, "kv_segments": own}
        return attn.blockwise_attention(
            q,
            k,
            v,
            block_q=block_q,
            block_kv=block_kv,
            q_positions=positions,
            kv_positions=positions,
            noise=noise,
            **docs,
        )
    bq, bk = min(block_q, q.shape[1]), min(block_kv, k.shape[1])
    if noise is not None:
        return _ring_dropout(q, k, v, positions, segments, noise, axis, bq, bk)
    return _ring(q, k, v, positions, segments, axis, bq, bk)


def ring_bytes_per_layer(kv_block_bytes: float, c: int, grad_itemsize_ratio: float = 1.0) -> tuple[float, float]:
    """(forward, backward) collective-permute bytes one device sends per layer in :func:`ring_attention`:
    forward ``(c-1)`` key/value blocks; backward ``(c-1)`` key/value blocks plus ``c`` gradient blocks
    (``grad_itemsize_ratio``: gradient dtype size / compute dtype size; 4/2 in bf16, 1 in fp32)."""
    return (c - 1) * kv_block_bytes, (c - 1) * kv_block_bytes + c * kv_block_bytes * grad_itemsize_ratio
