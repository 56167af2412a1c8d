"""Activations and temporaries of jaxpar's own train step, term by term: the other half of the peak.

``memory_analysis()`` of the compiled step reports ``argument`` bytes (parameters, optimizer state,
batch: :func:`jaxpar.analysis.estimate.estimated_argument_bytes`, exact to ~1e-5) and ``temp``
bytes: everything the step allocates while it runs. This module estimates the temporaries of one
device, closed-form (microseconds, so the planner can call it for every layout), from what the
step keeps for the backward pass and what it holds at its peak:

    temp = residual stack + gradient buffers + max(layer working set, head working set)
           (+ pipeline slot buffers; ZeRO-3: the embedding's full gradient, the head's gathered
           weight and the logit gradient as a third working set; in pipelines gathered layers)

* **Residuals** (:func:`layer_residual_bytes`): what ``jax.vjp`` of one llama block saves, per
  recompute policy and attention implementation. Counted from the block's code
  (:mod:`jaxpar.models.llama`) under JAX's linearization rules, and checked against
  ``jax.ad_checkpoint``'s saved residuals and the stacks in the compiled forward loop
  (tests/test_memory_estimate.py). The layer scan (:func:`jaxpar.models.base.scan_layers`) stacks
  them over the stage's layers; nothing of that stack is freed before the backward loop ends.
* **Gradient buffers** (:func:`gradient_buffer_bytes`): the backward scan writes each layer's fp32
  (param dtype) weight gradient into a stacked output; accumulation (m > 1, no pipeline) adds a
  second buffer for the running sum (ZeRO-2: sharded over data, :mod:`jaxpar.train.step`); ZeRO-3
  reduce-scatters inside the loop, so its gradients are sharded.
* **Layer working set** (:func:`layer_working_bytes`): the larger of two phases, each a count of the
  arrays XLA's buffer assignment holds live at that phase: the last layer's forward attention (the
  fp32 (s, s) scores, masked scores and probabilities beside the complete stack) and one layer's
  backward (its attention's scores kept for the attention backward, the MLP's gradients and
  recomputed activations, (b, s, h) operands of the weight-gradient matmuls, the layer's weights).
  Which phase is larger depends on s against h and f: short sequences peak in the backward, long
  ones in the forward attention.
* **Head working set** (:func:`head_working_bytes`): the vocabulary-parallel cross-entropy keeps
  fp32 logits (b, s, V/t) and exp(z) for its backward and builds the fp32 logit gradient.

Conventions: bytes per device; ``e`` = compute-dtype bytes, fp32 = 4 for what the code computes in
fp32 (norm statistics, scores, softmax, logits). ``s`` is the sequence slice one context rank holds
(``ParallelLayout.seq_local``); with sequence parallelism the tensors outside the tensor-parallel
region (layer input, residual adds, norms) hold s/t rows, the matmul inputs the gathered s rows.
The working-set counts were read from XLA:CPU's buffer assignment (the AOT path, fp32): see
:data:`FORWARD_SCORE_COPIES` and the counts beside it, and
``experiments/live_set.py``, which prints the live set at a compiled step's peak.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
from typing import Any

from jaxpar.analysis import moe_activations
from jaxpar.config import ConfigDict
from jaxpar.models.inventory import DTYPE_BYTES, ParallelLayout, param_tensors, shard_elements
from jaxpar.parallel.pipeline.schedule import keeps_activations, splits_backward, steady_slot_counts

F32 = 4


@dataclasses.dataclass(frozen=True)
class Dims:
    """Per-device sizes of one microbatch through one layer."""

    e: int  # compute-dtype bytes
    b: int  # sequences per microbatch
    s: int  # tokens per sequence on this context rank
    so: float  # rows outside the tensor-parallel region: s / t with sequence parallelism, else s
    h: int
    q: float  # heads * head_dim / t
    k: float  # kv_heads * head_dim / t
    n: float  # heads / t
    f: float  # mlp_dim / t
    v: float  # vocab / t

    @classmethod
    def of(cls, model: ConfigDict, layout: ParallelLayout, b: int | None = None) -> Dims:
        t = layout.tensor
        s = layout.seq_len // layout.context
        return cls(
            DTYPE_BYTES[model.compute_dtype],
            layout.microbatch_size if b is None else b,
            s,
            s / t if layout.sequence_parallel else s,
            model.embed_dim,
            model.num_heads * model.head_dim / t,
            model.num_kv_heads * model.head_dim / t,
            model.num_heads / t,
            model.mlp_dim / t,
            model.vocab_size / t,
        )


def _attention(layout: ParallelLayout) -> str:
    """The implementation the step runs (``auto`` resolves to blockwise on CPU; the context axis
    requires blockwise)."""
    return "dot_product" if layout.attention == "dot_product" and layout.context == 1 else "blockwise"


def layer_residual_bytes(
    model: ConfigDict, layout: ParallelLayout, recompute: str | None = None, b: int | None = None
) -> float:
    """Bytes one llama block saves for its backward, per microbatch (``b`` sequences), on one device.

    ``none`` (JAX keeps every residual the block's linearization needs; counted from the code):

    - layer input x and the post-attention residual sum: 2 e*b*so*h (outside the TP region);
    - each RMSNorm keeps its fp32 normalised input (the scale's gradient needs it): 2 * 4*b*so*h,
      and its rsqrt statistics 2 * 2 * 4*b*so;
    - the inputs of the column-parallel matmuls (the two norm outputs, gathered over the sequence
      with SP: jaxpar keeps the gathered copy, Megatron re-gathers it): 2 e*b*s*h;
    - attention: q and k after RoPE, v, and the attention output before W_o: e*b*s*(2q + 2k);
    - ``dot_product``: the masked fp32 scores and the fp32 probabilities (b, n, s, s): 2 * 4*b*n*s^2,
      and two softmax row statistics 2 * 4*b*n*s; ``blockwise``: only the fp32 log-sum-exp
      4*b*s*n (Dao et al. 2022: the backward recomputes the blocks);
    - SwiGLU MLP: gate and up outputs, silu's three jvp residuals (x, sigmoid, silu) and the
      product fed to W_down: 6 e*b*s*f. GeLU (tanh): up output, its cube term, tanh and the
      activation: 4 e*b*s*f (from JAX's jvp rules; not compiled-checked). An MoE layer:
      :func:`jaxpar.analysis.moe_activations.moe_residual_bytes` in their place.

    Korthikanti et al. 2022 (arXiv:2205.05198) count 34sbh + 5as^2b for a GPT layer with dropout in
    2-byte activations; without dropout this step keeps none of its masks, keeps fp32 norms, scores
    and probabilities, and JAX keeps more of the SwiGLU than a hand-written backward would. With
    dropout the layer stack also holds :func:`dropout_residual_bytes` per layer.

    ``selective`` (:func:`jaxpar.ops.remat.remat_policy`: ``dots_with_no_batch_dims_saveable``
    and the named outputs of :func:`jaxpar.ops.matmul.dense`):
    the layer input e*b*so*h and every weight-matmul output: q, k, v e*b*s*(q + 2k), W_o's (b, s, h)
    partial sum before the tensor reduction e*b*s*h, gate and up e*b*s*2f (GeLU: up only).

    ``full`` (``nothing_saveable``): the layer input only, e*b*so*h (the scan carry).
    """
    d = Dims.of(model, layout, b)
    recompute = recompute or layout.recompute
    swiglu = model.mlp_activation == "swiglu"
    if recompute == "full":
        return d.e * d.b * d.so * d.h
    if recompute == "selective":
        if model.get("num_experts", 0):  # the MoE layer's saved dots (jaxpar.analysis.moe_activations)
            moe = moe_activations.moe_residual_bytes(model, layout, recompute, b)
            return d.e * d.b * (d.so * d.h + d.s * (d.q + 2 * d.k + d.h)) + moe
        return d.e * d.b * (d.so * d.h + d.s * (d.q + 2 * d.k + d.h + (2 if swiglu else 1) * d.f))
    outside = d.b * d.so * (2 * d.e * d.h + 2 * F32 * d.h + 4 * F32)
    inputs = 2 * d.e * d.b * d.s * d.h
    attention = d.e * d.b * d.s * (2 * d.q + 2 * d.k)
    if _attention(layout) == "dot_product":
        attention += 2 * F32 * d.b * d.n * d.s * (d.s + 1)
    else:
        attention += F32 * d.b * d.s * d.n
    if model.get("num_experts", 0):  # the MoE layer in the MLP's place
        mlp = moe_activations.moe_residual_bytes(model, layout, recompute, b)
    else:
        mlp = (6 if swiglu else 4) * d.e * d.b * d.s * d.f
    return outside + inputs + attention + mlp


def dropout_residual_bytes(model: ConfigDict, layout: ParallelLayout, b: int | None = None) -> float:
    """What dropout adds to one layer's entry of the residual stack (0 without dropout), measured.

    The masks (:mod:`jaxpar.ops.dropout`) are hashes of indices the backward could redraw, but the
    layer scan's linearization saves what the backward reads, so the compiled step keeps them as
    1-byte bools, and only them (XLA recomputes the dropped values from the kept inputs and mask):

    - ``model.dropout``: the attention-output and MLP-output masks, (b, so, h) each: 2 b*so*h. The
      embedding's mask is not kept;
    - ``model.attention_dropout`` with ``dot_product``: the probabilities' mask (b, n, s, s): b*n*s^2
      (not the dropped probabilities); with ``blockwise`` (and context parallelism) nothing: its
      custom VJP redraws each block's mask from the indices.

    ``selective`` and ``full`` recompute the masks with the layer: nothing is added; the one-layer
    working set gains no mask (the masks' slices feed fusions).
    """
    if layout.recompute != "none":
        return 0.0
    d = Dims.of(model, layout, b)
    hidden = 2 * d.b * d.so * d.h if model.get("dropout", 0.0) > 0 else 0.0
    probs = 0.0
    if model.get("attention_dropout", 0.0) > 0 and _attention(layout) == "dot_product":
        probs = d.b * d.n * d.s * d.s
    return hidden + probs


def layer_params(model: ConfigDict, layout: ParallelLayout) -> float:
    """Elements of one layer's parameters on one device (split over tensor, not over data)."""
    return sum(
        shard_elements(t, layout.tensor, 1, False, layout.expert) for t in param_tensors(model) if t.place == "layer"
    )


def attention_params(model: ConfigDict, layout: ParallelLayout) -> float:
    """Elements of one layer's attention projections (``attn_w*``) on one device."""
    return sum(
        shard_elements(t, layout.tensor, 1, False, layout.expert)
        for t in param_tensors(model)
        if t.place == "layer" and t.name.startswith("attn_w")
    )


def zero3_regathered_params(model: ConfigDict, layout: ParallelLayout) -> float:
    """ZeRO-3 in a 1F1B / interleaved tick: elements gathered a second time, the attention's projections
    (see the count above :func:`zero3_embedding_gradient_bytes`)."""
    return attention_params(model, layout)


def shared_params(model: ConfigDict, layout: ParallelLayout, stage: str = "first") -> float:
    """Elements of the parameters outside the layers one device holds (embedding, head, norms)."""
    places = ("first", "last") if layout.pipeline == 1 else (stage,)
    return sum(
        shard_elements(t, layout.tensor, 1, False, layout.expert) for t in param_tensors(model) if t.place in places
    )


def shared_tables(model: ConfigDict, layout: ParallelLayout) -> float:
    """Elements of the embedding table on one device (V/t x h): its gradient is a scatter-add."""
    return model.vocab_size * model.embed_dim / layout.tensor


# The layer's working set at its peak, counted buffer by buffer in XLA:CPU's buffer assignment (the live
# set at the heap's peak: experiments/live_set.py on tiny data=8, seq 256 and
# 1024, every recompute policy, dot-product and blockwise attention; tiny data=4 x tensor=2 selective;
# ~1B data=4 x tensor=2 ZeRO-3 selective, seq 2048). Each count is a number of arrays of the named shape
# live at once, not a fit of bytes; :func:`layer_working_bytes` says which phase holds which.
#
# Forward attention of the last layer (the residual stack complete, the gradient buffers allocated):
# the fp32 scores q k^T, the causally masked scores and the probabilities, (b, n/t, s, s) each, beside
# the broadcast pred causal mask (1 byte per score) and its (s, s) iota comparison.
FORWARD_SCORE_COPIES = 3
# Backward of one layer, MLP phase (it runs first): the attention's fp32 scores and probabilities of that
# layer, sliced out of the stack (``none``: a dot operand is materialised, XLA:CPU fuses no
# dynamic-slice into a matmul) or recomputed (``selective``, ``full``), wait for the attention's backward.
BACKWARD_SCORE_COPIES = 2
# (b, s, mlp_dim/t) arrays live in that phase: ``none`` the three MLP gradients (of the W_down input,
# of gate and of up; the six saved activations are read from the stack inside fusions); ``full`` those
# three and the recomputed gate, up, silu(gate) and their product (7); ``selective``: gate and up are
# saved, the recomputed silu and product and the gradients overlap less (2 at the measured peak).
BACKWARD_MLP_WIDE = {"none": 3, "selective": 2, "full": 7}
# (b, s, h) arrays live in that phase: the incoming gradient and the residual-stream gradient, the norm
# outputs and the attention output sliced (or recomputed) as operands of the weight-gradient matmuls,
# their (h, b*s) transposes, the RMSNorm backward's products: 9 with ``none``, 10 with ``full``, 8 with
# ``selective`` (the (b, s, h) buffers of the measured live sets).
BACKWARD_HIDDEN_WIDE = {"none": 9, "selective": 8, "full": 10}
# Of those, the ones outside the tensor-parallel region (the incoming and residual-stream gradients, the
# RMSNorm backward's products): (b, s/t, h) with sequence parallelism (tiny data=4 x tensor=2 SP full, s=512:
# five f32[2,256,128] and three f32[2,512,128]-sized arrays at the MLP phase's peak).
BACKWARD_HIDDEN_OUTSIDE = 5
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
# blockwise, one block, is 0.987 of the compiled temporaries without it, 0.910 with it).
RING_RECOMPUTED_BLOCKS = {"selective": 2, "full": 1}
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


HEAD_COPIES = 3  # fp32 logits, exp(z) kept for the backward, the fp32 logit gradient
# ZeRO-3 inside a 1F1B / interleaved tick: weights gathered a second time, beyond the layer the working set
# counts. The tick's ``jax.vjp`` of its chunk gathers each layer for the recomputed forward and again in the
# backward, where the attention's projections are read for dx = dy W^T while the MLP's gathered weights are
# shared with the recomputed forward: the attention's weights once more (buffer assignment of tiny
# data=2 x tensor=2 x pipeline=2 1F1B ZeRO-3 ``full`` blockwise, s=128, b=1, at the MLP phase's peak: gate,
# up and W_down^T once, W_qkv three times and W_o twice). A whole second layer (the count before) put
# that layout at 0.83 of the compiled temporaries once the recomputed scores of a tick were counted.


def zero3_embedding_gradient_bytes(model: ConfigDict, layout: ParallelLayout) -> float:
    """ZeRO-3 without a pipeline: the embedding's gradient beyond its shard. The lookup's transpose is a
    scatter-add into a full V/t x h table (param dtype) that is reduce-scattered only after the layer
    loop; XLA:CPU allocates it (a broadcast of zeros) before the forward loop, so it is live through the
    whole backward beside the sharded gradients, which count its 1/N shard: pb * V*h/t * (1 - 1/N).
    ZeRO 0-2 count the full table among their gradients."""
    n = layout.data * layout.context * layout.expert
    return DTYPE_BYTES[model.param_dtype] * shared_tables(model, layout) * (1 - 1 / n)


def zero3_head_phase_bytes(model: ConfigDict, layout: ParallelLayout, b: int | None = None) -> float:
    """ZeRO-3 without a pipeline: the loss head's backward, at its weight-gradient matmul (the whole
    residual stack is still live: the head runs before the backward layer loop). Beside the stack and
    the gradients: the output weight gathered over ``data`` (compute dtype, e * V*h/t) and the fp32
    logit gradient 4*b*s*V/t; the logits and exp(z) are freed by then, and the weight's gradient is
    written as its transpose dy^T x (:func:`jaxpar.ops.matmul.dense`) straight into the buffer
    that is reduce-scattered. Under ZeRO 0-2 the weight is an argument and its gradient is
    counted among the gradients (:func:`head_working_bytes` is that case's head)."""
    d = Dims.of(model, layout, b)
    return d.e * shared_tables(model, layout) + F32 * d.b * d.s * d.v


def zero3_weight_gradient_bytes(model: ConfigDict, layout: ParallelLayout) -> float:
    """ZeRO-3 without a pipeline: what the layer's backward holds of its weights beyond the gathered layer
    (counted in :func:`layer_working_bytes`): a weight's fp32 gradient as its matmul writes it, before
    the reduce-scatter over ``data`` x ``context`` shards it, and one gathered weight copied into the
    other layout for the transposed matmul, (e + pb) times the largest layer weight. Buffer assignment
    of ~1B (2 layers) tensor=4 x context=2 ZeRO-3, s=256, ``none``: at the peak, beside the three
    gathered f32[2048,2048] MLP weights, a dot's f32[2048,2048] output (a weight gradient) and a copy of
    one gathered weight ({0,1} -> {1,0} layout). ZeRO 0-2 write the gradient into the stacked buffer
    and slice the weight in the layout the matmul reads."""
    if not layout.shards_parameters or layout.pipeline > 1:
        return 0.0
    e, pb = DTYPE_BYTES[model.compute_dtype], DTYPE_BYTES[model.param_dtype]
    return (e + pb) * largest_param(model, layout) / layout.stored_layers(model.num_layers)


def layer_working_bytes(
    model: ConfigDict, layout: ParallelLayout, b: int | None = None, layers: int = 2, tick: bool = False
) -> float:
    """One layer's working set on top of the residual stack and the gradient buffers: the larger of the
    last layer's forward attention and the layer's backward (its MLP phase), buffer by buffer:

    - forward (``dot_product``): :data:`FORWARD_SCORE_COPIES` fp32 (b, n/t, s, s) arrays (scores, masked
      scores, probabilities) + the broadcast pred causal mask b*n*s^2 + its (s, s) comparison, beside
      the layer's weights (e * :func:`layer_params`, sliced out of the stacked parameters or, ZeRO-3,
      gathered), one (b, s, h) and one (b, s, k) array;
    - backward: :data:`BACKWARD_SCORE_COPIES` fp32 score arrays (``dot_product``; none for a stage of
      one layer without recompute: nothing is sliced out of a loop) and, without recompute, the
      broadcast mask (hoisted out of the layer loop); :data:`BACKWARD_MLP_WIDE` (b, s, f) and
      :data:`BACKWARD_HIDDEN_WIDE` (b, s, h) arrays, K and V (2 e*b*s*k; blockwise: its key/value
      blocks, repeated to the query heads, 2 e*b*s*(q + 2k)) and the layer's weights.

    The flash-style backward (``blockwise``, Dao et al. 2022) keeps no (s, s) array; its attention
    phase (:func:`blockwise_attention_backward_bytes`: the inner step's block arrays and its operands)
    is a third candidate, and under recompute with a context axis (or a kernel of one block) the MLP phase
    also holds the recomputed score blocks (:data:`RING_RECOMPUTED_BLOCKS`). With
    ``model.attention_dropout`` (dot-product, no pipeline) the forward, and the backward's recomputed
    attention under ``selective`` / ``full``, also hold the keep mask and the dropped probabilities,
    (4 + 1)*b*n*s^2 (not counted in pipeline ticks). A stage of one layer without recompute writes
    its scores and probabilities into no stack: they are its residuals, so its forward adds
    :data:`FORWARD_SCORE_COPIES` - 2 arrays. ``tick`` (a 1F1B / interleaved backward tick, whose
    ``jax.vjp`` of the chunk recomputes the forward inside the tick): without recompute the backward
    keeps no score copies beyond the chunk's residuals (with it, the recomputed ones), and a chunk of one layer without recompute holds, beyond its
    residuals (the scores and probabilities among them), dP (one fp32 score array with
    ``dot_product``; blockwise: its attention phase) and one (b, s, f) array (buffer assignment of tiny
    data=2 x tensor=2 x pipeline=2 interleaved SP, s=1024: three f32[2,1,2,1024,1024] arrays at the
    peak, two of them the chunk's residuals)."""
    return max(_layer_working_phases(model, layout, b, layers, tick))


def _layer_working_phases(
    model: ConfigDict, layout: ParallelLayout, b: int | None, layers: int, tick: bool
) -> tuple[float, float]:
    """(forward, backward) of :func:`layer_working_bytes` (forward 0 without dot-product attention)."""
    d = Dims.of(model, layout, b)
    rec = layout.recompute
    if tick and rec == "none" and layers <= 1:  # the chunk's residuals hold the scores and probabilities;
        # its attention backward adds dP (one fp32 score array: buffer assignment of tiny interleaved,
        # chunks of one layer, s=1024: three f32[b, n/t, s, s] arrays at the peak, two of them residuals)
        # an MoE layer: its backward working set in the (b, s, f) array's place
        mlp = moe_activations.moe_backward_bytes(model, layout, b) if model.get("num_experts", 0) else None
        if _attention(layout) == "dot_product":
            return 0.0, (d.e * d.b * d.s * d.f if mlp is None else mlp) + F32 * d.b * d.n * d.s * d.s
        return 0.0, max(
            d.e * d.b * d.s * d.f if mlp is None else mlp, blockwise_attention_backward_bytes(model, layout, b)
        )
    weights = d.e * layer_params(model, layout)
    dot = _attention(layout) == "dot_product"
    one_layer_selective_tick = tick and rec == "selective" and layers <= 1
    kv = 2 * d.e * d.b * d.s * d.k if dot else 2 * d.e * d.b * d.s * (d.q + 2 * d.k)
    if model.get("num_experts", 0):  # the MoE layer's backward in the MLP's place
        mlp = moe_activations.moe_backward_bytes(model, layout, b)
    else:
        # a ``selective`` tick of a one-layer chunk: :data:`BACKWARD_MLP_WIDE` of ``full`` (buffer assignment of
        # tiny data=2 x tensor=2 x pipeline=2 interleaved SP selective, b=4, s=256: seven f32[4, 256, 192]
        # arrays at the peak; a chunk of two layers, 1F1B, b=4, s=128, is within 4% of the count without it)
        mlp = BACKWARD_MLP_WIDE["full" if one_layer_selective_tick else rec] * d.e * d.b * d.s * d.f
    backward = (
        mlp
        + BACKWARD_HIDDEN_OUTSIDE * d.e * d.b * d.so * d.h
        + (BACKWARD_HIDDEN_WIDE[rec] - BACKWARD_HIDDEN_OUTSIDE) * d.e * d.b * d.s * d.h
        + kv
        + weights
    )
    zero3 = zero3_weight_gradient_bytes(model, layout)
    if not dot:
        if zero3 and rec == "full" and not model.get("num_experts", 0):
            # the weight gradients are written once the recomputed gate, up, silu and product are consumed: that
            # moment holds the three MLP gradients of ``none`` beside ZeRO-3's gradient and relaid weight, not the
            # seven arrays of ``full`` (buffer assignment of ~1B, 2 layers, data=4 x context=2 ZeRO-3 full,
            # s=1024, block 64: seven f32[1024, 8192] arrays at the peak and no f32[2048, 8192] gradient)
            backward = max(backward, backward - mlp + BACKWARD_MLP_WIDE["none"] * d.e * d.b * d.s * d.f + zero3)
        else:
            backward += zero3
        one_block = layout.attention_block >= d.s and not tick  # a tick keeps no recomputed scores (as above)
        if (layout.context > 1 or one_block) and rec != "none":  # RING_RECOMPUTED_BLOCKS
            block = min(layout.attention_block, d.s)
            backward += layout.context * RING_RECOMPUTED_BLOCKS[rec] * F32 * d.b * d.n * block * block
        return 0.0, max(backward, blockwise_attention_backward_bytes(model, layout, b))
    scores = d.b * d.n * d.s * d.s  # elements of one (b, n/t, s, s) array
    unstacked = rec == "none" and layers <= 1
    copies = FORWARD_SCORE_COPIES - (BACKWARD_SCORE_COPIES if unstacked else 0)
    forward = (copies * F32 + 1) * scores + d.s * d.s + weights + d.e * d.b * d.s * (d.h + d.k)
    base = backward
    # A layer whose backward recomputes its forward (``selective`` / ``full``, with or without a pipeline tick)
    # holds the recomputed scores and probabilities until the attention's backward, through the MLP phase:
    # buffer assignment of tiny data=2 x tensor=2 x pipeline=2 1F1B ZeRO-1 full, s=512, b=2 (the chunk
    # recomputed layer by layer, one sequence at a time: f32[1, 1, 2, 512, 512] and f32[1024, 512] beside the
    # seven f32[512, 192] MLP arrays), the same layout with ZeRO-3, s=256 (the whole microbatch at once: two
    # f32[2, 1, 2, 256, 256] arrays at the MLP phase's peak). Without recomputation a tick's scores are its
    # chunk's residuals, counted in the residual stack.
    if not unstacked and (not tick or rec != "none"):
        backward += BACKWARD_SCORE_COPIES * F32 * scores
    if rec == "none":
        backward += scores  # the broadcast causal mask, hoisted out of the backward loop
    # ZeRO-3's weight gradient and relaid weight: a phase of its own beside the score arrays (~1B, 4 layers,
    # data=8 ZeRO-3 full, s=1024: counting both puts the estimate 15% over the compiled temporaries)
    backward = max(backward, base + zero3)
    if model.get("attention_dropout", 0.0) > 0 and (layout.pipeline == 1 or (tick and rec != "none")):
        # the forward attention's keep mask (1 byte) and dropped fp32 probabilities; in a 1F1B tick too (tiny
        # data=4 x pipeline=2 1F1B selective: four f32[b, n, s, s] arrays and the pred mask at the peak).
        # The backward's MLP phase holds no mask (tiny data=8 ZeRO-2 full, s=256: the two score arrays only)
        forward += (F32 + 1) * scores
    return forward, backward


def blockwise_attention_backward_bytes(model: ConfigDict, layout: ParallelLayout, b: int | None = None) -> float:
    """The attention phase of one layer's backward under ``blockwise`` attention (and context parallelism,
    whose ring runs the same kernel per hop): :data:`BLOCKWISE_BACKWARD_BLOCKS` (+1 with attention dropout)
    fp32 (b, n/t, bq, bk) arrays of the inner step, bq = bk = min(``attention_block``, s) (the kernel
    clamps its blocks to the sequence), and the operands e*b*(s*h + 3*so*h + 2*s*q + r*s*k), r = 1 without a
    ring and :func:`ring_backward_kv_arrays` with one; under ``full`` the recomputed forward's q, k and v
    projection weights too, e*h*(q + 2k) (their sliced copies: f32[128, 128] and two f32[64, 128] in the
    ring measurement of :func:`ring_backward_kv_arrays`)."""
    d = Dims.of(model, layout, b)
    block = min(layout.attention_block, d.s)
    copies = BLOCKWISE_BACKWARD_BLOCKS + (1 if model.get("attention_dropout", 0.0) > 0 else 0)
    # ring attention: the hops' backward steps are independent but for the dQ sum, and XLA overlaps them:
    # another hop's P, dP and dS beside this one's (buffer assignment of tiny data=4 x context=2, block =
    # s/c = 256, full: seven f32[2, n, 256, 256]-sized blocks at the peak)
    copies += (layout.context - 1) * (BLOCKWISE_BACKWARD_BLOCKS - 1)
    kv = ring_backward_kv_arrays(layout.context)
    operands = d.e * d.b * (d.s * d.h + 3 * d.so * d.h + 2 * d.s * d.q + kv * d.s * d.k)
    # the recomputed forward's q, k, v projection weights, sliced out of the stacked parameters (copies): h x (q + 2k)
    weights = d.e * d.h * (d.q + 2 * d.k) if layout.recompute == "full" else 0.0
    return copies * F32 * d.b * d.n * block * block + operands + weights


def layer_working_term(
    model: ConfigDict, layout: ParallelLayout, b: int | None = None, layers: int = 2
) -> tuple[str, float]:
    """(name, bytes) of the phase that sets :func:`layer_working_bytes`: the last layer's forward
    attention or one layer's backward."""
    forward, backward = _layer_working_phases(model, layout, b, layers, False)
    return ("last layer's forward attention", forward) if forward > backward else ("one layer's backward", backward)


def pipeline_head_phase_bytes(model: ConfigDict, layout: ParallelLayout, b: int | None = None) -> float:
    """The last stage's loss head in a 1F1B / interleaved backward tick, at its weight-gradient matmul,
    beside the chunk's residuals, the gradient accumulator and the tick's chunk gradients: the output
    weight as the tick's ``switch`` hands it to the matmul and in the transposed layout of the
    backward's dy^T x (e * h*V/t each), the weight's gradient before it is added to the accumulator
    (pb * h*V/t), two fp32 (b, s, V/t) arrays (the logit gradient and its scatter) and the final norm's
    (b, s, h) gradient. Buffer assignment of ~1B tensor=2 x pipeline=4, 1F1B, m=4, s=256, ``none``:
    ``f32[2048,16000]`` three times and ``f32[1,256,16000]`` twice at the step's peak; the layers'
    working set is not live then (they run after the head), so the tick's peak is the larger of the two
    phases."""
    d = Dims.of(model, layout, b)
    table = shared_tables(model, layout)
    return (2 * d.e + DTYPE_BYTES[model.param_dtype]) * table + 2 * F32 * d.b * d.s * d.v + d.e * d.b * d.s * d.h


def head_working_bytes(model: ConfigDict, layout: ParallelLayout, b: int | None = None) -> float:
    """The vocabulary-parallel cross-entropy of one microbatch (:func:`jaxpar.models.llama.cross_entropy_sum`):
    fp32 logits of this tensor rank's V/t columns, exp(z) kept for the backward, and the fp32 logit
    gradient: :data:`HEAD_COPIES` * 4*b*s*V/t (the final norm's input and output: 2 e*b*s*h)."""
    d = Dims.of(model, layout, b)
    return HEAD_COPIES * F32 * d.b * d.s * d.v + 2 * d.e * d.b * d.s * d.h


@dataclasses.dataclass(frozen=True)
class TempEstimate:
    """Estimated ``memory_analysis().temp_size_in_bytes`` of one device (one pipeline stage), by term."""

    stage: int
    residual_bytes: float  # saved for the backward: the layer stack x in-flight microbatches
    working_bytes: float  # one layer's (or the head's) backward working set at the peak
    gradient_bytes: float  # fp32 gradient buffers: stacked layer gradients, accumulators
    gather_bytes: float  # ZeRO-3: gathered layers in flight
    pipeline_bytes: float  # stage-input and gradient slot buffers of the schedule
    update_bytes: float  # the optimizer phase's peak (reductions, ZeRO shards), when it is the larger
    phase: str  # backward | update | accumulator: which phase sets the peak
    accumulator_bytes: float = (
        0.0  # 1F1B / interleaved: the accumulator copied beside itself (pipeline_accumulator_bytes)
    )
    working_term: str = "one layer's backward"  # which working set sets working_bytes

    @property
    def total_bytes(self) -> float:
        backward = (
            self.residual_bytes + self.working_bytes + self.gradient_bytes + self.gather_bytes + self.pipeline_bytes
        )
        return max(backward, self.update_bytes, self.accumulator_bytes)

    def terms(self) -> dict[str, float]:
        """The named terms of the phase that sets :attr:`total_bytes` (they sum to it)."""
        backward = (
            self.residual_bytes + self.working_bytes + self.gradient_bytes + self.gather_bytes + self.pipeline_bytes
        )
        if self.total_bytes == backward:
            out = {
                "residual stack": self.residual_bytes,
                self.working_term: self.working_bytes,
                "gradient buffers": self.gradient_bytes,
                "ZeRO-3 gathered layers": self.gather_bytes,
                "pipeline slot buffers": self.pipeline_bytes,
            }
        elif self.total_bytes == self.update_bytes:
            out = {"optimizer update (gradients, their reduction, ZeRO shards)": self.update_bytes}
        else:
            out = {"gradient accumulator held twice (pipeline tick)": self.accumulator_bytes}
        return {k: v for k, v in out.items() if v > 0}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"total_bytes": self.total_bytes}


def _grad_elements(model: ConfigDict, layout: ParallelLayout, stage: int) -> tuple[float, float]:
    """(layer, shared) gradient elements one device writes per backward (stage ``stage``)."""
    layers = layout.stored_layers(model.num_layers)
    if layout.pipeline == 1:
        return layers * layer_params(model, layout), shared_params(model, layout)
    where = "first" if stage == 0 else "last" if stage == layout.pipeline - 1 else "none"
    shared = shared_params(model, layout, where) if where != "none" else shared_tables(model, layout)
    return layers * layer_params(model, layout), shared


def early_scattered_head_bytes(model: ConfigDict, layout: ParallelLayout) -> float:
    """ZeRO-1/2 without accumulation or a pipeline: what the output layer's gradient frees by being
    reduce-scattered before the layers' backward. The loss head's backward runs first, and its weight
    gradient is final at once; XLA schedules its ``psum_scatter`` over data (x context) there, so only
    the 1/N shard stays live through the layer loop: pb * h*V/t * (1 - 1/N) less than the full table
    (buffer assignment of ~1B, 4 layers, data=4 x context=2 ZeRO-1 and data=2 x tensor=2 x context=2
    ZeRO-2, s=256: a ``reduce-scatter`` f32[b*s, V/N] beside the stacked layer gradients, no full
    output-layer gradient). The embedding's gradient, a scatter-add finished after the layer loop, stays
    full. With sequence parallelism XLA schedules the scatter after the layer loop (~1B data=2 x
    tensor=2 x context=2 ZeRO-1 SP: the full f32[2048,16000] gradient at the peak): not counted there."""
    n = layout.data * layout.context * layout.expert
    head = sum(
        shard_elements(t, layout.tensor, 1, False, layout.expert) for t in param_tensors(model) if t.name == "output"
    )
    return DTYPE_BYTES[model.param_dtype] * head * (1 - 1 / n)


def update_bytes(model: ConfigDict, layout: ParallelLayout, grads: float) -> float:
    """The optimizer phase (:mod:`jaxpar.train.step`), with ``grads`` the full local fp32 gradient bytes.

    Stage 0: the data all-reduce writes a second gradient buffer (XLA:CPU does not reduce in place),
    except for the embedding's scatter-add gradient: 2G - 4*V*h/t (the ~1B config at data=8: 0.1%).
    Stages 1-2: at the turn from the backward to the update, every gradient beside one relayout copy
    of the largest stacked layer gradient (W_down's (L, f, h) stack transposed so that the
    ``psum_scatter`` dim leads), pb * P_layer_max; the scatters then free the full gradients one by
    one, and the updated shards' all-gathers hold far less (buffer assignment of ~1B data=8 ZeRO-1
    s=512 with 4 and 16 layers, and data=2 x tensor=2 x context=2 ZeRO-2 with 2: a
    ``f32[L,8192,2048]{1,0,2}`` copy beside the stacked gradients at that point, nothing else of
    its size). Stage 3: the gradient buffers of the
    backward, G/N and the embedding's full table (:func:`zero3_embedding_gradient_bytes`), which the
    update reads in place (buffer assignment of ~1B data=8 full, s=512: the update's live set is
    those buffers, 749 MiB, and nothing of their size besides).
    """
    pb = DTYPE_BYTES[model.param_dtype]
    if not layout.shards_optimizer:
        return 2 * grads - pb * shared_tables(model, layout)
    if not layout.shards_parameters:  # ZeRO-1/2
        return grads + pb * largest_param(model, layout)
    return zero_sharded_bytes(model, layout, grads) + zero3_embedding_gradient_bytes(model, layout)


def zero_sharded_bytes(model: ConfigDict, layout: ParallelLayout, full_bytes: float) -> float:
    """``full_bytes`` of gradients (every parameter one device holds) ZeRO-sharded: / (data x context);
    with ``expert`` > 1 the experts' weights' share / (data x context), the rest / (data x expert x
    context) (:func:`jaxpar.axes.data_group`)."""
    n = layout.data * layout.context
    if layout.expert == 1:
        return full_bytes / n
    layers = layout.stored_layers(model.num_layers)
    experts = sum(
        shard_elements(t, layout.tensor, 1, False, layout.expert)
        for t in param_tensors(model)
        if t.place == "layer" and t.expert_split
    )
    experts *= layers * DTYPE_BYTES[model.param_dtype]
    return experts / n + (full_bytes - experts) / (n * layout.expert)


def largest_param(model: ConfigDict, layout: ParallelLayout) -> float:
    """Elements of the largest stacked layer weight one device holds (the stage's layers of it)."""
    layers = layout.stored_layers(model.num_layers)
    return layers * max(
        shard_elements(t, layout.tensor, 1, False, layout.expert) for t in param_tensors(model) if t.place == "layer"
    )


def temp_estimate(model: ConfigDict, layout: ParallelLayout, stage: int = 0) -> TempEstimate:
    """Estimated temporaries of one device on pipeline stage ``stage`` (0 without a pipeline).

    Without a pipeline: the layer scan keeps L x :func:`layer_residual_bytes` (one microbatch's stack
    for every m: the accumulation loop runs each microbatch's forward and backward inside one
    iteration, :mod:`jaxpar.train.step`); beside it the largest of one layer's
    :func:`layer_working_bytes` (the last layer's forward attention or one layer's backward), the
    head's :func:`head_working_bytes` and, ZeRO-3, :func:`zero3_head_phase_bytes`; the backward
    scan writes the stacked fp32 layer gradients (ZeRO-3: reduce-scattered, 1/N, plus
    :func:`zero3_embedding_gradient_bytes`) and, with m > 1, the accumulation sum is a second buffer
    (ZeRO-2/3: sharded; ZeRO 0-1: the microbatch's stacked layer gradients beside the full
    accumulator, into which the scatter-add of the embedding and the output layer's gradient are
    added in place: buffer assignment of ~1B, 2 layers, data=8 ZeRO-1 m=2, f32[2048,32000] and
    f32[32000,2048] once, the stacked layer gradients twice). ZeRO-3 gathers each layer's weights where ZeRO 0-2 slice them out of the
    stacked parameters: the same shapes, counted once in :func:`layer_working_bytes`, which adds
    ZeRO-3's unsharded weight gradient and relaid weight (:func:`zero3_weight_gradient_bytes`). The update
    phase (:func:`update_bytes`) sets the peak when it is the larger.

    1F1B / interleaved (:mod:`jaxpar.parallel.pipeline`): a backward tick recomputes its chunk of
    L/(p*v) layers under ``jax.vjp``, so one microbatch's chunk stack is live (with ``full`` and
    ZeRO < 2 one sequence at a time, layer by layer), plus :func:`layer_working_bytes` (``tick``), the chunk's
    gradient before it is added to the fp32 accumulator of the stage (none where each layer's gradient
    is added into the accumulator as it is written: ZeRO-3, whose layers leave the chunk's scan
    reduce-scattered, and ``full`` by layer; ZeRO-3 also gathers the attention's weights a second
    time, :func:`zero3_regathered_params`), and the act/grad slot buffers
    of the schedule (:func:`jaxpar.parallel.pipeline.compile_program`: p stage inputs on stage 0 for
    1F1B); the last stage runs the head inside the same backward; the accumulator held twice
    (:func:`pipeline_accumulator_bytes`) is a phase of its own. GPipe: the forward scan over
    m + p - 1 ticks is differentiated as a whole, so every tick's :func:`gpipe_tick_bytes` (bubbles
    included, the stage's weights among them) stay live; the backward tick slices one tick's
    residuals out of those stacks (a copy: one more :func:`gpipe_tick_bytes`; without recompute and with
    more than one layer per stage and b = 1, the layer residuals a second time, in the layer scan's layout) and
    works on one layer (:func:`layer_working_bytes`).
    """
    p, pb = layout.pipeline, DTYPE_BYTES[model.param_dtype]
    d = Dims.of(model, layout)
    layer_el, shared_el = _grad_elements(model, layout, stage)
    full_grads = pb * (layer_el + shared_el)
    zero3 = layout.shards_parameters
    ticks = p > 1 and layout.pipeline_schedule != "gpipe"  # GPipe's tick stacks hold the gathered weights already
    gather = d.e * zero3_regathered_params(model, layout) if zero3 and ticks else 0.0
    if p == 1:
        layers = model.num_layers
        # one microbatch's stack, for every m: the accumulation scan runs each microbatch's forward and
        # backward inside one iteration (jaxpar.train.step: every microbatch in the loop, from zeros)
        residual = layers * (layer_residual_bytes(model, layout) + dropout_residual_bytes(model, layout))
        candidates = [
            layer_working_term(model, layout, layers=layers),
            ("loss head", head_working_bytes(model, layout)),
        ]
        grads = zero_sharded_bytes(model, layout, full_grads) if zero3 else full_grads
        if zero3:  # no gathered layer added: it takes the place of the sliced one (see above)
            candidates.append(
                ("ZeRO-3 loss head (gathered weight, its gradient)", zero3_head_phase_bytes(model, layout))
            )
            grads += zero3_embedding_gradient_bytes(model, layout)
        term, working = max(candidates, key=lambda c: c[1])
        early = (
            early_scattered_head_bytes(model, layout)
            if layout.shards_optimizer
            and not layout.shards_parameters
            and (layout.microbatches == 1 or layout.shards_gradients)
            and not layout.sequence_parallel
            else 0
        )
        grads -= early
        if layout.microbatches > 1:  # the microbatch's stacked layer gradients beside the accumulator (ZeRO
            # 0-1; the embedding and output-layer gradients are added into it in place); ZeRO-2/3: a sharded sum
            grads += zero_sharded_bytes(model, layout, full_grads) if layout.shards_gradients else pb * layer_el
            if zero3:  # the zero table the embedding's scatter-add starts from, hoisted out of the microbatch
                # loop, and each microbatch's copy of it (buffer assignment of ~1B ZeRO-3 m=2 and m=4:
                # two f32[V/t, h] tables beside the sharded gradients)
                grads += pb * shared_tables(model, layout)
        update = update_bytes(model, layout, full_grads - early)
        return TempEstimate(
            0,
            residual,
            working,
            grads,
            gather,
            0.0,
            update,
            "update" if update > residual + working + grads + gather else "backward",
            working_term=term,
        )

    chunk = layout.layers_per_stage(model.num_layers)
    last = stage == p - 1
    if layout.pipeline_schedule == "gpipe":
        per_tick = gpipe_tick_bytes(model, layout)
        residual = (layout.microbatches + p - 1) * per_tick
        # the backward tick slices its residuals out of the tick stacks (a copy), then works on one layer
        working, slots = per_tick + layer_working_bytes(model, layout, layers=chunk), 0.0
        if layout.recompute == "none" and chunk > 1 and layout.microbatch_size == 1:
            # one sequence per microbatch: XLA lays the sliced residuals out with the size-1 batch dim moved
            # ({..,2,0,1}) and copies them into the chunk's layer scan's layout, a second copy of the tick's
            # layer residuals (buffer assignment of tiny data=4 x pipeline=2 GPipe ZeRO-3 m=4, s=256, b=1,
            # attention dropout: the tick's f32[2, 1, 2, 512, 256] scores, six f32[2, 1, 256, 384] MLP
            # residuals and pred masks twice each; the same layout with b=4, s=128 slices them once)
            working += chunk * (layer_residual_bytes(model, layout) + dropout_residual_bytes(model, layout))
        term = "backward tick: one tick's residuals and one layer's working set"
        chunk_grads = full_grads
    else:
        keep = keeps_activations(layout)
        prog = _program(layout.pipeline_schedule, p, layout.microbatches, layout.virtual_stages, keep)
        by_layer = layout.recompute == "full" and not layout.shards_gradients
        rows = 1 if by_layer else None
        residual = chunk * (layer_residual_bytes(model, layout, b=rows) + dropout_residual_bytes(model, layout, b=rows))
        # stage inputs and arriving gradients, and (no recomputation) each in-flight microbatch's
        # saved residuals: the stash slots of the program times one microbatch's chunk residuals, plus
        # one more set, the forward tick's residuals leaving its switch before they are written
        # into their slot (buffer assignment of tiny data=2 x tensor=2 x pipeline=2 1F1B m=4)
        slots = (prog[0] + prog[1]) * d.e * d.b * d.so * d.h + (prog[2] + 1) * residual * keep
        if splits_backward(layout.pipeline_schedule):  # B's frontier for W (each weight matmul's output gradient),
            # per layer and microbatch in flight between B and W: only what does not fit in the stash slot's
            # residuals that B alone read (jaxpar.parallel.pipeline.split_executor; none for a llama block)
            slots += (prog[3] + 1) * chunk * frontier_unpacked_bytes(model, layout)
            # F runs the loss head on the last virtual stage and every stage's slot keeps the head's residuals
            # (SPMD: one shape; buffer assignment of tiny zb-v data=2 x tensor=2 x pipeline=2 m=4: four
            # f32[4, b, s, h]-sized stash buffers, the logits and the final norm's three)
            slots += prog[2] * head_residual_bytes(model, layout)
        working = layer_working_bytes(model, layout, b=rows, layers=chunk, tick=True)
        if by_layer:  # the microbatch's gradient at the chunk's output and its input gradient, assembled
            # sequence by sequence: two (b, s, h) arrays of the whole microbatch beside the one sequence's
            # working set (buffer assignment of tiny data=2 x tensor=2 x pipeline=2 1F1B full m=4)
            working += 2 * d.e * d.b * d.so * d.h
        term = "backward tick: one layer's working set"
        if last:  # the loss head's backward runs in the tick before the chunk's: the larger phase sets the peak
            head = pipeline_head_phase_bytes(model, layout, b=rows)
            if zero3:  # ZeRO-3: one layer's weights gathered ahead of the chunk's backward, in place of the
                # layers in flight (buffer assignment of ~1B data=2 x pipeline=4 ZeRO-3 full: the MLP's
                # three gathered weights beside the head's, at the head's weight-gradient matmul)
                head += d.e * layer_params(model, layout) - gather
            if head > working:
                working, term = head, "backward tick: the loss head's backward"
        # recomputed layer by layer, each layer's weight gradient is added into the accumulator in place as the
        # layer's backward writes it: no gradient beside the accumulator (buffer assignment of tiny data=2 x
        # pipeline=4 1F1B ZeRO-0 full, m=8, s=256: the accumulator's f32[1, 128, 384] once at the peak)
        chunk_grads = 0.0 if by_layer else pb * chunk * layer_params(model, layout)
        if zero3:  # each layer is gathered inside the chunk's layer scan (Model.layer_step), so its gradient
            # leaves the scan through the gather's transpose, a reduce-scatter, and is added into its slice of
            # the sharded accumulator: no chunk gradient beside it (buffer assignment of tiny data=2 x tensor=2 x
            # pipeline=2 1F1B ZeRO-3 full, s=256 and s=128: the accumulator's f32[2, 64, 192] shards at the peak,
            # once, and no f32[2, 128, 192] chunk gradient)
            chunk_grads = 0.0
    acc = zero_sharded_bytes(model, layout, full_grads) if layout.shards_gradients else full_grads
    grads = acc + chunk_grads
    update = update_bytes(model, layout, full_grads)
    backward = residual + working + grads + gather + slots
    accumulator = 0.0 if layout.pipeline_schedule == "gpipe" else pipeline_accumulator_bytes(model, layout, acc) + slots
    phase = max((backward, "backward"), (update, "update"), (accumulator, "accumulator"))[1]
    return TempEstimate(stage, residual, working, grads, gather, slots, update, phase, accumulator, term)


def frontier_bytes(model: ConfigDict, layout: ParallelLayout) -> float:
    """What a split backward's B tick keeps of one layer for its W tick
    (:mod:`jaxpar.parallel.pipeline.weight_split`): the gradient at each weight matmul's output and
    the values W reads that B computed, in the compute dtype. Read from the frontier of the llama
    block's pullback: q, k and v, the attention output's and the MLP's gate and up gradients, and
    four (b, s, h) arrays (W_o's and W_down's output gradients, the two norms' normalised-input
    gradients): e*b*s*(q + 2k + 4h + 2f) (GeLU: one f)."""
    d = Dims.of(model, layout)
    f = (2 if model.mlp_activation == "swiglu" else 1) * d.f
    return d.e * d.b * d.s * (d.q + 2 * d.k + 4 * d.h + f)


def frontier_unpacked_bytes(model: ConfigDict, layout: ParallelLayout) -> float:
    """What of :func:`frontier_bytes` needs slots of its own: B writes the frontier into the
    compute-dtype residuals of its stash slot that W does not read
    (:func:`jaxpar.parallel.pipeline.stash.pack`), e*b*s*(q + 2k + 5f) for SwiGLU (q and k after
    RoPE, v, and the MLP's residuals but W_down's input; GeLU 3f), counted as one pool."""
    d = Dims.of(model, layout)
    b_only = d.e * d.b * d.s * (d.q + 2 * d.k + (5 if model.mlp_activation == "swiglu" else 3) * d.f)
    return max(0.0, frontier_bytes(model, layout) - b_only)


def pipeline_accumulator_bytes(model: ConfigDict, layout: ParallelLayout, acc: float) -> float:
    """1F1B / interleaved (:func:`jaxpar.parallel.pipeline.executor._explicit_loss_and_grads`): the
    backward tick holds the gradient accumulator (``acc`` bytes, the scan's carry) *twice*. The
    tick's ``switch`` takes the accumulator as an operand and returns it, and the backward updates
    it in place inside its layer loop, so XLA copies it into the loop's state while the operand
    stays live. Beside the two copies, the larger of:

    - inside the layer loop: one layer's weights sliced out of the stage's stack, and with v > 1
      the chunk's L/(p*v) layers sliced out first (:func:`jaxpar.parallel.pipeline.ticks.chunk_layers`),
      pb * (1 + [v > 1] * L/(p*v)) * :func:`layer_params`, and with ``dot_product`` the attention's
      :data:`BACKWARD_SCORE_COPIES` fp32 (b, n/t, s, s) arrays of the microbatch (buffer assignment of
      tiny data=4 x pipeline=2 1F1B ``full`` m=2: the two accumulator copies, the layer's sliced
      weights and two f32[4,2,2,128,128] score arrays at the peak);
    - after it, the first stage's embedding gradient (a scatter-add into a zero table, then the
      ``cond`` output): two more V/t x h tables, 2 * pb * :func:`shared_tables`.
    """
    pb = DTYPE_BYTES[model.param_dtype]
    chunk = layout.layers_per_stage(model.num_layers)
    loop = pb * layer_params(model, layout) * (1 + (chunk if layout.virtual_stages > 1 else 0))
    if _attention(layout) == "dot_product":
        d = Dims.of(model, layout)
        loop += BACKWARD_SCORE_COPIES * F32 * d.b * d.n * d.s * d.s
    return 2 * acc + max(loop, 2 * pb * shared_tables(model, layout))


def gpipe_tick_bytes(model: ConfigDict, layout: ParallelLayout) -> float:
    """What one GPipe forward tick (:func:`jaxpar.parallel.pipeline.executor._gpipe_loss_and_grads`) saves
    for the backward: the tick scan is differentiated as a whole, so this is stacked over all m + p - 1
    ticks (bubbles included: the skipped branch's residuals are zeros of the same shapes).

    - the stage's layer residuals, L/p x :func:`layer_residual_bytes`, and the head's, on every
      stage (SPMD): the fp32 logits 4*b*s*V/t, the final norm's input and output and its fp32
      normalised input (2e + 4)*b*s*h;
    - with jax 0.10 (:func:`cond_stacks_weights`) the stage's *parameters*, once per tick, in the
      compute dtype (the matmul operands): e * (L/p x :func:`layer_params` + the V/t x h ``ends`` / embedding table). JAX's partial
      evaluation of the tick's ``cond`` (work / skip) returns the branch's residuals as outputs of
      the cond, the weights among them; the scan then stacks them like any per-tick value instead
      of forwarding them as loop constants.
    """
    d = Dims.of(model, layout)
    layers = layout.stored_layers(model.num_layers)
    # ZeRO-3: the tick saves the layers' shards (each layer is gathered inside the layer scan, again in the
    # backward), 1/N of them (tiny data=2 x tensor=2 x pipeline=2 GPipe ZeRO-3: f32[5,2,64,192] stacks of
    # h/2 rows); the embedding / head table is saved whole
    shard = layout.data * layout.context if layout.shards_parameters else 1
    weights = d.e * (layers * layer_params(model, layout) / shard + shared_tables(model, layout))
    if not cond_stacks_weights():
        weights = 0.0
    head = head_residual_bytes(model, layout)
    # ``dot_product`` without recompute: each layer's broadcast causal mask, pred (b, n/t, s, s), is computed
    # inside the tick's ``cond`` and leaves it as a residual, so the tick scan stacks it per layer (jax 0.10.2
    # and 0.12.0.1 alike; buffer assignment of tiny data=2 x pipeline=4 GPipe ZeRO-3 m=4, b=2, s=1024:
    # pred[7, 2, 2, 2, 1024, 1024], 56 MiB). Without a pipeline it is hoisted out of the loop instead
    # (:func:`layer_working_bytes`).
    mask = 0.0
    if _attention(layout) == "dot_product" and layout.recompute == "none":
        d = Dims.of(model, layout)
        mask = layers * d.b * d.n * d.s * d.s
    layer = layer_residual_bytes(model, layout) + dropout_residual_bytes(model, layout)
    return layers * layer + mask + head + weights


@functools.cache
def cond_stacks_weights() -> bool:
    """Whether the installed jax's partial evaluation of ``lax.cond`` returns the branch's weights among its
    residuals, so that GPipe's tick scan stacks them (:func:`gpipe_tick_bytes`): jax 0.10 does, jax 0.12 forwards
    them as the loop's constants. Buffer assignment of tiny data=2 x pipeline=4 GPipe m=4, s=128 (b=2,
    ``none``): f32[7, 1, 128, 384]-shaped weight stacks (7 = m + p - 1 ticks) in the backward's loop state on
    jax 0.10.2, 51.87 MiB of temporaries; none on jax 0.12.0.1, 45.87 MiB, the 6.13 MiB the weights term
    counts. jax 0.11 is taken with 0.12 (not compiled). Read from the installed distribution's metadata, so
    the planner does not import JAX."""
    try:
        version = importlib.metadata.version("jax")
    except importlib.metadata.PackageNotFoundError:
        return False
    return tuple(int(v) for v in version.split(".")[:2] if v.isdigit()) < (0, 11)


def head_residual_bytes(model: ConfigDict, layout: ParallelLayout) -> float:
    """What the loss head keeps for its backward, per microbatch: the fp32 logits 4*b*s*V/t, the
    final norm's input and output and its fp32 normalised input (2e + 4)*b*s*h."""
    d = Dims.of(model, layout)
    return F32 * d.b * d.s * d.v + (2 * d.e + F32) * d.b * d.s * d.h


_PROGRAMS: dict[tuple, tuple[int, int, int, int]] = {}


def _program(schedule: str, p: int, m: int, v: int, keep: bool) -> tuple[int, int, int, int]:
    """(act_slots, grad_slots, stash_slots, front_slots) of a schedule's executor program, cached: the planner
    asks for the same few many times."""
    key = (schedule, p, m, v, keep)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = steady_slot_counts(schedule, p, m, v, keep)
    return _PROGRAMS[key]


def stage_temps(model: ConfigDict, layout: ParallelLayout) -> list[TempEstimate]:
    """:func:`temp_estimate` of every pipeline stage (one entry without a pipeline)."""
    return [temp_estimate(model, layout, stage) for stage in range(layout.pipeline)]


def estimated_temp_bytes(model: ConfigDict, layout: ParallelLayout) -> float:
    """The largest stage's estimated temporaries: what ``memory_analysis().temp_size_in_bytes`` reports
    (every device compiles the same SPMD program, so its temp buffer fits the busiest stage)."""
    return max(t.total_bytes for t in stage_temps(model, layout))
