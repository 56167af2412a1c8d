"""Activations of jaxpar's own train step, per layer and per phase: the terms the temporaries estimate
(:mod:`jaxpar.analysis.temporaries`) adds up into the other half of the peak.

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
* **Gradient buffers** (:func:`jaxpar.analysis.temporaries.temp_estimate`): the backward scan writes each layer's fp32
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
* **Head working set** (:mod:`jaxpar.analysis.head_phases`): the vocabulary-parallel cross-entropy keeps
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

import functools

from jaxpar.analysis import moe_activations
from jaxpar.analysis.attention_blocks import (
    RING_DEFERRED_MLP_GRADIENTS,
    RING_RECOMPUTED_BLOCKS,
    blockwise_attention_backward_bytes,
)
from jaxpar.analysis.dims import F32, Dims
from jaxpar.config import ConfigDict
from jaxpar.models.inventory import DTYPE_BYTES, ParallelLayout, param_tensors, shard_elements
from jaxpar.versions import jax_release


def attention_kind(layout: ParallelLayout) -> str:
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
    if attention_kind(layout) == "dot_product":
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
    if model.get("attention_dropout", 0.0) > 0 and attention_kind(layout) == "dot_product":
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
    return _place_elements(model, layout, ("first", "last") if layout.pipeline == 1 else (stage,))


def head_params(model: ConfigDict, layout: ParallelLayout) -> float:
    """Elements of the loss head's parameters one device holds (the final norm, the output weight)."""
    return _place_elements(model, layout, ("last",))


def _place_elements(model: ConfigDict, layout: ParallelLayout, places: tuple[str, ...]) -> float:
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
# Heap packing of attention dropout's chain. With ``model.attention_dropout`` the attention's forward is a
# chain of four same-shaped fp32 arrays, each read only by the next: q k^T, the masked scores, the
# probabilities, the dropped probabilities. Two are live at once, but XLA's best-fit heap
# (xla/service/heap_simulator) places equal-sized buffers of equal lifetimes in its own order, not the
# program's, so four links that each live one step take three slots. That happens where XLA:CPU runs the
# whole softmax as one fused kernel, which it does from :data:`SOFTMAX_FUSED_ROWS` rows (b * n/t * s) up:
# tiny data=8 ZeRO-1 selective, b=2, s=1024 (8192 rows) takes three f32[2, 2, 2, 1024, 1024] slots for two
# live (allocation 215.8 MiB, largest live set 183.8); below it XLA splits the softmax (exponentials, row
# sums, division), the probabilities live across those steps and the chain packs into two (tiny data=8
# selective, b=1, s=512: 2048 rows, no hole). The threshold is XLA:CPU's fusion choice, read from every
# ``dot_product`` row with attention dropout of experiments/results/2026-12-06-memory-grid (holes of one
# whole score array at 4096 rows and more under recompute, none below: 4096 fits every row, 2048 and 8192
# each put four rows outside the bounds). Without recompute the forward writes its scores and
# probabilities into the residual stack, no chain is transient, and no hole appears (tiny b=2, s=1024,
# ``none``: none). A GPipe tick scan saves them likewise.
SOFTMAX_FUSED_ROWS = 4096


@functools.cache
def fuses_every_softmax() -> bool:
    """Whether the installed jax's XLA:CPU runs the whole softmax as one kernel at every size: jax 0.12.1's does
    (tiny data=8 ZeRO-2 ``full``, b=4, s=256, 2048 rows: one f32[4, 2, 2, 256, 256] array at the backward's peak
    where 0.10.2 and 0.12.0.1 hold two), so one backward score copy is live, not two, and the chain holes of
    :data:`SOFTMAX_FUSED_ROWS` open at every size. Read from seeds 30, 31 and 37 of the random grid compiled on
    jax 0.12.1 (experiments/results/2026-12-06-memory-jax012/jax0.12.1): 110 of their 120 rows within the bounds
    with 0.10.2's counts, 116 with one backward copy, 118 with one copy and no threshold. Read from the installed
    distribution (:func:`jaxpar.versions.jax_release`), as :func:`jaxpar.analysis.pipeline_phases.cond_stacks_weights`."""
    return jax_release() >= (0, 12, 1)


def backward_score_copies() -> int:
    """:data:`BACKWARD_SCORE_COPIES` on the installed jax (one where :func:`fuses_every_softmax`)."""
    return 1 if fuses_every_softmax() else BACKWARD_SCORE_COPIES


def softmax_fused_rows() -> int:
    """:data:`SOFTMAX_FUSED_ROWS` on the installed jax (every size where :func:`fuses_every_softmax`)."""
    return 0 if fuses_every_softmax() else SOFTMAX_FUSED_ROWS


def recomputes_by_sequence(layout: ParallelLayout) -> bool:
    """Whether a pipeline's backward tick recomputes its chunk one sequence of the microbatch at a time:
    ``full`` under ZeRO 0-1 (:func:`jaxpar.parallel.pipeline.executor._stage_backward_by_layer` splits the
    microbatch into its sequences). Under ZeRO-2/3 a ``full`` tick also recomputes layer by layer, but with the
    whole microbatch, whose gradients the sharded accumulator takes at once."""
    return layout.recompute == "full" and not layout.shards_gradients


def dropout_chain_slots(model: ConfigDict, layout: ParallelLayout, b: int | None = None) -> float:
    """fp32 (b, n/t, s, s) slots beyond the live arrays that XLA's heap gives attention dropout's forward
    chain (``dot_product``): one where the softmax runs fused and the forward is recomputed, else none
    (see :data:`SOFTMAX_FUSED_ROWS`)."""
    if model.get("attention_dropout", 0.0) <= 0 or attention_kind(layout) != "dot_product":
        return 0.0
    d = Dims.of(model, layout, b)
    return 1.0 if layout.recompute != "none" and d.b * d.n * d.s >= softmax_fused_rows() else 0.0


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
# The MLP phase under ``blockwise`` attention and ``selective``, outside a pipeline tick, read from its own buffer
# assignments: five (b, s, f/t) arrays (the gradient of W_down's input, the rematerialised silu and product, the
# silu's gradient and the gate's summed gradient; RING_DEFERRED_MLP_GRADIENTS are among them), four (b, s, h) (the
# layer input and the norm's output sliced from the residual stack and a copy, outside the tensor-parallel region,
# and one (h, b*s) transpose for a weight gradient) and, beside the kernel's blocked K and V, three query-side
# (b, s, q/t) arrays where the count above has two. Tiny data=8 ZeRO-2, b=2, s=1024, block 64: five f32[2048, 384],
# four f32[2, 1024, 128]-sized and three f32[16, 2, 64, 2, 2, 32] at the peak (peak 1.093 of the estimate with
# the counts above, 1.002 with these); data=4 x tensor=2 ZeRO-2, the same with f32[2048, 192] (1.058 -> 1.034);
# tiny tensor=2 x pipeline=4 GPipe SP ZeRO-1, b=2, s=1024 (1.108 -> 1.081); ~1B data=8 ZeRO-2, b=2, s=1024: four
# f32[2048, 8192] and a transposed f32[8192, 2048] at the MLP phase's peak. The 514 kept blockwise ``selective``
# rows: 0.926-1.108 -> 0.915-1.099 (the 1.099 a 1F1B tick's, not counted here), median 1.008 -> 1.001.
BLOCKWISE_SELECTIVE_MLP_WIDE = 5
BLOCKWISE_SELECTIVE_HIDDEN = (3, 1)  # (b, s/t, h) with sequence parallelism outside the region, (b, s, h) inside
# The attention backward's score chain in a one-layer chunk's pipeline tick that recomputes the attention. The
# chain is six fp32 (b, n/t, s, s) arrays: the recomputed q k^T, its masked copy and the probabilities, then
# dP = dO V^T, dS and dS laid out for the dK / dQ matmuls; the probabilities live from the tick's MLP phase to the
# chain's end, and at most three of the six are live at once. XLA's best-fit heap places a size's longest-lived
# buffers first, and the chain then takes four slots:
# - under ``full`` where XLA:CPU splits the softmax (b * n/t * s below :func:`softmax_fused_rows`, b the
#   sequences the tick recomputes at once: one with ZeRO < 2, :func:`jaxpar.analysis.temporaries.stage_temps`):
#   buffer assignment of tiny tensor=2 x pipeline=4 1F1B ZeRO-1, b=1, s=1024: four 8 MiB offsets, three live,
#   allocation 37.97 MiB for a largest live set of 31.04; the same with sequence parallelism, 36.21 MiB; b=2,
#   s=512, whose tick recomputes one sequence at a time: four f32[1, 1, 2, 512, 512] offsets. Where the softmax is
#   fused, a ``full`` tick holds no such hole (tiny data=4 x pipeline=2 x v=2, b=1 and 2, s=1024: 0.939, 1.002);
# - under ``selective`` (the whole microbatch), without attention dropout, whose chain is
#   :func:`dropout_chain_slots`: tiny data=2 x pipeline=4 1F1B ZeRO-3, b=1, s=1024: four 16 MiB offsets, three
#   live (allocation 1.098 of the estimate without the slots, largest live set 0.914).
# A chunk of two layers runs the chain inside the layer loop's body, where it packs into three (tiny data=2 x
# tensor=2 x pipeline=2 1F1B ``full``, b=1, s=1024, with and without sequence parallelism: allocation within 1%
# of the largest live set). At s <= 512 the heap fills most of the fourth slot with smaller arrays (holes of
# 0.13-0.27 of a score array): counted whole there, an over-estimate of at most a tenth (0.909 of the compiled).
TICK_CHAIN_SLOTS = 4
# (b, s, h) arrays inside the tensor-parallel region live beside that chain: the q projection's input gradient
# and the recomputed norm output it is the operand of (same buffer assignments: two f32[1024, 128] arrays beside
# the :data:`BACKWARD_HIDDEN_OUTSIDE` (b, s/t, h)-or-(b, s, h) arrays).
ATTENTION_BACKWARD_HIDDEN_INSIDE = 2


def tick_chain_slots(model: ConfigDict, layout: ParallelLayout, b: int | None, layers: int, tick: bool) -> bool:
    """Whether a layer's backward holds :data:`TICK_CHAIN_SLOTS` score slots: a pipeline tick of a one-layer chunk
    with ``dot_product`` attention, under ``full`` where the softmax is split into steps (none on a jax whose
    XLA:CPU fuses every softmax, :func:`fuses_every_softmax`), or under ``selective`` without attention dropout."""
    if not (tick and layers <= 1 and attention_kind(layout) == "dot_product"):
        return False
    if layout.recompute == "selective":
        return model.get("attention_dropout", 0.0) <= 0
    d = Dims.of(model, layout, b)
    return layout.recompute == "full" and d.b * d.n * d.s < softmax_fused_rows()


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
    return DTYPE_BYTES[model.param_dtype] * shared_tables(model, layout) * (1 - 1 / layout.zero_shards())


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
    return (e + pb) * largest_layer_param(model, layout)


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
    phase (:func:`~jaxpar.analysis.attention_blocks.blockwise_attention_backward_bytes`: the inner step's block arrays and its operands)
    is a third candidate, and under recompute with a context axis (or a kernel of one block) the MLP phase
    also holds the recomputed score blocks (:data:`~jaxpar.analysis.attention_blocks.RING_RECOMPUTED_BLOCKS`). With
    ``model.attention_dropout`` (dot-product, no pipeline) the forward, and the backward's recomputed
    attention under ``selective`` / ``full``, also hold the dropped probabilities (the keep mask in the causal
    mask's place), 4*b*n*s^2, and the heap's packing of that chain, :func:`dropout_chain_slots` fp32 arrays
    (none in a ``full`` pipeline tick or a GPipe tick of one layer). A stage of one layer without recompute writes
    its scores and probabilities into no stack: they are its residuals, so its forward adds
    :data:`FORWARD_SCORE_COPIES` - 2 arrays. ``tick`` (a 1F1B / interleaved backward tick, whose
    ``jax.vjp`` of the chunk recomputes the forward inside the tick): without recompute the backward
    keeps no score copies beyond the chunk's residuals (with it, the recomputed ones), and a chunk of one layer without recompute holds, beyond its
    residuals (the scores and probabilities among them), dP (one fp32 score array with
    ``dot_product``; blockwise: its attention phase) and one (b, s, f) array (buffer assignment of tiny
    data=2 x tensor=2 x pipeline=2 interleaved SP, s=1024: three f32[2,1,2,1024,1024] arrays at the
    peak, two of them the chunk's residuals)."""
    return max(layer_working_phases(model, layout, b, layers, tick))


def layer_working_phases(
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
        if attention_kind(layout) == "dot_product":
            return 0.0, (d.e * d.b * d.s * d.f if mlp is None else mlp) + F32 * d.b * d.n * d.s * d.s
        return 0.0, max(
            d.e * d.b * d.s * d.f if mlp is None else mlp, blockwise_attention_backward_bytes(model, layout, b)
        )
    weights = d.e * layer_params(model, layout)
    dot = attention_kind(layout) == "dot_product"
    one_layer_selective_tick = tick and rec == "selective" and layers <= 1
    kv = 2 * d.e * d.b * d.s * d.k if dot else 2 * d.e * d.b * d.s * (d.q + 2 * d.k)
    if not dot and rec == "selective" and not tick and not model.get("num_experts", 0):  # BLOCKWISE_SELECTIVE_*
        outside, inside = BLOCKWISE_SELECTIVE_HIDDEN
        backward = (
            BLOCKWISE_SELECTIVE_MLP_WIDE * d.e * d.b * d.s * d.f
            + outside * d.e * d.b * d.so * d.h
            + inside * d.e * d.b * d.s * d.h
            + kv
            + d.e * d.b * d.s * d.q
            + weights
        )
    else:
        if model.get("num_experts", 0):  # the MoE layer's backward in the MLP's place
            mlp = moe_activations.moe_backward_bytes(model, layout, b)
        else:
            # a ``selective`` tick of a one-layer chunk: :data:`BACKWARD_MLP_WIDE` of ``full`` (buffer assignment of
            # tiny data=2 x tensor=2 x pipeline=2 interleaved SP selective, b=4, s=256: seven f32[4, 256, 192]
            # arrays at the peak; a chunk of two layers, 1F1B, b=4, s=128, is within 4% of the count without it),
            # less the saved gate and up among those seven, which the residual stack already counts (buffer
            # assignment of tiny data=2 x pipeline=4 1F1B ZeRO-1 selective blockwise, b=1, s=256: at the last
            # stage's MLP backward six f32[256, 384] arrays, the jvp's gate and up among them; peak 0.886 of the
            # estimate counting them twice, 0.929 once; the 46 one-layer ``selective`` tick rows it moves: median
            # of the 89 kept 0.953 -> 0.984, none past 1.05)
            mlp = BACKWARD_MLP_WIDE["full" if one_layer_selective_tick else rec] * d.e * d.b * d.s * d.f
            if one_layer_selective_tick:
                mlp -= (2 if model.mlp_activation == "swiglu" else 1) * d.e * d.b * d.s * d.f
            if rec == "selective" and layout.context > 1:  # RING_DEFERRED_MLP_GRADIENTS
                mlp += RING_DEFERRED_MLP_GRADIENTS * d.e * d.b * d.s * d.f
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
        # one block per hop (d.s is the local sequence, s/c); a tick without a ring keeps no recomputed scores
        one_block = layout.attention_block >= d.s
        if one_block and rec != "none" and (layout.context > 1 or not tick):  # RING_RECOMPUTED_BLOCKS
            block = min(layout.attention_block, d.s)
            backward += layout.context * RING_RECOMPUTED_BLOCKS[rec] * F32 * d.b * d.n * block * block
        return 0.0, max(backward, blockwise_attention_backward_bytes(model, layout, b))
    scores = d.b * d.n * d.s * d.s  # elements of one (b, n/t, s, s) array
    unstacked = rec == "none" and layers <= 1
    if tick and rec == "full" and d.b * d.n * d.s >= SOFTMAX_FUSED_ROWS and model.get("attention_dropout", 0.0) <= 0:
        # a ``full`` tick's recomputed forward where XLA:CPU fuses the mask into the softmax: q k^T and the
        # probabilities, no third copy and no pred mask (buffer assignment of tiny data=2 x pipeline=4 1F1B ZeRO-2
        # ``full``, b=2, s=1024, 8192 rows: no moment with more than two f32[2, 2, 2, 1024, 1024]-sized arrays live;
        # peak 0.892 of the estimate with this phase's three copies and mask, 0.981 with two). The 18 kept rows it
        # moves (tiny, s=1024): 0.919-0.975 -> 0.981-1.055. At 4096 rows (b=1, n/t=4) the attention's backward
        # holds three at once (tiny data=2 x pipeline=4 ZeRO-3, b=1: q k^T, dP and the masked scores at one
        # moment, 1.055 as counted). The raw threshold, not :func:`softmax_fused_rows`: on jax 0.12.1 no kept row
        # below it moves (tiny data=2 x pipeline=4 ZeRO-3, b=1, s=512 would go 1.011 -> 1.113).
        forward = BACKWARD_SCORE_COPIES * F32 * scores
    else:  # q k^T, the masked scores and the probabilities, the pred mask and its (s, s) iota comparison
        copies = FORWARD_SCORE_COPIES - (backward_score_copies() if unstacked else 0)
        forward = (copies * F32 + 1) * scores + d.s * d.s
    forward += weights + d.e * d.b * d.s * (d.h + d.k)
    base = backward
    # A layer whose backward recomputes its forward (``selective`` / ``full``, with or without a pipeline tick)
    # holds the recomputed scores and probabilities until the attention's backward, through the MLP phase:
    # buffer assignment of tiny data=2 x tensor=2 x pipeline=2 1F1B ZeRO-1 full, s=512, b=2 (the chunk
    # recomputed layer by layer, one sequence at a time: f32[1, 1, 2, 512, 512] and f32[1024, 512] beside the
    # seven f32[512, 192] MLP arrays), the same layout with ZeRO-3, s=256 (the whole microbatch at once: two
    # f32[2, 1, 2, 256, 256] arrays at the MLP phase's peak). Without recomputation a tick's scores are its
    # chunk's residuals, counted in the residual stack.
    if not unstacked and (not tick or rec != "none"):
        backward += backward_score_copies() * F32 * scores
    if rec == "none":
        backward += scores  # the broadcast causal mask, hoisted out of the backward loop
    # ZeRO-3's weight gradient and relaid weight: a phase of its own beside the score arrays (~1B, 4 layers,
    # data=8 ZeRO-3 full, s=1024: counting both puts the estimate 15% over the compiled temporaries)
    if zero3 and rec == "full" and not model.get("num_experts", 0):
        # under ``full`` the relaid copy of a gathered weight is live there, its gradient not yet: buffer assignment
        # of ~1B data=8 ZeRO-3 full, b=1, s=256 (the peak at the copy of a gathered f32[8192, 2048] MLP weight into
        # the other layout, the three gathered MLP weights beside it, no weight-sized gradient) and ~1B data=4 x
        # tensor=2, b=2, s=256 (the MLP phase with two gathered f32[2048, 4096] weights, no copy, no gradient:
        # 0.846 of the estimate on jax 0.12.0.1 with the gradient counted, 0.896 without)
        zero3 *= d.e / (d.e + DTYPE_BYTES[model.param_dtype])
    backward = max(backward, base + zero3)
    if tick_chain_slots(model, layout, b, layers, tick):  # its own phase, after the MLP's (as above)
        chain = TICK_CHAIN_SLOTS * F32 * scores + kv
        chain += d.e * d.b * (BACKWARD_HIDDEN_OUTSIDE * d.so * d.h + ATTENTION_BACKWARD_HIDDEN_INSIDE * d.s * d.h)
        backward = max(backward, chain)
    if model.get("attention_dropout", 0.0) > 0 and (
        layout.pipeline == 1 or (rec != "none" and (tick or layout.pipeline_schedule == "gpipe"))
    ):
        # the forward attention's dropped fp32 probabilities (its keep mask takes the place of the causal mask's
        # broadcast: one pred array of the scores' shape at the peak in each measurement below, and in tiny
        # data=8 ZeRO-1 selective, b=2, s=1024 and data=4 x tensor=2 SP ZeRO-3 full, b=2, s=512); in a 1F1B tick too (tiny
        # data=4 x pipeline=2 1F1B selective: four f32[b, n, s, s] arrays and the pred mask at the peak), and in
        # a GPipe backward tick that recomputes (tiny data=2 x pipeline=4 GPipe ZeRO-3 selective, b=2, s=1024:
        # four f32[2, 2, 2, 1024, 1024] arrays at the peak, one of them the keep scale 1/(1-p) broadcast to the
        # scores' shape for XLA:CPU's fused softmax backward; 1.119 of the estimate without them).
        # The backward's MLP phase holds no mask (tiny data=8 ZeRO-2 full, s=256: the two score arrays only)
        # and the heap's third slot for the chain; not in a GPipe tick of one layer, whose forward's scan saves
        # them, but in one of several, whose layer loop recomputes the chain as an unpipelined layer does (tiny
        # data=4 x pipeline=2 GPipe ZeRO-0 selective, b=2, s=1024, two layers per stage: the backward's four
        # f32[2, 2, 2, 1024, 1024] arrays at four offsets, three live; 1.107 of the estimate without the slot,
        # 0.981 with it; data=2 x tensor=2: 1.073 -> 0.982; no other kept row moves)
        # A ``full`` tick under ZeRO 0-1, which recomputes one sequence at a time, holds no slot: tiny data=2 x
        # pipeline=4 1F1B ZeRO-1 ``full``, both dropouts, b=1, s=1024 (4096 rows): four f32[1, 2, 2, 1024, 1024]
        # arrays at the peak, the three copies and the dropped probabilities, and no hole; peak 0.806 of the
        # estimate with the slot, 0.973 without; no other kept row moves. Under ZeRO-2/3 (the whole microbatch)
        # the hole is there: tiny tensor=2 x pipeline=4 1F1B ZeRO-2 ``full``, b=2, s=1024: allocation 1.178 of the
        # estimate without the slot, its largest live set 0.988.
        slots = dropout_chain_slots(model, layout, b) if layout.pipeline == 1 or tick or layers > 1 else 0.0
        if tick and recomputes_by_sequence(layout):
            slots = 0.0
            # one sequence at a time, that tick's recomputed forward holds no pred array of the scores' shape (the
            # causal mask's broadcast counted above), and where XLA:CPU splits the softmax the dropped probabilities
            # take the probabilities' place: q k^T, the masked scores and the dropped probabilities (buffer
            # assignment of tiny data=2 x tensor=2 x pipeline=2 1F1B ZeRO-1 ``full``, both dropouts, b=1, s=1024,
            # 2048 rows, the random SLOW draw 1194927844's case 5: three f32[1, 1, 2, 1024, 1024]-sized arrays and
            # the pred[1024, 1024] comparison at the peak, allocation 0.804 of the estimate counting four and the
            # mask; with the fused softmax, tiny data=2 x pipeline=4, 4096 rows, seed 68 case 28: the four above
            # and no pred array of their shape)
            forward -= scores
            if d.b * d.n * d.s < softmax_fused_rows():
                forward -= F32 * scores
        forward += (1 + slots) * F32 * scores
        if layout.pipeline == 1 or tick:  # where the softmax is fused (the chain slot's condition), the backward's MLP
            # phase also holds the keep scale 1/(1-p) broadcast to the scores' shape for the fused softmax backward,
            # as a GPipe tick does (tiny data=8 ZeRO-2 full, b=4, s=256, 4096 rows: the probabilities, the dropped
            # scores and the f32[4, 2, 2, 256, 256] broadcast at the peak; 1.133 of the estimate without it, 1.001
            # with; the 22 other unpipelined rows it moves stay within, 0.934-1.125), and a 1F1B / interleaved tick
            # that recomputes the whole microbatch (tiny data=4 x pipeline=2 1F1B ZeRO-3 ``full``, both dropouts,
            # b=4, s=256, 4096 rows, the random SLOW draw 1181658660's case 27: at the MLP backward's peak
            # f32[4, 2, 2, 256, 256] q k^T, masked scores and the broadcast, the last live from the tick's MLP
            # phase to the attention's backward; 1.161 of the estimate without it, 1.015 with; the 4 kept rows it
            # moves, ``selective`` ticks, 1.017-1.048 -> 0.979-1.008). A tick recomputing one sequence at a time
            # has no chain slot (above), so none here.
            backward += slots * F32 * scores  # slots: dropout_chain_slots
    return forward, backward


def layer_working_term(
    model: ConfigDict, layout: ParallelLayout, b: int | None = None, layers: int = 2
) -> tuple[str, float]:
    """(name, bytes) of the phase that sets :func:`layer_working_bytes`: the last layer's forward
    attention or one layer's backward."""
    forward, backward = layer_working_phases(model, layout, b, layers, False)
    return ("last layer's forward attention", forward) if forward > backward else ("one layer's backward", backward)


def largest_layer_param(model: ConfigDict, layout: ParallelLayout) -> float:
    """Elements of one layer's largest weight on one device (split over tensor and expert, not over data)."""
    return max(
        shard_elements(t, layout.tensor, 1, False, layout.expert) for t in param_tensors(model) if t.place == "layer"
    )


def largest_param(model: ConfigDict, layout: ParallelLayout) -> float:
    """Elements of the largest stacked layer weight one device holds (the stage's layers of it)."""
    return layout.stored_layers(model.num_layers) * largest_layer_param(model, layout)
