"""Megatron's printed arguments: the ``arguments`` block of a training log as the flags that give it.

Megatron-LM and Megatron-DeepSpeed print every parsed argument at start-up, resolved (no shell
variables), one ``  name ....... value`` line each between ``---- arguments ----`` and ``---- end of
arguments ----``. Each logged attribute is turned back into its option through the parser's table
(:mod:`jaxpar.port.megatron_arguments`): ``store_true`` / ``store_false`` options are given when the
value is not their default, other options with their value unless it is the default or ``None``.
Attributes that no option sets (Megatron derives them: ``rank``, ``data_parallel_size``,
``params_dtype`` ...) are not flags: each is a report row; ``world_size`` sizes the mesh. The log does
not name the training script; ``building GPT model`` (BERT, T5) after the block tells which. A
prefix before the header on its line (a rank label) is dropped from every line of the block.
"""

from __future__ import annotations

import ast
import re

from jaxpar.config import ConfigError
from jaxpar.port.megatron_arguments import ARGUMENTS, SOURCE
from jaxpar.port.report import Report

HEADER = "------------------------ arguments ------------------------"
FOOTER = "-------------------- end of arguments ---------------------"
LINE = re.compile(r"^\s*(\w+) \.+ ?(.*?)\s*$")
SCRIPTS = {"building GPT model": "pretrain_gpt.py", "building BERT model": "pretrain_bert.py"}
SCRIPTS["building T5 model"] = "pretrain_t5.py"
# options Megatron fills from another (validate_args) when not given: logged equal to it, they were not given
DERIVED = {"encoder_num_layers": "num_layers", "encoder_seq_length": "seq_length"}


def is_log(text: str) -> bool:
    """Whether ``text`` holds a Megatron ``arguments`` block."""
    return HEADER in text


def _values(raw: str) -> list[str]:
    """A logged value as option words: a Python list (``data_path``) gives one word per item."""
    if raw.startswith("[") and raw.endswith("]"):
        try:
            items = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            return [raw]
        return [str(x) for x in items] if isinstance(items, list) else [raw]
    return [raw]


def read(text: str, report: Report) -> tuple[list[tuple[str, list[str]]], int | None, str]:
    """``(flags, world size, training script)`` of the log's ``arguments`` block; refused (one line)
    when the block is missing its end, appears more than once or holds a line that is not ``name ... value``."""
    count = text.count(HEADER)
    if count > 1:
        raise ConfigError(
            f"megatron: the log holds {count} 'arguments' blocks (several runs); keep the lines of one run"
        )
    start = text.index(HEADER) + len(HEADER)
    end = text.find(FOOTER, start)
    if end < 0:
        raise ConfigError("megatron: the log's 'arguments' block has no 'end of arguments' line; pass the whole block")
    # what precedes the header on its line (srun --label's "0: ", a "[rank0]: ") precedes every line of the block
    prefix = text[text.rfind("\n", 0, start - len(HEADER)) + 1 : start - len(HEADER)]
    logged: dict[str, str] = {}
    for number, line in enumerate(text[start:end].splitlines(), text[:start].count("\n") + 1):
        line = line[len(prefix) :] if prefix.strip() and line.startswith(prefix) else line
        if line.strip():
            match = LINE.match(line)
            if match is None:
                raise ConfigError(
                    f"megatron: log line {number} {line.strip()[:60]!r} is not 'name .... value'; fix the log"
                )
            logged[match.group(1)] = match.group(2)
    flags: list[tuple[str, list[str]]] = []
    world = None
    for name, raw in logged.items():
        if name in DERIVED and logged.get(DERIVED[name]) == raw:
            report.mapped(f"(log) {name}", raw, "", f"Megatron sets it from {DERIVED[name]}")
        elif name == "world_size" and raw.isdigit():
            world = int(raw)
            report.mapped("(log) world_size", world, "mesh.data", "the run's world size")
        elif name not in ARGUMENTS:
            report.approximated(
                f"(log) {name}", raw, "", f"no option of {SOURCE} sets it: derived by Megatron, or newer; not read"
            )
        else:
            flag = _flag(ARGUMENTS[name], raw)
            if flag is not None:
                flags.append(flag)
    script = next((s for marker, s in SCRIPTS.items() if marker in text[end:]), "")
    return flags, world, script


def _flag(options: list[tuple[str, str, str | None]], raw: str) -> tuple[str, list[str]] | None:
    """The option (and its words) that gives the logged value ``raw``; None where no option is needed."""
    for option, action, default in options:
        if action in ("store_true", "store_false"):
            if raw in ("True", "False") and raw != default:
                return option, []
        else:  # store, append, or an Action class: the option takes the value
            if raw in ("None", default):
                return None
            return option, _values(raw)
    return None
