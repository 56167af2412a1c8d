"""Model families behind one interface (:class:`jaxpar.models.base.Model`), chosen by ``model.name``.

* ``llama``: the LLaMA decoder (:mod:`jaxpar.models.llama`): RMSNorm, SwiGLU, RoPE, grouped-query
  attention; its ``model.norm`` / ``model.mlp_activation`` / ``model.position`` switches also
  compute LayerNorm / GeLU / learned positions, in any combination (e.g. LLaMA with learned
  positions). HF LLaMA / Mistral checkpoints import and export (default switches only).
* ``gpt``: the classic GPT-2/3 block (:mod:`jaxpar.models.gpt`): the same code paths, pinned to
  LayerNorm, GeLU and learned positions (anything else is a ``llama`` variant); no HF format
  (HF GPT-2 has biases that jaxpar's linear layers do not).

A new family is one module defining a :class:`~jaxpar.models.base.Model` subclass, listed in
:data:`FAMILIES` (or added at run time with :func:`register`), plus a config setting ``model.name``.
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
