"""Port a recipe of any kind (``deepspeed``, ``megatron``, ``torchtitan``, ``fsdp``) and write the
result as a runnable jaxpar config file.

:func:`port_recipe` runs the importer of the kind and applies jaxpar fields set on top of it
(``model.vocab_size=128256``), re-validating; :func:`config_source` is the text of a config file
(``get_config()`` on top of ``default_config()``, only the fields that differ) and
:func:`write_atomic` writes it through a temporary file and a rename. Every bad input is a
:class:`ConfigError`: one line naming the field and the fix. The flags are in :mod:`jaxpar.cli.port`.
"""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING, Any

from jaxpar import write_guard
from jaxpar.config import MAX_DEVICES, ConfigDict, ConfigError, apply_overrides, default_config, flatten, validate

if TYPE_CHECKING:  # jaxpar.port.report imports JAX (through jaxpar.optim): not at the CLI's start
    from jaxpar.port.report import Report

SOURCES = ("deepspeed", "megatron", "torchtitan", "fsdp")


def port_recipe(
    source: str,
    file: str,
    *,
    world_size: int | None = None,
    tensor: int = 1,
    pipeline: int = 1,
    variables: dict[str, str] | None = None,
    side: dict[str, Any] | None = None,
    fields: dict[str, str] | None = None,
    allow_unresolved: bool = False,
) -> tuple[ConfigDict, Report]:
    """Port ``file`` with the importer of ``source``, then set the jaxpar ``fields`` (``key -> value``
    text) on the result; a config that no longer validates is reported in ``report.problems``.

    ``tensor``, ``pipeline`` and ``side`` (values for DeepSpeed ``"auto"`` settings) are DeepSpeed's,
    ``variables`` (shell variables) Megatron's; ``allow_unresolved`` uses defaults for values the
    recipe leaves open (not for FSDP, which leaves none).
    """
    if world_size is not None and not 1 <= world_size <= MAX_DEVICES:
        raise ConfigError(f"--world-size {world_size}: use a number of GPUs in [1, {MAX_DEVICES}]")
    try:
        cfg, report = _port(
            source,
            file,
            world_size=world_size,
            tensor=tensor,
            pipeline=pipeline,
            variables=variables,
            side=side,
            allow_unresolved=allow_unresolved,
        )
    except ConfigError:
        raise
    except (
        UnicodeDecodeError,
        ValueError,
        TypeError,
        KeyError,
        IndexError,
        AttributeError,
        ArithmeticError,
        RecursionError,
        MemoryError,
    ) as e:  # the recipe's content: bad input, never a traceback
        raise ConfigError(f"port {source}: '{file}' {_why(e)}; fix the recipe") from e
    except OSError as e:
        raise ConfigError(
            f"port {source}: '{file}' cannot be read ({e.strerror or type(e).__name__}); pass a readable recipe file"
        ) from e
    if fields:
        apply_overrides(cfg, [f"--config.{k}={v}" for k, v in fields.items()])
        for key, value in fields.items():
            report.mapped(f"--set {key}", value, key, "set on the command line")
            report.ported.append(key)
        report.problems.clear()
        try:
            validate(cfg)
        except ConfigError as e:
            report.problems.append(str(e))
    return cfg, report


def _why(error: BaseException) -> str:
    """What a non-ConfigError failure of an importer says about the recipe, in a few words."""
    if isinstance(error, UnicodeDecodeError):
        return f"is not UTF-8 text (byte {error.start}); pass the recipe file itself, not a binary"
    if isinstance(error, RecursionError):
        return "nests too deeply"
    if isinstance(error, MemoryError):
        return "is too large"
    first = (str(error).strip().splitlines() or [""])[0][:160]
    return f"has a value of the wrong type or form ({type(error).__name__}: {first})"


def _port(
    source: str,
    file: str,
    *,
    world_size: int | None,
    tensor: int,
    pipeline: int,
    variables: dict[str, str] | None,
    side: dict[str, Any] | None,
    allow_unresolved: bool,
) -> tuple[ConfigDict, Report]:
    """The importer of ``source`` on ``file``."""
    if source == "deepspeed":
        from jaxpar.port.deepspeed import port_deepspeed

        cfg, report = port_deepspeed(
            file,
            world_size=world_size,
            tensor=tensor,
            pipeline=pipeline,
            side_inputs=side or {},
            allow_unresolved=allow_unresolved,
        )
    elif source == "megatron":
        from jaxpar.port.megatron import port_megatron

        if not pathlib.Path(file).is_file():
            raise ConfigError(f"port megatron: file '{file}' not found; pass a .args recipe or launch script")
        cfg, report = port_megatron(
            pathlib.Path(file), variables=variables or {}, world_size=world_size, allow_unresolved=allow_unresolved
        )
    elif source == "torchtitan":
        from jaxpar.port.torchtitan import port_torchtitan

        cfg, report = port_torchtitan(file, world_size=world_size, allow_unresolved=allow_unresolved)
    elif source == "fsdp":
        from jaxpar.port.fsdp import port_fsdp

        cfg, report = port_fsdp(file, world_size=world_size)
    else:
        raise ConfigError(f"port: unknown recipe kind '{source}'; use one of {', '.join(SOURCES)}")
    return cfg, report


def config_source(cfg: ConfigDict, report: Report, command: str, output: str) -> str:
    """Text of a jaxpar config file returning ``cfg`` as overrides of ``default_config()``."""
    defaults = flatten(default_config().to_dict())
    changed = {k: v for k, v in flatten(cfg.to_dict()).items() if defaults.get(k) != v or k in report.ported}
    doc = (
        f"Ported from the {report.kind} recipe {report.source_path or '(inline)'}.\n\n"
        f"Generated by:\n    {command}\n\nMapping: {report.summary()}; rerun the command to see the report.\n\n"
        f"Run:\n    jaxpar train --config {output}\n"
    )
    doc = doc.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    body = [f"    c.{key} = {value!r}" for key, value in changed.items()]
    return (
        f'"""{doc}"""\n\nfrom jaxpar.config import default_config\n\n\ndef get_config():\n'
        "    c = default_config()\n" + "\n".join(body) + ("\n" if body else "") + "    return c\n"
    )


SIGNATURE = "Generated by:\n    jaxpar port "  # in the docstring of every config file port -o writes


def ported_by_jaxpar(head: str) -> bool:
    """Whether a file's first bytes are those of a config ``port -o`` wrote (the only kind ``--overwrite`` replaces)."""
    return head.startswith('"""Ported from the ') and SIGNATURE in head


def write_atomic(path: str, text: str, overwrite: bool = False, source: str | None = None) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename
    (:func:`jaxpar.write_guard.write_file`).

    An existing ``path`` is replaced only with ``overwrite`` and only when ``port -o`` wrote it; never the
    recipe ``source``; otherwise :class:`ConfigError`, also when the file appears while writing.
    """
    write_guard.write_file(
        path, text, flag="port -o", overwrite=overwrite, owned=ported_by_jaxpar, inputs={"the recipe": source}
    )
