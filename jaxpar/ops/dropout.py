"""Dropout whose mask is a pure function of (seed, step, layer, site, global indices).

Dropout (Srivastava et al. 2014, JMLR 15) zeroes each element with probability ``p`` and scales the
survivors by ``1 / (1 - p)``. Placement follows Megatron-LM (Shoeybi et al. 2019, arXiv:1909.08053;
``--hidden-dropout`` / ``--attention-dropout``): ``model.dropout`` on the embedding output and on
the attention-output and MLP-output branches, after their row-parallel reduction and before each
residual add; ``model.attention_dropout`` on the softmax probabilities before the value matmul
(:mod:`jaxpar.ops.attention`; cuDNN is refused).

**The mask is a counter-based hash** (Salmon et al. 2011, "Parallel random numbers: as easy as 1,
2, 3"), not a key split per call: each keep bit hashes (``lowbias32``) the run's seed, the optimizer
step, the layer, the site and the element's *global* indices (row in the global batch, position,
and feature or (query head, key position)). So every layout draws the same mask for the same
element, each device hashing only the indices it holds, and a resumed run, or the retry of a
skipped step (which keeps its count), draws what an uninterrupted one draws.

**The indices.** The train step appends each local sequence's global row to the token batch as an
int32 column (:func:`append_rows`: ``m * B/M + data_rank * b + r`` for microbatch ``m`` of ``M``,
global batch ``B``), which every slice of the batch carries and :func:`bind` strips. Positions are
the context rank's (:func:`jaxpar.ops.context_parallel.rank_positions`), sliced per tensor rank
under SP; heads are offset by the tensor rank; the layer is the model-form index.

With both rates 0 (the default) nothing here is traced.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

# the sites of one layer (and the embedding): each draws an independent mask
EMBED, ATTENTION_OUT, MLP_OUT, PROBS = 1, 2, 3, 4
_GOLDEN = 0x9E3779B9  # odd multiplier spreading consecutive indices over the 32 bits


def _u32(x: Any) -> jax.Array:
    return jnp.asarray(x).astype(jnp.uint32)


def mix(x: jax.Array) -> jax.Array:
    """``lowbias32`` (C. Wellons, hash-prospector): a bijective 32-bit mixer with full avalanche."""
    x = _u32(x)
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def absorb(h: jax.Array, index: Any) -> jax.Array:
    """Fold one more counter into a hash state (broadcasting): ``mix(h ^ index * golden)``."""
    return mix(_u32(h) ^ (_u32(index) * jnp.uint32(_GOLDEN)))


def step_key(seed: int, step: jax.Array) -> jax.Array:
    """The step's base key (uint32 scalar) from the run seed and the optimizer step."""
    return absorb(mix(jnp.uint32(seed & 0xFFFFFFFF) ^ jnp.uint32(0x5EED)), step)


def threshold(rate: float) -> int:
    """Drop an element iff its 32-bit hash is below ``round(rate * 2**32)``."""
    return min(int(round(rate * 2**32)), 2**32 - 1)


def keep_mask(key: jax.Array, *indices: jax.Array, rate: float) -> jax.Array:
    """Keep bits for the outer product of ``indices`` (1-D int arrays; broadcast shapes allowed):
    ``hash(key, i0, i1, ...) >= threshold(rate)``. Pure: equal indices give equal bits."""
    h = _u32(key)
    for index in indices:
        h = absorb(h, index)
    return keep_bits(h, rate)


def outer(*indices: jax.Array) -> tuple[jax.Array, ...]:
    """1-D index arrays reshaped to broadcast against each other, first one outermost."""
    n = len(indices)
    return tuple(jnp.reshape(x, (1,) * k + (-1,) + (1,) * (n - 1 - k)) for k, x in enumerate(indices))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Noise:
    """The traced half of dropout in the shard context: the step's key, the global rows of the local
    sequences (``None`` until :func:`bind`) and the model-form index of the current layer."""

    key: jax.Array
    rows: jax.Array | None = None
    layer: jax.Array | int = 0


def active(ctx: Any) -> bool:
    """Whether ``ctx`` (a :class:`jaxpar.models.base.ShardContext`) runs with dropout: a rate > 0 and
    a step's noise attached (evaluation and a model built without a step have none)."""
    return ctx.noise is not None and (ctx.dropout > 0 or ctx.attention_dropout > 0)


def append_rows(batch: jax.Array, global_batch: int, data_axis: str) -> jax.Array:
    """``batch`` (M, b, s+1) of this data rank plus one int32 column: each sequence's global row
    (``m * B/M + rank * b + r``). Inside ``shard_map`` (``data_axis`` bound)."""
    m, b = batch.shape[:2]
    start = jax.lax.axis_index(data_axis) * b
    rows = (
        jnp.arange(m, dtype=jnp.int32)[:, None] * (global_batch // m) + start + jnp.arange(b, dtype=jnp.int32)[None, :]
    )
    return jnp.concatenate([batch, rows[..., None].astype(batch.dtype)], axis=-1)


def bind(tokens: jax.Array, ctx: Any) -> tuple[jax.Array, Any]:
    """(tokens without the row column, ``ctx`` whose noise holds those rows); unchanged when
    dropout is off (no column was appended)."""
    if not active(ctx):
        return tokens, ctx
    rows = tokens[:, -1]
    return tokens[:, :-1], dataclasses.replace(ctx, noise=dataclasses.replace(ctx.noise, rows=rows))


def at_layer(ctx: Any, layer: jax.Array | int) -> Any:
    """``ctx`` with its noise at model-form layer ``layer`` (unchanged when dropout is off)."""
    if not active(ctx):
        return ctx
    return dataclasses.replace(ctx, noise=dataclasses.replace(ctx.noise, layer=layer))


def site_key(noise: Noise, site: int) -> jax.Array:
    return absorb(absorb(noise.key, noise.layer), site)


def hidden(x: jax.Array, positions: jax.Array, site: int, ctx: Any) -> jax.Array:
    """Hidden dropout of ``x`` (b, s, h) whose tokens sit at global ``positions`` (s,) of the local
    rows: the full feature dim is local (after the row-parallel reduction), so features are
    ``arange(h)``. Identity when ``model.dropout`` is 0 or dropout is off."""
    if not active(ctx) or ctx.dropout == 0:
        return x
    noise = ctx.noise
    keep = keep_mask(
        site_key(noise, site), *outer(noise.rows, positions, jnp.arange(x.shape[-1], dtype=jnp.int32)), rate=ctx.dropout
    )
    return jnp.where(keep, x * jnp.asarray(1.0 / (1.0 - ctx.dropout), x.dtype), jnp.zeros((), x.dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionNoise:
    """What the attention kernels need to draw the probabilities' mask: the layer's key for the
    ``PROBS`` site, the local rows' global indices and the global index of the first local head.
    ``rate`` is static."""

    key: jax.Array
    rows: jax.Array
    head0: jax.Array | int
    rate: float = dataclasses.field(metadata=dict(static=True), default=0.0)

    def keep(self, heads: jax.Array, q_pos: jax.Array, kv_pos: jax.Array) -> jax.Array:
        """(b, *heads.shape, sq, sk) keep bits; ``heads`` are local head indices (any shape)."""
        h = absorb(self.key, self.rows.reshape((-1,) + (1,) * heads.ndim))
        h = absorb(h, self.head0 + heads)
        h = absorb(h[..., None], q_pos)
        return keep_bits(absorb(h[..., None], kv_pos), self.rate)

    def apply(self, keep: jax.Array, p: jax.Array) -> jax.Array:
        """``p`` dropped where ``keep`` is false, survivors scaled by ``1 / (1 - rate)``."""
        return jnp.where(keep, p * jnp.asarray(1.0 / (1.0 - self.rate), p.dtype), jnp.zeros((), p.dtype))


def keep_bits(h: jax.Array, rate: float) -> jax.Array:
    return h >= jnp.uint32(threshold(rate))


def for_attention(ctx: Any, local_heads: int, tensor_axis: str | None) -> AttentionNoise | None:
    """The probabilities' noise of the current layer, or ``None`` when attention dropout is off."""
    if not active(ctx) or ctx.attention_dropout == 0:
        return None
    head0 = 0 if tensor_axis is None else jax.lax.axis_index(tensor_axis) * local_heads
    return AttentionNoise(site_key(ctx.noise, PROBS), ctx.noise.rows, head0, ctx.attention_dropout)
