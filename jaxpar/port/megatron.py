"""Import a Megatron-LM (or Megatron-DeepSpeed) launch recipe into a jaxpar config, with a report.

Input: the ``.args`` format (shell assignments, a ``# flags`` line, then one flag per line; examples
in ``tests/fixtures/recipes/megatron``) or a raw launch script (assignments, then the command running
``pretrain_*.py``). Variables expand as bash would (``--var NAME=VALUE`` wins over the
script); a variable a *needed* flag uses but nobody sets stops the port with one line naming it.

Megatron arithmetic reproduced: DP = world / (TP * PP * CP); microbatches = GBS / (MBS * DP);
SwiGLU's default FFN size ``int(4h * 2/3 / 64) * 64``; sequence parallel off at TP = 1; the
LR schedule counts samples (``num_steps`` grows by the global batch after each update), so
sample-based settings become fractional steps ``samples / GBS``.
"""

from __future__ import annotations

import pathlib
from typing import Any

from jaxpar import files
from jaxpar.config import ConfigDict, ConfigError
from jaxpar.port import megatron_log
from jaxpar.port.bash import Shell, launch_flags
from jaxpar.port.megatron_flags import KNOWN, LM_SCRIPTS, NOOP_NOTE, OTHER_SCRIPTS, PAI_FLAGS, PAI_SCRIPTS, Args
from jaxpar.port.megatron_layout import SIZE_VARIABLES, map_layout, read_sizes
from jaxpar.port.megatron_layout import pipeline_layout_counts as pipeline_layout_counts
from jaxpar.port.megatron_model import map_mla, map_model, report_model_changes
from jaxpar.port.megatron_moe import expert_count, map_moe
from jaxpar.port.megatron_optim import map_misc, map_observability, map_optim
from jaxpar.port.megatron_optim import schedule_fields as schedule_fields
from jaxpar.port.report import (
    Report,
    build_config,
    refuse_model_changes,
)


def port_megatron(
    path_or_text: str | pathlib.Path,
    *,
    variables: dict[str, str] | None = None,
    world_size: int | None = None,
    allow_unresolved: bool = False,
    approximate: bool | None = None,
) -> tuple[ConfigDict, Report]:
    """Port a Megatron recipe (path, or the text itself) to ``(config, report)``.

    ``variables`` set shell variables (they win over the script's assignments); ``world_size``
    overrides the launcher's ``--nproc_per_node * --nnodes``. Raises :class:`ConfigError` (one
    line) for unresolved variables that mapped flags need, or inconsistent sizes.

    What jaxpar cannot train as the recipe's model is a model change in the report
    (:data:`MODEL_FLAGS`, positions, biases, the vocabulary, a script that is not ``pretrain_gpt.py``);
    ``approximate=False`` refuses the ones no ``--set`` resolves at once, before asking for anything
    else; None leaves the decision to the caller (:func:`jaxpar.port.recipe.port_recipe`), except
    for a script that trains no decoder language model, refused unless ``approximate``.
    """
    text, source = _read(path_or_text)
    shell = Shell(variables)
    report = Report("megatron", source)
    if megatron_log.is_log(text):  # a training log's printed arguments (jaxpar.port.megatron_log)
        flags, logged_world, shell.script = megatron_log.read(text, report)
        world_size = world_size or logged_world
    else:
        flags = _flags(text, shell, report)
    a = Args(flags, shell, report)
    values: dict[str, Any] = {}
    script = shell.script or ""
    pai = _pai_script(a, script) if script in PAI_SCRIPTS else None
    if script and script not in LM_SCRIPTS and pai != "":
        what = pai or OTHER_SCRIPTS.get(script, "a model other than a decoder-only language model")
        report.model_change(
            "(training script)",
            script,
            f"{script} trains {what}; jaxpar trains decoder-only language models (Megatron's pretrain_gpt.py)",
            target="model.*",
        )
        if not approximate:
            refuse_model_changes(report, "megatron", approximate=False, final=True)
        if a.has("--encoder-num-layers") and not a.has("--num-layers"):
            a.flags["--num-layers"] = a.flags["--encoder-num-layers"]
    sizes = read_sizes(a, shell, world_size)
    mla = a.get("--multi-latent-attention", bool, False) and bool(expert_count(a))
    if mla:
        a.note("--kv-channels", "approximated", "", NOOP_NOTE + "MLA's head dims are --qk-head-dim, --v-head-dim")
    layers = map_model(a, values)
    if mla:
        map_mla(a, values)
    report_model_changes(a)
    sizes["ep"] = map_moe(a, values, sizes, approximate is True)
    if approximate is False:
        refuse_model_changes(report, "megatron", approximate=False, final=True)
    map_optim(a, values, sizes)
    map_misc(a, values)
    map_observability(a, values)
    _check_resolved(a, shell, allow_unresolved)
    map_layout(a, values, sizes, layers)
    _check_resolved(a, shell, allow_unresolved)  # a flag of the layout followed by an unset variable's marker
    a.finish()
    unused = [n for n in (variables or {}) if n not in shell.read and n not in SIZE_VARIABLES]
    if unused:
        raise ConfigError(
            f"megatron: --var {unused[0]}: the recipe never uses ${unused[0]}; check the name (case matters) or drop it"
        )
    return build_config(values, report), report


def _check_resolved(a: Args, shell: Shell, allow_unresolved: bool) -> None:
    if a.unresolved and not allow_unresolved:
        names = ", ".join(
            f"{v} ({shell.why.get(v, 'not set')}; used by {', '.join(dict.fromkeys(fs))})"
            for v, fs in a.unresolved.items()
        )
        raise ConfigError(f"megatron: unresolved shell variables: {names}; pass --var NAME=VALUE for each")


def _pai_script(a: Args, script: str) -> str:
    """The empty string where Pai-Megatron-Patch's ``script`` ports as ``pretrain_gpt.py`` (:data:`PAI_SCRIPTS`), else
    what it trains instead."""
    want = PAI_SCRIPTS[script]
    got = tuple(a.get(n, str, d, soft=True) for n, d in zip(PAI_FLAGS, (None, None, "pretrain")))
    if got != want:
        shown = " ".join(f"{n} {v}" for n, v in zip(PAI_FLAGS, want))
        given = ", ".join(f"{n} {g}" for n, g in zip(PAI_FLAGS, got))
        return f"Pai-Megatron-Patch's model, ported as Megatron's GPT only with {shown} (given: {given})"
    a.pai = True
    a.note("--patch-tokenizer-type", "mapped", "model.vocab_size", "Pai's Qwen3 tokenizer (see --padded-vocab-size)")
    a.note("--dataset", "mapped", "data.path", "Megatron's GPTDataset over --data-path, as pretrain_gpt.py")
    a.note("--train-mode", "mapped", "", "next-token loss averaged over the loss mask's tokens, as pretrain_gpt.py")
    a.note("--max-padding-length", "approximated", "", NOOP_NOTE + "read only by Pai's JSON-SFT dataset, not by MMAP")
    return ""


def _read(path_or_text: str | pathlib.Path) -> tuple[str, str]:
    text = str(path_or_text)
    if isinstance(path_or_text, pathlib.Path) or ("\n" not in text and not text.lstrip().startswith("--")):
        path = pathlib.Path(path_or_text)
        return files.read_text(path, "recipe", "megatron", "pass a .args recipe or a launch script"), str(path)
    return str(path_or_text), ""


def _flags(text: str, shell: Shell, report: Report) -> list[tuple[str, list[str]]]:
    """Run the assignments and return the flags, reporting repaired lines and stray words."""
    flags, stray, repaired = launch_flags(text, shell)
    if not flags and not stray:
        raise ConfigError(
            "megatron: no '# flags' section and no pretrain_*.py command found; pass a .args recipe "
            "(assignments, a '# flags' line, one flag per line) or the launch script"
        )
    for number, line in repaired:
        report.approximated(f"(line {number})", line, "", "unbalanced quote removed")
    for word in stray:
        report.unknown(word, word, KNOWN, "Megatron-LM")
    return flags
