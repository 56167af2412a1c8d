"""Port a recipe of any kind (``deepspeed``, ``megatron``, ``torchtitan``, ``fsdp``) and write the
result as a runnable jaxpar config file.

:func:`port_recipe` runs the importer of the kind, applies a Hugging Face ``config.json`` as the
model (``--model-config``: for recipes that do not describe their model, DeepSpeed JSON and
accelerate YAML) and jaxpar fields set on top of it (``model.vocab_size=128256``), re-validating,
and refuses a port whose config would not train the recipe's model (a *model change*,
:meth:`Report.model_change`) unless ``approximate``: **an exit 0 from ``jaxpar port`` promises
that the config trains the recipe's model**; changes of precision, speed or memory only are
approximated rows. :func:`config_source` is the text of a config file
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
    tensor: int | None = None,
    pipeline: int = 1,
    variables: dict[str, str] | None = None,
    side: dict[str, Any] | None = None,
    fields: dict[str, str] | None = None,
    allow_unresolved: bool = False,
    approximate: bool = False,
    model_config: str | None = None,
) -> tuple[ConfigDict, Report]:
    """Port ``file`` with the importer of ``source``, then take the model from the HF ``config.json``
    ``model_config`` (DeepSpeed and FSDP recipes only) and set the jaxpar ``fields`` (``key -> value``
    text) on the result; a config that no longer validates is reported in ``report.problems``.

    ``tensor``, ``pipeline`` and ``side`` (values for DeepSpeed ``"auto"`` settings) are DeepSpeed's,
    ``variables`` (shell variables) Megatron's; ``allow_unresolved`` uses defaults for values the
    recipe leaves open (not for FSDP, which leaves none). A model change left after ``fields`` and
    ``model_config`` (see :mod:`jaxpar.port.report`) raises a one-line :class:`ConfigError` naming
    it and the fix, unless ``approximate``: then the port goes through and the report lists it first.
    """
    if model_config is not None and source not in ("deepspeed", "fsdp"):
        raise ConfigError(
            f"port {source}: --model-config: a {source} recipe states its own model; drop --model-config "
            "(set single fields with --set model.FIELD=VALUE)"
        )
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
            approximate=approximate,
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
    if model_config is not None:
        _apply_model_config(cfg, report, model_config)
    if fields:
        apply_overrides(cfg, [f"--config.{k}={v}" for k, v in fields.items()])
        for key, value in fields.items():
            report.mapped(f"--set {key}", value, key, "set on the command line")
            report.ported.append(key)
    if fields or model_config is not None:
        report.problems.clear()
        try:
            validate(cfg)
        except ConfigError as e:
            report.problems.append(str(e))
    from jaxpar.port.report import refuse_model_changes  # imports JAX: only when porting

    refuse_model_changes(report, source, approximate)
    return cfg, report


# the model.* fields an HF config.json fixes (jaxpar.port.weights.model_config_from_hf); the rest
# (compute dtype, recompute, attention kernel, MoE dispatch) stay as the recipe's port set them
MODEL_CONFIG_FIELDS = (
    "name",
    "vocab_size",
    "embed_dim",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "mlp_dim",
    "max_seq_len",
    "rope_theta",
    "rope_scaling",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_seq_len",
    "norm_eps",
    "tie_embeddings",
    "init_std",
    "attention_dropout",
    "dropout",
    "mlp_activation",
    "norm",
    "position",
    "qk_norm",
    "num_experts",
    "experts_per_token",
    "router_norm_topk",
    "moe_aux_loss_coeff",
)


def _apply_model_config(cfg: ConfigDict, report: Report, path: str) -> None:
    """``--model-config``: the model of an HF ``config.json`` (the file or its folder) replaces the model
    fields of ``cfg``; one report row says which model it is."""
    from jaxpar.port.weights import model_config_from_hf  # imports JAX: only when asked for

    if not pathlib.Path(path).exists():
        raise ConfigError(f"port --model-config {path}: not found; pass an HF config.json (or the folder holding it)")
    m = model_config_from_hf(path, "port --model-config")
    for name in MODEL_CONFIG_FIELDS:
        cfg.model[name] = m[name]
        report.ported.append(f"model.{name}")
    report.mapped(
        "--model-config",
        path,
        "model.*",
        f"{m.name}: {m.num_layers} layers, width {m.embed_dim}, {m.num_heads} heads ({m.num_kv_heads} kv), "
        f"MLP {m.mlp_dim}, vocabulary {m.vocab_size}" + (f", {m.num_experts} experts" if m.num_experts else ""),
    )


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
    tensor: int | None,
    pipeline: int,
    variables: dict[str, str] | None,
    side: dict[str, Any] | None,
    allow_unresolved: bool,
    approximate: bool = False,
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

        cfg, report = port_megatron(
            pathlib.Path(file),
            variables=variables or {},
            world_size=world_size,
            allow_unresolved=allow_unresolved,
            approximate=approximate,
        )
    elif source == "torchtitan":
        from jaxpar.port.torchtitan import port_torchtitan

        cfg, report = port_torchtitan(
            file, world_size=world_size, allow_unresolved=allow_unresolved, approximate=approximate
        )
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
        f"Generated by:\n    {command}\n\nMapping: {report.summary()}; rerun the command to see the report.\n"
        f"{report.closing()}\n\n"
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
