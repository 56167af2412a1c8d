"""``jaxpar export``: write a training checkpoint's parameters as an HF LLaMA checkpoint.

The flags and the one line of output; the export is :func:`jaxpar.port.export.export_checkpoint`.
"""

from __future__ import annotations

import argparse
import sys

from jaxpar import write_guard
from jaxpar.cli.common import config_or_default, overrides
from jaxpar.cli.errors import note_workdir
from jaxpar.config import load_config

HELP = "write a training checkpoint's parameters as an HF LLaMA checkpoint (safetensors + config.json)"


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``jaxpar export`` (``--config.x.y=v`` overrides are split off by the CLI)."""
    parser.add_argument("--config", default=None, help="the run's config file (default: configs/tiny.py)")
    parser.add_argument("-o", "--output", required=True, help="directory to write (safetensors + config.json)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier export in -o (never a folder jaxpar export did not write)",
    )


def run_export(args: argparse.Namespace) -> int:
    """Export the checkpoint; :class:`ConfigError` (exit 2) for a missing checkpoint or output clash."""
    cfg = load_config(config_or_default(args), overrides(args))
    note_workdir(cfg.train.workdir)
    # before any read: -o may not be the run's workdir or an input, and replaces only an earlier export
    write_guard.check_apart(
        args.output,
        "export -o",
        inputs={"--config": config_or_default(args), "train.init_from": cfg.train.init_from},
        workdirs={"train.workdir": cfg.train.workdir},
    )
    write_guard.check_folder_output(args.output, "export -o", write_guard.EXPORT, args.overwrite)
    from jaxpar.port.export import export_checkpoint

    done = export_checkpoint(
        cfg, args.output, args.step, args.overwrite, echo=lambda line: print(f"note: {line}", file=sys.stderr)
    )
    print(f"wrote {done.output}: checkpoint step {done.step} of {done.checkpoints} as an HF LLaMA checkpoint")
    return 0
