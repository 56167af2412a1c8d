"""Communication per mesh axis of one layout: the published formulas and jaxpar's own step.

:func:`communication` gives the bytes one device sends per step on each axis as ring "bytes on the
wire" (nccl-tests PERFORMANCE.md: all-reduce 2(n-1)/n * S, all-gather / reduce-scatter (n-1)/n * S,
collective-permute S) and, with a cluster, the time over its links, under the ``paper`` convention
or the ``jaxpar`` one (what jaxpar's train step compiles to, per pipeline stage). With context
parallelism (c > 1) the ``data`` entry is the gradient reduction over data*c devices, activation
terms hold s/c tokens, and the ``context`` entry is the attention exchange (:func:`context_traffic`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpar.analysis.clusters import Cluster
from jaxpar.axes import MeshAxis
from jaxpar.config import ConfigDict, ConfigError
from jaxpar.models.inventory import (
    DTYPE_BYTES,
    TENSOR_DIMS,
    ParallelLayout,
    ParamTensor,
    held_elements,
    param_tensors,
    shard_elements,
    stage_tensors,
)
from jaxpar.ops.context_parallel import ring_bytes_per_layer

CONVENTIONS = ("jaxpar", "paper")


# --------------------------------------------------------------------------- communication


def all_reduce_bytes(size_bytes: float, n: int) -> float:
    """Ring all-reduce traffic per device: 2(n-1)/n * S (nccl-tests PERFORMANCE.md)."""
    return 2 * (n - 1) / n * size_bytes


def all_gather_bytes(size_bytes: float, n: int) -> float:
    """Ring all-gather or reduce-scatter traffic per device: (n-1)/n * S (S = the full array)."""
    return (n - 1) / n * size_bytes


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
    """The link a ring over ``axis`` uses. With devices ordered tensor, context, data, pipeline
    (innermost first, :data:`jaxpar.axes.DEVICE_ORDER`), a ring stays in a node when the span of
    device ids it touches (t, t*c, t*c*N, all) fits in one; else it crosses the NIC. ``data`` is the
    gradient reduction over (data, context): its span includes the context ranks."""
    t, c = layout.tensor, layout.context
    span = {
        MeshAxis.TENSOR: t,
        MeshAxis.CONTEXT: t * c,
        MeshAxis.DATA: t * c * layout.data,
        MeshAxis.PIPELINE: layout.devices,
    }[axis]
    return "intra" if span <= cluster.devices_per_node else "inter"


def reduce_group(layout: ParallelLayout) -> int:
    """Devices the gradients are reduced (and ZeRO shards) over: data x context (:func:`jaxpar.axes.data_group`)."""
    return layout.data * layout.context


def context_traffic(model: ConfigDict, layout: ParallelLayout) -> tuple[float, int]:
    """Context-axis (bytes, collectives) per step and device of the attention exchange
    (:mod:`jaxpar.ops.context_parallel`) over the busiest stage's L/p layers and m microbatches, with
    kvb = one rank's keys and values, 2*b*s/c*kv_heads/t*head_dim*a. ``ring``: per layer
    :func:`~jaxpar.ops.context_parallel.ring_bytes_per_layer`, keys and values as separate permutes,
    not repeated under recompute (the ring's custom VJP keeps its residuals: tests/test_context_hlo.py).
    ``all_gather``: per layer (c-1)*kvb gathered, again in a recomputed forward, and as much
    reduce-scattered.
    """
    c = layout.context
    if c == 1:
        return 0.0, 0
    a = DTYPE_BYTES[model.compute_dtype]
    kvb = 2 * layout.microbatch_size * layout.seq_local * model.num_kv_heads // layout.tensor * model.head_dim * a
    layers, remat = model.num_layers // layout.pipeline, int(layout.recompute != "none")
    if layout.context_exchange == "all_gather":
        per_layer, calls = (2 + remat) * (c - 1) * kvb, 2 * (2 + remat)
    else:
        per_layer, calls = sum(ring_bytes_per_layer(kvb, c, 4 / a)), 2 * (c - 1) * 2 + 2 * c
    return layout.microbatches * layers * per_layer, layout.microbatches * layers * calls


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
    if convention == "jaxpar":
        stages = [jaxpar_stage_traffic(model, layout, d, grad_reduce_bytes) for d in range(p)]
        data = _jaxpar_data(model, layout, grad_reduce_bytes)
        traffic = {
            MeshAxis.DATA: (n, *max((st.get(MeshAxis.DATA, data) for st in stages), key=lambda x: x[0])),
            MeshAxis.TENSOR: (t, *max((st[MeshAxis.TENSOR] for st in stages), key=lambda x: x[0])),
            MeshAxis.PIPELINE: (p, *max((st[MeshAxis.PIPELINE] for st in stages), key=lambda x: x[0])),
            MeshAxis.CONTEXT: (layout.context, *context_traffic(model, layout)),
            MeshAxis.EXPERT: (layout.expert, 0.0, 0),  # MoE is not priced: plan refuses it (dense: nothing)
        }
    else:
        grads = max(held_elements(model, layout, st, False) for st in ("first", "last")) * grad_reduce_bytes
        data = {  # (bytes, collectives) by ZeRO stage
            0: (all_reduce_bytes(grads, n), 1),
            1: (all_reduce_bytes(grads, n), 2),  # reduce-scatter + all-gather: the same bytes as one all-reduce
            2: ((m + 1) * all_gather_bytes(grads, n), m + 1),
            3: (3 * m * all_gather_bytes(grads, n), 3 * m),
        }[z]
        tp_calls = (6 if layout.recompute == "full" else 4) * (model.num_layers // p) * m
        traffic = {
            MeshAxis.DATA: (n, *data),
            MeshAxis.TENSOR: (
                t,
                tp_calls * all_reduce_bytes(bsh, t),
                tp_calls * (2 if layout.sequence_parallel else 1),
            ),
            MeshAxis.PIPELINE: pipeline,
            MeshAxis.CONTEXT: (layout.context, *context_traffic(model, layout)),
            MeshAxis.EXPERT: (layout.expert, 0.0, 0),  # MoE is not priced: plan refuses it (dense: nothing)
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


def _held_by_place(model: ConfigDict, layout: ParallelLayout) -> tuple[float, float]:
    """(layer, other) parameter elements per device after the tensor split, unsharded over data, on
    the stage holding the most parameters (jaxpar's pipeline: every stage holds the non-layer ones)."""
    best = (0.0, 0.0)
    for stage in ("first", "last"):
        held = stage_tensors(model, layout, stage, shared_on_every_stage=True)
        layer = sum(c * shard_elements(t, layout.tensor, 1, False) for t, c in held if t.place == "layer")
        other = sum(c * shard_elements(t, layout.tensor, 1, False) for t, c in held if t.place != "layer")
        best = max(best, (layer, other), key=sum)
    return best


def _jaxpar_data(model: ConfigDict, layout: ParallelLayout, grad_reduce_bytes: int) -> tuple[float, int]:
    """Data-axis (bytes, collectives) of the jaxpar step (jaxpar/train/step.py), E the per-device
    parameter elements after the tensor split, g = ``grad_reduce_bytes``, pb the param dtype bytes:

    stage 0: all-reduce E*g once per step. Stage 1: reduce-scatter E*g once and all-gather the
    updated parameters (E*pb). Stage 2: the reduce-scatter every microbatch, the all-gather once.
    Stage 3, in the compute dtype a: block parameters gathered twice per microbatch (forward, and
    again in the backward: remat never keeps the gathered copy), the embedding, final norm and output
    layer once per step (XLA hoists the loop-invariant gather out of the accumulation loop), every
    gradient reduce-scattered per microbatch. Parameters no ZeRO dim divides are all-reduced
    instead, and not counted here (nor are the loss and gradient-norm scalars).
    """
    n, m = reduce_group(layout), layout.microbatches
    layer, other = _held_by_place(model, layout)
    full, pb = layer + other, DTYPE_BYTES[model.param_dtype]
    if not layout.shards_optimizer:
        return all_reduce_bytes(full * grad_reduce_bytes, n), 1
    if not layout.shards_parameters:
        reductions = m if layout.shards_gradients else 1
        moved = reductions * all_gather_bytes(full * grad_reduce_bytes, n) + all_gather_bytes(full * pb, n)
        return moved, reductions + 1
    a = DTYPE_BYTES[model.compute_dtype]
    gathered = (2 * m * layer + other) * a
    return all_gather_bytes(gathered, n) + m * all_gather_bytes(full * a, n), 3 * m + 1


def _jaxpar_tensor(model: ConfigDict, layout: ParallelLayout) -> tuple[float, int]:
    """Tensor-axis (bytes, collectives) of the jaxpar model (jaxpar/models/llama.py), per microbatch:

    per layer 2 all-reduces of b*s*h forward (attention and MLP outputs) and 2 backward (their input
    gradients); recompute repeats the attention output's (the MLP one is dead there): 5, not
    Megatron's 6. With SP each is a gather/scatter pair of the same bytes, and recompute repeats both
    gathers and the attention scatter: 5.5 per layer. Also per microbatch the vocabulary-parallel
    embedding (forward, first stage) and the output layer input's gradient (backward, last stage),
    each b*s*h; the cross-entropy's 3 fp32 all-reduces of b*s (last stage); with SP the norm scales'
    gradients (2L/p + 1 fp32 vectors of h). The busiest stage (the last) counts.
    """
    t, p, m, sp = layout.tensor, layout.pipeline, layout.microbatches, layout.sequence_parallel
    bs = layout.microbatch_size * layout.seq_local
    bsh = bs * model.embed_dim * DTYPE_BYTES[model.compute_dtype]
    layers, remat = model.num_layers // p, layout.recompute != "none"
    per_layer = 4 + (1.5 if sp else 1.0) * remat
    ends = 2 if p == 1 else 1
    moved = (per_layer * layers + ends) * all_reduce_bytes(bsh, t) + 3 * all_reduce_bytes(bs * 4, t)
    calls = (4 + remat) * layers + ends + 3
    if sp:
        moved += (2 * layers + 1) * all_reduce_bytes(model.embed_dim * 4, t)
        calls += (4 + 2 * remat) * layers + ends + 2 * layers + 1  # each pair counts 2, plus the norm scales
    return m * moved, m * calls


def jaxpar_stage_traffic(
    model: ConfigDict, layout: ParallelLayout, stage: int, grad_reduce_bytes: int = 4
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
        data = _jaxpar_pipeline_zero3(model, layout, stage)
    elif layout.shards_gradients:
        data = _jaxpar_pipeline_zero2(model, layout, stage, grad_reduce_bytes)
    v = v if layout.schedule == "interleaved" else 1
    bs = layout.microbatch_size * layout.seq_local
    bsh = bs * model.embed_dim * DTYPE_BYTES[model.compute_dtype]
    send = m * ((v - (stage == p - 1)) + (v - (stage == 0)))
    # + once per step, the fp32 gradients of what every stage holds (final norm, positions, a tied
    # table), summed over pipeline, and the loss
    held = [
        x
        for x in param_tensors(model)
        if x.name.startswith("final_norm") or x.name == "positions" or (model.tie_embeddings and x.name == "embedding")
    ]
    summed = 4 + 4 * sum(shard_elements(x, t, reduce_group(layout), layout.shards_gradients) for x in held)
    pipeline = (send * bsh / (t if sp else 1) + all_reduce_bytes(summed, p), send + 1)
    if t == 1:
        return {MeshAxis.TENSOR: (0.0, 0), MeshAxis.PIPELINE: pipeline, **({MeshAxis.DATA: data} if data else {})}
    a, c = all_reduce_bytes(bsh, t), model.num_layers // (p * v)
    remat = layout.recompute != "none"
    full = layout.recompute == "full" and layout.schedule != "gpipe"
    per_seq = layout.microbatch_size if full else 1  # the full-remat backward runs sequence by sequence
    recompute = (1.5 if sp else 1.0) * remat
    if c == 1 and not full and layout.schedule != "gpipe":  # XLA merges the recomputed forward (see above)
        recompute = 1.0 if sp and remat else 0.0
    moved, calls = 0.0, 0
    for chunk in range(v):
        first, last = stage == 0 and chunk == 0, stage == p - 1 and chunk == v - 1
        if layout.schedule == "gpipe":
            units = (4 + recompute) * c
        else:
            forward = 0 if last else 2 * c
            backward = (5.5 if sp else 5) * c if full else (4 + recompute) * c
            units = forward + backward
        explicit_embed = 1.5 if sp else 2  # forward, and again in the backward (SP: a scatter, then a pair)
        units += (explicit_embed if layout.schedule != "gpipe" else 1) * first + (1 if last else 0)
        moved += units * a + (3 * all_reduce_bytes(bs * 4, t) if last else 0.0)
        calls += round(units) + (3 if last else 0)
        if sp:  # norm-scale gradients: 2 per layer (+ the final norm on the last stage), per sequence
            moved += per_seq * (2 * c + last) * all_reduce_bytes(model.embed_dim * 4, t)
            calls += per_seq * (2 * c + last)
    return {
        MeshAxis.TENSOR: (m * moved, m * calls),
        MeshAxis.PIPELINE: pipeline,
        **({MeshAxis.DATA: data} if data else {}),
    }


def _zero_gathered(model: ConfigDict, layout: ParallelLayout, tensors: list[ParamTensor], nbytes: int) -> float:
    """Ring bytes of one all-gather (or reduce-scatter) over ``data`` of the ZeRO-shardable tensors."""
    n, t = reduce_group(layout), layout.tensor
    return sum(
        all_gather_bytes(shard_elements(x, t, 1, False) * nbytes, n)
        for x in tensors
        if any(size % n == 0 for name, size in x.dims if name not in TENSOR_DIMS)
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
    model: ConfigDict, layout: ParallelLayout, stage: int, grad_reduce_bytes: int = 4
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
    scattered = layers + (stage in (0, p - 1)) * shared
    gathered = sum(count * _zero_gathered(model, layout, [x], pb) for x, count in held)
    return m * scattered + gathered, m + 1


def _jaxpar_pipeline_zero3(model: ConfigDict, layout: ParallelLayout, stage: int) -> tuple[float, int]:
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
    v = layout.virtual_stages if layout.schedule == "interleaved" else 1
    a = DTYPE_BYTES[model.compute_dtype]
    c = model.num_layers // (p * v)
    layer, first, last = (_zero_gathered(model, layout, group, a) for group in _stage_groups(model))
    # one layer per chunk without full remat: the backward's regather merges with the vjp forward's
    explicit = layout.schedule != "gpipe"
    backward = 2 if c == 1 and explicit and layout.recompute != "full" else 3
    moved = 0.0
    for chunk in range(v):
        is_first, is_last = stage == 0 and chunk == 0, stage == p - 1 and chunk == v - 1
        forward = 0 if layout.schedule == "gpipe" or is_last else c * layer + is_first * first
        moved += forward + backward * c * layer + 2 * is_first * first + 2 * is_last * last
    return m * moved, m * backward * c * v
