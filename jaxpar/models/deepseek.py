"""The ``deepseek_v3`` family (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv:2412.19437):
LLaMA's residual stream with multi-head latent attention (MLA, DeepSeek-V2, arXiv:2405.04434) and
DeepSeekMoE MLPs (sigmoid routing, a per-expert selection bias, group-limited routing, shared
experts), the first ``first_dense_layers`` layers with a dense SwiGLU MLP of ``mlp_dim``.

**MLA.** Per token, ``c_q = RMSNorm(x W_qa)`` (``q_lora_rank``; 0: ``q = x W_q`` directly) and
``[c_kv, k_r] = x W_kva`` (``kv_lora_rank`` + ``qk_rope_head_dim``), ``c_kv`` RMSNormed (eps 1e-6,
as HF). Per head, ``q = c_q W_qb`` = [nope | rope] parts, ``[k_nope | v] = c_kv W_kvb``; the rope
part of the query and the one shared ``k_r`` are rotated (RoPE on the de-interleaved pairs:
DeepSeek's checkpoints keep rotary pairs adjacent, HF ``apply_rotary_pos_emb_interleave``), the
key is ``[k_nope | k_r]``, and attention is scaled by ``1/sqrt(qk_nope + qk_rope)`` (no YaRN, so
no ``mscale``). Tensor parallelism (Megatron's MLA): the low-rank projections and their norms run
on every tensor rank before the column-parallel input gather, so what is gathered under sequence
parallelism is the latents; ``W_qb``, ``W_kvb`` are split over heads (column-parallel) and the
output projection is row-parallel, reduced over ``tensor`` like LLaMA's. The values (``v_head_dim``
<= the query-key dim) are zero-padded to the query-key dim for the attention kernels and sliced
after.

**Dense first layers** are a second stack (``dense_blocks``), run by :meth:`DeepseekModel.embed`
after the token embedding, so the scanned ``blocks`` stay homogeneous (their role is the first
stage's, but pipeline parallelism with them is refused by :mod:`jaxpar.layout` for now). Their
stacked dim is named ``dense_layers`` (never split over ``pipeline``).

**Routing** (:func:`jaxpar.models.moe.route`): sigmoid (DeepSeek-V3; softmax: torchtitan's 16B
flavor, DeepSeekMoE 16B) scores plus ``expert_bias`` choose, the
unbiased scores weigh (renormalised when ``router_norm_topk``, times ``router_scale``). The bias
is a parameter the loss does not differentiate; the aux-loss-free balancing of the paper (section
2.1.2) moves it outside the optimizer (:mod:`jaxpar.models.moe`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ConfigDict, ConfigError
from jaxpar.models import base, llama, moe
from jaxpar.models.base import DTYPES, HFMap, HFTensor, require_settings
from jaxpar.ops import context_parallel, dropout

LATENT_NORM_EPS = 1e-6  # HF DeepseekV3RMSNorm's default, which q_a_layernorm / kv_a_layernorm use
DEEPSEEK_BLOCK = (
    ("norm", "rmsnorm"),
    ("mlp_activation", "swiglu"),
    ("position", "rope"),
    ("qk_norm", False),
    ("rope_scaling", "none"),
)


def _param(key, shape, axes, std, dtype) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(key, shape, dtype), logical_axes=axes)


class LatentAttention(nnx.Module):
    """MLA projections, stacked over ``L`` layers (module docstring)."""

    def __init__(self, m: ConfigDict, L: int, key: jax.Array, dtype):
        h, n = m.embed_dim, m.num_heads
        dq, dv, r = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim, m.qk_rope_head_dim
        k1, k2, k3, k4, k5 = jax.random.split(key, 5)
        std, out_std = m.init_std, m.init_std / math.sqrt(2 * m.num_layers)
        if m.q_lora_rank:
            self.wq_a = _param(k1, (L, h, m.q_lora_rank), ("layers", "embed", "q_lora"), std, dtype)
            self.q_norm = llama.Norm(m.q_lora_rank, "rmsnorm", dtype, stack=(L,))
            self.wq_b = _param(k2, (L, m.q_lora_rank, n, dq), ("layers", "q_lora", "heads", "head_dim"), std, dtype)
        else:
            self.wq = _param(k2, (L, h, n, dq), ("layers", "embed", "heads", "head_dim"), std, dtype)
        self.wkv_a = _param(k3, (L, h, m.kv_lora_rank + r), ("layers", "embed", "kv_lora"), std, dtype)
        self.kv_norm = llama.Norm(m.kv_lora_rank, "rmsnorm", dtype, stack=(L,))
        kvb = (L, m.kv_lora_rank, n, m.qk_nope_head_dim + dv)
        self.wkv_b = _param(k4, kvb, ("layers", "kv_lora", "heads", "head_dim"), std, dtype)
        self.wo = _param(k5, (L, n, dv, h), ("layers", "heads", "head_dim", "embed"), out_std, dtype)


class Blocks(nnx.Module):
    """``L`` stacked layers: MLA and either a dense MLP (``moe=False``) or DeepSeekMoE."""

    def __init__(self, m: ConfigDict, L: int, use_moe: bool, key: jax.Array, dtype):
        ka, km = jax.random.split(key)
        self.attn_norm = llama.Norm(m.embed_dim, m.norm, dtype, stack=(L,))
        self.attn = LatentAttention(m, L, ka, dtype)
        self.mlp_norm = llama.Norm(m.embed_dim, m.norm, dtype, stack=(L,))
        std, out_std = m.init_std, m.init_std / math.sqrt(2 * m.num_layers)
        if use_moe:
            self.moe = moe.Experts(
                L, m.embed_dim, m.moe_mlp_dim, m.num_experts, std, out_std, km, dtype, shared=m.shared_expert_dim
            )
            self.moe.expert_bias = nnx.Param(jnp.zeros((L, m.num_experts), dtype), logical_axes=("layers", "bias"))
        else:
            self.mlp = DenseMlp(L, m.embed_dim, m.mlp_dim, std, out_std, km, dtype)


class DenseMlp(nnx.Module):
    """A SwiGLU MLP of width ``f``, stacked over ``L`` layers (the dense first layers)."""

    def __init__(self, L: int, h: int, f: int, std: float, out_std: float, key: jax.Array, dtype):
        kg, ku, kd = jax.random.split(key, 3)
        self.w_gate = _param(kg, (L, h, f), ("layers", "embed", "mlp"), std, dtype)
        self.w_up = _param(ku, (L, h, f), ("layers", "embed", "mlp"), std, dtype)
        self.w_down = _param(kd, (L, f, h), ("layers", "mlp", "embed"), out_std, dtype)


class DeepseekV3(nnx.Module):
    def __init__(self, m: ConfigDict, rngs: nnx.Rngs):
        dtype = DTYPES[m.param_dtype]
        ke, kd, kb, kh = jax.random.split(rngs.params(), 4)
        self.embed = _param(ke, (m.vocab_size, m.embed_dim), ("vocab", "embed"), m.init_std, dtype)
        k = m.first_dense_layers
        if k:
            self.dense_blocks = Blocks(m, k, False, kd, dtype)
        self.blocks = Blocks(m, m.num_layers - k, True, kb, dtype)
        self.final_norm = llama.Norm(m.embed_dim, m.norm, dtype)
        if not m.tie_embeddings:
            self.lm_head = _param(kh, (m.embed_dim, m.vocab_size), ("embed", "vocab"), m.init_std, dtype)


# --------------------------------------------------------------------------- forward


@dataclasses.dataclass(frozen=True)
class ShardContext(llama.ShardContext):
    """LLaMA's context plus MLA's head split and DeepSeek's routing settings."""

    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    router_groups: int = 1
    router_group_topk: int = 1
    router_scale: float = 1.0
    router_bias_rate: float = 0.0

    @property
    def moe(self) -> moe.MoeSettings:
        """LLaMA's MoE settings with group-limited routing and the route scale."""
        return dataclasses.replace(
            super().moe,
            groups=self.router_groups,
            group_topk=self.router_group_topk,
            route_scale=self.router_scale,
            bias_rate=self.router_bias_rate,
        )


def deinterleave(x: jax.Array) -> jax.Array:
    """Rotary pairs ``(2i, 2i + 1)`` moved to ``(i, i + d/2)`` (rotate-half layout) on the last dim."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def _attention(x: jax.Array, a: dict, positions: jax.Array, ctx: ShardContext) -> jax.Array:
    """MLA of normed ``x`` (b, s_local, h); the output projection's partial sum over ``tensor``."""
    dt = DTYPES[ctx.compute_dtype]
    nope, dv = ctx.qk_nope_head_dim, ctx.v_head_dim
    if "wq_a" in a:  # the latent is computed on this rank's tokens, then gathered (module docstring)
        # einsum, not ops.matmul.dense: under sequence parallelism x varies over tensor and the
        # replicated weight's gradient must be summed over it, which JAX's own transpose does
        cq = llama.rms_norm(jnp.einsum("bsh,hr->bsr", x, a["wq_a"].astype(dt)), a["q_norm"]["scale"], LATENT_NORM_EPS)
        q = jnp.einsum("bsr,rnd->bsnd", llama.gather_seq(cq, ctx), a["wq_b"].astype(dt))
    else:
        q = jnp.einsum("bsh,hnd->bsnd", llama.gather_seq(x, ctx), a["wq"].astype(dt))
    ckv = jnp.einsum("bsh,hr->bsr", x, a["wkv_a"].astype(dt))
    rank = a["kv_norm"]["scale"].shape[-1]
    c = llama.rms_norm(ckv[..., :rank], a["kv_norm"]["scale"], LATENT_NORM_EPS)
    ckv = llama.gather_seq(jnp.concatenate([c, ckv[..., rank:]], axis=-1), ctx)
    kv = jnp.einsum("bsr,rnd->bsnd", ckv[..., :rank], a["wkv_b"].astype(dt))
    k_nope, v = kv[..., :nope], kv[..., nope:]
    q_rope = llama.rope(deinterleave(q[..., nope:]), positions, ctx.rope_theta)
    k_rope = llama.rope(deinterleave(ckv[..., rank:])[:, :, None, :], positions, ctx.rope_theta)
    q = jnp.concatenate([q[..., :nope], q_rope], axis=-1)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (*k_nope.shape[:3], k_rope.shape[-1]))], axis=-1)
    pad = q.shape[-1] - dv  # the kernels want one head dim: zero value columns, sliced off after
    att = context_parallel.causal_attention(
        q,
        k,
        jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, pad))) if pad else v,
        positions,
        implementation=ctx.attention,
        block=ctx.attention_block,
        axis=ctx.context_axis,
        exchange=ctx.context_exchange,
        noise=dropout.for_attention(ctx, q.shape[2], ctx.tensor_axis),
        segments=ctx.documents(),
    )
    return jnp.einsum("bsnd,ndh->bsh", att[..., :dv], a["wo"].astype(dt))


def _block(x: jax.Array, p: dict, positions: jax.Array, ctx: ShardContext) -> jax.Array:
    o = _attention(llama.norm(x, p["attn_norm"], ctx), p["attn"], positions, ctx)
    x = x + llama.branch(o, positions, dropout.ATTENTION_OUT, ctx)
    return llama.mlp_residual(x, p, positions, ctx)


# --------------------------------------------------------------------------- HF format

_L = "model.layers.{i}."
_A = _L + "self_attn."
_M = _L + "mlp."


def _stack(name: str, tensors: tuple[HFTensor, ...]) -> tuple[HFTensor, ...]:
    return tuple(dataclasses.replace(t, path=(name, *t.path[1:])) for t in tensors)


def _attention_tensors() -> tuple[HFTensor, ...]:
    """MLA's tensors, with both query forms (q_lora_rank > 0: q_a / q_b; 0: q_proj)."""
    q = (
        HFTensor(("blocks", "attn", "wq_a"), _A + "q_a_proj.weight", "transpose", "(q_lora_rank, embed_dim)"),
        HFTensor(("blocks", "attn", "q_norm", "scale"), _A + "q_a_layernorm.weight", "copy", "(q_lora_rank,)"),
        HFTensor(
            ("blocks", "attn", "wq_b"), _A + "q_b_proj.weight", "heads_in", "(num_heads*qk_head_dim, q_lora_rank)"
        ),
        HFTensor(("blocks", "attn", "wq"), _A + "q_proj.weight", "heads_in", "(num_heads*qk_head_dim, embed_dim)"),
    )
    return (
        *q,
        HFTensor(
            ("blocks", "attn", "wkv_a"),
            _A + "kv_a_proj_with_mqa.weight",
            "transpose",
            "(kv_lora_rank+qk_rope_head_dim, embed_dim)",
        ),
        HFTensor(("blocks", "attn", "kv_norm", "scale"), _A + "kv_a_layernorm.weight", "copy", "(kv_lora_rank,)"),
        HFTensor(
            ("blocks", "attn", "wkv_b"),
            _A + "kv_b_proj.weight",
            "heads_in",
            "(num_heads*(qk_nope_head_dim+v_head_dim), kv_lora_rank)",
        ),
        HFTensor(("blocks", "attn", "wo"), _A + "o_proj.weight", "heads_out", "(embed_dim, num_heads*v_head_dim)"),
        HFTensor(("blocks", "attn_norm", "scale"), _L + "input_layernorm.weight", "copy", "(embed_dim,)"),
        HFTensor(("blocks", "mlp_norm", "scale"), _L + "post_attention_layernorm.weight", "copy", "(embed_dim,)"),
    )


def _moe_tensors() -> tuple[HFTensor, ...]:
    experts = _M + "experts.{e}."
    shared = _M + "shared_experts."
    return (
        HFTensor(("blocks", "moe", "router"), _M + "gate.weight", "transpose", "(num_experts, embed_dim)"),
        HFTensor(("blocks", "moe", "expert_bias"), _M + "gate.e_score_correction_bias", "copy", "(num_experts,)"),
        HFTensor(("blocks", "moe", "w_gate"), experts + "gate_proj.weight", "transpose", "(moe_mlp_dim, embed_dim)"),
        HFTensor(("blocks", "moe", "w_up"), experts + "up_proj.weight", "transpose", "(moe_mlp_dim, embed_dim)"),
        HFTensor(("blocks", "moe", "w_down"), experts + "down_proj.weight", "transpose", "(embed_dim, moe_mlp_dim)"),
        HFTensor(("blocks", "moe", "shared_gate"), shared + "gate_proj.weight", "transpose", "(shared, embed_dim)"),
        HFTensor(("blocks", "moe", "shared_up"), shared + "up_proj.weight", "transpose", "(shared, embed_dim)"),
        HFTensor(("blocks", "moe", "shared_down"), shared + "down_proj.weight", "transpose", "(embed_dim, shared)"),
    )


def _dense_tensors() -> tuple[HFTensor, ...]:
    return (
        HFTensor(("blocks", "mlp", "w_gate"), _M + "gate_proj.weight", "transpose", "(mlp_dim, embed_dim)"),
        HFTensor(("blocks", "mlp", "w_up"), _M + "up_proj.weight", "transpose", "(mlp_dim, embed_dim)"),
        HFTensor(("blocks", "mlp", "w_down"), _M + "down_proj.weight", "transpose", "(embed_dim, mlp_dim)"),
    )


def hf_map() -> HFMap:
    """The HF ``DeepseekV3ForCausalLM`` tensors; ``{i}`` counts the dense layers first."""
    ends = tuple(t for t in llama.HF_LLAMA.tensors if t.path[0] != "blocks")
    return HFMap(
        tensors=(
            *ends,
            *_stack("dense_blocks", (*_attention_tensors(), *_dense_tensors())),
            *_attention_tensors(),
            *_moe_tensors(),
        ),
        config_fields=(
            *((f, k) for f, k in llama.HF_LLAMA.config_fields if f not in ("head_dim", "num_kv_heads")),
            ("moe_mlp_dim", "moe_intermediate_size"),
            ("num_experts", "n_routed_experts"),
            ("experts_per_token", "num_experts_per_tok"),
            ("router_norm_topk", "norm_topk_prob"),
            ("router_groups", "n_group"),
            ("router_group_topk", "topk_group"),
            ("router_scale", "routed_scaling_factor"),
            ("first_dense_layers", "first_k_dense_replace"),
            ("shared_expert_dim", "n_shared_experts"),
            ("q_lora_rank", "q_lora_rank"),
            ("kv_lora_rank", "kv_lora_rank"),
            ("qk_nope_head_dim", "qk_nope_head_dim"),
            ("qk_rope_head_dim", "qk_rope_head_dim"),
            ("v_head_dim", "v_head_dim"),
        ),
        requires=(*DEEPSEEK_BLOCK, ("router_score", "sigmoid")),
        label="HF DeepSeek-V3",
    )


HF_DEEPSEEK_V3 = hf_map()


# --------------------------------------------------------------------------- the interface


class DeepseekModel(llama.LlamaModel):
    """``model.name=deepseek_v3`` (module docstring)."""

    name = "deepseek_v3"
    roles = {
        "embed": "embedding",
        "dense_blocks": "dense_layers",
        "final_norm": "final_norm",
        "lm_head": "output",
    }
    hf = HF_DEEPSEEK_V3

    @classmethod
    def validate(cls, cfg: ConfigDict) -> None:
        require_settings(cfg, cls.name, DEEPSEEK_BLOCK)
        if cfg.num_experts < 2 or not cfg.kv_lora_rank:
            raise ConfigError(
                f"model.num_experts={cfg.num_experts}, model.kv_lora_rank={cfg.kv_lora_rank}: model.name=deepseek_v3 "
                "is MLA with experts; set both (DeepSeek-V3: 256 and 512), e.g. --config configs/tiny_deepseek_v3.py"
            )
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if (cfg.num_kv_heads, cfg.head_dim) != (cfg.num_heads, qk):
            raise ConfigError(
                f"model.num_kv_heads={cfg.num_kv_heads}, model.head_dim={cfg.head_dim}: MLA has one key per head of "
                f"the query-key dim; set --config.model.num_kv_heads={cfg.num_heads} --config.model.head_dim={qk}"
            )
        if cfg.shared_expert_dim % cfg.moe_mlp_dim:
            raise ConfigError(
                f"model.shared_expert_dim={cfg.shared_expert_dim}: DeepSeek's shared experts are whole experts; "
                f"use a multiple of model.moe_mlp_dim={cfg.moe_mlp_dim}"
            )
        if not 0 <= cfg.first_dense_layers < cfg.num_layers:
            raise ConfigError(
                f"model.first_dense_layers={cfg.first_dense_layers}: use 0 to model.num_layers-1="
                f"{cfg.num_layers - 1} (DeepSeek-V3: 3 of 61)"
            )

    def layer_stacks(self) -> dict[str, int]:
        k = self.cfg.first_dense_layers
        return {"dense_blocks": 0, "blocks": k} if k else {"blocks": 0}

    def init(self, key: jax.Array) -> dict:
        _, state = nnx.split(DeepseekV3(self.cfg, nnx.Rngs(params=key)))
        return nnx.to_pure_dict(state)

    def logical_axes(self) -> dict:
        model = nnx.eval_shape(lambda: DeepseekV3(self.cfg, nnx.Rngs(params=0)))
        _, state = nnx.split(model)
        names = nnx.to_pure_dict(
            jax.tree.map(
                lambda v: v.get_metadata()["logical_axes"], state, is_leaf=lambda x: isinstance(x, nnx.Variable)
            )
        )
        if "dense_blocks" in names:  # not the scanned dim: never split over pipeline
            names["dense_blocks"] = jax.tree.map(
                lambda t: ("dense_layers", *t[1:]), names["dense_blocks"], is_leaf=lambda t: isinstance(t, tuple)
            )
        return names

    def shard_context(self, **parallel: Any) -> ShardContext:
        m = self.cfg
        ctx = llama.shard_context_for(m, **parallel)
        fields = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)}
        return ShardContext(
            **fields,
            qk_nope_head_dim=m.qk_nope_head_dim,
            v_head_dim=m.v_head_dim,
            router_groups=m.router_groups,
            router_group_topk=m.router_group_topk,
            router_scale=m.router_scale,
            router_bias_rate=m.router_bias_rate,
        )

    def embed(self, params: dict, tokens: jax.Array, ctx: ShardContext) -> jax.Array:
        """The token embedding, then the dense first layers (gathered with it under ZeRO-3)."""
        x = llama.embed_tokens(params, tokens, ctx)
        if "dense_blocks" not in params:
            return x
        positions = context_parallel.rank_positions(ctx.context_axis, tokens.shape[1])
        local = dataclasses.replace(ctx, zero3_dims=None, zero3_groups=None)
        return base.scan_layers(_block, x, params["dense_blocks"], positions, local, "dense_blocks")

    def block(self, x: jax.Array, layer: dict, positions: jax.Array, ctx: ShardContext) -> jax.Array:
        return _block(x, layer, positions, ctx)
