"""The mixture-of-experts layer's share of the temporaries (:mod:`jaxpar.analysis.activations`).

An MoE layer (:func:`jaxpar.models.moe.moe_mlp`) replaces the dense MLP's residuals and backward
working set with its own, counted here from the code. Per device and microbatch: T = b*s tokens
(s the context rank's slice, gathered over ``tensor`` under SP), n = mesh.expert, G = E/n local
experts, k experts per token, f = the experts' width / t (``model.moe_mlp_dim`` where it is set, deepseek_v3's;
else ``mlp_dim``), e the compute-dtype bytes. The dispatch all-gathers
the expert group's n*T tokens and sorts their N = n*T*k (token, choice) rows by expert
(:func:`jaxpar.models.moe.expert_mlp`); rows of other ranks' experts sort past every group and are
computed on but weigh 0, so every size below is the dropless one whatever
``model.moe_capacity_factor`` says (a dropped choice keeps its row, weight 0).

Residuals (``none``), per layer, replacing the dense SwiGLU's 6 e*b*s*f:

- the grouped SwiGLU on the N rows, as JAX linearizes it: the gate and up outputs, silu's jvp
  residuals (its input, sigmoid, silu) and the product fed to W_down: 6 e*N*f;
- the rows taken from the gathered tokens (the ragged matmuls' input) and W_down's output
  before its routing weight (the weight's gradient reads it): 2 e*N*h;
- the router's fp32 logits and probabilities on the rank's own T/t (SP) or T rows: 2 * 4*T*E.

``selective`` keeps the router logits (a dot without batch dims) of all that, ``full`` nothing;
both recompute the rest inside the layer's backward.

Backward working set (the layer's MoE phase, on top of the stack): on CPU jax lowers
``ragged_dot`` through its generic implementation (``_ragged_dot_general_impl`` in
``jax/_src/lax/lax.py``: the ragged operand broadcast over the G local groups and masked with
``select``), so the transposes run over every group: the gate and up gradients masked per group,
(G, N, f) each, and each laid out again as (N, G*f) for the weight gradient, 4 e*G*N*f; the masked
rows (G, N, h), e*G*N*h; the gradient of W_down's input, e*N*f; and the zero (n*T, h) buffer the
token gradient is scatter-added into, e*n*T*h. On GPU and TPU ``ragged_dot`` lowers to the
ragged-dot instruction (or a Triton kernel) without the G-fold arrays: for those the count is an
upper bound (the planner uses it for every cluster). Counted in the buffer assignment of
tiny_mixtral, fp32, e4 x d2 at s=256 (the live set at the peak:
``experiments/live_set.py``) and held against the grid of
tests/test_memory_moe.py. A shared expert (``shared_expert_dim``) adds the dense SwiGLU's
terms at its width.

``moe_dispatch=dense`` (every local expert on every gathered token: R = n*T*G rows, einsums, no
ragged matmul) saves the SwiGLU's six (R, f) arrays, W_down's per-expert output (R, h) and the
gathered tokens (n*T, h), and its backward holds five (R, f) arrays and the tokens' slice (n*T, h)
(buffer assignment of tiny_mixtral e4 x d2, s=128).
"""

from __future__ import annotations

import dataclasses

from jaxpar.config import ConfigDict
from jaxpar.models.inventory import DTYPE_BYTES, ParallelLayout

F32 = 4


@dataclasses.dataclass(frozen=True)
class MoeDims:
    """Per-device sizes of one MoE layer for one microbatch (module docstring)."""

    e: int  # compute-dtype bytes
    tokens: float  # T: the rank's tokens as the experts see them (b*s, gathered over tensor under SP)
    router_rows: float  # the router's rows: b*s/t under SP, else T
    gathered: float  # n*T: the expert group's tokens
    rows: float  # N: the (token, choice) rows the local experts run on (n*T*k; dense dispatch n*T*G)
    groups: int  # G: local experts
    h: int
    f: float  # mlp_dim / t
    shared: float  # shared_expert_dim / t
    experts: int  # E
    dense: bool = False  # moe_dispatch=dense: rows = n*T*G, every local expert on every token

    @classmethod
    def of(cls, model: ConfigDict, layout: ParallelLayout, b: int | None = None) -> MoeDims:
        t, n = layout.tensor, layout.expert
        b = layout.microbatch_size if b is None else b
        s = layout.seq_len // layout.context
        tokens = b * s
        groups = model.num_experts // n
        dense = model.get("moe_dispatch", "grouped") == "dense"
        return cls(
            DTYPE_BYTES[model.compute_dtype],
            tokens,
            tokens / t if layout.sequence_parallel else tokens,
            n * tokens,
            n * tokens * (groups if dense else model.experts_per_token),
            groups,
            model.embed_dim,
            (model.get("moe_mlp_dim", 0) or model.mlp_dim) / t,
            model.get("shared_expert_dim", 0) / t,
            model.num_experts,
            dense,
        )


def moe_residual_bytes(model: ConfigDict, layout: ParallelLayout, recompute: str, b: int | None = None) -> float:
    """What one MoE layer saves for its backward beyond attention and norms (module docstring):
    ``none`` 6 e*N*f + 2 e*N*h + 2 * 4*T*E (dense dispatch: 6 e*R*f + e*R*h + e*n*T*h in place of
    the first two; + the shared expert's 6 e*T*f_s); ``selective`` the
    router's fp32 logits 4*T*E (+ the shared expert's gate and up, 2 e*T*f_s); ``full`` nothing."""
    d = MoeDims.of(model, layout, b)
    if recompute == "full":
        return 0.0
    if recompute == "selective":
        return F32 * d.router_rows * d.experts + 2 * d.e * d.tokens * d.shared
    routed = 6 * d.e * d.rows * d.f + 2 * d.e * d.rows * d.h
    if d.dense:  # W_down's per-expert output and the gathered tokens, not the taken rows
        routed = 6 * d.e * d.rows * d.f + d.e * d.rows * d.h + d.e * d.gathered * d.h
    return routed + 2 * F32 * d.router_rows * d.experts + 6 * d.e * d.tokens * d.shared


def moe_backward_bytes(model: ConfigDict, layout: ParallelLayout, b: int | None = None) -> float:
    """One MoE layer's backward working set (module docstring): 4 e*G*N*f + e*G*N*h + e*N*f +
    e*n*T*h (dense dispatch: 5 e*R*f + e*n*T*h), the shared expert's three (b, s, f_s) gradients, and under ``selective`` / ``full`` the
    recomputed forward's residuals (:func:`moe_residual_bytes` of ``none``)."""
    d = MoeDims.of(model, layout, b)
    working = d.e * (4 * d.groups * d.rows * d.f + d.groups * d.rows * d.h + d.rows * d.f + d.gathered * d.h)
    if d.dense:  # plain einsums: five (R, f) arrays and the tokens' slice
        working = d.e * (5 * d.rows * d.f + d.gathered * d.h)
    if layout.recompute != "none":
        working += moe_residual_bytes(model, layout, "none", b)
    if not d.dense:
        working = max(working, moe_wide_rows_bytes(model, layout, b))
    return working + 3 * d.e * d.tokens * d.shared


def moe_wide_rows_bytes(model: ConfigDict, layout: ParallelLayout, b: int | None = None) -> float:
    """The phase of an MoE layer's backward that holds the (G, N, h) arrays, the larger where the model is
    wider than its experts (h > f: Qwen3-30B-A3B's 2048 and 768, DeepSeek-V3's 7168 and 2048).

    The generic ``ragged_dot`` masks its ragged operand per group, so a ragged matmul whose operand is
    the (N, h) rows holds (G, N, h) and lays it out again as (N, G*h) for the dot with the weight laid out
    as (G*h, f). Under ``selective`` / ``full`` the backward recomputes the gate and up matmuls: two of
    each, 4 e*G*N*h, beside a second layout of the layer's three expert weights (each (G, h, f): e*G*h*f,
    one already counted with the layer's weights), 3 e*G*h*f, and four (N, h)-sized row arrays (the taken
    rows and their mask, the routed output's gradient and its transpose), 4 e*N*h. Without recompute
    the gate and up weight gradients read the saved rows: two (G, N, h) and one (N, G*h), beside one
    (G, N, f) output gradient and the (G, f, h)-sized weight gradient being written (the three relaid
    weights beside them are the layer's weights, counted with them), e*(3 G*N*h + G*N*f + G*h*f). Buffer
    assignment of Qwen3-30B-A3B cut to 4 layers, fp32, data=2 x expert=4, b=1, s=128 (G=32, N=4096): at
    the peak two f32[32, 4096, 2048] and two
    f32[4096, 65536] under ``full`` and ``selective``, beside six f32[G*h*f]-sized weight layouts; under
    ``none`` two f32[32, 4096, 2048], one f32[4096, 65536], one f32[32, 4096, 768] and four (G*h*f)-sized."""
    d = MoeDims.of(model, layout, b)
    wide = d.groups * d.rows * d.h
    weights = d.groups * d.h * d.f
    if layout.recompute == "none":
        return d.e * (3 * wide + d.groups * d.rows * d.f + weights)
    return d.e * (4 * wide + 3 * weights + 4 * d.rows * d.h)
