"""The ``qwen3`` and ``qwen3_moe`` families (Qwen Team 2025, "Qwen3 Technical Report"): LLaMA's
decoder with QK-norm (an RMSNorm of every query and key head before RoPE, one scale per head dim)
and, for ``qwen3_moe``, a softmax-routed mixture of experts in every layer, top-k weights
renormalised where ``norm_topk_prob`` says (:mod:`jaxpar.models.moe`). The code is the ``llama``
family's; these pin what HF ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` checkpoints hold and
carry their tensor names (per layer ``self_attn.q_norm.weight`` / ``k_norm.weight`` (head_dim,); MoE
``mlp.gate.weight`` (E, h), ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``).
"""

from __future__ import annotations

from jaxpar.config import ConfigDict, ConfigError
from jaxpar.models.base import HFMap, HFTensor, Model, expert_tensors, require_settings
from jaxpar.models.llama import HF_LLAMA, LlamaModel

_A = "model.layers.{i}.self_attn."
_M = "model.layers.{i}.mlp."
QK_NORM = (
    HFTensor((Model.stacked, "attn", "q_norm", "scale"), _A + "q_norm.weight", "copy", "(head_dim,)"),
    HFTensor((Model.stacked, "attn", "k_norm", "scale"), _A + "k_norm.weight", "copy", "(head_dim,)"),
)
DENSE_BLOCK = (("norm", "rmsnorm"), ("mlp_activation", "swiglu"), ("position", "rope"), ("qk_norm", True))
MOE_BLOCK = (*DENSE_BLOCK, ("router_score", "softmax"), ("shared_expert_dim", 0))
HF_QWEN3 = HFMap(
    tensors=(*HF_LLAMA.tensors, *QK_NORM),
    config_fields=HF_LLAMA.config_fields,
    requires=DENSE_BLOCK,
    label="HF Qwen3",
)
HF_QWEN3_MOE = HFMap(
    tensors=(
        *HF_LLAMA.without_dense_mlp(),
        *QK_NORM,
        *expert_tensors(_M, "gate.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight"),
    ),
    config_fields=(
        *((f, k) for f, k in HF_LLAMA.config_fields if f != "mlp_dim"),
        ("mlp_dim", "moe_intermediate_size"),
        ("num_experts", "num_experts"),
        ("experts_per_token", "num_experts_per_tok"),
        ("router_norm_topk", "norm_topk_prob"),
    ),
    requires=MOE_BLOCK,
    label="HF Qwen3-MoE",
)


class Qwen3Model(LlamaModel):
    """``model.name=qwen3``: LLaMA's code paths with QK-norm, dense MLPs."""

    name = "qwen3"
    hf = HF_QWEN3

    @classmethod
    def validate(cls, cfg: ConfigDict) -> None:
        require_settings(cfg, cls.name, DENSE_BLOCK)
        if cfg.num_experts:
            raise ConfigError(
                f"model.num_experts={cfg.num_experts}: model.name=qwen3 is the dense Qwen3; use model.name=qwen3_moe"
            )


class Qwen3MoeModel(LlamaModel):
    """``model.name=qwen3_moe``: QK-norm and a softmax-routed MoE MLP in every layer."""

    name = "qwen3_moe"
    hf = HF_QWEN3_MOE

    @classmethod
    def validate(cls, cfg: ConfigDict) -> None:
        require_settings(cfg, cls.name, MOE_BLOCK)
        if cfg.num_experts < 2:
            raise ConfigError(
                f"model.num_experts={cfg.num_experts}: model.name=qwen3_moe is a mixture of experts; set "
                "--config.model.num_experts=128 (Qwen3-30B-A3B), or use model.name=qwen3"
            )
