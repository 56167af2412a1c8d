"""``jaxpar port deepspeed|megatron|torchtitan|fsdp FILE``: import a recipe, print the report.

``-o out.py`` writes a runnable jaxpar config (``get_config()`` on top of ``default_config()``,
only the fields that differ), atomically, and never over an existing file unless ``--overwrite``;
``--json`` prints one JSON object ``{config, report}``. ``--set KEY=VALUE`` sets a jaxpar field
(``model.vocab_size=128256``) after the port, or, for DeepSpeed, fills an ``"auto"`` value
(``lr=3e-4``). ``--model-config config.json`` takes the model of a DeepSpeed or accelerate recipe
(which do not describe it) from a Hugging Face config. Every bad input is a :class:`ConfigError`:
one line naming the field and the fix.

Exit 0 promises that the config trains the recipe's model: a port whose model would differ (an
unknown family or flavor, MoE as a dense backbone, ALiBi, MLA, a shape the recipe does not state)
exits 2 naming it, unless ``--approximate`` is given; then the report lists each model change
first and closes with a summary line. The port itself is :func:`jaxpar.port.recipe.port_recipe`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import TYPE_CHECKING, Any

from jaxpar import write_guard
from jaxpar.cli.common import at_least_one, overrides
from jaxpar.config import MAX_DEVICES, MOVED_KEYS, ConfigDict, ConfigError, default_config, flatten, moved_key_error
from jaxpar.port.recipe import SOURCES, config_source, port_recipe, ported_by_jaxpar, write_atomic

if TYPE_CHECKING:
    from jaxpar.port.report import Report

HELP = "import a DeepSpeed / Megatron-LM / torchtitan / FSDP recipe"


def add_port_arguments(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``port`` sub-command to ``subparsers`` (from ``add_subparsers``); returns its parser."""
    p = subparsers.add_parser(
        "port",
        help=HELP,
        description="Import a DeepSpeed / Megatron-LM / torchtitan / FSDP recipe into a "
        "jaxpar config and report what became of every setting.",
    )
    p.add_argument("source", choices=SOURCES, help="recipe kind")
    p.add_argument(
        "file", help="ds_config.json, Megatron .args / launch script / training log, torchtitan .toml, accelerate .yaml"
    )
    p.add_argument("--world-size", type=int, default=None, help="total number of GPUs the recipe runs on")
    p.add_argument(
        "--tensor",
        type=int,
        default=None,
        help="DeepSpeed only: tensor-parallel size (default: the recipe's tensor_parallel.autotp_size, else 1)",
    )
    p.add_argument("--pipeline", type=int, default=None, help="DeepSpeed only: pipeline stages (default 1)")
    p.add_argument("--var", action="append", default=[], metavar="NAME=VALUE", help="Megatron: shell variable")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        dest="sets",
        metavar="KEY=VALUE",
        help='jaxpar field (model.vocab_size=128256) or DeepSpeed side input for "auto" (lr=3e-4)',
    )
    p.add_argument("--allow-unresolved", action="store_true", help="use defaults for unresolved values (reported)")
    p.add_argument(
        "--model-config",
        default=None,
        metavar="CONFIG_JSON",
        help="deepspeed/fsdp: the model, from a Hugging Face config.json (these recipes do not describe it)",
    )
    p.add_argument(
        "--approximate",
        action="store_true",
        help="port even when jaxpar would train another model than the recipe's (listed first in the report)",
    )
    p.add_argument("-o", "--output", default=None, help="write a jaxpar config file (.py)")
    p.add_argument("--overwrite", action="store_true", help="replace an -o file an earlier port wrote")
    p.add_argument("--json", action="store_true", help="print {config, report} as one JSON object")
    p.set_defaults(run=run_port)
    return p


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name.strip():
            raise ConfigError(f"port {flag} '{item}': expected {flag} NAME=VALUE")
        out[name.strip()] = value
    return out


def port_file(args: argparse.Namespace) -> tuple[ConfigDict, Report]:
    """Check the flags against the recipe kind, then :func:`port_recipe` with them."""
    from jaxpar.port.report import parse_side_value, schema_has, suggest  # imports JAX: only when porting

    given = overrides(args)
    if given:
        key = given[0].split("=", 1)[0][len("--config.") :]
        key = MOVED_KEYS.get(key, key)
        raise ConfigError(f"port: {given[0]}: port does not take --config overrides; use --set {key}=VALUE")
    at_least_one(world_size=args.world_size, tensor=args.tensor, pipeline=args.pipeline)
    for flag, value in (("--world-size", args.world_size), ("--tensor", args.tensor), ("--pipeline", args.pipeline)):
        if value is not None and value > MAX_DEVICES:
            raise ConfigError(f"{flag} {value}: more GPUs than any cluster has; use at most {MAX_DEVICES}")
    sets = _pairs(args.sets, "--set")
    for key, value in sets.items():  # a key from before the layout's fields moved to parallel.*
        if key in MOVED_KEYS:
            raise ConfigError(f"port: --set {key}: {moved_key_error(key, value, f'--set {key}')}")
    fields = {k: v for k, v in sets.items() if schema_has(k)}
    side = {k: parse_side_value(v) for k, v in sets.items() if k not in fields}
    variables = _pairs(args.var, "--var")
    if args.source != "deepspeed":
        if args.tensor is not None or args.pipeline is not None:
            raise ConfigError(
                f"port {args.source}: --tensor/--pipeline apply to deepspeed only; this recipe names "
                "its own parallel sizes"
            )
        if side:
            key = next(iter(side))
            close = suggest(key, sorted(flatten(default_config().to_dict())))
            raise ConfigError(
                f"port {args.source}: --set {key}: not a jaxpar config key"
                + (f"; did you mean '{close}'?" if close else "; use section.field, e.g. model.vocab_size")
            )
    if variables and args.source != "megatron":
        raise ConfigError("port: --var sets shell variables of Megatron launch recipes only")
    if args.allow_unresolved and args.source == "fsdp":
        raise ConfigError(
            "port fsdp: --allow-unresolved applies to deepspeed, megatron and torchtitan recipes only "
            "(an FSDP config leaves no value open); drop it"
        )
    return port_recipe(
        args.source,
        args.file,
        world_size=args.world_size,
        tensor=args.tensor,
        pipeline=args.pipeline or 1,
        variables=variables,
        side=side,
        fields=fields,
        allow_unresolved=args.allow_unresolved,
        approximate=getattr(args, "approximate", False),
        model_config=getattr(args, "model_config", None),
    )


def command_line(args: argparse.Namespace) -> str:
    """The ``jaxpar port ...`` command that reproduces ``args``."""
    parts = ["jaxpar", "port", args.source, args.file]
    for flag, value in (("--world-size", args.world_size), ("--tensor", args.tensor), ("--pipeline", args.pipeline)):
        if value is not None:
            parts += [flag, str(value)]
    parts += [p for v in args.var for p in ("--var", v)] + [p for s in args.sets for p in ("--set", s)]
    parts += ["--allow-unresolved"] if args.allow_unresolved else []
    parts += ["--model-config", args.model_config] if getattr(args, "model_config", None) else []
    parts += ["--approximate"] if getattr(args, "approximate", False) else []
    parts += ["-o", args.output] if args.output else []
    parts += ["--overwrite"] if args.output and getattr(args, "overwrite", False) else []
    return " ".join(shlex.quote(p) for p in parts)


def run_port(args: argparse.Namespace) -> int:
    """Port, print the report (table or JSON), write ``-o``; ConfigError when the result does not validate
    or ``-o`` names an existing file without ``--overwrite``."""
    if args.output:  # before porting: the same answer, without printing a report first
        write_guard.check_file_output(
            args.output,
            "port -o",
            getattr(args, "overwrite", False),
            ported_by_jaxpar,
            inputs={"the recipe": args.file},
        )
    cfg, report = port_file(args)
    if args.json:
        print(json.dumps({"config": cfg.to_dict(), "report": report.to_dict()}, indent=2))
    elif sys.stdout.isatty():
        report.render_rich()
    else:
        print(report.render_text())
    if report.problems:
        raise ConfigError(
            f"port {args.source}: the ported config does not validate: {report.problems[0]}; adjust "
            "it with --set KEY=VALUE"
        )
    if args.output:
        write_atomic(
            args.output,
            config_source(cfg, report, command_line(args), args.output),
            overwrite=getattr(args, "overwrite", False),
            source=args.file,
        )
        if not args.json:
            print(f"wrote {args.output}")
    return 0
