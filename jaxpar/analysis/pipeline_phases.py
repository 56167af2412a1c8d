"""The pipeline ticks' terms of the step's temporaries (:mod:`jaxpar.analysis.temporaries`): what a
1F1B / interleaved backward tick holds beside its gradient accumulator, what a GPipe forward tick saves
for its backward, a split backward's frontier, the loss head's residuals per microbatch, the executor
programs' slot counts, and the two jax-release switches these counts depend on (read from the installed
distribution, so the planner does not import JAX).
"""

from __future__ import annotations

import functools

from jaxpar.analysis.activations import (
    BACKWARD_SCORE_COPIES,
    attention_kind,
    dropout_chain_slots,
    dropout_residual_bytes,
    layer_params,
    layer_residual_bytes,
    recomputes_by_sequence,
    shared_tables,
)
from jaxpar.analysis.attention_blocks import blockwise_attention_backward_bytes
from jaxpar.analysis.dims import F32, Dims
from jaxpar.config import ConfigDict
from jaxpar.models.inventory import DTYPE_BYTES, ParallelLayout
from jaxpar.parallel.pipeline.schedule import keeps_activations, steady_slot_counts
from jaxpar.versions import jax_release


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
    stays live (once on jax >= 0.12.1: :func:`accumulator_copies`). Beside the copies, the larger of:

    - inside the layer loop: one layer's weights sliced out of the stage's stack, and with v > 1
      the chunk's L/(p*v) layers sliced out first (:func:`jaxpar.parallel.pipeline.ticks.chunk_layers`),
      pb * (1 + [v > 1] * L/(p*v)) * :func:`layer_params`, and with ``dot_product`` the forward tick's
      attention over the whole microbatch: :data:`BACKWARD_SCORE_COPIES` fp32 (b, n/t, s, s) arrays (with
      attention dropout the heap's :func:`dropout_chain_slots` more) and the layer's input and keys,
      e*b*s*(h + k) (buffer assignment of tiny data=4 x pipeline=2 1F1B ``full`` m=2: the two accumulator
      copies, the layer's sliced weights and two f32[4,2,2,128,128] score arrays at the peak; with
      attention dropout, b=4, s=256: two f32[4, 2, 2, 256, 256] arrays live in three slots, and four
      (b, s, h)-sized arrays); with ``blockwise`` the same count of its (b, n/t, bq, bk) blocks (tiny
      data=2 x pipeline=4 1F1B ``full``, b=4, s=256, one block of 256: f32[4, 2, 256, 512] q k^T and
      f32[4, 2, 2, 256, 256] exponentials beside the two copies; 1.413 of the estimate without them);
    - with ``blockwise``, inside the layer loop too: the layer's attention backward,
      :func:`~jaxpar.analysis.attention_blocks.blockwise_attention_backward_bytes` over the rows the tick
      recomputes at once (one sequence where :func:`recomputes_by_sequence`), which is the larger where those
      rows are the whole microbatch's (buffer assignment of tiny data=4 x pipeline=2 interleaved ZeRO-0
      ``full``, b=1, s=256, one block of 256, seed 32 case 29 of the random grid: the accumulator's two copies,
      the flash backward's four f32[1, 2, 2, 256, 256]-sized blocks and its operands at the peak, no MLP weight;
      1.152 of the estimate without this candidate, 1.013 with it; one other of the 4247 kept rows moves,
      0.974 -> 0.970);
    - after it, the first stage's embedding gradient (a scatter-add into a zero table, then the
      ``cond`` output): two more V/t x h tables, 2 * pb * :func:`shared_tables`, and under ZeRO-3 where
      the tick recomputes the stage (``full``) the embedding's accumulator shard a third time
      (:func:`embedding_shard_copies`).

    Under ZeRO-3 :func:`embedding_shard_copies` replaces the accumulator's copies for its embedding share.
    """
    pb = DTYPE_BYTES[model.param_dtype]
    chunk = layout.layers_per_stage(model.num_layers)
    loop = pb * layer_params(model, layout) * (1 + (chunk if layout.virtual_stages > 1 else 0))
    d = Dims.of(model, layout)
    # one (b, n/t, side, side) score array, or the flash kernel's block (its q k^T and exponentials)
    side = d.s if attention_kind(layout) == "dot_product" else min(layout.attention_block, d.s)
    # the forward's q k^T and its masked copy on every jax (the fused softmax of jax >= 0.12.1 saves a copy in the
    # backward only: seed 31 case 22 on 0.12.1, interleaved, b=2, s=512, peaks in the forward tick at
    # f32[2, 2, 1024, 512] q k^T and f32[2, 2, 2, 512, 512] masked scores); no chain slot for blockwise
    slots = BACKWARD_SCORE_COPIES + dropout_chain_slots(model, layout)
    loop += slots * F32 * d.b * d.n * side * side + d.e * d.b * d.s * (d.h + d.k)
    if attention_kind(layout) != "dot_product":  # the layer's flash backward, over the rows the tick recomputes
        loop = max(
            loop, blockwise_attention_backward_bytes(model, layout, 1 if recomputes_by_sequence(layout) else None)
        )
    copies, held, shard = accumulator_copies(), embedding_shard_copies(layout), embedding_shard_bytes(model, layout)
    tables = 2 * pb * shared_tables(model, layout) + (embedding_shard_copies(layout, True) - held) * shard
    return copies * acc + (held - copies) * shard + max(loop, tables)


def embedding_shard_bytes(model: ConfigDict, layout: ParallelLayout) -> float:
    """ZeRO-3: the embedding's share of the sharded gradient accumulator, pb * V/t x h / N (the
    embedding is not an expert weight: N = data x context x expert); 0 below ZeRO-3."""
    if not layout.shards_parameters:
        return 0.0
    return DTYPE_BYTES[model.param_dtype] * shared_tables(model, layout) / layout.zero_shards()


def embedding_shard_copies(layout: ParallelLayout, at_scatter: bool = False) -> int:
    """Copies of :func:`embedding_shard_bytes` a ZeRO-3 1F1B / interleaved tick holds, on every jax release
    (where the layers' accumulators are held :func:`accumulator_copies` times): two through the tick, the
    tick scan's carry in the layout of the ``psum_scatter`` that writes it ({1,0,2}, the sharded dim major)
    and the layer loop's state in the row-major one; ``at_scatter``, at the first stage's embedding
    scatter-add, a third where the tick recomputes the stage (``full``): the ``switch``'s output. Buffer
    assignment of ~1B, 4 layers, data=2 x tensor=2 x pipeline=2 1F1B ZeRO-3 ``full`` SP, m=4, b=1, s=256
    (seed 127 case 3 of the random grid): at the scatter-add's relayout copy the two f32[16000, 2048]
    tables and three f32[1, 16000, 1024] shards, the layers' accumulators twice on jax 0.10.2 and once on
    0.12.1, and the {1,0,2} carry and the row-major state live through the whole tick on both (1.104 of the
    estimate's largest live set on 0.10.2 with two shards counted at the scatter-add, 1.004 with three); the
    same three in seed 36 case 25 (data=4, s=128) and seed 67 case 3 (interleaved, s=256); two with
    ``selective``, which keeps activations (seed 78 case 28), and two at the loss head's backward of data=4
    ``none`` on 0.12.1 (seed 57 case 3). The split-backward schedules' ticks are counted alike, unmeasured."""
    return 3 if at_scatter and not keeps_activations(layout) else 2


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
      of forwarding them as loop constants. With jax 0.12 the layers' weights are forwarded, but the
      output layer's table, transposed inside the branch for the head's matmul, is a new value and
      still stacked: e * V/t x h per tick (buffer assignment on jax 0.12.0.1: f32[3, 2048, 32000] for
      ~1B data=4 x pipeline=2 GPipe m=2, f32[7, 128, 256] for tiny data=2 x pipeline=4 GPipe m=4).
    """
    d = Dims.of(model, layout)
    layers = layout.stored_layers(model.num_layers)
    # ZeRO-3: the tick saves the layers' shards (each layer is gathered inside the layer scan, again in the
    # backward), 1/N of them (tiny data=2 x tensor=2 x pipeline=2 GPipe ZeRO-3: f32[5,2,64,192] stacks of
    # h/2 rows); the embedding / head table is saved whole
    shard = layout.data * layout.context if layout.shards_parameters else 1
    # jax 0.12 forwards the layers' weights; the output layer's table, which the tick's branch transposes for
    # the head's matmul, is a new value and stacked like any residual
    layer_weights = layers * layer_params(model, layout) / shard if cond_stacks_weights() else 0.0
    weights = d.e * (layer_weights + shared_tables(model, layout))
    head = head_residual_bytes(model, layout)
    # ``dot_product`` without recompute: each layer's broadcast causal mask, pred (b, n/t, s, s), is computed
    # inside the tick's ``cond`` and leaves it as a residual, so the tick scan stacks it per layer (jax 0.10.2
    # and 0.12.0.1 alike; buffer assignment of tiny data=2 x pipeline=4 GPipe ZeRO-3 m=4, b=2, s=1024:
    # pred[7, 2, 2, 2, 1024, 1024], 56 MiB). Without a pipeline it is hoisted out of the loop instead
    # (:func:`layer_working_bytes`).
    mask = 0.0
    if attention_kind(layout) == "dot_product" and layout.recompute == "none":
        d = Dims.of(model, layout)
        mask = layers * d.b * d.n * d.s * d.s
    layer = layer_residual_bytes(model, layout) + dropout_residual_bytes(model, layout)
    return layers * layer + mask + head + weights


@functools.cache
def accumulator_copies() -> int:
    """Copies of the gradient accumulator a 1F1B / interleaved backward tick holds on the installed jax
    (:func:`pipeline_accumulator_bytes`): two before jax 0.12.1 (the ``switch``'s operand and the layer loop's
    state), one from 0.12.1 on, whose XLA:CPU updates the operand in place. Buffer assignment of ~1B, 4 layers,
    data=2 x tensor=2 x pipeline=2 1F1B SP ``full``, s=256 (seed 49 case 5 of the random grid) on jax 0.12.1: the
    accumulator's f32[2, 2048, 4096] layer gradients and f32[1, 16000, 2048] table once at the step's peak, beside
    the loss head's two f32[2048, 16000] weight copies; every 1F1B row of the grid's seeds compiled on 0.12.1
    whose estimate this phase sets moves toward the compiled bytes with one copy (four rows, none away).
    Read from the installed distribution (:func:`jaxpar.versions.jax_release`), as :func:`cond_stacks_weights`."""
    return 1 if jax_release() >= (0, 12, 1) else 2


@functools.cache
def cond_stacks_weights() -> bool:
    """Whether the installed jax's partial evaluation of ``lax.cond`` returns the branch's weights among its
    residuals, so that GPipe's tick scan stacks them (:func:`gpipe_tick_bytes`): jax 0.10 does, jax 0.12 forwards
    them as the loop's constants. Buffer assignment of tiny data=2 x pipeline=4 GPipe m=4, s=128 (b=2,
    ``none``): f32[7, 1, 128, 384]-shaped weight stacks (7 = m + p - 1 ticks) in the backward's loop state on
    jax 0.10.2, 51.87 MiB of temporaries; none on jax 0.12.0.1, 45.87 MiB, where only the output layer's
    table is stacked (f32[7, 128, 256], :func:`gpipe_tick_bytes`). jax 0.11 is taken with 0.12 (not
    compiled). Read from the installed distribution's metadata (:func:`jaxpar.versions.jax_release`), so the
    planner does not import JAX."""
    release = jax_release()
    return bool(release) and release < (0, 11)


def head_residual_bytes(model: ConfigDict, layout: ParallelLayout) -> float:
    """What the loss head keeps for its backward, per microbatch: the fp32 logits 4*b*s*V/t, the
    final norm's input and output and its fp32 normalised input (2e + 4)*b*so*h, so = s/t under sequence
    parallelism, which runs the norm outside the tensor-parallel region (buffer assignment of tiny tensor=2 x
    pipeline=4 GPipe SP ``full``, b=4, s=128: three f32[7, 4, 64, 128] stacks of the norm's arrays; 0.857 of
    the estimate with (b, s, h))."""
    d = Dims.of(model, layout)
    return F32 * d.b * d.s * d.v + (2 * d.e + F32) * d.b * d.so * d.h


_SLOT_PROGRAMS: dict[tuple, tuple[int, int, int, int]] = {}


def program_slots(schedule: str, p: int, m: int, v: int, keep: bool) -> tuple[int, int, int, int]:
    """(act_slots, grad_slots, stash_slots, front_slots) of a schedule's executor program, cached: the planner
    asks for the same few many times."""
    key = (schedule, p, m, v, keep)
    if key not in _SLOT_PROGRAMS:
        _SLOT_PROGRAMS[key] = steady_slot_counts(schedule, p, m, v, keep)
    return _SLOT_PROGRAMS[key]
