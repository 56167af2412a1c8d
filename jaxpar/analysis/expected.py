"""The formulas' side of ``jaxpar inspect``: the estimated collectives and memory of a layout.

Bytes per device per step for each (collective kind, mesh axes), from the real per-parameter
placements (:mod:`jaxpar.sharding`) and the step's dtypes, priced as ring traffic (nccl-tests
PERFORMANCE.md), and the per-device argument memory. :mod:`jaxpar.analysis.compiled` puts these
beside what the compiler emitted.
"""

from __future__ import annotations

import math
from typing import Any

from jaxpar.analysis.estimate import DTYPE_BYTES
from jaxpar.analysis.traffic import (
    HeldParam,
    context_collectives,
    moe_dispatch_arrays,
    moe_layer_phases,
    ring_bytes,
    tensor_collectives,
    zero_collectives,
)
from jaxpar.axes import DEVICE_ORDER, MeshAxis, data_group, group_axes
from jaxpar.config import ConfigDict, ConfigError
from jaxpar.layout import ParallelLayout
from jaxpar.models.inventory import stacked_layers
from jaxpar.optim import registry
from jaxpar.sharding import spec_axes


def param_leaves(
    cfg: ConfigDict, layout: ParallelLayout, placements: Any = None
) -> list[tuple[str, tuple[int, ...], Any]]:
    """(path, global shape, :class:`~jaxpar.sharding.ParamPlacement`) of every parameter, built from
    shapes alone (``placements`` from a ``Setup`` may be passed to reuse them)."""
    import jax

    from jaxpar.models import get_model
    from jaxpar.sharding import Strategy, is_placement, param_placement

    model = get_model(cfg.model)
    abstract = model.abstract_params()
    if placements is None:
        strategy = Strategy.for_layout(layout)
        placements = jax.tree.map(
            lambda a, n: param_placement(tuple(a.shape), tuple(n), strategy, layout),
            abstract,
            model.logical_axes(),
            is_leaf=lambda x: isinstance(x, tuple),
        )
    flat = jax.tree.leaves(placements, is_leaf=is_placement)
    return [
        (jax.tree_util.keystr(path), tuple(a.shape), place)
        for (path, a), place in zip(jax.tree_util.tree_leaves_with_path(abstract), flat)
    ]


def _held(cfg: ConfigDict, leaves: list, mesh_shape: dict[str, int]) -> list[HeldParam]:
    """Each parameter of ``leaves`` (:func:`param_leaves`) as :func:`jaxpar.analysis.traffic.zero_collectives`
    reads it: its elements under the compute spec, its placement's group, whether ZeRO found it a
    dim, and its place in the model (the inventory's, in the same leaf order: a leaf of the scanned
    stack is a ``layer`` tensor)."""
    from jaxpar.models.inventory import param_tensors

    tensors = param_tensors(cfg.model)
    if len(tensors) != len(leaves):
        raise ValueError(f"the inventory lists {len(tensors)} parameters, the placements {len(leaves)}")
    return [
        HeldParam(
            local_elements(shape, place.compute, mesh_shape),
            group_axes(place.zero_axes),
            place.zero_dim is not None,
            x.place,
        )
        for (_, shape, place), x in zip(leaves, tensors)
    ]


def local_elements(shape: tuple[int, ...], spec: Any, mesh_shape: dict[str, int]) -> int:
    """Elements of one device's shard of an array of ``shape`` laid out by PartitionSpec ``spec``."""
    return math.prod(shape) // math.prod(mesh_shape[a] for a in spec_axes(spec))


def estimated_collectives(
    cfg: ConfigDict, layout: ParallelLayout, placements: Any = None
) -> dict[tuple[str, tuple[str, ...]], dict]:
    """Formula ring bytes per device per step for each (kind, axes) the layout should compile to.

    Ring costs (nccl-tests PERFORMANCE.md) per device and step: m microbatches of b sequences of s
    tokens per data shard; E a parameter's elements per device under its *compute* spec; g = bytes
    of ``parallel.grad_reduce_dtype``; a = bytes of ``model.compute_dtype``; n = the axis size.

    * ``data``: the gradient reductions and ZeRO gathers of every parameter over its placement's
      group, as :func:`jaxpar.analysis.traffic.zero_collectives` derives them for the planner too
      (stage 0 all-reduces every gradient once, 2(n-1)/n*E*g; ZeRO-1/2 reduce-scatter it and
      all-gather the updated parameter; ZeRO-3 gathers the layers twice per microbatch, counted in
      g: the program XLA:CPU compiles moves them in fp32 with bf16 compute).
      Plus the fp32 loss.
    * ``tensor`` (Megatron), per layer and microbatch, each b*s*h*a: 2 all-reduces forward
      (attention and MLP outputs), 2 backward, and the attention output's again with remat. Per
      microbatch: the vocabulary-parallel embedding, the output layer input's gradient, and the
      cross-entropy's 3 fp32 all-reduces of b*s. SP turns each b*s*h all-reduce into an all-gather
      + reduce-scatter of the same bytes; recomputation repeats both gathers and the attention
      reduce-scatter; each norm scale's gradient (2L+1 of h fp32) is all-reduced.
    * gradient-norm scalars (fp32) over the axes each gradient is split over.
    * ``context`` (c > 1): ``data`` reads (``data``, ``context``), n = data*c, and s reads s/c; the
      attention exchange is :func:`jaxpar.analysis.traffic.context_collectives`.
    * ``expert`` (MoE): each parameter reduces over its placement's group (the experts' weights over
      data (x context), the rest over data x expert (x context)), b counts sequences per data x
      expert shard, and every MoE layer adds, per microbatch, the dispatch and combine over
      ``expert`` (:func:`jaxpar.analysis.traffic.moe_dispatch_arrays`), its ``tensor`` collectives
      (:func:`jaxpar.analysis.traffic.moe_tensor_arrays`), each as often as
      :func:`jaxpar.analysis.traffic.moe_layer_phases` says, and with an auxiliary loss the fp32
      expert counts (E) all-reduced over the token axes (the other statistics' reductions are dead:
      only the loss's gradient is used).

    ``count`` is the number of logical collectives; XLA may combine several into one op.
    Pipeline placements are not modelled (``ConfigError``).
    """
    if cfg.mesh.pipeline > 1:
        raise ConfigError("estimated_collectives: pipeline placements are not modelled; use mesh.pipeline=1")
    mesh_shape = dict(cfg.mesh)
    c, experts = cfg.mesh.context, cfg.mesh.expert
    group = group_axes(data_group(mesh_shape))  # the batch's reductions: data (x expert) (x context)
    m, s = cfg.parallel.microbatches, cfg.train.seq_len // c  # s: the tokens of a sequence one device holds
    b = cfg.train.global_batch // (m * cfg.mesh.data * experts)
    layers = cfg.model.num_layers
    act, g = DTYPE_BYTES[cfg.model.compute_dtype], DTYPE_BYTES[cfg.parallel.grad_reduce_dtype]
    out: dict[tuple[str, tuple[str, ...]], dict] = {}

    def add(kind: str, axes: tuple[str, ...], size: float, count: int, what: str) -> None:
        axes = tuple(a for a in DEVICE_ORDER if a in axes and mesh_shape[a] > 1)  # size-1 axes move nothing
        n = math.prod(mesh_shape[a] for a in axes)
        if count == 0 or (n <= 1 and kind != "collective-permute"):
            return
        row = out.setdefault((kind, axes), {"count": 0, "bytes_per_device": 0.0, "terms": []})
        moved = count * ring_bytes(kind, n, size)
        row["count"] += count
        row["bytes_per_device"] += moved
        for term in row["terms"]:
            if term["what"] == what:
                term["count"] += count
                term["bytes_per_device"] += moved
                break
        else:
            row["terms"].append({"what": what, "count": count, "bytes_per_device": moved})

    leaves = param_leaves(cfg, layout, placements)
    norm_axes = (MeshAxis.DATA, MeshAxis.CONTEXT, MeshAxis.TENSOR, MeshAxis.EXPERT)
    for (_, _, place), held in zip(leaves, _held(cfg, leaves, mesh_shape)):
        for kind, axes, size, count, what in zero_collectives(cfg.model, layout, [held], g, zero3_bytes=g):
            add(kind, axes, size, count, what)
        split = tuple(a for a in norm_axes if a in spec_axes(place.optimizer))
        add("all-reduce", split, 4, 1, "gradient-norm scalars")
    add("all-reduce", group, 4, 1, "loss")

    for kind, size, count, what in tensor_collectives(cfg.model, layout):
        add(kind, (MeshAxis.TENSOR,), size, count, what)
    remat = int(cfg.parallel.recompute != "none")
    if c > 1:
        kv = 2 * b * s * cfg.model.num_kv_heads // cfg.mesh.tensor * cfg.model.head_dim * act  # kvb
        for kind, count, size, what in context_collectives(kv, c, cfg.parallel.context_exchange, act, remat):
            add(kind, (MeshAxis.CONTEXT,), size, m * layers * count, what)
    if cfg.model.num_experts:
        _moe_collectives(cfg, layout, add, group)
    return out


def _moe_collectives(cfg: ConfigDict, layout: ParallelLayout, add: Any, group: tuple[str, ...]) -> None:
    """The MoE layers' expert-axis rows of :func:`estimated_collectives` (its docstring), through its
    ``add``; their tensor-axis rows are in :func:`jaxpar.analysis.traffic.tensor_collectives`."""
    # the MoE layers (deepseek_v3: not its dense first)
    per_step = cfg.parallel.microbatches * stacked_layers(cfg.model)
    phases = moe_layer_phases(layout)
    arrays = moe_dispatch_arrays(cfg.model, layout)
    for phase, times in phases.items():
        for kind, size, what in arrays[phase]:
            add(kind, (MeshAxis.EXPERT,), size, per_step * times, what)
    if cfg.model.moe_aux_loss_coeff or cfg.model.moe_z_loss_coeff:
        tokens = (*group, *((MeshAxis.TENSOR,) if cfg.parallel.sequence_parallel else ()))
        add("all-reduce", tokens, cfg.model.num_experts * 4, per_step, "MoE expert counts (aux loss)")


def estimated_memory(cfg: ConfigDict, layout: ParallelLayout, placements: Any = None) -> dict[str, float]:
    """Per-device argument and output bytes of the train step, and the gradient buffer.

    argument = parameters under their storage spec (param dtype) + the optimizer's state
    (:func:`jaxpar.optim.registry.local_state_bytes`; AdamW: mu and nu under the optimizer spec) +
    the step count (int32) + this device's batch rows (m x b x (s+1) int32) + the bad-step guard (2
    fp32); output = the same state + 4 metrics (loss, grad norm, lr, skipped). ``grad_buffer_bytes``:
    the fp32 gradient (accumulation) buffer, under the compute spec at stages 0-1 and the optimizer
    spec at 2-3; it lives in the temporaries, which have no closed formula here.
    """
    mesh_shape = dict(cfg.mesh)
    pb = DTYPE_BYTES[cfg.model.param_dtype]
    params = opt = grads = 0
    for _, shape, place in param_leaves(cfg, layout, placements):
        params += local_elements(shape, place.storage, mesh_shape) * pb
        opt += registry.local_state_bytes(cfg.optim, shape, place, mesh_shape)  # AdamW: mu + nu, 8 bytes
        grads += local_elements(shape, place.optimizer if layout.shards_gradients else place.compute, mesh_shape) * 4
    t = cfg.train
    batch = t.global_batch // (cfg.mesh.data * cfg.mesh.expert) * (t.seq_len + 1) * 4  # rows over data x expert
    return {
        "param_bytes": params,
        "optimizer_bytes": opt,
        "batch_bytes": batch,
        "grad_buffer_bytes": grads,
        "argument_bytes": params + opt + 4 + batch + 8,
        "output_bytes": params + opt + 4 + 16,
    }
