"""The ``llama`` family: a LLaMA-style decoder in Flax NNX, written shard-locally (Megatron style).

Each ``nnx.Param`` carries its logical dim names (``logical_axes`` metadata) for
:mod:`jaxpar.sharding`. The layers are stacked on a leading ``layers`` dim and run with
``lax.scan``, so compile time does not grow with depth. The forward pass runs inside ``shard_map``
on *local* shards, with Megatron-LM's tensor-parallel collectives written out:

* column-parallel QKV and MLP up/gate, row-parallel attention output and MLP down, then one ``psum``
  over ``tensor`` (sequence parallelism: ``all_gather`` of the sequence before the block and
  ``psum_scatter`` after it); the backward all-reduce of Megatron's "f" is JAX's transpose of the
  implicit broadcast of a tensor-replicated activation;
* vocabulary-parallel embedding and cross-entropy (max / sum-exp / target logit over ``tensor``);
* ZeRO-3 gathers each layer inside the scan body and never saves it (:mod:`jaxpar.models.base`).

:class:`LlamaModel` puts these functions (which the parity tests call directly) behind the
:class:`~jaxpar.models.base.Model` interface, with the HF LLaMA maps (:data:`HF_LLAMA`). Outside
``shard_map`` the same code runs as a single-device model.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ConfigDict
from jaxpar.models import base, moe
from jaxpar.models.base import DTYPES, HFMap, HFTensor, Model
from jaxpar.ops import context_parallel, dropout
from jaxpar.ops.matmul import dense

# --------------------------------------------------------------------------- parameters


def _param(key: jax.Array, shape: tuple[int, ...], axes: tuple[str, ...], std: float, dtype) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(key, shape, dtype), logical_axes=axes)


def _ones(shape: tuple[int, ...], axes: tuple[str, ...], dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype), logical_axes=axes)


def _zeros(shape: tuple[int, ...], axes: tuple[str, ...], dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes)


class Norm(nnx.Module):
    """RMSNorm (LLaMA) or LayerNorm (classic GPT) scale/bias, optionally stacked over layers."""

    def __init__(self, dim: int, kind: str, dtype, stack: tuple[int, ...] = ()):
        lead = ("layers",) * len(stack)
        self.scale = _ones((*stack, dim), (*lead, "norm"), dtype)
        if kind == "layernorm":
            self.bias = _zeros((*stack, dim), (*lead, "norm_bias"), dtype)


class Attention(nnx.Module):
    """Grouped-query attention projections (and QK-norm scales), stacked over layers."""

    def __init__(self, m: ConfigDict, key: jax.Array, dtype):
        L, h, d = m.num_layers, m.embed_dim, m.head_dim
        kq, kk, kv, ko = jax.random.split(key, 4)
        std, out_std = m.init_std, m.init_std / math.sqrt(2 * L)
        self.wq = _param(kq, (L, h, m.num_heads, d), ("layers", "embed", "heads", "head_dim"), std, dtype)
        self.wk = _param(kk, (L, h, m.num_kv_heads, d), ("layers", "embed", "kv_heads", "head_dim"), std, dtype)
        self.wv = _param(kv, (L, h, m.num_kv_heads, d), ("layers", "embed", "kv_heads", "head_dim"), std, dtype)
        self.wo = _param(ko, (L, m.num_heads, d, h), ("layers", "heads", "head_dim", "embed"), out_std, dtype)
        if m.qk_norm:  # one scale per head dim, shared by every head (Qwen3)
            self.q_norm = Norm(d, "rmsnorm", dtype, stack=(L,))
            self.k_norm = Norm(d, "rmsnorm", dtype, stack=(L,))


class Mlp(nnx.Module):
    """SwiGLU (LLaMA) or GeLU (classic GPT, f = 4h) MLP, stacked over layers."""

    def __init__(self, m: ConfigDict, key: jax.Array, dtype):
        L, h, f = m.num_layers, m.embed_dim, m.mlp_dim
        kg, ku, kd = jax.random.split(key, 3)
        std, out_std = m.init_std, m.init_std / math.sqrt(2 * L)
        if m.mlp_activation == "swiglu":
            self.w_gate = _param(kg, (L, h, f), ("layers", "embed", "mlp"), std, dtype)
        self.w_up = _param(ku, (L, h, f), ("layers", "embed", "mlp"), std, dtype)
        self.w_down = _param(kd, (L, f, h), ("layers", "mlp", "embed"), out_std, dtype)


class Blocks(nnx.Module):
    """All transformer blocks, parameters stacked on a leading ``layers`` dim."""

    def __init__(self, m: ConfigDict, key: jax.Array, dtype):
        ka, km = jax.random.split(key)
        self.attn_norm = Norm(m.embed_dim, m.norm, dtype, stack=(m.num_layers,))
        self.attn = Attention(m, ka, dtype)
        self.mlp_norm = Norm(m.embed_dim, m.norm, dtype, stack=(m.num_layers,))
        if m.num_experts:
            L = m.num_layers
            std, out_std = m.init_std, m.init_std / math.sqrt(2 * L)
            self.moe = moe.Experts(
                L, m.embed_dim, m.mlp_dim, m.num_experts, std, out_std, km, dtype, shared=m.shared_expert_dim
            )
        else:
            self.mlp = Mlp(m, km, dtype)


class Llama(nnx.Module):
    """Embedding, stacked blocks, final norm and (optionally untied) output layer."""

    def __init__(self, m: ConfigDict, rngs: nnx.Rngs):
        dtype = DTYPES[m.param_dtype]
        ke, kb, kh, kp = jax.random.split(rngs.params(), 4)
        self.embed = _param(ke, (m.vocab_size, m.embed_dim), ("vocab", "embed"), m.init_std, dtype)
        if m.position == "learned":
            self.pos_embed = _param(kp, (m.max_seq_len, m.embed_dim), ("pos", "embed"), m.init_std, dtype)
        self.blocks = Blocks(m, kb, dtype)
        self.final_norm = Norm(m.embed_dim, m.norm, dtype)
        if not m.tie_embeddings:
            self.lm_head = _param(kh, (m.embed_dim, m.vocab_size), ("embed", "vocab"), m.init_std, dtype)


def init_params(model_cfg: ConfigDict, key: jax.Array) -> dict:
    """Parameters as a plain nested dict (the training state keeps pure pytrees)."""
    _, state = nnx.split(Llama(model_cfg, nnx.Rngs(params=key)))
    return nnx.to_pure_dict(state)


def logical_axes(model_cfg: ConfigDict) -> dict:
    """Logical dim names of every parameter, same tree as :func:`init_params` (no allocation)."""
    model = nnx.eval_shape(lambda: Llama(model_cfg, nnx.Rngs(params=0)))
    _, state = nnx.split(model)
    names = jax.tree.map(
        lambda v: v.get_metadata()["logical_axes"], state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return nnx.to_pure_dict(names)


# --------------------------------------------------------------------------- forward


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (:func:`rope_frequencies`); the ``model.rope_*`` fields."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    @classmethod
    def from_config(cls, model_cfg: ConfigDict) -> RopeScaling | None:
        """The scaling ``model_cfg`` asks for; None for plain RoPE (``model.rope_scaling=none``)."""
        if model_cfg.get("rope_scaling", "none") == "none":
            return None
        return cls(
            float(model_cfg.rope_scaling_factor),
            float(model_cfg.rope_low_freq_factor),
            float(model_cfg.rope_high_freq_factor),
            int(model_cfg.rope_original_max_seq_len),
        )


@dataclasses.dataclass(frozen=True)
class ShardContext(base.ShardContext):
    """:class:`jaxpar.models.base.ShardContext` plus the block's static settings."""

    mlp_activation: str = "swiglu"
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    position: str = "rope"
    qk_norm: bool = False
    # mixture of experts (model.num_experts > 0; jaxpar.models.moe)
    num_experts: int = 0
    experts_per_token: int = 2
    router_score: str = "softmax"
    router_norm_topk: bool = True
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    moe_capacity_factor: float = 0.0
    moe_dispatch: str = "grouped"

    @property
    def moe(self) -> moe.MoeSettings:
        """The MoE layer's settings, with the token-splitting axes of this shard."""
        return moe.MoeSettings(
            num_experts=self.num_experts,
            top_k=self.experts_per_token,
            score=self.router_score,
            norm_topk=self.router_norm_topk,
            aux_loss_coeff=self.moe_aux_loss_coeff,
            z_loss_coeff=self.moe_z_loss_coeff,
            capacity_factor=self.moe_capacity_factor,
            dispatch=self.moe_dispatch,
            loss_scale=1.0 / self.microbatches,
            expert_axis=self.expert_axis,
            token_axes=moe.token_axes(self.data_axis, self.tensor_axis, self.sequence_parallel),
            probe=self.moe_probe,
        )


def _axis_size(axis: str | None) -> int:
    return 1 if axis is None else jax.lax.axis_size(axis)


def _axis_index(axis: str | None):
    return 0 if axis is None else jax.lax.axis_index(axis)


def norm(x: jax.Array, p: dict, ctx: ShardContext) -> jax.Array:
    """``ctx.norm`` (RMSNorm or LayerNorm) of ``x`` with the scale (and bias) in ``p``."""
    if ctx.norm == "rmsnorm":
        return rms_norm(x, p["scale"], ctx.norm_eps)
    dtype = x.dtype
    x = x.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    x = (x - mean) * jax.lax.rsqrt(jnp.var(x, axis=-1, keepdims=True) + ctx.norm_eps)
    return (x * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last dim, in fp32 (Zhang & Sennrich 2019)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * scale.astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """RoPE's inverse frequencies ``f_i = theta^(-2i/d)``, ``i < d/2``, fp32; with ``scaling``, Llama
    3.1's (``model.rope_scaling=llama3``). With ``L`` the original context (``original_max_seq_len``),
    ``s`` the factor, ``lo``/``hi`` the low/high frequency factors, and ``w_i = 2 pi / f_i`` the
    wavelength, the scaled frequency is::

        f_i                          if w_i < L / hi   (high frequencies: unchanged)
        f_i / s                      if w_i > L / lo   (low frequencies: divided by the factor)
        (1 - a) f_i / s + a f_i      otherwise, a = (L / w_i - lo) / (hi - lo)  (smoothly in between)

    which is continuous (``a`` is 0 at ``w_i = L / lo`` and 1 at ``w_i = L / hi``). This is Meta's
    Llama 3.1 reference (``apply_scaling`` in ``llama/model.py`` of meta-llama/llama-models; factor 8,
    low 1, high 4, L 8192) and HF transformers' ``_compute_llama3_parameters``
    (``transformers/modeling_rope_utils.py``, rope_type ``llama3``), computed in the same order in
    fp32; torchtitan (``precompute_freqs_cis``, ``RoPEScalingArgs``, since 5bbda42) and Megatron-LM
    (``RotaryEmbedding._apply_scaling``, ``--use-rope-scaling``) compute the same.
    """
    freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if scaling is None:
        return freq
    s, lo, hi, length = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor, scaling.original_max_seq_len
    wavelen = 2 * math.pi / freq
    low_freq_wavelen, high_freq_wavelen = length / lo, length / hi
    scaled = jnp.where(wavelen > low_freq_wavelen, freq / s, freq)
    a = (length / wavelen - lo) / (hi - lo)
    smoothed = (1 - a) * scaled / s + a * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope(x: jax.Array, positions: jax.Array, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """Rotary embedding, rotate-half convention (the HF LLaMA layout), at :func:`rope_frequencies`."""
    d = x.shape[-1]
    freq = rope_frequencies(d, theta, scaling)
    angle = positions[:, None].astype(jnp.float32) * freq[None, :]  # (s, d/2)
    cos = jnp.concatenate([jnp.cos(angle)] * 2, axis=-1)[None, :, None, :]
    sin = jnp.concatenate([jnp.sin(angle)] * 2, axis=-1)[None, :, None, :]
    xf = x.astype(jnp.float32)
    half = jnp.concatenate([-xf[..., d // 2 :], xf[..., : d // 2]], axis=-1)
    return (xf * cos + half * sin).astype(x.dtype)


def gather_seq(x: jax.Array, ctx: ShardContext) -> jax.Array:
    """Megatron's "f": the input of a column-parallel block, made varying over ``tensor`` once.

    With sequence parallelism it is an all-gather of the sequence. Without, an explicit cast: one
    cast feeds all the column-parallel matmuls of the block (QKV, or up and gate), so the backward
    pass sums their input gradients in one all-reduce of b*s*h instead of one per matmul.
    """
    if ctx.tensor_axis is None:
        return x
    if ctx.sequence_parallel:
        return jax.lax.all_gather(x, ctx.tensor_axis, axis=1, tiled=True)
    return jax.lax.pcast(x, ctx.tensor_axis, to="varying")


def gather_routing(a: jax.Array, ctx: ShardContext) -> jax.Array:
    """Routing decisions (b, s_local, k) made on this tensor rank's tokens, for the whole sequence
    the experts see: all-gathered over ``tensor`` under sequence parallelism, else as they are."""
    if ctx.tensor_axis is None or not ctx.sequence_parallel:
        return a
    return jax.lax.all_gather(a, ctx.tensor_axis, axis=1, tiled=True)


def _reduce_tensor(x: jax.Array, ctx: ShardContext) -> jax.Array:
    """Megatron's "g": all-reduce of row-parallel outputs, or reduce-scatter on seq with SP."""
    if ctx.tensor_axis is None:
        return x
    if ctx.sequence_parallel:
        return jax.lax.psum_scatter(x, ctx.tensor_axis, scatter_dimension=1, tiled=True)
    return jax.lax.psum(x, ctx.tensor_axis)


def _local_positions(positions: jax.Array, seq_local: int, ctx: ShardContext) -> jax.Array:
    """Positions of the tokens a residual-stream tensor of ``seq_local`` tokens holds: all of the
    context rank's, or this tensor rank's share of them under sequence parallelism."""
    if not ctx.sequence_parallel or ctx.tensor_axis is None:
        return positions
    return jax.lax.dynamic_slice_in_dim(positions, _axis_index(ctx.tensor_axis) * seq_local, seq_local)


def branch(y: jax.Array, positions: jax.Array, site: int, ctx: ShardContext) -> jax.Array:
    """A residual branch's output after its row-parallel reduction, with hidden dropout (Megatron
    drops the attention and MLP outputs before each residual add; identity with dropout off)."""
    y = _reduce_tensor(y, ctx)
    if not dropout.active(ctx):
        return y
    return dropout.hidden(y, _local_positions(positions, y.shape[1], ctx), site, ctx)


def _block(x: jax.Array, p: dict, positions: jax.Array, ctx: ShardContext) -> jax.Array:
    dt = DTYPES[ctx.compute_dtype]

    def w(a):
        return a.astype(dt)

    h = gather_seq(norm(x, p["attn_norm"], ctx), ctx)
    a = p["attn"]
    q = jnp.einsum("bsh,hnd->bsnd", h, w(a["wq"]))
    k = jnp.einsum("bsh,hnd->bsnd", h, w(a["wk"]))
    v = jnp.einsum("bsh,hnd->bsnd", h, w(a["wv"]))
    if ctx.qk_norm:  # over each head's dims, before RoPE (Qwen3)
        q, k = rms_norm(q, a["q_norm"]["scale"], ctx.norm_eps), rms_norm(k, a["k_norm"]["scale"], ctx.norm_eps)
    if ctx.position == "rope":
        q = rope(q, positions, ctx.rope_theta, ctx.rope_scaling)
        k = rope(k, positions, ctx.rope_theta, ctx.rope_scaling)
    att = context_parallel.causal_attention(
        q,
        k,
        v,
        positions,
        implementation=ctx.attention,
        block=ctx.attention_block,
        axis=ctx.context_axis,
        exchange=ctx.context_exchange,
        noise=dropout.for_attention(ctx, q.shape[2], ctx.tensor_axis),
        segments=ctx.documents(),
    )
    o = jnp.einsum("bsnd,ndh->bsh", att, w(a["wo"]))
    x = x + branch(o, positions, dropout.ATTENTION_OUT, ctx)
    return mlp_residual(x, p, positions, ctx)


def mlp_residual(x: jax.Array, p: dict, positions: jax.Array, ctx: ShardContext) -> jax.Array:
    """``x`` plus the block's MLP branch (``p["moe"]``: experts; else ``p["mlp"]``: dense)."""
    dt = DTYPES[ctx.compute_dtype]

    def w(a):
        return a.astype(dt)

    if "moe" in p:
        y = moe.moe_mlp(
            norm(x, p["mlp_norm"], ctx),
            p["moe"],
            ctx.moe,
            dt,
            lambda a: gather_seq(a, ctx),
            lambda a: gather_routing(a, ctx),
        )
        return x + branch(y, positions, dropout.MLP_OUT, ctx)
    h = gather_seq(norm(x, p["mlp_norm"], ctx), ctx)
    m = p["mlp"]
    up = dense(h, w(m["w_up"]))
    if ctx.mlp_activation == "swiglu":
        act = jax.nn.silu(dense(h, w(m["w_gate"]))) * up
    else:
        act = jax.nn.gelu(up, approximate=True)
    return x + branch(dense(act, w(m["w_down"])), positions, dropout.MLP_OUT, ctx)


def run_blocks(x: jax.Array, blocks: dict, positions: jax.Array, ctx: ShardContext) -> jax.Array:
    """Scan the stacked blocks over their leading ``layers`` dim (:func:`jaxpar.models.base.scan_layers`)."""
    return base.scan_layers(_block, x, blocks, positions, ctx)


def embed_tokens(params: dict, tokens: jax.Array, ctx: ShardContext) -> jax.Array:
    """Vocabulary-parallel embedding lookup; the output is reduced over ``tensor``."""
    table = params["embed"]
    vocab_local = table.shape[0]
    local = tokens - _axis_index(ctx.tensor_axis) * vocab_local
    inside = (local >= 0) & (local < vocab_local)
    x = jnp.take(table, jnp.clip(local, 0, vocab_local - 1), axis=0) * inside[..., None].astype(table.dtype)
    x = _reduce_tensor(x.astype(DTYPES[ctx.compute_dtype]), ctx)
    if ctx.position == "learned":  # replicated over tensor: added after the reduction
        seq_local = x.shape[1]
        start = _axis_index(ctx.tensor_axis) * seq_local if ctx.sequence_parallel else 0
        if ctx.context_axis is None:
            pos = jax.lax.dynamic_slice_in_dim(params["pos_embed"], start, seq_local, axis=0)
        else:  # this context rank's two chunks (jaxpar.ops.context_parallel), then the tensor rank's share
            positions = jax.lax.dynamic_slice_in_dim(
                context_parallel.rank_positions(ctx.context_axis, tokens.shape[1]), start, seq_local
            )
            pos = jnp.take(params["pos_embed"], positions, axis=0)
        x = x + pos.astype(x.dtype)[None]
    if dropout.active(ctx):  # Megatron's embedding dropout, at the hidden rate
        positions = _local_positions(
            context_parallel.rank_positions(ctx.context_axis, tokens.shape[1]), x.shape[1], ctx
        )
        x = dropout.hidden(x, positions, dropout.EMBED, ctx)
    return x


def logits_local(params: dict, x: jax.Array, ctx: ShardContext) -> jax.Array:
    """Final norm and output layer; returns this tensor rank's slice of the vocabulary, fp32."""
    h = gather_seq(norm(x, params["final_norm"], ctx), ctx)
    dt = DTYPES[ctx.compute_dtype]
    if "lm_head" in params:
        logits = dense(h, params["lm_head"].astype(dt))
    else:
        logits = dense(h, params["embed"].astype(dt).T)
    return logits.astype(jnp.float32)


def cross_entropy_sum(logits: jax.Array, targets: jax.Array, ctx: ShardContext) -> jax.Array:
    """Sum over tokens of next-token cross-entropy, vocabulary-parallel over ``tensor``, fp32."""
    axis = ctx.tensor_axis
    vocab_local = logits.shape[-1]
    local_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
    top = local_max if axis is None else jax.lax.pmax(local_max, axis)
    z = logits - jax.lax.stop_gradient(top)[..., None]
    sum_exp = jnp.sum(jnp.exp(z), axis=-1)
    local = targets - _axis_index(axis) * vocab_local
    inside = (local >= 0) & (local < vocab_local)
    target_z = jnp.take_along_axis(z, jnp.clip(local, 0, vocab_local - 1)[..., None], axis=-1)[..., 0]
    target_z = jnp.where(inside, target_z, 0.0)
    if axis is not None:
        sum_exp, target_z = jax.lax.psum(sum_exp, axis), jax.lax.psum(target_z, axis)
    return jnp.sum(jnp.log(sum_exp) - target_z)


def loss_sum(params: dict, tokens: jax.Array, ctx: ShardContext) -> jax.Array:
    """Summed next-token loss of ``tokens`` (b, s+1) on this shard (local rows); ``ctx`` from
    :func:`shard_context_for` (the model config is not needed beyond it)."""
    return LlamaModel(None).loss_sum(params, tokens, ctx)


def shard_context_for(model_cfg: ConfigDict, **overrides: Any) -> ShardContext:
    """A :class:`ShardContext` with the model's static settings (the layout's, such as ``recompute``, come as
    ``overrides``)."""
    return ShardContext(
        compute_dtype=model_cfg.compute_dtype,
        mlp_activation=model_cfg.mlp_activation,
        norm=model_cfg.norm,
        norm_eps=model_cfg.norm_eps,
        rope_theta=model_cfg.rope_theta,
        rope_scaling=RopeScaling.from_config(model_cfg),
        position=model_cfg.position,
        qk_norm=model_cfg.qk_norm,
        num_experts=model_cfg.num_experts,
        experts_per_token=model_cfg.experts_per_token,
        router_score=model_cfg.router_score,
        router_norm_topk=model_cfg.router_norm_topk,
        moe_aux_loss_coeff=model_cfg.moe_aux_loss_coeff,
        moe_z_loss_coeff=model_cfg.moe_z_loss_coeff,
        moe_capacity_factor=model_cfg.moe_capacity_factor,
        moe_dispatch=model_cfg.moe_dispatch,
        dropout=model_cfg.get("dropout", 0.0),
        attention_dropout=model_cfg.get("attention_dropout", 0.0),
        attention_mask=model_cfg.get("attention_mask", "causal"),
        eos_token_id=model_cfg.get("eos_token_id", -1),
        **overrides,
    )


# --------------------------------------------------------------------------- the interface

_L = "model.layers.{i}."
HF_LLAMA = HFMap(
    tensors=(
        HFTensor(("embed",), "model.embed_tokens.weight", "copy", "(vocab_size, embed_dim)"),
        HFTensor(
            (Model.stacked, "attn", "wq"),
            _L + "self_attn.q_proj.weight",
            "heads_in",
            "(num_heads*head_dim, embed_dim)",
            rope=True,
        ),
        HFTensor(
            (Model.stacked, "attn", "wk"),
            _L + "self_attn.k_proj.weight",
            "heads_in",
            "(num_kv_heads*head_dim, embed_dim)",
            rope=True,
        ),
        HFTensor(
            (Model.stacked, "attn", "wv"),
            _L + "self_attn.v_proj.weight",
            "heads_in",
            "(num_kv_heads*head_dim, embed_dim)",
        ),
        HFTensor(
            (Model.stacked, "attn", "wo"),
            _L + "self_attn.o_proj.weight",
            "heads_out",
            "(embed_dim, num_heads*head_dim)",
        ),
        HFTensor((Model.stacked, "mlp", "w_gate"), _L + "mlp.gate_proj.weight", "transpose", "(mlp_dim, embed_dim)"),
        HFTensor((Model.stacked, "mlp", "w_up"), _L + "mlp.up_proj.weight", "transpose", "(mlp_dim, embed_dim)"),
        HFTensor((Model.stacked, "mlp", "w_down"), _L + "mlp.down_proj.weight", "transpose", "(embed_dim, mlp_dim)"),
        HFTensor((Model.stacked, "attn_norm", "scale"), _L + "input_layernorm.weight", "copy", "(embed_dim,)"),
        HFTensor((Model.stacked, "mlp_norm", "scale"), _L + "post_attention_layernorm.weight", "copy", "(embed_dim,)"),
        HFTensor(("final_norm", "scale"), "model.norm.weight", "copy", "(embed_dim,)"),
        HFTensor(("lm_head",), "lm_head.weight", "transpose", "(vocab_size, embed_dim)"),
    ),
    # model fields an HF config.json fixes: (jaxpar field, HF key in the message). Not the dropout
    # rates: config.json's attention_dropout is read on import (jaxpar.port.weights) but is a training
    # choice, which fine-tuning may change, not a property of the weights.
    config_fields=(
        ("vocab_size", "vocab_size"),
        ("embed_dim", "hidden_size"),
        ("num_layers", "num_hidden_layers"),
        ("num_heads", "num_attention_heads"),
        ("num_kv_heads", "num_key_value_heads"),
        ("head_dim", "head_dim"),
        ("mlp_dim", "intermediate_size"),
        ("tie_embeddings", "tie_word_embeddings"),
        ("rope_theta", "rope_theta"),
        ("rope_scaling", "rope_scaling.rope_type"),
        ("rope_scaling_factor", "rope_scaling.factor"),
        ("rope_low_freq_factor", "rope_scaling.low_freq_factor"),
        ("rope_high_freq_factor", "rope_scaling.high_freq_factor"),
        ("rope_original_max_seq_len", "rope_scaling.original_max_position_embeddings"),
        ("norm_eps", "rms_norm_eps"),
        ("mlp_activation", "hidden_act"),
        ("norm", "model_type"),
        ("position", "model_type"),
    ),
    requires=(
        ("norm", "rmsnorm"),
        ("mlp_activation", "swiglu"),
        ("position", "rope"),
        ("qk_norm", False),
        ("num_experts", 0),
    ),
    label="HF LLaMA",
)


class LlamaModel(Model):
    """The ``llama`` family (see the module docstring); every switch combination is allowed."""

    name = "llama"
    roles = {"embed": "embedding", "pos_embed": "positions", "final_norm": "final_norm", "lm_head": "output"}
    hf = HF_LLAMA

    def init(self, key: jax.Array) -> dict:
        return init_params(self.cfg, key)

    def logical_axes(self) -> dict:
        return logical_axes(self.cfg)

    def shard_context(self, **parallel: Any) -> ShardContext:
        return shard_context_for(self.cfg, **parallel)

    def embed(self, params: dict, tokens: jax.Array, ctx: ShardContext) -> jax.Array:
        return embed_tokens(params, tokens, ctx)

    def block(self, x: jax.Array, layer: dict, positions: jax.Array, ctx: ShardContext) -> jax.Array:
        return _block(x, layer, positions, ctx)

    def head_loss(self, params: dict, x: jax.Array, targets: jax.Array, ctx: ShardContext) -> jax.Array:
        return cross_entropy_sum(logits_local(params, x, ctx), targets, ctx)
