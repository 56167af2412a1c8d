"""Blockwise (flash-style) and ring attention in one layer's backward: the fp32 score blocks of the kernel's
inner step and the operands beside them, counted from XLA:CPU's buffer assignment (each count names its
measurement). Summed into the layer's working set by :func:`jaxpar.analysis.activations.layer_working_phases`."""

from __future__ import annotations

from jaxpar.analysis.dims import F32, Dims
from jaxpar.config import ConfigDict
from jaxpar.models.inventory import ParallelLayout

# Blockwise attention with dropout: the inner step's block arrays leave holes of 0 to 1.24 blocks in the same
# rows (with a context axis; no threshold separates them), so the estimate counts the midpoint, half a block:
# the error this term leaves is half a block either way.
BLOCKWISE_DROPOUT_PACKING_SLOTS = 0.5


# Backward of one layer, attention phase, ``blockwise`` (:func:`jaxpar.ops.attention.flash_backward`): the
# inner step's fp32 (b, n/t, block_q, block_kv) arrays live at once, the recomputed probabilities P, dP = dO V^T,
# dS = P (dP - D) and dS laid out for the dK / dQ matmuls (4; with ``model.attention_dropout`` also the dropped
# probabilities: 5), beside the attention's operands: the layer's incoming gradient (b, s, h), three (b, s/t, h)
# arrays outside the tensor-parallel region (the residual-stream gradient and the norm's), the query side twice
# (b, s, q: q and dO blocked for the loop) and K (b, s, k). Counted in the buffer assignment of tiny data=8 s=256
# block 256 (none) and tiny data=4 x tensor=2 SP s=256 block 256 (selective, attention dropout).
BLOCKWISE_BACKWARD_BLOCKS = 4
# Ring attention (context > 1) under ``selective`` / ``full``: the recomputed forward's per-hop score blocks
# are the very arrays the ring backward recomputes for the same hop (the same q, the same keys received), so
# XLA keeps them from the recomputation to the attention's backward, through the MLP's backward: per hop,
# fp32 (b, n/t, bq, bk) blocks, 1 with ``full`` (q k^T) and 2 with ``selective`` (measured: tiny
# data=4 x context=2 full: two f32[4,2,128,256] q k^T blocks at the MLP phase's peak; selective, SP and
# ZeRO-3 draws: four to five block-sized arrays, scores and their masked copies). Without a ring the same holds
# where the kernel runs one block (``attention_block`` >= s): its recomputed q k^T is the backward's (tiny
# data=8 ZeRO-3 ``full`` blockwise, s=256, block 512: one f32[2, 2, 256, 512] array at the MLP phase's peak;
# with several blocks, or in a pipeline tick, not counted: tiny data=2 x tensor=2 x pipeline=2 1F1B ``full``
# blockwise, one block, is 0.987 of the compiled temporaries without it, 0.910 with it). The ring too keeps them
# only where each hop runs one block (``attention_block`` >= s/c): with several the kernel's loop recomputes them
# block by block (buffer assignment of tiny data=4 x context=2 ZeRO-3 selective, s=512, block 128: no block-sized
# score array at the MLP phase's peak, 0.887 of the estimate with two per hop counted, 0.979 without; data=2 x
# tensor=2 x context=2 ZeRO-2 full, s=1024, block 256: none either, 0.905 -> 1.006; the 132 ring
# rows of experiments/results/2026-12-06-memory-grid with several blocks per hop: mean 0.971 -> 0.998, none out).
RING_RECOMPUTED_BLOCKS = {"selective": 2, "full": 1}
# Ring attention under ``selective``: XLA schedules the ring's recomputation and its collective-permutes into the
# MLP's backward and defers the MLP's weight-gradient matmuls past the attention's backward, so the gradients of
# gate and up, two (b, s, f) arrays, stay live through it beside :data:`BACKWARD_MLP_WIDE` (buffer assignment of
# tiny data=4 x context=2 ZeRO-2 selective, b=2, s=1024, block 64: two f32[1024, 384] arrays live from the MLP's
# backward to the weight-gradient matmuls after the ring's; 1.134 of the estimate without them).
RING_DEFERRED_MLP_GRADIENTS = 2
# Key-side (b, s, kv_heads*head_dim/t) arrays of the attention phase: K alone without a ring. The ring's backward
# (:func:`jaxpar.ops.context_parallel._ring_bwd`) unrolls its c hops, each a flash backward with its own
# zero-initialised fp32 dK and dV accumulators, which XLA hoists ahead of the first hop (2c), beside each hop's
# K and V in the kernel's transposed layout (2c: f32[b, kv/t, head_dim, 2s] concatenations) and the hop at
# work's K^T and V^T (2): 4c + 2. Counted in the buffer assignment of tiny data=4 x context=2 ZeRO-2 ``full``
# with attention dropout, s = 512, block 256: ten f32[2, 256, 2, 32]-sized arrays at the peak (four hoisted
# zero copies, two f32[2, 2, 32, 256] transposes, two f32[2, 2, 32, 512]). Measured at c = 2 only: whether
# the f32[.., 512] pair grows with c (all hops) or not (K and V of one hop side by side) is not pinned down.


def ring_backward_kv_arrays(context: int) -> int:
    """Key-side (b, s, k) arrays of the blockwise attention phase (see the count above)."""
    return 1 if context == 1 else 4 * context + 2


def blockwise_attention_backward_bytes(model: ConfigDict, layout: ParallelLayout, b: int | None = None) -> float:
    """The attention phase of one layer's backward under ``blockwise`` attention (and context parallelism,
    whose ring runs the same kernel per hop): :data:`BLOCKWISE_BACKWARD_BLOCKS` (with attention dropout +1, the
    dropped probabilities, and :data:`BLOCKWISE_DROPOUT_PACKING_SLOTS`)
    fp32 (b, n/t, bq, bk) arrays of the inner step, bq = bk = min(``attention_block``, s) (the kernel
    clamps its blocks to the sequence), and the operands e*b*(s*h + 3*so*h + 2*s*q + r*s*k), r = 1 without a
    ring and :func:`ring_backward_kv_arrays` with one; under ``full`` the recomputed forward's q, k and v
    projection weights too, e*h*(q + 2k) (their sliced copies: f32[128, 128] and two f32[64, 128] in the
    ring measurement of :func:`ring_backward_kv_arrays`)."""
    d = Dims.of(model, layout, b)
    block = min(layout.attention_block, d.s)
    dropout = model.get("attention_dropout", 0.0) > 0
    copies = BLOCKWISE_BACKWARD_BLOCKS + ((1 + BLOCKWISE_DROPOUT_PACKING_SLOTS) if dropout else 0)
    # ring attention: the hops' backward steps are independent but for the dQ sum, and XLA overlaps them where
    # each hop is one block: another hop's P, dP and dS beside this one's (buffer assignment of tiny data=4 x
    # context=2, block = s/c = 256, full: seven f32[2, n, 256, 256]-sized blocks at the peak). Where a hop runs
    # several blocks (its own loop) no other hop's blocks are live: tiny data=4 x context=2 ZeRO-3 selective,
    # attention dropout, b=2, s=1024, block 256 (two per hop): five f32[2, 2, 2, 256, 256] blocks at the peak,
    # S, P, the dropped P, dS and a relaid copy; peak 0.893 of the estimate with the overlap, 1.032 without; the
    # 25 kept rows this moves, 0.893-1.006 -> 1.008-1.064)
    if block >= d.s:
        copies += (layout.context - 1) * (BLOCKWISE_BACKWARD_BLOCKS - 1)
    kv = ring_backward_kv_arrays(layout.context)
    operands = d.e * d.b * (d.s * d.h + 3 * d.so * d.h + 2 * d.s * d.q + kv * d.s * d.k)
    # the recomputed forward's q, k, v projection weights, sliced out of the stacked parameters (copies): h x (q + 2k)
    weights = d.e * d.h * (d.q + 2 * d.k) if layout.recompute == "full" else 0.0
    return copies * F32 * d.b * d.n * block * block + operands + weights
