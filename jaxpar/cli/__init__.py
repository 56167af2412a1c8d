"""``jaxpar`` command line: train | inspect | plan | compare | sweep | port | export | drill.

One module per subcommand holds its flags and its output (tables, text, JSON); the modules it calls
return data and raise :class:`~jaxpar.config.ConfigError` on bad input. Errors take one path
(:mod:`jaxpar.cli.errors`); Ctrl-C exits 130 and SIGTERM to ``sweep`` or ``drill`` 143, both after
stopping the processes the command started (:mod:`jaxpar.children`); what a subcommand writes goes
through :mod:`jaxpar.write_guard`. On CPU the number of simulated devices is set from the config's
mesh before JAX starts, unless ``XLA_FLAGS`` already sets it: no subcommand module imports JAX at import.
"""

from __future__ import annotations

import argparse
import sys

from jaxpar import children, interrupt
from jaxpar.cli import compare, drill, errors, export, inspect, plan, port, sweep, train
from jaxpar.cli.common import Parser, refuse_repeated_overrides
from jaxpar.environment import check_environment
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
            raise ConfigError(
                f"{args.command} {action.option_strings[-1] if action.option_strings else action.dest}: "
                "the value holds a NUL byte, which no path or name may; retype it"
            )


def main(argv: list[str] | None = None) -> int:
    """Run ``jaxpar ARGV``; returns the exit code (0 ok, 1 internal error, 2 bad input, 130 Ctrl-C,
    141 stdout closed). Without ``argv`` (the ``jaxpar`` program) stdout's write errors name it and a
    Ctrl-C anywhere is one line too (:mod:`jaxpar.interrupt`)."""
    program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    children.forget_stopped()  # a command names only the processes it stopped itself
    stdout = sys.stdout
    if program:
        if interrupt.interrupted():  # Ctrl-C while the CLI's modules loaded (noted, not raised there)
            print("interrupted", file=sys.stderr)
            interrupt.exit_now()
        interrupt.install()
        sys.stdout = errors.NamedStdout(stdout)
    try:
        code = _run(argv)
        if code != errors.EXIT_BROKEN_PIPE:
            code = _flushed(code, argv)
    finally:
        if program:
            sys.stdout = stdout
            interrupt.leave_at_once()
            if interrupt.interrupted():  # the shutdown of what a Ctrl-C cut short may crash: skip it
                interrupt.exit_now(code)
    return code


def _flushed(code: int, argv: list[str]) -> int:
    """``code``, after stdout is flushed: a closed pipe or a full disk found only by the last flush is
    reported like one found earlier."""
    try:
        sys.stdout.flush()
    except OSError as e:
        return errors.os_error(e, argv)
    except KeyboardInterrupt as e:
        return _report(e, argv)
    return code


def _run(argv: list[str]) -> int:
    # --config.x.y=v overrides are not argparse flags: split them off first.
    overrides = [a for a in argv if a.startswith("--config.")]
    rest = [a for a in argv if not a.startswith("--config.")]
    errors.note_workdir(None)
    try:
        parser = build_parser()
        args = parser.parse_args(rest)
        _refuse_empty(parser, args)
        if args.command != "port":  # port refuses every override (jaxpar.cli.port names --set instead)
            refuse_repeated_overrides(args.command, overrides)
        args.overrides = overrides
        # the environment, before JAX starts: XLA_FLAGS and JAX_PLATFORMS only where JAX runs
        check_environment(jax_runs=args.command != "port")
        if args.command != "port":  # port reads recipes and writes a config: it never loads JAX
            with interrupt.deferring():  # JAX's extension loads here (the other subcommands import it): Ctrl-C waits
                import jax  # noqa: F401 - imported, not started: the device count is still set later
        return int(args.run(args) or 0)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - every error takes one of the paths below
        return _report(e, argv)


def _report(error: BaseException, argv: list[str]) -> int:
    """The one line and exit code of ``error``: Ctrl-C (also an error it turned into another, e.g. an
    ImportError of an extension it interrupted), bad input, an OS error, else a bug."""
    if isinstance(error, children.Terminated):  # SIGTERM: the children are stopped already
        print(f"terminated{children.summary()}", file=sys.stderr)
        return children.EXIT_TERMINATED
    if isinstance(error, KeyboardInterrupt) or interrupt.interrupted():
        print(f"interrupted{children.summary()}", file=sys.stderr)
        return errors.EXIT_INTERRUPTED
    if isinstance(error, JaxparError):
        return errors.bad_input(error)
    if isinstance(error, OSError):  # a closed pipe, a full disk, a path the OS refuses; without a path: a bug
        return errors.os_error(error, argv)
    if (mismatch := errors.broken_dependency(error)) is not None:  # a library made for another JAX
        return errors.bad_input(mismatch)
    return errors.internal_error(error, argv)


if __name__ == "__main__":
    sys.exit(main())
