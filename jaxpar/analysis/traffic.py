"""Communication per mesh axis of one layout: the published formulas and jaxpar's own step.

:func:`communication` gives the bytes one device sends per step on each axis as ring "bytes on the
wire" (nccl-tests PERFORMANCE.md: all-reduce 2(n-1)/n * S, all-gather / reduce-scatter (n-1)/n * S,
collective-permute S) and, with a cluster, the time over its links, under the ``paper`` convention
or the ``jaxpar`` one (what jaxpar's train step compiles to, per pipeline stage). With context
parallelism (c > 1) the ``data`` entry is the gradient reduction over data*c devices, activation
terms hold s/c tokens, and the ``context`` entry is the attention exchange (:func:`context_traffic`).
With experts (mesh.expert > 1) the ``data`` entry sums two reductions (the experts' weights over
data*c, the rest over data*expert*c) and the ``expert`` entry is the MoE dispatch and combine
(:func:`expert_traffic`, the same in both conventions: it is how jaxpar's MoE layer is built).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxpar.analysis.clusters import Cluster
from jaxpar.axes import MeshAxis, axis_rules, data_group, group_axes
from jaxpar.config import ConfigDict, ConfigError
from jaxpar.models.inventory import (
    DTYPE_BYTES,
    ParallelLayout,
    ParamTensor,
    held_elements,
    param_tensors,
    shard_elements,
    stage_tensors,
)
from jaxpar.parallel.pipeline.schedule import device_of, keeps_activations, splits_backward, virtual_stage

CONVENTIONS = ("jaxpar", "paper")


# --------------------------------------------------------------------------- communication


def all_reduce_bytes(size_bytes: float, n: int) -> float:
    """Ring all-reduce traffic per device: 2(n-1)/n * S (nccl-tests PERFORMANCE.md)."""
    return 2 * (n - 1) / n * size_bytes


def all_gather_bytes(size_bytes: float, n: int) -> float:
    """Ring all-gather or reduce-scatter traffic per device: (n-1)/n * S (S = the full array)."""
    return (n - 1) / n * size_bytes


def ring_bytes(kind: str, n: int, size_bytes: float) -> float:
    """Ring bytes one device sends for a collective over ``n`` devices on an array of ``size_bytes``."""
    if kind == "collective-permute":
        return size_bytes
    return all_reduce_bytes(size_bytes, n) if kind == "all-reduce" else all_gather_bytes(size_bytes, n)


@dataclasses.dataclass(frozen=True)
class AxisComm:
    """Traffic one device sends over one mesh axis per optimizer step; link is intra | inter | none."""

    axis: str
    size: int
    bytes: float
    collectives: int
    link: str
    time_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def axis_link(layout: ParallelLayout, axis: str, cluster: Cluster) -> str:
    """The link a ring over ``axis`` uses. With devices ordered tensor, context, expert, data,
    pipeline (innermost first, :data:`jaxpar.axes.DEVICE_ORDER`), a ring stays in a node when the
    span of device ids it touches (t, t*c, t*c*e, t*c*e*N, all) fits in one; else it crosses the
    NIC. ``data`` is the gradient reduction over (data, expert, context): its span includes the
    expert and context ranks."""
    t, c, e = layout.tensor, layout.context, layout.expert
    span = {
        MeshAxis.TENSOR: t,
        MeshAxis.CONTEXT: t * c,
        MeshAxis.EXPERT: t * c * e,
        MeshAxis.DATA: t * c * e * layout.data,
        MeshAxis.PIPELINE: layout.devices,
    }[axis]
    return "intra" if span <= cluster.devices_per_node else "inter"


def reduce_group(layout: ParallelLayout) -> int:
    """Devices the gradients are reduced (and ZeRO shards) over: data x context (:func:`jaxpar.axes.data_group`);
    with ``expert`` > 1 the experts' weights' group (the other parameters' is ``expert`` times it)."""
    return layout.data * layout.context


# --------------------------------------------------------------------------- mixture of experts


def moe_dispatch_arrays(model: ConfigDict, layout: ParallelLayout) -> dict[str, list[tuple[str, float, str]]]:
    """One MoE layer's collectives over ``expert`` for one microbatch, as (kind, S, what) with S the
    full array in bytes (the all-gather output, the reduce-scatter input), by phase. As built in
    :func:`jaxpar.models.moe.expert_mlp` (Megatron-core's ``allgather`` dispatcher): n = mesh.expert,
    T = b*s/c tokens of a rank (gathered over ``tensor`` first under SP), k = experts per token,
    a = compute-dtype bytes; the router's weights are fp32 and its choices int32.

    - ``gather`` (dispatch): all-gather of the tokens n*T*h*a, of the routing weights and of the
      choices, n*T*k*4 each; repeated by a recomputed forward (``selective`` too: the gathers are
      not saved);
    - ``combine``: reduce-scatter of the summed expert outputs, n*T*h*a (dead in a recomputation,
      whose layer output nothing reads);
    - ``backward``: the transposes, all-gather of the output's gradient and reduce-scatter of the
      tokens' (n*T*h*a each) and of the routing weights' (n*T*k*4); the choices have none.

    Capacity dropping (``model.moe_capacity_factor``) moves the same arrays: a dropped choice keeps
    its row with weight 0 (:func:`jaxpar.models.moe.moe_mlp`); ``moe_dispatch=dense`` too. Priced as
    ring traffic, (n-1)/n * S each (nccl-tests PERFORMANCE.md).
    """
    n, a = layout.expert, DTYPE_BYTES[model.compute_dtype]
    tokens = layout.microbatch_size * layout.seq_local
    x, routing = n * tokens * model.embed_dim * a, n * tokens * model.experts_per_token * 4
    return {
        "gather": [
            ("all-gather", x, "MoE dispatch: tokens all-gathered over expert"),
            ("all-gather", routing, "MoE dispatch: router weights (fp32)"),
            ("all-gather", routing, "MoE dispatch: router choices (int32)"),
        ],
        "combine": [("reduce-scatter", x, "MoE combine: expert outputs reduce-scattered")],
        "backward": [
            ("all-gather", x, "MoE combine's transpose: output gradient (bwd)"),
            ("reduce-scatter", x, "MoE dispatch's transpose: token gradient (bwd)"),
            ("reduce-scatter", routing, "MoE dispatch's transpose: router weight gradient (bwd)"),
        ],
    }


def moe_tensor_arrays(model: ConfigDict, layout: ParallelLayout) -> dict[str, list[tuple[str, float, str]]]:
    """One MoE layer's collectives over ``tensor`` for one microbatch beyond the dense MLP's (whose
    output reduction the routed and shared experts share), as :func:`moe_dispatch_arrays` lists them.
    The router runs on the rank's own (b, s/t, h) rows under SP, on the replicated sequence without:

    - without SP, ``backward``: the routing weights are tensor-invariant and scale each expert row of
      a tensor-partial output, so their gradient is all-reduced: the grouped dispatch's (n*T*k, 1)
      row weights, the dense dispatch's (n*T, E/n) mask, in the compute dtype;
    - with SP, ``gather``: the routing weights (fp32) and choices (int32), (b, s, k), all-gathered
      over the sequence (the routing gather of :mod:`jaxpar.models.llama`); ``backward``: the weights'
      gradient reduce-scattered, and the router's (h, E) fp32 gradient all-reduced (the router sees
      s/t tokens per rank, like the norm scales).
    """
    t = layout.tensor
    if t == 1 or not model.get("num_experts", 0):
        return {"gather": [], "combine": [], "backward": []}
    tokens = layout.microbatch_size * layout.seq_local
    routing = tokens * model.experts_per_token * 4
    if layout.sequence_parallel:
        return {
            "gather": [
                ("all-gather", routing, "MoE router weights gathered over the sequence (SP)"),
                ("all-gather", routing, "MoE router choices gathered over the sequence (SP)"),
            ],
            "combine": [],
            "backward": [
                ("reduce-scatter", routing, "MoE router weight gradient (SP, bwd)"),
                ("all-reduce", model.embed_dim * model.num_experts * 4, "MoE router gradient (SP, bwd)"),
            ],
        }
    rows = layout.expert * tokens * model.experts_per_token
    if model.get("moe_dispatch", "grouped") == "dense":
        rows = tokens * model.num_experts
    what = "MoE routing weight gradient (bwd)"
    return {"gather": [], "combine": [], "backward": [("all-reduce", rows * DTYPE_BYTES[model.compute_dtype], what)]}


def _moe_phase_bytes(arrays: dict[str, list[tuple[str, float, str]]], phases: dict[str, int], n: int) -> float:
    """Ring bytes over ``n`` devices of the ``phases`` (times each) of one layer's ``arrays``."""
    return sum(times * ring_bytes(kind, n, size) for phase, times in phases.items() for kind, size, _ in arrays[phase])


def moe_layer_phases(layout: ParallelLayout, tick: str = "") -> dict[str, int]:
    """How often one MoE layer runs each phase of :func:`moe_dispatch_arrays` per microbatch.

    Without a pipeline (``tick`` empty): gather 1 + [recompute], combine 1, backward 1. In a 1F1B /
    interleaved ``forward`` tick gather and combine once; in a ``backward`` tick (which recomputes
    its chunk under ``jax.vjp``, :mod:`jaxpar.parallel.pipeline`) gather and combine once more,
    backward once, and the gathers again with recompute (with ``full``: the scan keeping each
    layer's input, then the layer's recomputation). A ``kept`` backward tick (from the stash,
    :mod:`jaxpar.parallel.pipeline.stash`) runs the backward once and, with recompute, the gathers
    the rematerialised layer repeats. GPipe: as without a pipeline.
    """
    remat = int(layout.recompute != "none")
    if tick == "forward":
        return {"gather": 1, "combine": 1, "backward": 0}
    if tick == "kept":
        return {"gather": remat, "combine": 0, "backward": 1}
    if tick == "backward":
        return {"gather": 1 + remat, "combine": 1, "backward": 1}
    return {"gather": 1 + remat, "combine": 1, "backward": 1}


def expert_traffic(model: ConfigDict, layout: ParallelLayout, pipeline_stage: int = 0) -> tuple[float, int]:
    """Expert-axis (bytes, collectives) per step and device: :func:`moe_dispatch_arrays` of every
    MoE layer of pipeline stage ``pipeline_stage`` per microbatch, as often as :func:`moe_layer_phases` says
    (1F1B / interleaved: the last virtual stage has no forward tick; its backward tick runs it)."""
    n = layout.expert
    if n == 1 or not model.get("num_experts", 0):
        return 0.0, 0
    arrays = moe_dispatch_arrays(model, layout)

    def moved(phases: dict[str, int]) -> tuple[float, int]:
        return _moe_phase_bytes(arrays, phases, n), sum(times * len(arrays[ph]) for ph, times in phases.items())

    p, m = layout.pipeline, layout.microbatches
    if p == 1 or layout.pipeline_schedule == "gpipe":
        per_layer = moved(moe_layer_phases(layout))
        layers = layout.stored_layers(model.num_layers)
        return m * layers * per_layer[0], m * layers * per_layer[1]
    v = layout.virtual_stages
    c = layout.stored_layers(model.num_layers) // v
    fwd, bwd = moved(moe_layer_phases(layout, "forward")), moved(moe_layer_phases(layout, "backward"))
    kept = moved(moe_layer_phases(layout, "kept"))
    # the last virtual stage (on the last device; zb-v: on device 0) runs its forward in its
    # backward tick unless the backward is split; the other chunks' backward reads the stash
    split = splits_backward(layout.pipeline_schedule)
    holds_last = device_of(layout.pipeline_schedule, p, p * v - 1) == pipeline_stage
    if not keeps_activations(layout):
        chunks_forward = v - holds_last
        return m * c * (chunks_forward * fwd[0] + v * bwd[0]), m * c * (chunks_forward * fwd[1] + v * bwd[1])
    fresh = holds_last and not split
    moved_bytes = (v - fresh) * (fwd[0] + kept[0]) + fresh * bwd[0]
    count = (v - fresh) * (fwd[1] + kept[1]) + fresh * bwd[1]
    return m * c * moved_bytes, m * c * count


def context_traffic(model: ConfigDict, layout: ParallelLayout) -> tuple[float, int]:
    """Context-axis (bytes, collectives) per step and device of the attention exchange
    (:mod:`jaxpar.ops.context_parallel`) over the busiest stage's L/p layers and m microbatches: the
    ring bytes of :func:`context_collectives` per layer, with kvb = one rank's keys and values,
    2*b*s/c*kv_heads/t*head_dim*a.
    """
    c = layout.context
    if c == 1:
        return 0.0, 0
    a = DTYPE_BYTES[model.compute_dtype]
    kvb = 2 * layout.microbatch_size * layout.seq_local * model.num_kv_heads // layout.tensor * model.head_dim * a
    layers, remat = layout.stored_layers(model.num_layers), int(layout.recompute != "none")
    records = context_collectives(kvb, c, layout.context_exchange, a, remat)
    per_layer = sum(count * ring_bytes(kind, c, size) for kind, count, size, _ in records)
    calls = sum(count for _, count, _, _ in records)
    return layout.microbatches * layers * per_layer, layout.microbatches * layers * calls


def context_collectives(
    kv_block_bytes: float, c: int, exchange: str, act: int, remat: int
) -> list[tuple[str, int, float, str]]:
    """(kind, count per layer and microbatch, bytes of one array, what) of the attention exchange over
    ``context`` (:mod:`jaxpar.ops.context_parallel`). ``kv_block_bytes``: one rank's keys and values,
    2*b*s/c*kv_heads/t*head_dim*``act``, sent as two arrays of half the block; ``remat`` = 1 if the
    layer's forward is recomputed, which repeats the all-gather but not the ring (a ``custom_vjp``
    whose residuals remat keeps). Ring: c-1 key/value hops forward and backward, c hops of the fp32
    gradients; all-gather: (c-1)*kvb gathered, the same reduce-scattered."""
    half = kv_block_bytes / 2
    if exchange == "all_gather":  # gathered size: c * half per array; ring bytes (c-1) * half each
        return [
            ("all-gather", 2 * (1 + remat), c * half, "context K/V all-gather (fwd, remat)"),
            ("reduce-scatter", 2, c * half, "context K/V gradient reduce-scatter (bwd)"),
        ]
    return [
        ("collective-permute", 2 * (c - 1), half, "ring K/V hops (fwd)"),
        ("collective-permute", 2 * (c - 1), half, "ring K/V hops (bwd)"),
        ("collective-permute", 2 * c, half * 4 / act, "ring fp32 dK/dV hops (bwd)"),
    ]


def communication(
    model: ConfigDict,
    layout: ParallelLayout,
    cluster: Cluster | None = None,
    grad_reduce_bytes: int = 4,
    link_efficiency: float = 0.75,
    convention: str = "paper",
) -> dict[str, AxisComm]:
    """Bytes per device per step on each mesh axis, with times if a cluster is given.

    ``paper`` (the default): data (ZeRO paper sec. 7), S = per-device parameters (after TP/PP) x
    ``grad_reduce_bytes``: DP all-reduces gradients once per step; ZeRO-1 reduce-scatters them and
    all-gathers the updated parameters once (same bytes); ZeRO-2 reduce-scatters every microbatch
    (m RS + 1 AG); ZeRO-3 gathers parameters in forward and backward and reduce-scatters gradients
    every microbatch (3m x (N-1)/N * S). tensor (Shoeybi et al. 2019; Korthikanti 2022): 4
    all-reduces of b*s*h per layer and microbatch, 6 with full recompute, SP pairs of the same
    bytes; the 2 embedding/output collectives are ignored (< 1/(2L/p) of it). pipeline (Narayanan
    2021): an activation forward and a gradient backward of b*s*h per microbatch and boundary, x v
    interleaved, /t with SP. context (Liu et al. 2023): :func:`context_traffic`; s reads s/c, N
    reads data*c. ``jaxpar``: what the train step compiles to (:func:`_jaxpar_data`,
    :func:`jaxpar_stage_traffic`; the busiest stage counts), checked by tests/test_plan_aot.py.
    Times use ``link_efficiency`` x nominal bandwidth (nccl-tests bus bandwidths reach 70-80%).
    """
    if convention not in CONVENTIONS:
        raise ConfigError(f"convention '{convention}': use one of {', '.join(CONVENTIONS)}")
    n, t, p, m, z = reduce_group(layout), layout.tensor, layout.pipeline, layout.microbatches, layout.zero_stage
    bsh = layout.microbatch_size * layout.seq_local * model.embed_dim * DTYPE_BYTES[model.compute_dtype]
    pp_calls = 2 * m * layout.virtual_stages
    pipeline = (p, pp_calls * bsh / (t if layout.sequence_parallel else 1), pp_calls)
    expert = (layout.expert, *max((expert_traffic(model, layout, d) for d in range(p)), key=lambda x: x[0]))
    if convention == "jaxpar":
        stages = [jaxpar_stage_traffic(model, layout, d, grad_reduce_bytes) for d in range(p)]
        data = _jaxpar_data(model, layout, grad_reduce_bytes)
        traffic = {
            MeshAxis.DATA: (
                n * layout.expert,
                *max((st.get(MeshAxis.DATA, data) for st in stages), key=lambda x: x[0]),
            ),
            MeshAxis.TENSOR: (t, *max((st[MeshAxis.TENSOR] for st in stages), key=lambda x: x[0])),
            MeshAxis.PIPELINE: (p, *max((st[MeshAxis.PIPELINE] for st in stages), key=lambda x: x[0])),
            MeshAxis.CONTEXT: (layout.context, *context_traffic(model, layout)),
            MeshAxis.EXPERT: expert,
        }
    else:
        data = (0.0, 0)
        for experts, group in _reduce_groups(layout):
            held = max(held_elements(model, layout, st, False, experts=experts) for st in ("first", "last"))
            grads = held * grad_reduce_bytes
            part = {  # (bytes, collectives) by ZeRO stage
                0: (all_reduce_bytes(grads, group), 1),
                1: (all_reduce_bytes(grads, group), 2),  # reduce-scatter + all-gather: the same bytes as one all-reduce
                2: ((m + 1) * all_gather_bytes(grads, group), m + 1),
                3: (3 * m * all_gather_bytes(grads, group), 3 * m),
            }[z]
            data = (data[0] + part[0], max(data[1], part[1]))
        tp_calls = (6 if layout.recompute == "full" else 4) * layout.stored_layers(model.num_layers) * m
        traffic = {
            MeshAxis.DATA: (n * layout.expert, *data),
            MeshAxis.TENSOR: (
                t,
                tp_calls * all_reduce_bytes(bsh, t),
                tp_calls * (2 if layout.sequence_parallel else 1),
            ),
            MeshAxis.PIPELINE: pipeline,
            MeshAxis.CONTEXT: (layout.context, *context_traffic(model, layout)),
            MeshAxis.EXPERT: expert,
        }
    out = {}
    for axis, (size, nbytes, calls) in traffic.items():
        if size == 1:
            out[axis] = AxisComm(axis, 1, 0.0, 0, "none")
            continue
        link = axis_link(layout, axis, cluster) if cluster else "none"
        gbps = {"intra": cluster.intra_node_gbps, "inter": cluster.inter_node_gbps}[link] if cluster else 0.0
        out[axis] = AxisComm(axis, size, nbytes, calls, link, nbytes / (gbps * 1e9 * link_efficiency) if gbps else 0.0)
    return out


def _reduce_groups(layout: ParallelLayout) -> list[tuple[bool | None, int]]:
    """(which tensors, group size) of each gradient reduction: every parameter over data x context,
    or with ``expert`` > 1 the experts' weights over data x context and the rest over data x expert
    x context (:func:`jaxpar.axes.data_group`)."""
    n = reduce_group(layout)
    return [(None, n)] if layout.expert == 1 else [(True, n), (False, n * layout.expert)]


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
    rules = axis_rules(layout.mesh)
    return group_axes(data_group(layout.mesh, {rules[d] for d, _ in x.dims if d in rules}))


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


def _jaxpar_data(model: ConfigDict, layout: ParallelLayout, grad_reduce_bytes: int) -> tuple[float, int]:
    """Data-axis (bytes, collectives) of the jaxpar step: the ring bytes of :func:`zero_collectives`
    on the stage holding the most (each parameter over its own group: an MoE model's experts'
    weights over data x context, the rest over data x expert x context), and the collectives per
    step: 1 at stage 0, the reductions + 1 gather at 1-2, 3m + 1 at 3. The loss and gradient-norm
    scalars are not counted."""
    moved = 0.0
    for pipeline_stage in ("first", "last"):
        records = zero_collectives(model, layout, held_params(model, layout, pipeline_stage), grad_reduce_bytes)
        sizes = [math.prod(layout.size(a) for a in axes) for _, axes, _, _, _ in records]
        moved = max(moved, sum(c * ring_bytes(k, n, b) for (k, _, b, c, _), n in zip(records, sizes)))
    m = layout.microbatches
    if not layout.shards_optimizer:
        return moved, 1
    if not layout.shards_parameters:
        return moved, (m if layout.shards_gradients else 1) + 1
    return moved, 3 * m + 1


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
        arrays = moe_tensor_arrays(model, layout)
        for phase, times in moe_layer_phases(layout).items():
            out += [(kind, size, m * layers * times, what) for kind, size, what in arrays[phase]]
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
        shard_elements(x, t, reduce_group(layout), layout.shards_gradients, layout.expert) for x in held
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
                moved += c * _moe_phase_bytes(arrays, phases, t)
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
