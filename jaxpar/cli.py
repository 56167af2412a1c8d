"""``jaxpar`` command line: train | inspect | plan | compare | sweep | port | export | drill.

Configuration errors print one line naming the field and the fix and exit with code 2, no
traceback. On CPU, the number of simulated devices is set from the config's mesh
(``--xla_force_host_platform_device_count``) before JAX starts, unless ``XLA_FLAGS`` already
sets it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from jaxpar.config import ConfigError, load_config

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.py")
EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad flags in one line with exit code 2."""

    def error(self, message: str) -> None:  # noqa: D102
        raise ConfigError(f"{self.prog}: {message} (see --help)")


def _config_path(args: argparse.Namespace) -> str:
    path = args.config or DEFAULT_CONFIG
    if args.config is None and not os.path.exists(path):
        path = "configs/tiny.py"
    return path


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = load_config(_config_path(args), args.overrides)
    from jaxpar.distributed import ensure_host_devices, initialize_from_env

    ensure_host_devices(cfg.mesh.data * cfg.mesh.tensor * cfg.mesh.pipeline)
    from jaxpar.train.loop import Trainer

    distributed = initialize_from_env()
    try:
        Trainer(cfg, progress=not args.no_progress).run()
    except ConfigError:
        raise
    except Exception as e:
        if not distributed:
            raise
        _peer_failure(e)
    return 0


EXIT_PEER_FAILURE = 3


def _peer_failure(error: Exception) -> None:
    """A collective failed in a multi-process run: a peer died or hung. Say so in one line and leave
    at once (skipping jax.distributed's shutdown barrier, which would abort on the dead peer)."""
    import jax

    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:240]
    print(
        f"error: process {jax.process_index()}/{jax.process_count()}: a collective failed, a peer process "
        f"probably died ({first}); restart the job to resume from the last checkpoint",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os._exit(EXIT_PEER_FAILURE)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="config file (default: configs/tiny.py)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxpar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = sub.add_parser("train", help="train a config on the devices present (CPU: simulated devices)")
    _add_config_args(train)
    train.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    train.set_defaults(run=_cmd_train)

    _add_optional(sub, "inspect", "jaxpar.analysis.inspect_cli", "add_inspect_arguments", "run_inspect",
                  "compile a layout (AOT) and report its collectives and per-device memory against the formulas")
    _add_optional(sub, "plan", "jaxpar.analysis.plan", "add_plan_arguments", "run_plan",
                  "estimate and rank layouts for a cluster before renting it")
    _add_optional(sub, "compare", "jaxpar.analysis.compare", "add_compare_arguments", "run_compare",
                  "chosen layouts side by side: memory, step time, MFU, communication (--aot: compiled too)")
    _add_optional(sub, "sweep", "jaxpar.analysis.sweep_cli", "add_sweep_arguments", "run_sweep",
                  "run every valid layout of N devices for K steps: times, memory, bytes, losses, report + plots")
    _add_port(sub)
    _add_optional(sub, "export", "jaxpar.port.export", "add_export_arguments", "run_export",
                  "write a training checkpoint's parameters as an HF LLaMA checkpoint (safetensors + config.json)")
    _add_optional(sub, "drill", "jaxpar.drill", "add_drill_arguments", "run_drill_cli",
                  "kill training with SIGKILL at random steps, resume, and check the end state is identical")
    return parser


def _add_optional(sub, name: str, module: str, add: str, run: str, help_text: str) -> None:
    """Register a subcommand whose module is imported now (none of them imports JAX at import)."""
    import importlib

    mod = importlib.import_module(module)
    p = sub.add_parser(name, help=help_text)
    getattr(mod, add)(p)
    p.set_defaults(run=getattr(mod, run))


def _add_port(sub) -> None:
    from jaxpar.port.cli import add_port_arguments, run_port

    add_port_arguments(sub)
    sub.choices["port"].set_defaults(run=run_port)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # --config.x.y=v overrides are not argparse flags: split them off first.
    overrides = [a for a in argv if a.startswith("--config.")]
    rest = [a for a in argv if not a.startswith("--config.")]
    try:
        args = build_parser().parse_args(rest)
        args.overrides = overrides
        run: Callable[[argparse.Namespace], int] = args.run
        return int(run(args) or 0)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
