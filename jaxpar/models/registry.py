"""The names of the model families (``model.name``) and how to import each: no family is imported
until it is used, and this module imports nothing of jaxpar but its errors, so the config
schema can check a name without loading JAX or flax."""

from __future__ import annotations

import importlib

from jaxpar.errors import ConfigError

# model.name -> "module:Class", imported on first use (config validation stays light)
FAMILIES: dict[str, str] = {
    "llama": "jaxpar.models.llama:LlamaModel",
    "gpt": "jaxpar.models.gpt:GptModel",
    "mixtral": "jaxpar.models.mixtral:MixtralModel",
    "qwen3": "jaxpar.models.qwen3:Qwen3Model",
    "qwen3_moe": "jaxpar.models.qwen3:Qwen3MoeModel",
    "deepseek_v3": "jaxpar.models.deepseek:DeepseekModel",
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
