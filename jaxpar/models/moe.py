"""Mixture-of-experts MLP: a router picks ``k`` of ``E`` SwiGLU experts per token (Shazeer et al.
2017; Fedus et al. 2022, Switch; Jiang et al. 2024, Mixtral), computed shard-locally inside the
step's ``shard_map`` with explicit collectives.

**Routing.** fp32 router logits ``x @ W_r``; ``softmax`` (Mixtral, Qwen3-MoE) over all experts or
``sigmoid`` (DeepSeek-V3) independent scores; the top ``k`` kept, renormalised when ``norm_topk``.

**Dropless dispatch over ``expert``** (Megatron-core's ``allgather`` token dispatcher). Experts are
split over ``expert``, tokens over ``data x expert``. Each rank all-gathers its ``expert`` group's
tokens and routing, sorts the (token, choice) pairs by expert, runs its local experts as grouped
matmuls (``jax.lax.ragged_dot``), weights each row by its router weight, sums the rows onto their
tokens and reduce-scatters the sums over ``expert``: nothing dropped or padded. Per layer and rank
(forward): an all-gather and a reduce-scatter of ``(expert - 1) / expert`` of the group's ``T x h``
activations (``ragged_all_to_all``, which moves only routed rows, does not run on XLA:CPU). Expert
weights are also split over ``tensor`` on ``mlp``, so the output is reduced over ``tensor`` like
the dense MLP's. A shared expert (``shared_expert_dim > 0``; DeepSeekMoE, Dai et al. 2024) is a
dense SwiGLU MLP every token runs through, added to the routed output.

**Capacity** (``capacity_factor > 0``, Switch / GShard token dropping): each expert takes at most
``ceil(cf * s * k / E)`` of each sequence's choices (:func:`within_capacity`); a dropped choice adds
nothing. The group is one sequence, so the same tokens drop on every layout (context parallelism,
which splits a sequence, is refused).

With a probe (``MoeSettings.probe``, set by the train step) the layer reports how many choices it
dropped (:func:`count_drops`): the step's ``moe_dropped`` metric.

**Auxiliary losses** (not in the reported loss; their gradient is in the step, as Megatron-core's
``MoEAuxLossAutoScaler``): Switch load balancing ``E * sum_e f_e * P_e``, ``f_e`` the share of the
``T*k`` choices that went to expert ``e``, ``P_e`` its mean router probability (Fedus et al. 2022,
eq. 4: 1 at perfect balance), and the router z-loss ``mean_t logsumexp(logits_t)^2`` (Zoph et al.
2022, ST-MoE, eq. 5), reduced over every token-splitting axis (every layout computes one device's
loss), each weighted by its coefficient over the microbatch count (Megatron adds it per microbatch).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.axes import group_axes
from jaxpar.compat import vary, varying_axes
from jaxpar.ops.matmul import dense

ROUTER_SCORES = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class MoeSettings:
    """What the MoE layer computes (from ``model.*``) and where its collectives run (from the step)."""

    num_experts: int
    top_k: int
    score: str = "softmax"  # softmax | sigmoid
    norm_topk: bool = True
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    dispatch: str = "grouped"  # grouped (ragged_dot) | dense (every expert on every token: the reference)
    capacity_factor: float = 0.0  # 0: dropless; else each expert takes ceil(cf * s * k / E) choices per sequence
    loss_scale: float = 1.0  # 1 / microbatches: the auxiliary losses are added once per microbatch
    expert_axis: str | None = None  # set when mesh.expert > 1
    token_axes: tuple[str, ...] = ()  # every axis the router's tokens are split over (for the aux statistics)
    groups: int = 1  # group-limited routing (DeepSeek-V3 n_group): experts in this many equal groups
    group_topk: int = 1  # only the best this many groups' experts are eligible (topk_group)
    route_scale: float = 1.0  # the combine weights times this (DeepSeek-V3 routed_scaling_factor)
    bias_rate: float = 0.0  # aux-loss-free balancing: the bias's "gradient" is its load statistic
    # with capacity: a zero (2,) array whose gradient becomes (dropped, routed) choices (count_drops)
    probe: Any = dataclasses.field(default=None, compare=False)


class Experts(nnx.Module):
    """Router and expert weights of every layer, stacked on ``layers`` then ``experts``; with
    ``shared > 0`` also a shared expert of that width that every token runs through."""

    def __init__(
        self,
        num_layers: int,
        h: int,
        f: int,
        num_experts: int,
        std: float,
        out_std: float,
        key,
        dtype,
        shared: int = 0,
    ):
        L, E = num_layers, num_experts
        kr, kg, ku, kd, ks = jax.random.split(key, 5)

        def param(k, shape, axes, s):
            return nnx.Param(s * jax.random.normal(k, shape, dtype), logical_axes=axes)

        self.router = param(kr, (L, h, E), ("layers", "embed", "router"), std)
        self.w_gate = param(kg, (L, E, h, f), ("layers", "experts", "embed", "mlp"), std)
        self.w_up = param(ku, (L, E, h, f), ("layers", "experts", "embed", "mlp"), std)
        self.w_down = param(kd, (L, E, f, h), ("layers", "experts", "mlp", "embed"), out_std)
        if shared:  # a dense SwiGLU MLP beside the routed experts (DeepSeekMoE, Dai et al. 2024)
            kg, ku, kd = jax.random.split(ks, 3)
            self.shared_gate = param(kg, (L, h, shared), ("layers", "embed", "mlp"), std)
            self.shared_up = param(ku, (L, h, shared), ("layers", "embed", "mlp"), std)
            self.shared_down = param(kd, (L, shared, h), ("layers", "mlp", "embed"), out_std)


def route(logits: jax.Array, s: MoeSettings, bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(weights, experts, probs)`` of fp32 router ``logits`` (T, E): the ``k`` chosen experts per
    token, their combine weights, and every expert's score (for the load-balancing loss).

    ``bias`` (E,): added to the scores for the choice only, never to the weights (DeepSeek-V3's
    ``e_score_correction_bias``; aux-loss-free balancing, arXiv:2412.19437 section 2.1.2). With
    ``s.groups > 1`` the choice is group-limited: a group's score is the sum of its two best
    (biased) scores, and only the ``s.group_topk`` best groups' experts are eligible (DeepSeek-V3;
    HF ``DeepseekV3TopkRouter``). The weights are then times ``s.route_scale``."""
    probs = jax.nn.softmax(logits, axis=-1) if s.score == "softmax" else jax.nn.sigmoid(logits)
    choice = probs if bias is None else probs + jax.lax.stop_gradient(bias).astype(jnp.float32)
    if s.groups > 1:
        t, e = choice.shape
        grouped = choice.reshape(t, s.groups, e // s.groups)
        group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # (T, groups)
        best = jax.lax.top_k(group_score, s.group_topk)[1]
        allowed = jnp.sum(jax.nn.one_hot(best, s.groups, dtype=jnp.int32), axis=1) > 0
        choice = jnp.where(jnp.repeat(allowed, e // s.groups, axis=1), choice, -jnp.inf)
    if bias is None and s.groups == 1:
        weights, experts = jax.lax.top_k(probs, s.top_k)
    else:
        experts = jax.lax.top_k(choice, s.top_k)[1]
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if s.norm_topk:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if s.route_scale != 1.0:
        weights = weights * s.route_scale
    return weights, experts, probs


def aux_loss(logits: jax.Array, probs: jax.Array, experts: jax.Array, s: MoeSettings) -> jax.Array:
    """The weighted load-balancing and z-losses of this microbatch (module docstring), reduced over
    ``s.token_axes``: the same value on every rank."""
    E = s.num_experts
    counts = jnp.sum(jax.nn.one_hot(experts, E, dtype=jnp.float32), axis=(0, 1))  # (E,)
    stats = {
        "counts": counts,
        "probs": jnp.sum(probs, axis=0),
        "z": jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1))),
        "tokens": jnp.float32(logits.shape[0]),
    }
    if s.token_axes:
        stats = jax.lax.psum(stats, s.token_axes)
    tokens = stats["tokens"]
    balance = E * jnp.sum((stats["counts"] / (tokens * s.top_k)) * (stats["probs"] / tokens))
    return s.aux_loss_coeff * balance + s.z_loss_coeff * stats["z"] / tokens


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _with_loss_gradient(x: jax.Array, loss: jax.Array, weight: float) -> jax.Array:
    return x


def _with_loss_fwd(x, loss, weight):
    return x, loss


def _with_loss_bwd(weight, loss, g):
    return g, jnp.full_like(loss, weight)


_with_loss_gradient.defvjp(_with_loss_fwd, _with_loss_bwd)


@jax.custom_vjp
def _with_load(x: jax.Array, bias: jax.Array, excess: jax.Array) -> jax.Array:
    return x


def _with_load_fwd(x, bias, excess):
    return x, excess


def _with_load_bwd(excess, g):
    return g, excess, jnp.zeros_like(excess)


_with_load.defvjp(_with_load_fwd, _with_load_bwd)


def with_load_statistic(weights: jax.Array, bias: jax.Array, experts: jax.Array, num_experts: int) -> jax.Array:
    """``weights`` unchanged; in the backward pass ``bias`` receives, instead of a gradient, how
    many more of this shard's choices each expert got than the mean (``count_e - T*k/E``). Summed
    over microbatches and the data-parallel reduction it is the step's ``load - mean load``, which
    the train step takes out of the gradients (:func:`take_balance`), so the optimizer never sees it."""
    counts = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32), axis=(0, 1))
    excess = counts - experts.shape[0] * experts.shape[1] / num_experts
    # under sequence parallelism each tensor rank routed its own tokens: their counts add up; the
    # statistic then varies over the axes the bias does (the custom VJP's type rule)
    extra = tuple(sorted(varying_axes(excess) - varying_axes(bias)))
    excess = vary(jax.lax.psum(excess, extra) if extra else excess, varying_axes(bias))
    return _with_load(weights, bias, excess.astype(bias.dtype))


BIAS_PATH = ("moe", "expert_bias")


def take_balance(grads: dict, stacked: str) -> tuple[dict, Any]:
    """``(grads with the expert-bias entry zeroed, that entry)``: the load statistics of
    :func:`with_load_statistic` (None where the tree has no expert bias)."""
    moe_grads = grads.get(stacked, {}).get(BIAS_PATH[0], {})
    if BIAS_PATH[1] not in moe_grads:
        return grads, None
    excess = moe_grads[BIAS_PATH[1]]
    zeroed = {**grads, stacked: {**grads[stacked], "moe": {**moe_grads, "expert_bias": jnp.zeros_like(excess)}}}
    return zeroed, excess


def apply_balance(params: dict, excess: Any, stacked: str, rate: float, ok: jax.Array) -> dict:
    """Aux-loss-free balancing (DeepSeek-V3, arXiv:2412.19437 section 2.1.2; torchtitan's
    ``load_balance_coeff``): ``bias += rate * sign(mean load - load)``, outside the optimizer;
    unchanged on a skipped step."""
    if excess is None:
        return params
    moe_params = params[stacked]["moe"]
    bias = moe_params["expert_bias"]
    new = jnp.where(ok, bias - rate * jnp.sign(excess).astype(bias.dtype), bias)
    return {**params, stacked: {**params[stacked], "moe": {**moe_params, "expert_bias": new}}}


def add_loss_gradient(x: jax.Array, loss: jax.Array, weight: float) -> jax.Array:
    """``x`` unchanged; in the backward pass ``loss`` receives the cotangent ``weight``, as if
    ``weight * loss`` were added to the objective (Megatron-core's ``MoEAuxLossAutoScaler``)."""
    return _with_loss_gradient(x, loss, float(weight))


def router_logits(x: jax.Array, router: jax.Array) -> jax.Array:
    """fp32 logits (T, E) of tokens ``x`` (T, h)."""
    return jnp.einsum("th,he->te", x.astype(jnp.float32), router.astype(jnp.float32))


def expert_mlp(tokens: jax.Array, weights: jax.Array, experts: jax.Array, p: dict, s: MoeSettings, dtype) -> jax.Array:
    """The experts' output for ``tokens`` (T, h) routed to ``experts`` (T, k) with ``weights``:
    (T, h), partial over ``tensor`` (row-parallel down projection) and summed over ``expert``."""
    spread = s.expert_axis is not None and jax.lax.axis_size(s.expert_axis) > 1
    if spread:  # the whole expert group's tokens, to run this rank's experts on
        tokens, weights, experts = (
            jax.lax.all_gather(a, s.expert_axis, axis=0, tiled=True) for a in (tokens, weights, experts)
        )
    local = p["w_up"].shape[0]
    first = jax.lax.axis_index(s.expert_axis) * local if spread else 0
    if s.dispatch == "dense":
        out = _every_expert(tokens, weights, experts - first, p, local, dtype)
    else:
        out = _grouped_experts(tokens, weights, experts - first, p, local, dtype)
    if spread:  # every rank's experts summed, each rank's own tokens back
        out = jax.lax.psum_scatter(out, s.expert_axis, scatter_dimension=0, tiled=True)
    elif s.expert_axis is not None:  # one expert rank: the weights' size-1 axis, summed away
        out = jax.lax.psum(out, s.expert_axis)
    return out


def _every_expert(tokens, weights, choice, p, local: int, dtype) -> jax.Array:
    """``dispatch='dense'``: every local expert runs on every token, its output weighted by the
    token's routing weight for it (0 where not chosen): the one-hot formulation, ``local`` times
    the routed compute, kept as the reference the grouped path is measured against."""
    mask = jnp.sum(jax.nn.one_hot(choice, local, dtype=jnp.float32) * weights[..., None], axis=1)  # (rows, local)
    x = tokens.astype(dtype)
    act = jax.nn.silu(jnp.einsum("th,ehf->tef", x, p["w_gate"].astype(dtype)))
    act = act * jnp.einsum("th,ehf->tef", x, p["w_up"].astype(dtype))
    y = jnp.einsum("tef,efh->teh", act, p["w_down"].astype(dtype))
    return jnp.einsum("teh,te->th", y, mask.astype(dtype))


def _grouped_experts(tokens, weights, choice, p, local: int, dtype) -> jax.Array:
    """``dispatch='grouped'``: the (token, choice) rows of the local experts sorted by expert and
    run as grouped matmuls (``jax.lax.ragged_dot``); other ranks' rows sort past every group."""
    k = choice.shape[1]
    choice = choice.reshape(-1)  # (N,) with N = rows * k
    mine = (choice >= 0) & (choice < local)
    key = jnp.where(mine, choice, local)  # other ranks' choices sort last, past every group
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.zeros((local,), jnp.int32).at[jnp.where(mine, choice, 0)].add(mine.astype(jnp.int32))
    row_token = order // k
    x = jnp.take(tokens, row_token, axis=0).astype(dtype)
    gate = jax.lax.ragged_dot(x, p["w_gate"].astype(dtype), group_sizes)
    up = jax.lax.ragged_dot(x, p["w_up"].astype(dtype), group_sizes)
    y = jax.lax.ragged_dot(jax.nn.silu(gate) * up, p["w_down"].astype(dtype), group_sizes)
    row_weight = jnp.where(jnp.take(mine, order), jnp.take(weights.reshape(-1), order), 0.0)
    y = y * row_weight[:, None].astype(dtype)
    return jnp.zeros((tokens.shape[0], y.shape[-1]), dtype).at[row_token].add(y)


def capacity(seq: int, s: MoeSettings) -> int:
    """Choices one expert takes from one sequence of ``seq`` tokens: ``ceil(cf * seq * k / E)``
    (Fedus et al. 2022, eq. 3; the group is one sequence)."""
    return math.ceil(s.capacity_factor * seq * s.top_k / s.num_experts)


def within_capacity(experts: jax.Array, seq: int, num_experts: int, cap: int) -> jax.Array:
    """Which choices (rows, k) a capacity of ``cap`` per expert and sequence keeps: a choice is
    dropped when ``cap`` earlier choices of its sequence went to the same expert, earlier meaning
    a lower choice slot, then an earlier position (GShard's priority, Lepikhin et al. 2020: every
    token's first choice before any second choice). ``experts``' rows are whole sequences of
    ``seq`` tokens in order; the count is a stable sort by expert, not a one-hot over experts."""
    rows, k = experts.shape
    n = rows // seq
    e = experts.reshape(n, seq, k).transpose(0, 2, 1).reshape(n, k * seq)  # in priority order
    order = jnp.argsort(e, axis=1, stable=True)
    sorted_e = jnp.take_along_axis(e, order, axis=1)
    idx = jnp.broadcast_to(jnp.arange(k * seq), (n, k * seq))
    first = jnp.concatenate([jnp.ones((n, 1), bool), sorted_e[:, 1:] != sorted_e[:, :-1]], axis=1)
    rank_sorted = idx - jax.lax.cummax(jnp.where(first, idx, 0), axis=1)  # earlier choices of the same expert
    rank = jnp.zeros_like(rank_sorted).at[jnp.arange(n)[:, None], order].set(rank_sorted)
    return (rank < cap).reshape(n, k, seq).transpose(0, 2, 1).reshape(rows, k)


def count_drops(weights: jax.Array, keep: jax.Array, s: MoeSettings) -> jax.Array:
    """``weights`` unchanged; in the backward pass ``s.probe`` receives ``(dropped, routed)``: the
    (token, expert) choices of this shard's sequences in this layer that capacity dropped, and all of
    them. The train step adds them over layers and microbatches and sums them once over the shards
    (the dropped-choice metric). Under sequence parallelism every tensor rank holds the same
    gathered choices: they are counted once (``pmax`` over ``tensor``)."""
    counts = jnp.stack([jnp.sum(~keep, dtype=jnp.float32), jnp.float32(keep.size)])
    extra = tuple(sorted(varying_axes(counts) - varying_axes(s.probe)))
    counts = jax.lax.pmax(counts, extra) if extra else counts  # equal on those ranks (gathered routing)
    return _with_load(weights, s.probe, vary(counts, varying_axes(s.probe)))


def moe_mlp(h_local: jax.Array, p: dict, s: MoeSettings, dtype, gather_seq, gather_routing) -> jax.Array:
    """The MoE MLP of normed activations ``h_local`` (b, s_local, h), ``p`` one layer's weights.

    ``gather_seq``: the block's column-parallel input gather (Megatron's "f": all-gather of the
    sequence under sequence parallelism); ``gather_routing``: the same gather for the routing
    decisions (b, s_local, k). The router runs on ``h_local`` before it, so its gradient is the
    tokens' own (no copy over ``tensor``). Returns (b, s, h), partial over ``tensor``.
    """
    b, sl, hd = h_local.shape
    logits = router_logits(h_local.reshape(b * sl, hd), p["router"])
    weights, experts, probs = route(logits, s, p.get("expert_bias"))
    if s.bias_rate and "expert_bias" in p:
        weights = with_load_statistic(weights, p["expert_bias"], experts, s.num_experts)
    if s.aux_loss_coeff or s.z_loss_coeff:
        weights = add_loss_gradient(weights, aux_loss(logits, probs, experts, s), s.loss_scale)
    h = gather_seq(h_local)
    weights = gather_routing(weights.reshape(b, sl, -1))
    experts = gather_routing(experts.reshape(b, sl, -1))
    T = h.shape[0] * h.shape[1]
    weights, experts = weights.reshape(T, -1), experts.reshape(T, -1)
    if s.capacity_factor:  # a dropped choice adds nothing (the residual carries the token)
        keep = within_capacity(experts, h.shape[1], s.num_experts, capacity(h.shape[1], s))
        if s.probe is not None:
            weights = count_drops(weights, keep, s)
        weights, experts = jnp.where(keep, weights, 0.0), jnp.where(keep, experts, s.num_experts)
    out = expert_mlp(h.reshape(T, hd), weights, experts, p, s, dtype).reshape(h.shape)
    if "shared_up" in p:  # column / row parallel like the dense MLP: partial over tensor too
        act = jax.nn.silu(dense(h, p["shared_gate"].astype(dtype))) * dense(h, p["shared_up"].astype(dtype))
        out = out + dense(act, p["shared_down"].astype(dtype))
    return out


def token_axes(data_axis: str | tuple[str, ...] | None, tensor_axis: str | None, sequence_parallel: bool):
    """Every axis the router's tokens are split over: the ZeRO group (data, expert, context) and,
    under sequence parallelism, ``tensor``."""
    axes = () if data_axis is None else group_axes(data_axis)
    if sequence_parallel and tensor_axis is not None:
        axes += (tensor_axis,)
    return axes
