"""Activations and temporaries of jaxpar's own train step, term by term: the other half of the peak.

``memory_analysis()`` of the compiled step reports ``argument`` bytes (parameters, optimizer state,
batch: :func:`jaxpar.analysis.estimate.estimated_argument_bytes`, exact to ~1e-5) and ``temp``
bytes: everything the step allocates while it runs. This module estimates the temporaries of one
device, closed-form (microseconds, so the planner can call it for every layout), from what the
step keeps for the backward pass and what it holds at its peak:

    temp = residual stack + gradient buffers + max(layer working set, head working set)
           (+ pipeline slot buffers; ZeRO-3: the embedding's full gradient, the head's gathered
           weight and its gradient as a third working set; in pipelines gathered layers)

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
* **Layer working set** (:func:`layer_working_bytes`): the backward of one layer has that layer's
  complete residual set live (sliced out of the stack with no recompute; recomputed with
  ``selective`` / ``full``) plus the gradient temporaries of its largest op.
* **Head working set** (:func:`head_working_bytes`): the vocabulary-parallel cross-entropy keeps
  fp32 logits (b, s, V/t) and exp(z) for its backward and builds the fp32 logit gradient.

Conventions: bytes per device; ``e`` = compute-dtype bytes, fp32 = 4 for what the code computes in
fp32 (norm statistics, scores, softmax, logits). ``s`` is the sequence slice one context rank holds
(``ParallelLayout.seq_local``); with sequence parallelism the tensors outside the tensor-parallel
region (layer input, residual adds, norms) hold s/t rows, the matmul inputs the gathered s rows.
The working-set constants were measured on XLA:CPU (the AOT path): see :data:`WORKING_SET`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpar.config import ConfigDict
from jaxpar.models.inventory import DTYPE_BYTES, ParallelLayout, param_tensors, shard_elements
from jaxpar.parallel.pipeline.schedule import steady_slot_counts

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
        return cls(DTYPE_BYTES[model.compute_dtype], layout.microbatch_size if b is None else b, s,
                   s / t if layout.sequence_parallel else s, model.embed_dim, model.num_heads * model.head_dim / t,
                   model.num_kv_heads * model.head_dim / t, model.num_heads / t, model.mlp_dim / t,
                   model.vocab_size / t)


def _attention(layout: ParallelLayout) -> str:
    """The implementation the step runs (``auto`` resolves to blockwise on CPU; the context axis
    requires blockwise)."""
    return "dot_product" if layout.attention == "dot_product" and layout.context == 1 else "blockwise"


def layer_residual_bytes(model: ConfigDict, layout: ParallelLayout, recompute: str | None = None,
                         b: int | None = None) -> float:
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
      activation: 4 e*b*s*f (from JAX's jvp rules; not compiled-checked).

    Korthikanti et al. 2022 (arXiv:2205.05198) count 34sbh + 5as^2b for a GPT layer with dropout in
    2-byte activations; without dropout this step keeps none of its masks, keeps fp32 norms, scores
    and probabilities, and JAX keeps more of the SwiGLU than a hand-written backward would. With
    dropout the layer stack also holds :func:`dropout_residual_bytes` per layer.

    ``selective`` (:func:`jaxpar.parallel.zero.remat_policy`: ``dots_with_no_batch_dims_saveable``
    and the named outputs of :func:`jaxpar.models.matmul.dense`):
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
        return d.e * d.b * (d.so * d.h + d.s * (d.q + 2 * d.k + d.h + (2 if swiglu else 1) * d.f))
    outside = d.b * d.so * (2 * d.e * d.h + 2 * F32 * d.h + 4 * F32)
    inputs = 2 * d.e * d.b * d.s * d.h
    attention = d.e * d.b * d.s * (2 * d.q + 2 * d.k)
    if _attention(layout) == "dot_product":
        attention += 2 * F32 * d.b * d.n * d.s * (d.s + 1)
    else:
        attention += F32 * d.b * d.s * d.n
    mlp = (6 if swiglu else 4) * d.e * d.b * d.s * d.f
    return outside + inputs + attention + mlp


def dropout_residual_bytes(model: ConfigDict, layout: ParallelLayout, b: int | None = None) -> float:
    """What dropout adds to one layer's entry of the residual stack (0 without dropout), measured.

    The masks (:mod:`jaxpar.models.dropout`) are hashes of indices the backward could redraw, but the
    layer scan's linearization saves what the backward reads, so the compiled step keeps them as
    1-byte bools, and only them (XLA recomputes the dropped values from the kept inputs and mask):

    - ``model.dropout``: the attention-output and MLP-output masks, (b, so, h) each: 2 b*so*h. The
      embedding's mask is not kept (measured: nothing beyond the layers' masks);
    - ``model.attention_dropout`` with ``dot_product``: the probabilities' mask (b, n, s, s): b*n*s^2
      (not the dropped probabilities); with ``blockwise`` (and context parallelism) nothing: its
      custom VJP redraws each block's mask from the indices.

    ``selective`` and ``full`` recompute the masks with the layer: nothing is added. Measured on
    XLA:CPU (fp32, tiny config, seq 128, b 2, data=8; tests/test_memory_estimate.py): dot-product
    hidden +263376 bytes for 4 layers (this: 262144), attention +525392 (this: 524288). The one-layer
    working set gains no mask: the masks' slices feed fusions. Some compiles keep one dropped (b, s, h)
    activation beside the masks, which buffer assignment decides per sequence length and XLA release;
    the estimate leaves it out.
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
    return sum(shard_elements(t, layout.tensor, 1, False) for t in param_tensors(model) if t.place == "layer")


def shared_params(model: ConfigDict, layout: ParallelLayout, stage: str = "first") -> float:
    """Elements of the parameters outside the layers one device holds (embedding, head, norms)."""
    places = ("first", "last") if layout.pipeline == 1 else (stage,)
    return sum(shard_elements(t, layout.tensor, 1, False) for t in param_tensors(model) if t.place in places)


def shared_tables(model: ConfigDict, layout: ParallelLayout) -> float:
    """Elements of the embedding table on one device (V/t x h): its gradient is a scatter-add."""
    return model.vocab_size * model.embed_dim / layout.tensor


# Working-set constants, in units of one (b, s, mlp_dim / t) fp32-or-compute-dtype tensor e*b*s*f: the
# backward temporaries of one layer beyond its residuals (the gradient of the MLP's widest
# activation, the recomputed forward's duplicates under full remat). Measured on XLA:CPU (AOT,
# fp32) for the tiny and ~1B llama configs (tests/test_memory_estimate.py): none ~1, selective ~1,
# full 3.5 (tiny b*s = 512 and 1B s = 1024 agree to ~10%).
WORKING_SET = {"none": 1.0, "selective": 1.0, "full": 3.5}
# dot_product attention: the backward of the softmax holds, beside the scores and probabilities it
# saved (or recomputed), their fp32 gradients dP and dS (b, n/t, s, s) and the broadcast pred causal
# mask (1 byte per score). Measured on XLA:CPU: llama2_7b, data=64 ZeRO-3, b=4, s=4096, selective,
# fp32 (64 simulated devices): four f32[4,32,4096,4096] buffers (8 GiB each) and one
# pred[4,32,1,4096,4096] (2 GiB) live beside the residual stacks at the peak, two more score copies
# than layer_residual_bytes("none") counts. But the MLP's residuals, also in that term, are freed by
# the time the attention's backward runs (~5 GiB there), so the net is one copy: with 1 the 7B temp
# ratio is 1.105 -> 1.02 (with 2: 0.947, and the tiny grid moves to 0.87-0.90).
DOT_BACKWARD_SCORE_COPIES = 1
HEAD_COPIES = 3  # fp32 logits, exp(z) kept for the backward, the fp32 logit gradient
# ZeRO-3 inside a pipeline tick: gathered layers (compute dtype) beside the residuals, the layer in use and
# the next one. Not re-derived (no ZeRO-3 pipeline in the compiled grid); without a pipeline the terms of
# zero3_head_phase_bytes / zero3_embedding_gradient_bytes replace it (they are what this constant fitted:
# ~0.5 layers on tiny, ~2.4-2.8 on the ~1B config)
ZERO3_GATHERED_LAYERS = 2.0


def zero3_embedding_gradient_bytes(model: ConfigDict, layout: ParallelLayout) -> float:
    """ZeRO-3 without a pipeline: the embedding's gradient beyond its shard. The lookup's transpose is a
    scatter-add into a full V/t x h table (param dtype) that is reduce-scattered only after the layer
    loop; XLA:CPU allocates it (a broadcast of zeros) before the forward loop, so it is live through the
    whole backward beside the sharded gradients, which count its 1/N shard: pb * V*h/t * (1 - 1/N).
    Measured (buffer assignment): ``f32[256,128]`` (tiny) and ``f32[32000,2048]`` (~1B) from before the
    forward loop to after the backward loop. ZeRO 0-2 count the full table among their gradients."""
    n = layout.data * layout.context
    return DTYPE_BYTES[model.param_dtype] * shared_tables(model, layout) * (1 - 1 / n)


def zero3_head_phase_bytes(model: ConfigDict, layout: ParallelLayout, b: int | None = None) -> float:
    """ZeRO-3 without a pipeline: the loss head's backward, at its weight-gradient matmul (the whole
    residual stack is still live: the head runs before the backward layer loop). Beside the stack and
    the gradients: the output weight gathered over ``data`` (compute dtype, e * V*h/t), its gradient
    full-size before the reduce-scatter that transposes the gather (e * V*h/t), the fp32 logit
    gradient 4*b*s*V/t and the transposed copy of it XLA:CPU feeds the matmul (4*b*s*V/t); the logits
    and exp(z) are freed by then. Measured (~1B, data=8, b=1, s=512, fp32, full): ``all_gather``
    ``f32[2048,32000]``, ``dot`` ``f32[2048,32000]``, ``scatter`` ``f32[1,512,32000]`` and its copy
    ``f32[32000,512]``: 1415.5 MiB live with the stack and gradients, 1442.8 allocated; this + the
    stack + the gradients: 1434. Under ZeRO 0-2 the weight is an argument and its gradient is counted
    among the gradients (:func:`head_working_bytes` is that case's head)."""
    d = Dims.of(model, layout, b)
    return 2 * d.e * shared_tables(model, layout) + 2 * F32 * d.b * d.s * d.v


def layer_working_bytes(model: ConfigDict, layout: ParallelLayout, b: int | None = None, layers: int = 2,
                        dot_backward: bool = True) -> float:
    """One layer's backward working set on top of the residual stack: the complete residual set of
    that layer (sliced out of the stack into fresh buffers with no recompute, recomputed with
    ``selective`` / ``full``; a stage of one layer has no loop, hence no copy when nothing is
    recomputed) plus :data:`WORKING_SET` e*b*s*f of gradient temporaries; with ``dot_product``
    attention also the backward's fp32 gradients of the probabilities and of the scores
    (:data:`DOT_BACKWARD_SCORE_COPIES`) and the broadcast causal mask (1 byte per score), except in
    a 1F1B / interleaved backward tick (``dot_backward=False``: there the tiny grid measures the
    estimate already high, pp2 1F1B selective temp 0.890, and the term would take it to 0.851)."""
    d = Dims.of(model, layout, b)
    live = layer_residual_bytes(model, layout, "none", b)
    if layout.recompute == "none" and layers <= 1:
        live = 0.0
    if dot_backward and _attention(layout) == "dot_product":  # dP / dS beside scores and probabilities, the mask
        live += (DOT_BACKWARD_SCORE_COPIES * F32 + 1) * d.b * d.n * d.s * d.s
    return live + WORKING_SET[layout.recompute] * d.e * d.b * d.s * d.f


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
    accumulator_bytes: float = 0.0  # 1F1B / interleaved: the accumulator copied beside itself (pipeline_accumulator_bytes)

    @property
    def total_bytes(self) -> float:
        backward = (self.residual_bytes + self.working_bytes + self.gradient_bytes + self.gather_bytes
                    + self.pipeline_bytes)
        return max(backward, self.update_bytes, self.accumulator_bytes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"total_bytes": self.total_bytes}


def _grad_elements(model: ConfigDict, layout: ParallelLayout, stage: int) -> tuple[float, float]:
    """(layer, shared) gradient elements one device writes per backward (stage ``stage``)."""
    layers = model.num_layers // layout.pipeline
    if layout.pipeline == 1:
        return layers * layer_params(model, layout), shared_params(model, layout)
    where = "first" if stage == 0 else "last" if stage == layout.pipeline - 1 else "none"
    shared = shared_params(model, layout, where) if where != "none" else shared_tables(model, layout)
    return layers * layer_params(model, layout), shared


def update_bytes(model: ConfigDict, layout: ParallelLayout, grads: float) -> float:
    """The optimizer phase (:mod:`jaxpar.train.step`), with ``grads`` the full local fp32 gradient bytes.

    Stage 0: the data all-reduce writes a second gradient buffer (XLA:CPU does not reduce in place),
    except for the embedding's scatter-add gradient: 2G - 4*V*h/t (the ~1B config at data=8: 0.1%).
    Stages 1-2: the full gradient and, per parameter, the updated shard all-gathered into a fresh
    full-size buffer before it is written out: two of the largest (stacked) parameter, 2*P_max
    (~1B at data=8 x tensor=1 and data=4 x tensor=2: +3%). Stage 3: three shards of the gradient.
    """
    n = layout.data * layout.context
    pb = DTYPE_BYTES[model.param_dtype]
    if layout.zero_stage == 0:
        return 2 * grads - pb * shared_tables(model, layout)
    if layout.zero_stage in (1, 2):
        return grads + 2 * pb * largest_param(model, layout)
    return 3 * grads / n


def largest_param(model: ConfigDict, layout: ParallelLayout) -> float:
    """Elements of the largest parameter array one device holds (a stacked layer weight holds the
    stage's layers)."""
    layers = model.num_layers // layout.pipeline
    return max(shard_elements(t, layout.tensor, 1, False) * (layers if t.place == "layer" else 1)
               for t in param_tensors(model))


def temp_estimate(model: ConfigDict, layout: ParallelLayout, stage: int = 0) -> TempEstimate:
    """Estimated temporaries of one device on pipeline stage ``stage`` (0 without a pipeline).

    Without a pipeline: the layer scan keeps L x :func:`layer_residual_bytes`; the backward holds one
    layer's :func:`layer_working_bytes` (or, if larger, the head's :func:`head_working_bytes`); the
    backward scan writes the stacked fp32 layer gradients (ZeRO-3: reduce-scattered, 1/N) and, with
    m > 1, the accumulation sum is a second buffer (ZeRO-2/3: sharded, :mod:`jaxpar.train.step`).
    ZeRO-3: the layer's backward holds the same weights as without ZeRO, gathered instead of sliced
    out of the stacked parameters: at its peak (the MLP's backward, eight (b, s, f) buffers live) the
    ``all_gather`` outputs of the gate and up weights and the copies of the attention weights, e *
    (layer - W_down), exactly where ZeRO-0 holds ``dynamic-slice`` copies of the same shapes
    (buffer assignments of tiny data=8 full recompute, ZeRO-3 and ZeRO-0: the same live set but for
    the gradients). :func:`layer_working_bytes`, measured with those slices inside, therefore already
    counts them; ZeRO-3 adds :func:`zero3_embedding_gradient_bytes` to the gradients and the head's
    backward (:func:`zero3_head_phase_bytes`) as a third working set. These replace two gathered layers
    (``ZERO3_GATHERED_LAYERS``, still used inside pipeline ticks) that were additive to the layer
    phase. Compiled / estimated temp (peak), before -> after: tiny data=8 full 0.803 (0.827) -> 0.956
    (0.962), none 0.924 -> 0.978, m=4 0.930 -> 0.985, data=4 x tensor=2 + SP selective ~0.83 -> 0.922;
    ~1B none 1.034 -> 1.004, selective 1.070 -> 1.004 (both peak in the head phase). ~1B full stays
    0.913: its estimate is the update phase's three gradient shards (:func:`update_bytes`), above
    what its buffer assignment holds after the loop (the shards and the embedding table, ~0.75 GiB).
    One microbatch's residual stack is live for every m, m = 2 included: the accumulation scan runs
    all m microbatches from zeros, each one's forward and backward inside one iteration (the compiled
    step: the layer scans are while loops inside the microbatch loop's body, trip count m). An
    earlier rule doubled the stack at m = 2, measured when the first microbatch ran outside the loop
    and a one-trip loop of the second was inlined beside it; since the loop runs every microbatch
    that rule over-counted by one stack (tiny, data=8, ZeRO-1, m = 2, b = 1: temp ratio 0.673 ->
    1.001, peak 0.716 -> 1.001; ZeRO-0, b = 2: 0.981).

    1F1B / interleaved (:mod:`jaxpar.parallel.pipeline`): a backward tick recomputes its chunk of
    L/(p*v) layers under ``jax.vjp``, so one microbatch's chunk stack is live (with ``full`` and
    ZeRO < 2 one sequence at a time, layer by layer), plus the chunk's gradient before it is added
    to the fp32 accumulator of the stage, plus the act/grad slot buffers of the schedule
    (:func:`jaxpar.parallel.pipeline.compile_program`: p stage inputs on stage 0 for 1F1B); the
    last stage runs the head inside the same backward. GPipe: the forward scan over m + p - 1 ticks
    is differentiated as a whole, so every tick's :func:`gpipe_tick_bytes` (bubbles included, the
    stage's weights among them) stay live; the backward tick slices one tick's residuals out of
    those stacks (a copy: one more :func:`gpipe_tick_bytes`) and works on one layer
    (:func:`layer_working_bytes`). Measured compiled / estimated (tiny, s=128, fp32): p=4 m=4
    none 1.069, m=8 1.057, b=1 1.068, selective 0.981, full 0.962; p=2 t=2 none 1.058 (before this
    term: 1.25-1.49). The remaining ~6% under ``none`` is the backward tick's gradient temporaries
    beyond :data:`WORKING_SET` (~2-3 MiB of the 53 MiB at p=4 m=4).
    """
    p, pb, n = layout.pipeline, DTYPE_BYTES[model.param_dtype], layout.data * layout.context
    d = Dims.of(model, layout)
    layer_el, shared_el = _grad_elements(model, layout, stage)
    full_grads = pb * (layer_el + shared_el)
    zero3 = layout.zero_stage == 3
    gather = ZERO3_GATHERED_LAYERS * d.e * layer_params(model, layout) if zero3 and p > 1 else 0.0
    if p == 1:
        layers = model.num_layers
        # one microbatch's stack, for every m: the accumulation scan runs each microbatch's forward and
        # backward inside one iteration (jaxpar.train.step: every microbatch in the loop, from zeros)
        residual = layers * (layer_residual_bytes(model, layout) + dropout_residual_bytes(model, layout))
        working = max(layer_working_bytes(model, layout, layers=layers), head_working_bytes(model, layout))
        grads = full_grads / n if zero3 else full_grads
        if zero3:  # no gathered layer added: it takes the place of the sliced one (see above)
            working = max(working, zero3_head_phase_bytes(model, layout))
            grads += zero3_embedding_gradient_bytes(model, layout)
        if layout.microbatches > 1:
            grads += full_grads / n if layout.zero_stage >= 2 else full_grads
        update = update_bytes(model, layout, full_grads)
        return TempEstimate(0, residual, working, grads, gather, 0.0, update,
                            "update" if update > residual + working + grads + gather else "backward")

    chunk = model.num_layers // layout.stages
    last = stage == p - 1
    if layout.schedule == "gpipe":
        per_tick = gpipe_tick_bytes(model, layout)
        residual = (layout.microbatches + p - 1) * per_tick
        # the backward tick slices its residuals out of the tick stacks (a copy), then works on one layer
        working, slots = per_tick + layer_working_bytes(model, layout, layers=chunk), 0.0
        chunk_grads = full_grads
    else:
        prog = _program(layout.schedule, p, layout.microbatches, layout.virtual_stages)
        slots = (prog[0] + prog[1]) * d.e * d.b * d.so * d.h
        by_layer = layout.recompute == "full" and layout.zero_stage < 2
        rows = 1 if by_layer else None
        residual = chunk * (layer_residual_bytes(model, layout, b=rows) + dropout_residual_bytes(model, layout, b=rows))
        working = layer_working_bytes(model, layout, b=rows, layers=chunk, dot_backward=False)
        if last:
            working += head_working_bytes(model, layout, b=rows)
        chunk_grads = pb * (1 if by_layer else chunk) * layer_params(model, layout)
    acc = full_grads / n if layout.zero_stage >= 2 else full_grads
    grads = acc + chunk_grads
    update = update_bytes(model, layout, full_grads)
    backward = residual + working + grads + gather + slots
    accumulator = 0.0 if layout.schedule == "gpipe" else pipeline_accumulator_bytes(model, layout, acc) + slots
    phase = max((backward, "backward"), (update, "update"), (accumulator, "accumulator"))[1]
    return TempEstimate(stage, residual, working, grads, gather, slots, update, phase, accumulator)


def pipeline_accumulator_bytes(model: ConfigDict, layout: ParallelLayout, acc: float) -> float:
    """1F1B / interleaved (:func:`jaxpar.parallel.pipeline.executor._explicit_loss_and_grads`): the
    backward tick holds the gradient accumulator (``acc`` bytes, the scan's carry) *twice*. The
    tick's ``switch`` takes the accumulator as an operand and returns it, and the backward updates
    it in place inside its layer loop, so XLA copies it into the loop's state while the operand
    stays live. Beside the two copies, the larger of:

    - inside the layer loop: one layer's weights sliced out of the stage's stack, and with v > 1
      the chunk's L/(p*v) layers sliced out first (:func:`jaxpar.parallel.pipeline.executor._chunk`),
      pb * (1 + [v > 1] * L/(p*v)) * :func:`layer_params`;
    - after it, the first stage's embedding gradient (a scatter-add into a zero table, then the
      ``cond`` output): two more V/t x h tables, 2 * pb * :func:`shared_tables`.

    Measured on XLA:CPU (the buffer assignment's live set at the peak), ~1B config, data=1 x
    tensor=2 x pipeline=4, m=4, b=1, s=256, fp32: 1F1B full 1442 MiB compiled, this term 1438
    (2 x 589 accumulator + 2 x 125 tables + 10 slots); interleaved v=2 none and full 1552 compiled,
    this term 1546 (2 x 589 + one layer 116 + the chunk 232 + 20 slots); before this term the
    estimate was the update phase's 1053 (ratio 1.37-1.47). On the tiny config the activations of
    the backward tick are larger than the accumulator and this phase is not the peak.
    """
    pb = DTYPE_BYTES[model.param_dtype]
    chunk = model.num_layers // layout.stages
    loop = pb * layer_params(model, layout) * (1 + (chunk if layout.virtual_stages > 1 else 0))
    return 2 * acc + max(loop, 2 * pb * shared_tables(model, layout))


def gpipe_tick_bytes(model: ConfigDict, layout: ParallelLayout) -> float:
    """What one GPipe forward tick (:func:`jaxpar.parallel.pipeline.executor._gpipe_loss_and_grads`) saves
    for the backward: the tick scan is differentiated as a whole, so this is stacked over all m + p - 1
    ticks (bubbles included: the skipped branch's residuals are zeros of the same shapes).

    - the stage's layer residuals, L/p x :func:`layer_residual_bytes`, and the head's, on every
      stage (SPMD): the fp32 logits 4*b*s*V/t, the final norm's input and output and its fp32
      normalised input (2e + 4)*b*s*h (measured: one ``f32[7,2,128,256]`` and three
      ``f32[7,2,128,128]`` stacks);
    - the stage's *parameters*, once per tick, in the compute dtype (the matmul operands):
      e * (L/p x :func:`layer_params` + the V/t x h ``ends`` / embedding table). JAX's partial
      evaluation of the tick's ``cond`` (work / skip) returns the branch's residuals as outputs of
      the cond, the weights among them; the scan then stacks them like any per-tick value instead
      of forwarding them as loop constants. Measured (tiny, p=4, m=4, b=2, s=128, fp32: the
      buffer assignment's ``f32[7,1,128,384]``, ``f32[7,1,128,4,32]``, ``f32[7,256,128]``, ...
      stacks): 7 x 0.875 MiB, exactly e * (layer_params + V*h) per tick.
    """
    d = Dims.of(model, layout)
    layers = model.num_layers // layout.pipeline
    weights = d.e * (layers * layer_params(model, layout) + shared_tables(model, layout))
    head = F32 * d.b * d.s * d.v + (2 * d.e + F32) * d.b * d.s * d.h
    return layers * (layer_residual_bytes(model, layout) + dropout_residual_bytes(model, layout)) + head + weights


_PROGRAMS: dict[tuple, tuple[int, int]] = {}


def _program(schedule: str, p: int, m: int, v: int) -> tuple[int, int]:
    """(act_slots, grad_slots) of a schedule's executor program, cached: the planner asks for the
    same few many times."""
    key = (schedule, p, m, v)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = steady_slot_counts(schedule, p, m, v)
    return _PROGRAMS[key]


def stage_temps(model: ConfigDict, layout: ParallelLayout) -> list[TempEstimate]:
    """:func:`temp_estimate` of every pipeline stage (one entry without a pipeline)."""
    return [temp_estimate(model, layout, stage) for stage in range(layout.pipeline)]


def expected_temp_bytes(model: ConfigDict, layout: ParallelLayout) -> float:
    """The largest stage's estimated temporaries: what ``memory_analysis().temp_size_in_bytes`` reports
    (every device compiles the same SPMD program, so its temp buffer fits the busiest stage)."""
    return max(t.total_bytes for t in stage_temps(model, layout))
