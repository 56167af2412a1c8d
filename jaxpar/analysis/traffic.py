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

import math

from jaxpar.analysis.clusters import Cluster
from jaxpar.analysis.moe_traffic import (  # noqa: F401 - re-exported
    expert_traffic,
    moe_dispatch_arrays,
    moe_layer_phases,
    moe_tensor_arrays,
)
from jaxpar.analysis.rings import (  # noqa: F401 - re-exported
    AxisComm,
    all_gather_bytes,
    all_reduce_bytes,
    axis_link,
    ring_bytes,
)
from jaxpar.analysis.step_traffic import (  # noqa: F401 - re-exported
    HeldParam,
    held_params,
    jaxpar_stage_traffic,
    tensor_collectives,
    zero_collectives,
)
from jaxpar.axes import MeshAxis
from jaxpar.config import ConfigDict, ConfigError
from jaxpar.models.inventory import DTYPE_BYTES, ParallelLayout, held_elements

CONVENTIONS = ("jaxpar", "paper")


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
    n = layout.zero_shards(expert_weight=True)
    t, p, m, z = layout.tensor, layout.pipeline, layout.microbatches, layout.zero_stage
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
    n = layout.zero_shards(expert_weight=True)
    return [(None, n)] if layout.expert == 1 else [(True, n), (False, n * layout.expert)]


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
