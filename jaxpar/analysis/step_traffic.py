"""What jaxpar's own train step communicates: the ZeRO collectives of each held parameter over its
group (:func:`zero_collectives`), the tensor-axis collectives of a layer (:func:`tensor_collectives`)
and the tensor-, pipeline- and data-axis bytes of one pipeline stage (:func:`jaxpar_stage_traffic`),
the ``jaxpar`` convention of :func:`jaxpar.analysis.traffic.communication`."""

from __future__ import annotations

import dataclasses
import functools
import math

from jaxpar.analysis.moe_traffic import moe_layer_phases, moe_phase_bytes, moe_tensor_arrays
from jaxpar.analysis.rings import all_gather_bytes, all_reduce_bytes, ring_bytes
from jaxpar.axes import MeshAxis, axis_rules, data_group, group_axes
from jaxpar.config import ConfigDict
from jaxpar.models.inventory import (
    DTYPE_BYTES,
    ParallelLayout,
    ParamTensor,
    param_tensors,
    shard_elements,
    stacked_layers,
    stage_tensors,
)
from jaxpar.parallel.pipeline.schedule import device_of, keeps_activations, splits_backward, virtual_stage


@dataclasses.dataclass(frozen=True)
class HeldParam:
    """One parameter tensor as the step's gradient reductions and ZeRO gathers see it
    (:func:`zero_collectives`), from the real placements (:mod:`jaxpar.analysis.expected`) or the
    inventory (:func:`held_params`)."""

    elements: float  # per device under its compute spec (the tensor / expert split), all its layers
    group: tuple[str, ...]  # the axes it is reduced and ZeRO-sharded over (jaxpar.axes.data_group)
    divisible: bool  # a dim its group divides: ZeRO shards it; else it is all-reduced at every stage
    place: str  # layer (the scanned stack) | first | last (jaxpar.models.inventory.ParamTensor.place)


def _tensor_group(layout: ParallelLayout, x: ParamTensor) -> tuple[str, ...]:
    """The axes ``x`` is reduced and ZeRO-sharded over: :func:`jaxpar.axes.data_group` less the axes
    the rules split it over (an expert weight's leaves out ``expert``)."""
    return _group_of(tuple(layout.mesh.items()), frozenset(d for d, _ in x.dims))


@functools.lru_cache(maxsize=4096)
def _group_of(mesh: tuple[tuple[str, int], ...], dims: frozenset[str]) -> tuple[str, ...]:
    """:func:`_tensor_group` of a tensor with logical ``dims`` on a mesh of ``mesh``'s sizes, cached:
    the planner asks it for every tensor of every stage of every layout it searches."""
    sizes = dict(mesh)
    rules = axis_rules(sizes)
    return group_axes(data_group(sizes, {rules[d] for d in dims if d in rules}))


def held_params(model: ConfigDict, layout: ParallelLayout, pipeline_stage: str = "first") -> list[HeldParam]:
    """The parameters one device of ``pipeline_stage`` holds (:func:`jaxpar.models.inventory.stage_tensors`,
    jaxpar's pipeline form), each with its group (:func:`jaxpar.axes.data_group`, less the axes the
    rules split it over) and whether ZeRO's rule (:func:`jaxpar.sharding.zero_dim`) finds it a dim."""
    out = []
    for x, copies in stage_tensors(model, layout, pipeline_stage, shared_on_every_stage=True):
        group = _tensor_group(layout, x)
        n = math.prod(layout.size(a) for a in group)
        elements = copies * shard_elements(x, layout.tensor, 1, False, layout.expert)
        out.append(HeldParam(elements, group, n > 1 and any(size % n == 0 for size in x.zero_candidates), x.place))
    return out


def zero_collectives(
    model: ConfigDict,
    layout: ParallelLayout,
    params: list[HeldParam],
    grad_reduce_bytes: int,
    zero3_bytes: int | None = None,
) -> list[tuple[str, tuple[str, ...], float, int, str]]:
    """(kind, axes, bytes of one array, count per step, what) of the jaxpar step's gradient
    reductions and ZeRO gathers (jaxpar/train/step.py, :mod:`jaxpar.parallel.zero`,
    :mod:`jaxpar.ops.zero3`), one derivation for the planner (:func:`communication`) and for the
    collectives ``inspect`` estimates (:func:`jaxpar.analysis.expected.estimated_collectives`).

    Per parameter of E elements over its group, with g = ``grad_reduce_bytes``, pb the param dtype
    and a the compute dtype bytes (or ``zero3_bytes``), m microbatches (Rajbhandari et al. 2020): stage
    0 all-reduces E*g once per step. Stage 1 reduce-scatters E*g once and all-gathers the updated
    parameter (E*pb); stage 2 reduce-scatters every microbatch. Stage 3, in a (the gather casts
    first, its transpose reduce-scatters in a too): each layer parameter gathered twice per
    microbatch (forward, and again in the backward: remat never keeps it), the final norm and
    output layer once per microbatch, the embedding and positions once per step (read by the
    forward alone, their gather is loop-invariant and XLA hoists it out of the microbatch loop),
    and every gradient reduce-scattered per microbatch. A parameter no dim of which its group
    divides is all-reduced instead (per step at stages 0-1, per microbatch at 2-3).

    ``zero3_bytes``: what one element of a ZeRO-3 gather moves, where it is not the compute
    dtype's: ``inspect`` compares with the program XLA:CPU compiles, whose gathers move fp32 bytes
    with bf16 compute (it passes ``grad_reduce_bytes``)."""
    m, g = layout.microbatches, grad_reduce_bytes
    pb, a = DTYPE_BYTES[model.param_dtype], zero3_bytes or DTYPE_BYTES[model.compute_dtype]
    per_reduce = m if layout.shards_gradients else 1
    out = []
    for x in params:
        e, group = x.elements, x.group
        if not (layout.shards_optimizer and x.divisible):
            out.append(("all-reduce", group, e * g, per_reduce, "gradient all-reduce"))
        elif layout.shards_parameters:
            gathers = 2 * m if x.place == "layer" else 1 if x.place == "first" else m
            out.append(("all-gather", group, e * a, gathers, "ZeRO-3 parameter gathers (fwd, bwd for blocks)"))
            out.append(("reduce-scatter", group, e * a, m, "ZeRO-3 gradient reduce-scatter per microbatch"))
        else:
            out.append(("reduce-scatter", group, e * g, per_reduce, "gradient reduce-scatter"))
            out.append(("all-gather", group, e * pb, 1, "updated parameter all-gather"))
    return out


def tensor_collectives(model: ConfigDict, layout: ParallelLayout) -> list[tuple[str, float, int, str]]:
    """(kind, bytes of one array, count per step, what) over ``tensor`` of the jaxpar model
    (jaxpar/models/llama.py) without a pipeline, with A = one microbatch's b*s*h activations:

    per layer 2 all-reduces of A forward (attention and MLP outputs) and 2 backward (their input
    gradients); recompute repeats the attention output's (the MLP one is dead there): 5, not
    Megatron's 6. With SP each is a gather/scatter pair of the same bytes, and recompute repeats both
    gathers and the attention scatter. Also per microbatch the vocabulary-parallel embedding
    (forward) and the output layer input's gradient (backward), each A; the cross-entropy's 3 fp32
    all-reduces of b*s; with SP the norm scales' gradients (2L + 1 fp32 vectors of h); an MoE
    layer's :func:`moe_tensor_arrays` as often as :func:`moe_layer_phases` says.
    """
    m, layers = layout.microbatches, model.num_layers
    bs = layout.microbatch_size * layout.seq_local
    x = bs * model.embed_dim * DTYPE_BYTES[model.compute_dtype]
    remat = int(layout.recompute != "none")
    if layout.sequence_parallel:
        out = [
            ("all-gather", x, m * layers * (4 + 2 * remat), "SP block input gathers (fwd, bwd, remat)"),
            ("reduce-scatter", x, m * layers * (4 + remat), "SP block output reduce-scatters (fwd, bwd, remat)"),
            ("reduce-scatter", x, m, "embedding output (fwd)"),
            ("all-gather", x, m, "embedding output gradient (bwd)"),
            ("all-gather", x, m, "final norm output (fwd)"),
            ("reduce-scatter", x, m, "output layer input gradient (bwd)"),
            ("all-reduce", model.embed_dim * 4, m * (2 * layers + 1), "norm scale gradients (SP)"),
        ]
    else:
        out = [
            ("all-reduce", x, m * layers * 2, "row-parallel outputs (fwd)"),
            ("all-reduce", x, m * layers * 2, "column-parallel input gradients (bwd)"),
            ("all-reduce", x, m * layers * remat, "attention output recomputed (remat)"),
            ("all-reduce", x, m, "vocab-parallel embedding (fwd)"),
            ("all-reduce", x, m, "output layer input gradient (bwd)"),
        ]
    out.append(("all-reduce", bs * 4, 3 * m, "cross-entropy max / sum-exp / target (fp32)"))
    if model.get("num_experts", 0):
        arrays, moe_layers = moe_tensor_arrays(model, layout), stacked_layers(model)  # deepseek_v3: not its dense first
        for phase, times in moe_layer_phases(layout).items():
            out += [(kind, size, m * moe_layers * times, what) for kind, size, what in arrays[phase]]
    return out


def _jaxpar_tensor(model: ConfigDict, layout: ParallelLayout) -> tuple[float, int]:
    """Tensor-axis (bytes, collectives) of the jaxpar step without a pipeline: the ring bytes and
    the count of :func:`tensor_collectives`."""
    records = tensor_collectives(model, layout)
    moved = sum(count * ring_bytes(kind, layout.tensor, size) for kind, size, count, _ in records)
    return moved, sum(count for _, _, count, _ in records)


def jaxpar_stage_traffic(
    model: ConfigDict, layout: ParallelLayout, pipeline_stage: int, grad_reduce_bytes: int = 4
) -> dict[str, tuple[float, int]]:
    """Tensor- and pipeline-axis (bytes, collectives) per step of one pipeline stage of the jaxpar
    executor (jaxpar/parallel/pipeline/executor.py); without a pipeline, :func:`_jaxpar_tensor`.

    Pipeline: stage d sends an activation per microbatch for each of its v chunks but the last
    virtual stage's, and a gradient for each but the first's: (m(v - [d = p-1]) + m(v - [d = 0]))
    sends of b*s*h (/t with SP); middle stages 2mv, the ends m(2v-1) (Narayanan et al. 2021 count
    2mv per boundary).

    Tensor, per microbatch and chunk of c = L/(p*v) layers, A = one all-reduce of b*s*h (SP: a
    gather/scatter pair of the same bytes). 1F1B / interleaved: the forward tick runs the chunk (2cA,
    plus the embedding's A on the first virtual stage; idle on the last). The backward tick
    recomputes the stage forward: with full remat a scan keeping each layer's input (2cA), then per
    layer a recomputed layer under vjp (1A: the MLP's all-reduce is dead there) and its backward
    (2A): 5cA; SP 5.5cA plus 2 fp32 norm-scale gradients of h per layer and sequence; otherwise the
    stage's vjp, (4 + [recompute])cA. The first virtual stage's backward recomputes the embedding
    (A; SP 1.5A); the last's adds the output layer's input gradient (A) and the cross-entropy's 3
    fp32 all-reduces of b*s. GPipe: per layer (4 + [recompute])A as :func:`_jaxpar_tensor`, the
    embedding on stage 0, output-layer gradient and cross-entropy on stage p-1.

    With c = 1 and no full remat, XLA unrolls the one-step scan and merges the recomputed forward
    with the vjp's own (``prevent_cse=False``): no recompute all-reduce is left (with SP, A is).
    An MoE layer adds its :func:`moe_tensor_arrays` per tick as :func:`moe_layer_phases` counts them.
    Checked per stage against the compiled step by tests/test_plan_aot.py.
    """
    t, p, v, m, sp = (
        layout.tensor,
        layout.pipeline,
        layout.virtual_stages,
        layout.microbatches,
        layout.sequence_parallel,
    )
    if p == 1:
        return {MeshAxis.TENSOR: _jaxpar_tensor(model, layout), MeshAxis.PIPELINE: (0.0, 0)}
    data = None  # ZeRO 0/1: the same on every stage (see communication)
    if layout.shards_parameters:
        data = _jaxpar_pipeline_zero3(model, layout, pipeline_stage)
    elif layout.shards_gradients:
        data = _jaxpar_pipeline_zero2(model, layout, pipeline_stage, grad_reduce_bytes)
    v = v if layout.pipeline_schedule in ("interleaved", "zb-v") else 1
    bs = layout.microbatch_size * layout.seq_local
    bsh = bs * model.embed_dim * DTYPE_BYTES[model.compute_dtype]
    ks = [virtual_stage(layout.pipeline_schedule, p, chunk, pipeline_stage) for chunk in range(v)]
    # a send per microbatch for each chunk but the last virtual stage's (forward) and the first's
    # (backward), none where the next virtual stage is on this device (zb-v's tip)
    send = m * sum(
        (k < p * v - 1 and device_of(layout.pipeline_schedule, p, k + 1) != pipeline_stage)
        + (k > 0 and device_of(layout.pipeline_schedule, p, k - 1) != pipeline_stage)
        for k in ks
    )
    # + once per step, the fp32 gradients of what every stage holds (final norm, positions, a tied
    # table), summed over pipeline, and the loss
    held = [
        x
        for x in param_tensors(model)
        if x.name.startswith("final_norm") or x.name == "positions" or (model.tie_embeddings and x.name == "embedding")
    ]
    summed = 4 + 4 * sum(
        shard_elements(x, t, layout.zero_shards(expert_weight=True), layout.shards_gradients, layout.expert)
        for x in held
    )
    pipeline = (send * bsh / (t if sp else 1) + all_reduce_bytes(summed, p), send + 1)
    if t == 1:
        return {MeshAxis.TENSOR: (0.0, 0), MeshAxis.PIPELINE: pipeline, **({MeshAxis.DATA: data} if data else {})}
    a, c = all_reduce_bytes(bsh, t), layout.stored_layers(model.num_layers) // v
    remat = layout.recompute != "none"
    full = layout.recompute == "full" and layout.pipeline_schedule != "gpipe"
    per_seq = layout.microbatch_size if full else 1  # the full-remat backward runs sequence by sequence
    recompute = kept_recompute = (1.5 if sp else 1.0) * remat
    if c == 1 and not full and layout.pipeline_schedule != "gpipe":  # XLA merges the recomputed forward (see above)
        recompute = 1.0 if sp and remat else 0.0
    keep, split = keeps_activations(layout), splits_backward(layout.pipeline_schedule)
    moved, calls = 0.0, 0
    for chunk in range(v):
        first, last = ks[chunk] == 0, ks[chunk] == p * v - 1
        kept = keep and (split or not last)  # this virtual stage's backward reads its stash
        if layout.pipeline_schedule == "gpipe":
            units = (4 + recompute) * c
        elif kept:  # the forward once, the backward from the stash (selective: its recomputed part)
            units = 2 * c + (2 + kept_recompute) * c
        else:
            forward = 0 if last else 2 * c
            backward = (5.5 if sp else 5) * c if full else (4 + recompute) * c
            units = forward + backward
        # the embedding: forward, and again in a recomputing backward (SP: a scatter, then a pair)
        embed = 1 if layout.pipeline_schedule == "gpipe" or kept else 1.5 if sp else 2
        units += embed * first + (1 if last else 0)
        moved += units * a + (3 * all_reduce_bytes(bs * 4, t) if last else 0.0)
        calls += round(units) + (3 if last else 0)
        if model.get("num_experts", 0):  # the MoE layers' own (moe_tensor_arrays), per tick
            arrays = moe_tensor_arrays(model, layout)
            if layout.pipeline_schedule == "gpipe":
                ticks = [moe_layer_phases(layout)]
            elif kept:
                ticks = [moe_layer_phases(layout, "kept"), moe_layer_phases(layout, "forward")]
            else:
                ticks = [moe_layer_phases(layout, "backward")] + (
                    [moe_layer_phases(layout, "forward")] if not last else []
                )
            for phases in ticks:
                moved += c * moe_phase_bytes(arrays, phases, t)
                calls += c * sum(times * len(arrays[ph]) for ph, times in phases.items())
        if sp:  # norm-scale gradients: 2 per layer (+ the final norm on the last stage), per sequence
            moved += per_seq * (2 * c + last) * all_reduce_bytes(model.embed_dim * 4, t)
            calls += per_seq * (2 * c + last)
    return {
        MeshAxis.TENSOR: (m * moved, m * calls),
        MeshAxis.PIPELINE: pipeline,
        **({MeshAxis.DATA: data} if data else {}),
    }


def _zero_gathered(model: ConfigDict, layout: ParallelLayout, tensors: list[ParamTensor], nbytes: int) -> float:
    """Ring bytes of one all-gather (or reduce-scatter) over ``data`` of the ZeRO-shardable tensors
    (each over its group: :func:`_tensor_group`)."""
    t, e = layout.tensor, layout.expert

    def group(x: ParamTensor) -> int:
        return math.prod(layout.size(a) for a in _tensor_group(layout, x))

    return sum(
        all_gather_bytes(shard_elements(x, t, 1, False, e) * nbytes, group(x))
        for x in tensors
        if any(size % group(x) == 0 for size in x.zero_candidates)
    )


def _stage_groups(model: ConfigDict) -> tuple[list[ParamTensor], list[ParamTensor], list[ParamTensor]]:
    """(layer, first-stage, last-stage) tensors as the jaxpar pipeline uses them: the first stage
    embeds (embedding, positions), the last projects (output table or the tied embedding, final norm)."""
    tensors = param_tensors(model)
    table = [x for x in tensors if x.name == ("embedding" if model.tie_embeddings else "output")]
    return (
        [x for x in tensors if x.place == "layer"],
        [x for x in tensors if x.place == "first"],
        table + [x for x in tensors if x.name.startswith("final_norm")],
    )


def _jaxpar_pipeline_zero2(
    model: ConfigDict, layout: ParallelLayout, pipeline_stage: int, grad_reduce_bytes: int = 4
) -> tuple[float, int]:
    """Data-axis (bytes, collectives) of one pipeline stage with ZeRO-2 (1F1B / interleaved): every
    backward tick reduce-scatters its chunk's layer gradients, and the first / last virtual stage's
    also the gradients of every non-layer parameter the stage holds (embedding or output table,
    final norm, positions: :func:`stage_tensors`), into the sharded accumulator, m per step each;
    after the update one all-gather of every parameter the stage holds (param dtype). Parameters
    no ZeRO dim divides are all-reduced instead (not counted)."""
    p, m = layout.pipeline, layout.microbatches
    held = stage_tensors(model, layout, "first", shared_on_every_stage=True)
    g, pb = grad_reduce_bytes, DTYPE_BYTES[model.param_dtype]
    layers = sum(count * _zero_gathered(model, layout, [x], g) for x, count in held if x.place == "layer")
    shared = sum(_zero_gathered(model, layout, [x], g) for x, _ in held if x.place != "layer")
    scattered = layers + (pipeline_stage in (0, p - 1)) * shared
    gathered = sum(count * _zero_gathered(model, layout, [x], pb) for x, count in held)
    return m * scattered + gathered, m + 1


def _jaxpar_pipeline_zero3(model: ConfigDict, layout: ParallelLayout, pipeline_stage: int) -> tuple[float, int]:
    """Data-axis (bytes, collectives) of one pipeline stage with ZeRO-3 (jaxpar/parallel/pipeline/executor.py).

    With G(x) the all-gather of x elements in the compute dtype ((n-1)/n * x * a; the gradient's
    reduce-scatter moves as much), per microbatch and chunk of c layers: 1F1B / interleaved: the
    forward tick gathers each layer once (cG; idle on the last virtual stage), the backward tick
    for the recomputed forward, again for the layer's vjp, and reduce-scatters its gradient (3cG;
    with full remat the whole microbatch at once, not per sequence). GPipe: 3cG. The first stage
    gathers the embedding (and positions) in each tick that embeds (G forward, 2G backward), the
    last the output table and final norm (2G). Parameters no ZeRO dim divides are all-reduced once
    per step instead (not counted).
    """
    p, m = layout.pipeline, layout.microbatches
    v = layout.virtual_stages if layout.pipeline_schedule in ("interleaved", "zb-v") else 1
    a = DTYPE_BYTES[model.compute_dtype]
    c = layout.stored_layers(model.num_layers) // v
    layer, first, last = (_zero_gathered(model, layout, group, a) for group in _stage_groups(model))
    # one layer per chunk without full remat: the backward's regather merges with the vjp forward's
    explicit = layout.pipeline_schedule != "gpipe"
    backward = 2 if c == 1 and explicit and layout.recompute != "full" else 3
    keep, split = keeps_activations(layout), splits_backward(layout.pipeline_schedule)
    moved, calls = 0.0, 0
    for chunk in range(v):
        k = virtual_stage(layout.pipeline_schedule, p, chunk, pipeline_stage)
        is_first, is_last = k == 0, k == p * v - 1
        kept = keep and (split or not is_last)
        # from the stash: the backward gathers each layer once (the split's W once more), then scatters
        back = (3 if split else 2) if kept else backward
        forward = 0 if layout.pipeline_schedule == "gpipe" or (is_last and not split) else c * layer + is_first * first
        moved += forward + back * c * layer + (1 if kept else 2) * is_first * first + 2 * is_last * last
        calls += back * c
    return m * moved, m * calls
