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

import importlib

from jaxpar.config import ConfigDict, ConfigError

# model.name -> "module:Class", imported on first use (config validation stays light)
FAMILIES: dict[str, str] = {
    "llama": "jaxpar.models.llama:LlamaModel",
    "gpt": "jaxpar.models.gpt:GptModel",
}
_registered: dict[str, type] = {}


def known_models() -> tuple[str, ...]:
    """Every accepted ``model.name``, sorted."""
    return tuple(sorted({*FAMILIES, *_registered}))


def register(cls: type) -> type:
    """Add a :class:`~jaxpar.models.base.Model` subclass under ``cls.name`` (usable as a decorator)."""
    _registered[cls.name] = cls
    return cls


def unregister(name: str) -> None:
    """Remove a family added with :func:`register` (tests)."""
    _registered.pop(name, None)


def check_name(name: str) -> None:
    """An unknown ``model.name`` is a one-line :class:`ConfigError` listing the known ones (called by
    :func:`jaxpar.config.validate`; imports no family, so loading a config stays light)."""
    if name not in FAMILIES and name not in _registered:
        raise ConfigError(f"model.name='{name}' is not a known model; use one of {', '.join(known_models())}")


def model_class(name: str) -> type:
    """The family class of ``model.name``; unknown names are a one-line :class:`ConfigError`."""
    check_name(name)
    if name in _registered:
        return _registered[name]
    module, _, attr = FAMILIES[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def get_model(model_cfg: ConfigDict):
    """The :class:`~jaxpar.models.base.Model` of a ``model`` config, after the family's own checks
    (:meth:`~jaxpar.models.base.Model.validate`: one-line :class:`ConfigError`). The trainer's
    ``Setup``, the planner's inventory and the HF importers all start here."""
    cls = model_class(model_cfg.name)
    cls.validate(model_cfg)
    return cls(model_cfg)
