"""The ``gpt`` family: the classic GPT-2/3 decoder block (Radford et al. 2019; Brown et al. 2020).

Pre-LayerNorm with bias, a GeLU MLP (tanh approximation, usually f = 4h) and a learned position
table, on the ``llama`` family's code (:mod:`jaxpar.models.llama`). What it adds is the check:
``model.name=gpt`` requires ``model.norm=layernorm``, ``model.mlp_activation=gelu`` and
``model.position=learned``; other mixes are ``llama`` variants. Linear layers carry no biases
(GPT-3's do: about 0.1% of its parameters), hence no HF GPT-2 checkpoint format.
"""

from __future__ import annotations

from jaxpar.config import ConfigDict, ConfigError
from jaxpar.models.llama import LlamaModel

# The settings that make the classic block: (model field, required value)
GPT_BLOCK = (("norm", "layernorm"), ("mlp_activation", "gelu"), ("position", "learned"))


class GptModel(LlamaModel):
    """``model.name=gpt``: LLaMA's code paths pinned to LayerNorm, GeLU and learned positions."""

    name = "gpt"
    hf = None

    @classmethod
    def validate(cls, cfg: ConfigDict) -> None:
        for field, want in GPT_BLOCK:
            if cfg[field] != want:
                raise ConfigError(
                    f"model.{field}='{cfg[field]}': model.name=gpt is the classic GPT block and needs "
                    f"model.{field}='{want}'; use model.name=llama for other combinations"
                )
