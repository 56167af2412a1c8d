"""The loss head's working sets: what the cross-entropy and the output layer's weight gradient hold at
their peak, without a pipeline (:func:`head_working_bytes`, ZeRO-3's :func:`zero3_head_phase_bytes`) and on
a pipeline's last stage (:func:`pipeline_head_phase_bytes`, and :func:`deferred_head_bytes` where XLA runs the
head's weight-gradient matmul after a one-layer chunk's recomputed forward). Counted buffer by buffer in
XLA:CPU's buffer assignment like the layers' working sets of :mod:`jaxpar.analysis.activations`, whose shapes
(:class:`~jaxpar.analysis.activations.Dims`) and score-array counts they use; summed into a stage's
temporaries by :mod:`jaxpar.analysis.temporaries`.
"""

from __future__ import annotations

from jaxpar.analysis.activations import (
    attention_kind,
    backward_score_copies,
    dropout_chain_slots,
    shared_tables,
)
from jaxpar.analysis.dims import F32, Dims
from jaxpar.config import ConfigDict
from jaxpar.models.inventory import DTYPE_BYTES, ParallelLayout

HEAD_COPIES = 3  # fp32 logits, exp(z) kept for the backward, the fp32 logit gradient


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


# A 1F1B last stage of one layer under ``full``: XLA:CPU schedules the loss head's weight-gradient matmul after the
# chunk's recomputed forward, so at that matmul the recomputed attention's scores and probabilities (``dot_product``:
# :data:`~jaxpar.analysis.activations.BACKWARD_SCORE_COPIES` fp32 (b, n/t, s, s) arrays; with attention dropout also the dropped probabilities)
# and four (b, s, f/t) arrays of the MLP (the recomputed gate, up and silu(gate), and their product transposed for
# the down projection's weight gradient) are live beside the head's. Buffer assignment of ~1B, 2 layers, data=4 x
# pipeline=2 ZeRO-2, b=1, s=512 (f32[1, 8, 4, 512, 512] twice, f32[512, 8192] three times and f32[8192, 512] at the
# head's f32[32000, 2048] weight gradient; 1.212 of the estimate without them, 1.076 with); ~1B, 4 layers,
# tensor=2 x pipeline=4 SP ZeRO-2, b=2, s=1024 (f32[2, 4, 4, 1024, 1024] twice, f32[2048, 4096] four times; 1.311
# without, 1.122 with); ~1B, 2 layers, data=4 x pipeline=2 ZeRO-0 with attention dropout, s=1024 (three
# f32[1, 8, 4, 1024, 1024]; 1.156 with two, 1.065 with three). Blockwise (no score arrays; ~1B tensor=4 x
# pipeline=2 ZeRO-1, attention dropout, s=1024): 1.342 without, 1.250 with, the kernel's arrays not counted. With
# two layers or more per stage the layers run in a loop, and the ~1B rows of the grids hold without this
# (0.87-1.00). ``selective`` defers the matmul the same way (~1B, 2 layers, tensor=4 x pipeline=2 ZeRO-2, both
# dropouts, b=2, s=512: the recomputed f32[2, 2, 4, 512, 512] scores, two more score-sized arrays of the dropout
# and the MLP's gate, up, silu and transposes at the head's f32[8000, 2048] weight gradient; 1.263 of the
# estimate without the term, 1.123 with, the rest the chunk's saved dense outputs), and so does the last virtual
# stage of interleaved chunks of one layer (~1B, 4 layers, data=4 x pipeline=2 x v=2 ZeRO-3 selective, b=2,
# s=1024: two recomputed f32[2, 8, 4, 1024, 1024] score arrays, the MLP's gate, up and silu and two gathered
# f32[2048, 8192] weights at the head's f32[32000, 2048] weight gradient; 1.306 -> 1.042).
HEAD_DEFERRED_MLP_WIDE = 4


# Under ``full`` the tick recomputes its chunk layer by layer
# (:func:`jaxpar.parallel.pipeline.executor._stage_backward_by_layer`: one sequence at a time under ZeRO 0-1, the
# whole microbatch under ZeRO-2/3); with one layer the reverse layer loop is a single iteration, and at the
# deferred head's weight-gradient matmul nine more (b, s, h)-sized arrays are live beside the four of the MLP: the
# recomputed layer's residual sum, two norm products, its attention output and two activation transposes for its
# weight gradients, and, of the head, its forward's three saved arrays (final norm input, normalised input,
# scaled output) less the final norm's gradient already counted, and its input transposed for dy^T x; plus the
# embedding branch's output, a zero (b, s, h) array on the last stage. Buffer assignments of ~1B, 2 layers,
# data=4 x pipeline=2 1F1B ZeRO-0 ``full``, attention dropout, b=1, s=1024 (h=2048 and f=8192 apart: eleven
# f32[1, 1024, 2048]-sized arrays and four of f32[1024, 8192] at the head's f32[32000, 2048] weight gradient;
# peak 1.038 of the estimate without them, 1.013 with), tensor=4 x pipeline=2 ZeRO-1 blockwise, both dropouts,
# b=2, s=1024 (1.141 -> 1.014) and, the whole microbatch, ~1B, 4 layers, data=2 x tensor=2 x pipeline=2 x v=2
# ZeRO-3 blockwise, b=1, s=1024 (the same arrays beside the gathered MLP weights; 1.104 -> 1.052); the thirteen
# ZeRO-2/3 rows kept that this moves, 1.033-1.104 -> 1.007-1.065.
DEFERRED_HEAD_HIDDEN_BY_LAYER = 9


def deferred_head_bytes(model: ConfigDict, layout: ParallelLayout, b: int | None = None) -> float:
    """What the last stage of 1F1B or interleaved chunks of one layer, under ``full`` or ``selective``, holds
    of its chunk's recomputed forward at the loss head's weight-gradient matmul, beyond
    :func:`pipeline_head_phase_bytes` (see :data:`HEAD_DEFERRED_MLP_WIDE` and, recomputed by layer,
    :data:`DEFERRED_HEAD_HIDDEN_BY_LAYER`); 0 elsewhere."""
    if layout.recompute == "none" or layout.layers_per_stage(model.num_layers) != 1:
        return 0.0
    d = Dims.of(model, layout, b)
    copies = 0
    if attention_kind(layout) == "dot_product":  # attention dropout's third array is the keep scale broadcast for
        # the fused softmax's backward (dropout_chain_slots): where XLA:CPU splits the softmax the dropped
        # probabilities take the probabilities' place (tiny tensor=2 x pipeline=4 1F1B ZeRO-2 SP ``full``, b=2,
        # s=512, 2048 rows: two f32[2, 1, 2, 512, 512] arrays at the head's weight gradient beside the nine arrays
        # of DEFERRED_HEAD_HIDDEN_BY_LAYER; peak 0.880 of the estimate with a third, 0.971 with two)
        copies = backward_score_copies() + dropout_chain_slots(model, layout, b)
    hidden = DEFERRED_HEAD_HIDDEN_BY_LAYER * d.e * d.b * d.s * d.h if layout.recompute == "full" else 0.0
    return copies * F32 * d.b * d.n * d.s * d.s + HEAD_DEFERRED_MLP_WIDE * d.e * d.b * d.s * d.f + hidden


def head_working_bytes(model: ConfigDict, layout: ParallelLayout, b: int | None = None) -> float:
    """The vocabulary-parallel cross-entropy of one microbatch (:func:`jaxpar.models.llama.cross_entropy_sum`):
    fp32 logits of this tensor rank's V/t columns, exp(z) kept for the backward, and the fp32 logit
    gradient: :data:`HEAD_COPIES` * 4*b*s*V/t (the final norm's input and output: 2 e*b*s*h)."""
    d = Dims.of(model, layout, b)
    return HEAD_COPIES * F32 * d.b * d.s * d.v + 2 * d.e * d.b * d.s * d.h
