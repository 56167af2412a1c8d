"""The temporaries of jaxpar's train step on one device: the per-layer terms of
:mod:`jaxpar.analysis.activations` assembled into what ``memory_analysis().temp_size_in_bytes`` reports,
per pipeline stage and per phase (backward, optimizer update, a pipeline tick's accumulator), with the
gradient buffers, the ZeRO shards and the pipeline's slot buffers and tick stacks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpar.analysis.activations import (
    attention_kind,
    dropout_residual_bytes,
    head_params,
    largest_layer_param,
    largest_param,
    layer_params,
    layer_residual_bytes,
    layer_working_bytes,
    layer_working_phases,
    layer_working_term,
    recomputes_by_sequence,
    shared_params,
    shared_tables,
    softmax_fused_rows,
    zero3_embedding_gradient_bytes,
    zero3_regathered_params,
)
from jaxpar.analysis.dims import F32, Dims
from jaxpar.analysis.head_phases import (
    deferred_head_bytes,
    head_working_bytes,
    pipeline_head_phase_bytes,
    zero3_head_phase_bytes,
)
from jaxpar.analysis.pipeline_phases import (
    embedding_shard_bytes,
    embedding_shard_copies,
    frontier_unpacked_bytes,
    gpipe_tick_bytes,
    head_residual_bytes,
    pipeline_accumulator_bytes,
    program_slots,
)
from jaxpar.config import ConfigDict
from jaxpar.models.inventory import DTYPE_BYTES, ParallelLayout, param_tensors, shard_elements
from jaxpar.parallel.pipeline.schedule import keeps_activations, splits_backward


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
    update_hole_bytes: float = 0.0  # the heap's hole beside the update's live set (update_hole_bytes)

    @property
    def total_bytes(self) -> float:
        backward = (
            self.residual_bytes + self.working_bytes + self.gradient_bytes + self.gather_bytes + self.pipeline_bytes
        )
        return max(backward, self.update_bytes + self.update_hole_bytes, self.accumulator_bytes)

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
        elif self.total_bytes == self.update_bytes + self.update_hole_bytes:
            out = {
                "optimizer update (gradients, their reduction, ZeRO shards)": self.update_bytes,
                "heap hole beside the update's relayout copies": self.update_hole_bytes,
            }
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


def scatters_stacked_in_update(layout: ParallelLayout) -> bool:
    """ZeRO-1/2 without a pipeline, whose update reduce-scatters the backward's stacked layer gradients
    (one microbatch, or ZeRO-2, whose accumulation sums them; ZeRO-1 with accumulation scatters the
    accumulator)."""
    return (
        layout.pipeline == 1
        and layout.shards_optimizer
        and not layout.shards_parameters
        and (layout.microbatches == 1 or layout.shards_gradients)
    )


def scatters_head_early(layout: ParallelLayout) -> bool:
    """:func:`scatters_stacked_in_update` without sequence parallelism: the output layer's gradient is
    reduce-scattered at the loss head's backward (:func:`early_scattered_head_bytes`), not in the update."""
    return scatters_stacked_in_update(layout) and not layout.sequence_parallel


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
    n = layout.zero_shards()
    head = sum(
        shard_elements(t, layout.tensor, 1, False, layout.expert) for t in param_tensors(model) if t.name == "output"
    )
    return DTYPE_BYTES[model.param_dtype] * head * (1 - 1 / n)


def update_bytes(model: ConfigDict, layout: ParallelLayout, grads: float) -> float:
    """The optimizer phase (:mod:`jaxpar.train.step`), with ``grads`` the full local fp32 gradient bytes.

    Stage 0: the data all-reduce writes a second gradient buffer (XLA:CPU does not reduce in place),
    except for the embedding's scatter-add gradient: 2G - 4*V*h/t (the ~1B config at data=8: 0.1%), and
    with sequence parallelism that one too: 2G (every ~1B row of the random grid without a pipeline whose
    update sets the peak: the 18 without sequence parallelism at 1.000 of 2G - 4*V*h/t, the 5 with it
    at 1.000 of 2G, where the all-reduce's operands hold both f32[V/t, h] tables), and with accumulation
    that one too: 2G (the 16 ~1B ZeRO-0 rows kept with m > 1 whose update sets the peak: 1.052-1.131 of
    2G - 4*V*h/t, 1.000 of 2G each; buffer assignment of ~1B data=2 x tensor=4 m=2: the accumulator's and
    the all-reduce's f32[8000, 2048] embedding gradients side by side).
    Stages 1-2: at the turn from the backward to the update, every gradient beside one relayout copy
    of the largest stacked layer gradient (W_down's (L, f, h) stack transposed so that the
    ``psum_scatter`` dim leads), pb * P_layer_max; the scatters then free the full gradients one by
    one, and the updated shards' all-gathers hold far less (buffer assignment of ~1B data=8 ZeRO-1
    s=512 with 4 and 16 layers, and data=2 x tensor=2 x context=2 ZeRO-2 with 2: a
    ``f32[L,8192,2048]{1,0,2}`` copy beside the stacked gradients at that point, nothing else of
    its size); the heap's hole beside them is :func:`update_hole_bytes`. Stage 3: the gradient buffers of the
    backward, G/N and the embedding's full table (:func:`zero3_embedding_gradient_bytes`), which the
    update reads in place (buffer assignment of ~1B data=8 full, s=512: the update's live set is
    those buffers, 749 MiB, and nothing of their size besides).
    """
    pb = DTYPE_BYTES[model.param_dtype]
    if not layout.shards_optimizer:
        # the embedding's scatter-add gradient is reduced in place only as the step's one microbatch writes it;
        # with accumulation it is a slice of the accumulator like the rest
        in_place = not layout.sequence_parallel and layout.microbatches == 1
        return 2 * grads - (pb * shared_tables(model, layout) if in_place else 0.0)
    if not layout.shards_parameters:  # ZeRO-1/2
        return grads + pb * largest_param(model, layout)
    return zero_sharded_bytes(model, layout, grads) + zero3_embedding_gradient_bytes(model, layout)


def update_hole_bytes(model: ConfigDict, layout: ParallelLayout) -> float:
    """The hole XLA's heap leaves beside the live set of a ZeRO-1/2 update that reduce-scatters the stacked
    layer gradients (:func:`scatters_stacked_in_update`): one slot of the largest of them, pb * P_layer_max,
    less, with sequence parallelism, what the output layer's whole gradient puts into it.

    The update's reduce-scatters read each stacked fp32 layer gradient through a relayout copy (its
    scatter dim leading, :func:`update_bytes`) made while the source is still live. XLA's buffer
    assignment packs its heap best-fit over whole live ranges in a size-first or a duration-first order,
    whichever packs tighter (``GlobalDecreasingSizeBestFitHeap``'s spatial and temporal orders,
    xla/service/heap_simulator), not in program order, so a copy does not take the slot its source frees
    at that moment. Buffer assignment of ~1B, 4 layers, tensor=4 x context=2 ZeRO-1 ``full``, s=128
    (the random grid's seed 80 case 22): the three stacked f32[4, 2048, 2048] MLP gradients and their
    three copies take five 64 MiB slots where no moment holds more than four, with the step-long buffers
    above them (the embedding's zero f32[8000, 2048] table, which XLA schedules ahead of the forward and
    the update's scatter-add writes; the output layer's reduce-scattered shard): 459.8 MiB allocated,
    398.0 MiB the largest live set. The same layout with 16 layers: five f32[16, 2048, 2048] slots for
    four live, 1573.9 MiB allocated, 1278.5 MiB live.

    With sequence parallelism the output layer's gradient is scattered in the update, not at the loss
    head's backward (:func:`early_scattered_head_bytes`), so the count holds its whole f32[h, V/t] table
    there; the heap puts it where the hole is, and the allocation is the same as without sequence
    parallelism (~1B, 16 layers, data=2 x tensor=4 ZeRO-1 SP and tensor=4 x context=2 without: 1573.9 MiB
    each): the hole less the bytes the early scatter saves. Measured (``experiments/results/
    2026-12-06-memory-grid``): the allocation is 0.33-1.15 slots above the live count in the
    held-out ~1B rows of 8 and 16 layers, and the 85 kept rows the slot moves go from 0.97-1.18 of the
    estimate to 0.90-1.06 (the held-out rows 1.00-1.23 to 0.89-1.03), the low end where XLA's duration-first
    order packs the heap tighter (data x context = 8 at tensor = 1, and ~1B, 16 layers, data=2 x tensor=2 x
    context=2 ZeRO-2, whose embedding table sits at offset 0).
    """
    slot = DTYPE_BYTES[model.param_dtype] * largest_param(model, layout)
    if layout.sequence_parallel:  # the output layer's whole gradient, counted in the update, fills it
        return max(0.0, slot - early_scattered_head_bytes(model, layout))
    return slot


def zero_sharded_bytes(model: ConfigDict, layout: ParallelLayout, full_bytes: float) -> float:
    """``full_bytes`` of gradients (every parameter one device holds) ZeRO-sharded: / (data x context);
    with ``expert`` > 1 the experts' weights' share / (data x context), the rest / (data x expert x
    context) (:func:`jaxpar.axes.data_group`)."""
    n = layout.zero_shards(expert_weight=True)
    if layout.expert == 1:
        return full_bytes / n
    layers = layout.stored_layers(model.num_layers)
    experts = sum(
        shard_elements(t, layout.tensor, 1, False, layout.expert)
        for t in param_tensors(model)
        if t.place == "layer" and t.expert_split
    )
    experts *= layers * DTYPE_BYTES[model.param_dtype]
    return experts / n + (full_bytes - experts) / layout.zero_shards()


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
    is added into the accumulator as it is written: ``full`` by layer, and ZeRO-3 under ``full``; ZeRO-3's
    layers leave the chunk's scan reduce-scattered, so where activations are kept its chunk gradient is
    sharded; ZeRO-3 also gathers the attention's weights a second
    time, :func:`zero3_regathered_params`), and the act/grad slot buffers
    of the schedule (:func:`jaxpar.parallel.pipeline.compile_program`: p stage inputs on stage 0 for
    1F1B); the last stage runs the head inside the same backward; the accumulator held twice
    (:func:`pipeline_accumulator_bytes`) is a phase of its own. GPipe: the forward scan over
    m + p - 1 ticks is differentiated as a whole, so every tick's :func:`gpipe_tick_bytes` (bubbles
    included, the stage's weights among them) stay live; the backward tick slices one tick's
    residuals out of those stacks (a copy: one more :func:`gpipe_tick_bytes`; without recompute and with
    more than one layer per stage and b = 1, the layer residuals a second time, in the layer scan's layout) and
    works on one layer (:func:`layer_working_bytes`), or, on the last stage outside ZeRO-3, on the loss
    head's backward (:func:`pipeline_head_phase_bytes`) where that is the larger; under ZeRO-3 the stage's
    gradients are the sharded accumulator twice, and the first stage's embedding scatter-add is a phase too.
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
        early = early_scattered_head_bytes(model, layout) if scatters_head_early(layout) else 0.0
        grads -= early
        if layout.microbatches > 1:  # the microbatch's stacked layer gradients beside the accumulator (ZeRO
            # 0-1; the embedding and output-layer gradients are added into it in place); ZeRO-2/3: a sharded sum
            grads += zero_sharded_bytes(model, layout, full_grads) if layout.shards_gradients else pb * layer_el
            if layout.sequence_parallel and not layout.shards_gradients:  # the head's parameters pass through
                # the layer scan's carry (jaxpar.models.base.Model.loss_sum), so the microbatch's gradient of the
                # output weight leaves the backward layer loop as its carry instead of being added into the
                # accumulator in place: one more (h, V/t) gradient through the loop (buffer assignment of ~1B,
                # 2 layers, data=4 x tensor=2 SP ZeRO-1 ``selective``, m=2, s=128: the accumulator's and the
                # loop carry's f32[2048, 16000] at the peak; 1.146 of the estimate without it, 1.000 with; the
                # 43 kept rows it moves by 2% or more, 1.009-1.146 -> 0.959-1.014). ZeRO-2 counts the microbatch's
                # gradient.
                grads += pb * head_params(model, layout)
            if zero3:  # the zero table the embedding's scatter-add starts from, hoisted out of the microbatch
                # loop, and each microbatch's copy of it (buffer assignment of ~1B ZeRO-3 m=2 and m=4:
                # two f32[V/t, h] tables beside the sharded gradients)
                grads += pb * shared_tables(model, layout)
        update = update_bytes(model, layout, full_grads - early)
        hole = update_hole_bytes(model, layout) if scatters_stacked_in_update(layout) else 0.0
        return TempEstimate(
            0,
            residual,
            working,
            grads,
            gather,
            0.0,
            update,
            "update" if update + hole > residual + working + grads + gather else "backward",
            working_term=term,
            update_hole_bytes=hole,
        )

    chunk = layout.layers_per_stage(model.num_layers)
    last = stage == p - 1
    if layout.pipeline_schedule == "gpipe":
        per_tick = gpipe_tick_bytes(model, layout)
        residual = (layout.microbatches + p - 1) * per_tick
        # the backward tick slices its residuals out of the tick stacks (a copy), then works on one layer
        forward, backward = layer_working_phases(model, layout, None, chunk, False)
        working, slots = per_tick + max(forward, backward), 0.0
        # one tick's layer residuals, the chunk's (the layer loop's stack; at b = 1 also the copy below)
        chunk_residuals = chunk * (layer_residual_bytes(model, layout) + dropout_residual_bytes(model, layout))
        fused = d.b * d.n * d.s >= softmax_fused_rows()
        if layout.recompute != "none" and not model.get("attention_dropout", 0.0) and fused:
            # where XLA:CPU runs the softmax as one kernel (SOFTMAX_FUSED_ROWS), the tick's recomputed attention
            # holds the scores and the probabilities alone, the backward's two arrays: the forward phase's three
            # score copies and causal mask are the forward scan's, where no tick's residuals are sliced out, so
            # the peak is the larger of that phase and the sliced residuals with the backward. Buffer assignment
            # of tiny data=2 x pipeline=4 GPipe ZeRO-1 selective, b=1, s=1024 (4096 rows): no moment with three
            # f32[1, 2, 2, 1024, 1024] arrays live, two at the peak (0.897 of the estimate with the sliced
            # residuals beside the forward phase, 0.963 without); tensor=2 x pipeline=4, b=1, s=1024 (2048
            # rows, the softmax split): three at the peak beside the sliced residuals (1.005 as counted)
            stack = 0.0
            if chunk > 1 and layout.microbatch_size > 1:  # the tick's layer loop carries the chunk's residual stack
                # beside the last layer's forward attention, before the tick writes it into the tick stacks (buffer
                # assignment of tiny data=4 x pipeline=2 GPipe ZeRO-0 selective, hidden dropout, b=2, s=1024: the
                # loop state's f32[2, 2, 1024, 384] gate and up beside the three f32[2, 2, 2, 1024, 1024] score
                # arrays and the three-tick stacks; peak 1.119 of the estimate without it, 1.015 with). At b = 1 the
                # copy below adds the same bytes to this phase.
                stack = chunk_residuals
            working = max(forward + stack, per_tick + backward)
        if layout.recompute != "full" and chunk > 1 and layout.microbatch_size == 1:
            # one sequence per microbatch: XLA lays the sliced residuals out with the size-1 batch dim moved
            # ({..,2,0,1}) and copies them into the chunk's layer scan's layout, a second copy of the tick's
            # layer residuals (buffer assignment of tiny data=4 x pipeline=2 GPipe ZeRO-3 m=4, s=256, b=1,
            # attention dropout: the tick's f32[2, 1, 2, 512, 256] scores, six f32[2, 1, 256, 384] MLP
            # residuals and pred masks twice each; the same layout with b=4, s=128 slices them once); so
            # under ``selective`` (tiny data=4 x pipeline=2 GPipe ZeRO-1 m=2, s=1024, b=1: the saved gate and
            # up, f32[2, 1, 1024, 384], in both layouts; 1.197 of the estimate without the second copy)
            working += chunk_residuals
        elif (
            layout.recompute == "none" and chunk > 1 and d.k * d.n == d.q and attention_kind(layout) == "dot_product"
        ):  # one key/value head per tensor rank: the saved scores and probabilities carry that size-1 dim, and
            # XLA copies them into the layer scan's layout as it does every residual at b = 1 (buffer assignment of
            # tiny data=2 x tensor=2 x pipeline=2 GPipe ZeRO-1 SP ``none``, b=2, s=512: the tick's f32[2, 2, 1, 2,
            # 512, 512] and f32[2, 2, 1, 1024, 512] twice each, in the {..,1,0,2} layout and in the scan's, the MLP's
            # residuals once; peak 1.103 of the estimate without the copy, 1.001 with; four other kept rows 1.039-1.067
            # -> 0.997-1.024)
            working += chunk * 2 * F32 * d.b * d.n * d.s * d.s
        term = "backward tick: one tick's residuals and one layer's working set"
        tick_grads = full_grads
        if zero3:  # each tick gathers its layers' weights and leaves their gradients reduce-scattered into the
            # sharded accumulator, which the tick's layer loop carries as a copy beside the operand (two copies, as
            # in pipeline_accumulator_bytes); no unsharded stage gradient. The first stage's embedding backward,
            # a scatter-add into a zero V/t x h table and the microbatch's copy of it (as without a pipeline),
            # is a phase of its own beside the tick's sliced residuals. Buffer assignment of ~1B, 4 layers,
            # data=4 x pipeline=2 GPipe ZeRO-3 ``full``, s=512, b=1: the peak at that scatter-add, with two
            # f32[32000, 2048] tables, the sliced tick (its f32[2048, 32000] head weight among them) and the
            # sharded layer accumulators twice (f32[2, 512, 8192] in the loop's state and outside it); 0.885 of
            # the estimate with the stage's unsharded gradient counted, 1.006 as counted here. data=2 x tensor=2
            # ``selective``, s=128: the same phase with f32[16000, 2048] tables (0.975, 1.008).
            tick_grads = zero_sharded_bytes(model, layout, full_grads)
            embedding = per_tick + 2 * pb * shared_tables(model, layout) if stage == 0 else 0.0
            if embedding > working:
                working, term = embedding, "backward tick: one tick's residuals and the embedding's scatter-add"
        if last and not zero3:  # the loss head's backward, a phase of its own as in a 1F1B tick (buffer assignment
            # of ~1B data=4 x pipeline=2 GPipe ZeRO-1 m=2, s=128, ``none``, jax 0.12.0.1: at the head's
            # f32[32000, 2048] weight gradient the tick's slice of the table stack, the weight's gradient from
            # the tick's two branches and its sum, and the (b, s, V) logit gradients; 1.228 of the estimate
            # without it, 1.047 with). ZeRO-3 is left out: its GPipe tick gathers the head (~1B data=4 x
            # pipeline=2 GPipe ZeRO-3 ``selective``: 0.969 without this phase, 0.873 with it)
            head = pipeline_head_phase_bytes(model, layout)
            if head > working:
                working, term = head, "backward tick: the loss head's backward"
    else:
        keep = keeps_activations(layout)
        prog = program_slots(layout.pipeline_schedule, p, layout.microbatches, layout.virtual_stages, keep)
        by_sequence = recomputes_by_sequence(layout)
        rows = 1 if by_sequence else None
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
        # the microbatch's gradient at the chunk's output and its input gradient, assembled sequence by sequence:
        # two (b, s, h) arrays of the whole microbatch beside the one sequence's working set (buffer assignment of
        # tiny data=2 x tensor=2 x pipeline=2 1F1B full m=4), live through the loss head's backward too (below)
        assembled = 2 * d.e * d.b * d.so * d.h if by_sequence else 0.0
        working += assembled
        term = "backward tick: one layer's working set"
        # recomputed layer by layer and sequence by sequence, each layer's weight gradient is added into the
        # accumulator in place as the layer's backward writes it: no gradient beside the accumulator (buffer
        # assignment of tiny data=2 x pipeline=4 1F1B ZeRO-0 full, m=8, s=256: the accumulator's f32[1, 128, 384]
        # once at the peak)
        chunk_grads = 0.0 if by_sequence else pb * chunk * layer_params(model, layout)
        if zero3:  # each layer is gathered inside the chunk's layer scan (Model.layer_step), so its gradient
            # leaves the scan through the gather's transpose, a reduce-scatter: the chunk's gradient is sharded.
            # Under ``full`` it is added into its slice of the sharded accumulator with no chunk gradient beside
            # it at the peak (buffer assignment of tiny data=2 x tensor=2 x pipeline=2 1F1B ZeRO-3 full, s=256 and
            # s=128: the accumulator's f32[2, 64, 192] shards once, no f32[2, 128, 192] chunk gradient). Where the
            # schedule keeps activations (``selective``, ``none``), the last stage runs its chunk's forward and
            # backward in one tick and the backward layer scan carries the chunk's sharded gradients beside the
            # accumulator (the same mesh, ``selective``, m=4, b=2, s=128: f32[2, 64, 192] in the scan's state and
            # in the accumulator at the peak, peak 1.100 of the estimate without the scan's, 1.061 with; the 29
            # ZeRO-3 ``selective`` 1F1B/interleaved rows kept: peak median 1.033 -> 1.009, max 1.124 -> 1.099)
            chunk_grads = zero_sharded_bytes(model, layout, chunk_grads) if keep else 0.0
        # ZeRO-2 ``full`` recomputes the chunk layer by layer with the whole microbatch, and XLA reduce-scatters
        # each weight's gradient into the sharded accumulator as its matmul writes it: one weight's unsharded
        # gradient beside the accumulator, not the chunk's (buffer assignment of tiny data=2 x pipeline=4 1F1B
        # ZeRO-2 ``full``, b=1, s=256: at the tick's MLP backward one f32[128, 384] weight gradient beside the
        # accumulator's f32[1, 64, 384] shards; peak 0.882 of the estimate with the chunk's gradient, 0.933 with
        # one weight's; ~1B, 4 layers, data=4 x pipeline=2, b=2, s=1024, two layers a tick: no weight gradient
        # at the MLP phase's peak, 0.912 -> 1.045)
        tick_grads = chunk_grads
        if layout.recompute == "full" and layout.shards_gradients and not zero3:
            tick_grads = pb * largest_layer_param(model, layout)
        if last:  # the loss head's backward runs in the tick before the chunk's: the larger phase sets the peak,
            # and the chunk's gradient is not written yet (buffer assignment of ~1B, 4 layers, data=2 x tensor=2
            # x pipeline=2 1F1B ZeRO-2 full, m=4, s=512: at the head's weight-gradient matmul the sharded
            # accumulator and the head's f32[16000, 2048] gradients, no f32[2, 1024, 4096] chunk gradient)
            head = pipeline_head_phase_bytes(model, layout, b=rows) + deferred_head_bytes(model, layout, b=rows)
            # the microbatch's two assembled (b, s, h) arrays (the same buffer assignments as
            # DEFERRED_HEAD_HIDDEN_BY_LAYER: f32[2, 1024, 2048] twice at the head's weight gradient, b=2)
            head += assembled
            if zero3 and chunk == 1:  # ZeRO-3: a chunk of one layer gathers it ahead of its backward, in place
                # of the layers in flight (buffer assignment of ~1B data=2 x pipeline=4 ZeRO-3 full: the MLP's
                # three gathered weights beside the head's, at the head's weight-gradient matmul); a chunk of
                # several gathers each inside its layer loop, none at the head's (~1B, 4 layers, data=4 x
                # pipeline=2 1F1B ZeRO-3 full, b=1, s=128: the head's three f32[32000, 2048]-sized arrays, the
                # sharded accumulator and the logits at the peak, no f32[2048, 8192] weight; 0.905 of the estimate
                # with a gathered layer, 1.017 without)
                head += d.e * layer_params(model, layout) - gather
            # ZeRO-2 (the chunk's gradient is reduce-scattered into the sharded accumulator once written); ZeRO
            # 0-1 keep a chunk-gradient-sized buffer through the head's backward (~1B, 4 layers, data=4 x
            # pipeline=2 1F1B ZeRO-0, m=4, s=256: 1.164 of the estimate without it), and so does an interleaved
            # tick (~1B, 4 layers, data=2 x tensor=2 x pipeline=2 interleaved ZeRO-2 selective: 1.255 without it),
            # and so does ZeRO-2 without recomputation, whose chunk backward's zero-initialised gradient carry XLA
            # hoists ahead of the head (~1B, 4 layers, data=4 x pipeline=2 1F1B ZeRO-2 ``none``, m=2, s=128: two
            # f32[2, 2048, 8192] zero tables and a copy at the head's f32[32000, 2048] weight gradient; 1.374 of
            # the estimate without it, 1.003 with; three other such rows 1.025-1.108 -> 0.940-1.024), and so does
            # ZeRO-3 ``selective`` with a chunk of several layers, its scan's zero-initialised sharded gradient
            # carries (~1B, 4 layers, data=2 x tensor=2 x pipeline=2 1F1B ZeRO-3 selective, b=1, s=256: two
            # f32[2, 1024, 4096] and two f32[2, 16, 64, 1024]-sized broadcasts at the head's weight gradient),
            # and so does ZeRO-2 ``selective`` with a chunk of several layers (the same mesh, ZeRO-2, m=4, b=2,
            # s=256, blockwise, seed 122 case 29 of the random grid: two f32[2, 2048, 4096] zero tables and a copy
            # beside the head's three f32[16000, 2048]-sized arrays; 1.297 of the estimate without them, 1.019
            # with; no other of the 4488 kept rows moves)
            unwritten = (
                chunk_grads
                if layout.shards_gradients
                and layout.virtual_stages == 1
                and layout.recompute != "none"
                and not (keep and chunk > 1)
                else 0.0
            )
            if head + chunk_grads - unwritten > working + tick_grads:
                working, tick_grads, term = head, chunk_grads - unwritten, "backward tick: the loss head's backward"
    acc = zero_sharded_bytes(model, layout, full_grads) if layout.shards_gradients else full_grads
    grads = acc + tick_grads
    if ticks:  # ZeRO-3: the embedding's share of the accumulator a second time, in its scatter's layout
        grads += (embedding_shard_copies(layout) - 1) * embedding_shard_bytes(model, layout)
    update = update_bytes(model, layout, full_grads)
    backward = residual + working + grads + gather + slots
    accumulator = 0.0 if layout.pipeline_schedule == "gpipe" else pipeline_accumulator_bytes(model, layout, acc) + slots
    phase = max((backward, "backward"), (update, "update"), (accumulator, "accumulator"))[1]
    return TempEstimate(stage, residual, working, grads, gather, slots, update, phase, accumulator, term)


def stage_temps(model: ConfigDict, layout: ParallelLayout) -> list[TempEstimate]:
    """:func:`temp_estimate` of every pipeline stage (one entry without a pipeline)."""
    return [temp_estimate(model, layout, stage) for stage in range(layout.pipeline)]


def estimated_temp_bytes(model: ConfigDict, layout: ParallelLayout) -> float:
    """The largest stage's estimated temporaries: what ``memory_analysis().temp_size_in_bytes`` reports
    (every device compiles the same SPMD program, so its temp buffer fits the busiest stage)."""
    return max(t.total_bytes for t in stage_temps(model, layout))
