"""The ``mixtral`` family: LLaMA's decoder with a mixture-of-experts MLP in every layer (Jiang et
al. 2024, "Mixtral of Experts"): ``num_experts`` SwiGLU experts of ``mlp_dim``, a softmax router
whose top ``experts_per_token`` weights are renormalised (:mod:`jaxpar.models.moe`). The code is the
``llama`` family's; this pins what HF ``MixtralForCausalLM`` checkpoints hold and carries their
tensor names: per layer ``block_sparse_moe.gate.weight`` (E, h) and
``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` (gate, up: (f, h); down: (h, f)).
"""

from __future__ import annotations

from jaxpar.config import ConfigDict, ConfigError
from jaxpar.models.base import HFMap, expert_tensors, require_settings
from jaxpar.models.llama import HF_LLAMA, LlamaModel

# The settings a Mixtral checkpoint computes with: (model field, required value)
MIXTRAL_BLOCK = (
    ("norm", "rmsnorm"),
    ("mlp_activation", "swiglu"),
    ("position", "rope"),
    ("router_score", "softmax"),
    ("router_norm_topk", True),
    ("shared_expert_dim", 0),
)

HF_MIXTRAL = HFMap(
    tensors=(
        *HF_LLAMA.without_dense_mlp(),
        *expert_tensors("model.layers.{i}.block_sparse_moe.", "gate.weight", "w1.weight", "w3.weight", "w2.weight"),
    ),
    config_fields=(
        *HF_LLAMA.config_fields,
        ("num_experts", "num_local_experts"),
        ("experts_per_token", "num_experts_per_tok"),
    ),
    requires=MIXTRAL_BLOCK,
    label="HF Mixtral",
)


class MixtralModel(LlamaModel):
    """``model.name=mixtral``: LLaMA's code paths with a softmax-routed MoE MLP in every layer."""

    name = "mixtral"
    hf = HF_MIXTRAL

    @classmethod
    def validate(cls, cfg: ConfigDict) -> None:
        if cfg.num_experts < 2:
            raise ConfigError(
                f"model.num_experts={cfg.num_experts}: model.name=mixtral is a mixture of experts; set "
                "--config.model.num_experts=8 (Mixtral 8x7B), or use model.name=llama for a dense model"
            )
        require_settings(cfg, cls.name, MIXTRAL_BLOCK)
