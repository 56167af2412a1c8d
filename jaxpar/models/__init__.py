"""Model families behind one interface (:class:`jaxpar.models.base.Model`), chosen by ``model.name``.

* ``llama`` (:mod:`jaxpar.models.llama`): RMSNorm, SwiGLU, RoPE, grouped-query attention; its
  ``model.norm`` / ``model.mlp_activation`` / ``model.position`` switches also give LayerNorm /
  GeLU / learned positions in any combination. HF LLaMA / Mistral checkpoints import and export.
* ``gpt`` (:mod:`jaxpar.models.gpt`): the same code pinned to the classic GPT-2/3 block; no HF format.
* ``qwen3``, ``qwen3_moe``, ``mixtral``: LLaMA's code with QK-norm and/or experts, HF formats.

A new family is one module defining a :class:`~jaxpar.models.base.Model` subclass, listed in
:data:`FAMILIES` (or :func:`register` at run time), plus a config setting ``model.name``.
"""

from __future__ import annotations

from typing import Any

from jaxpar.models.registry import (  # noqa: F401 - the registry's names are the package's
    FAMILIES,
    check_name,
    known_models,
    model_class,
    register,
    unregister,
)


def get_model(model_cfg: Any):
    """The :class:`~jaxpar.models.base.Model` of a ``model`` config, after the family's own checks
    (:meth:`~jaxpar.models.base.Model.validate`: one-line :class:`ConfigError`). The trainer's
    ``Setup``, the planner's inventory and the HF importers all start here."""
    cls = model_class(model_cfg.name)
    cls.validate(model_cfg)
    return cls(model_cfg)
