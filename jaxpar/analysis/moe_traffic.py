"""Mixture-of-experts communication: the arrays an MoE layer sends over ``expert`` (dispatch and
combine) and over ``tensor``, how often a layer's phases run per tick, and the expert-axis bytes of
a pipeline stage (:func:`expert_traffic`, the same in both conventions of
:func:`jaxpar.analysis.traffic.communication`: it is how jaxpar's MoE layer is built)."""

from __future__ import annotations

from jaxpar.analysis.rings import ring_bytes
from jaxpar.config import ConfigDict
from jaxpar.models.inventory import DTYPE_BYTES, ParallelLayout, stacked_layers
from jaxpar.parallel.pipeline.schedule import device_of, keeps_activations, splits_backward


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


def moe_phase_bytes(arrays: dict[str, list[tuple[str, float, str]]], phases: dict[str, int], n: int) -> float:
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
        return moe_phase_bytes(arrays, phases, n), sum(times * len(arrays[ph]) for ph, times in phases.items())

    p, m = layout.pipeline, layout.microbatches
    if p == 1 or layout.pipeline_schedule == "gpipe":
        per_layer = moved(moe_layer_phases(layout))
        layers = layout.stored_layers(stacked_layers(model))  # the MoE layers (deepseek_v3: not its dense first)
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
