"""``jaxpar export``: write a training checkpoint's parameters as an HF LLaMA checkpoint.

The flags and the one line of output; the export is :func:`jaxpar.port.export.export_checkpoint`.
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxpar.cli.common import config_or_default, overrides
from jaxpar.cli.errors import note_workdir
from jaxpar.config import ConfigError, load_config

HELP = "write a training checkpoint's parameters as an HF LLaMA checkpoint (safetensors + config.json)"


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``jaxpar export`` (``--config.x.y=v`` overrides are split off by the CLI)."""
    parser.add_argument("--config", default=None, help="the run's config file (default: configs/tiny.py)")
    parser.add_argument("-o", "--output", required=True, help="directory to write (safetensors + config.json)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")


def run_export(args: argparse.Namespace) -> int:
    """Export the checkpoint; :class:`ConfigError` (exit 2) for a missing checkpoint or output clash."""
    cfg = load_config(config_or_default(args), overrides(args))
    note_workdir(cfg.train.workdir)
    if os.path.exists(args.output) and not args.overwrite:
        raise ConfigError(f"-o {args.output}: exists; pass --overwrite to replace it or choose another directory")
    from jaxpar.port.export import export_checkpoint

    done = export_checkpoint(cfg, args.output, args.step, args.overwrite,
                             echo=lambda line: print(f"note: {line}", file=sys.stderr))
    print(f"wrote {done.output}: checkpoint step {done.step} of {done.checkpoints} as an HF LLaMA checkpoint")
    return 0
