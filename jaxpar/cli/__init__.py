"""``jaxpar`` command line: train | inspect | plan | compare | sweep | port | export | drill.

One module per subcommand (:mod:`jaxpar.cli.train`, ``inspect``, ``plan``, ``compare``, ``sweep``, ``port``,
``export``, ``drill``) holds its flags and its output (tables, text, JSON); the modules it calls
return data and raise :class:`~jaxpar.config.ConfigError` on bad input. Errors take one path
(:mod:`jaxpar.cli.errors`): bad input prints one line and exits with code 2, anything else is an
internal error (exit code 1, traceback written to a file), Ctrl-C exits with 130. On CPU, the
number of simulated devices is set from the config's mesh (``--xla_force_host_platform_device_count``)
before JAX starts, unless ``XLA_FLAGS`` already sets it: no subcommand module imports JAX at import.
"""

from __future__ import annotations

import argparse
import sys

from jaxpar.cli import compare, drill, errors, export, inspect, plan, port, sweep, train
from jaxpar.cli.common import Parser
from jaxpar.errors import ConfigError, JaxparError

EXIT_BAD_INPUT = errors.EXIT_BAD_INPUT
EXIT_PEER_FAILURE = train.EXIT_PEER_FAILURE


def build_parser() -> argparse.ArgumentParser:
    """The ``jaxpar`` parser with one subparser per subcommand (``args.run`` runs it)."""
    parser = Parser(prog="jaxpar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for module, name, add, run in (
        (train, "train", train.add_train_arguments, train.run_train),
        (inspect, "inspect", inspect.add_inspect_arguments, inspect.run_inspect),
        (plan, "plan", plan.add_plan_arguments, plan.run_plan),
        (compare, "compare", compare.add_compare_arguments, compare.run_compare),
        (sweep, "sweep", sweep.add_sweep_arguments, sweep.run_sweep),
        (port, "port", None, None),
        (export, "export", export.add_export_arguments, export.run_export),
        (drill, "drill", drill.add_drill_arguments, drill.run_drill),
    ):
        if add is None:  # port builds its own subparser (it has a description)
            port.add_port_arguments(sub)
            continue
        p = sub.add_parser(name, help=module.HELP)
        add(p)
        p.set_defaults(run=run)
    return parser


def _refuse_empty(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """An empty flag value (``-o ''``, ``--config=``) names nothing: refused, never read as "not given";
    a NUL byte cannot be in a path (the OS raises ValueError): refused here, once, for every flag."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for action in sub.choices[args.command]._actions:
        value = getattr(args, action.dest, None)
        values = value if isinstance(value, list) else [value]
        if action.option_strings and "" in values:
            raise ConfigError(f"{args.command} {action.option_strings[-1]}: empty value; give one or drop the flag")
        if any(isinstance(v, str) and "\x00" in v for v in values):
            raise ConfigError(f"{args.command} {action.option_strings[-1] if action.option_strings else action.dest}: "
                              "the value holds a NUL byte, which no path or name may; retype it")


def main(argv: list[str] | None = None) -> int:
    """Run ``jaxpar ARGV``; returns the exit code (0 ok, 1 internal error, 2 bad input, 130 Ctrl-C)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # --config.x.y=v overrides are not argparse flags: split them off first.
    overrides = [a for a in argv if a.startswith("--config.")]
    rest = [a for a in argv if not a.startswith("--config.")]
    errors.note_workdir(None)
    try:
        parser = build_parser()
        args = parser.parse_args(rest)
        _refuse_empty(parser, args)
        args.overrides = overrides
        return int(args.run(args) or 0)
    except JaxparError as e:
        return errors.bad_input(e)
    except OSError as e:
        if e.filename is None:  # not about a path the user gave: a bug
            return errors.internal_error(e, argv)
        return errors.bad_path(e)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return errors.EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - a bug: one line on stderr, the traceback in a file
        return errors.internal_error(e, argv)


if __name__ == "__main__":
    sys.exit(main())
