"""``jaxpar train``: train a config on the devices present (on CPU: simulated devices).

In a multi-process job (``jax.distributed`` initialised from the environment) any failure but
bad input is taken for a failed collective, a peer that died or hung: one line on stderr and exit
code 3 at once (:func:`peer_failure`), so that the launcher sees the job end in bounded time.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from jaxpar.cli.common import DEFAULT_CONFIG, overrides
from jaxpar.cli.errors import EXIT_INTERRUPTED, note_workdir
from jaxpar.config import load_config_and_layout
from jaxpar.errors import JaxparError

HELP = "train a config on the devices present (CPU: simulated devices)"
EXIT_PEER_FAILURE = 3


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``jaxpar train``."""
    parser.add_argument("--config", default=None, help="config file (default: configs/tiny.py)")
    parser.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")


def _config_path(args: argparse.Namespace) -> str:
    path = args.config or DEFAULT_CONFIG
    if args.config is None and not os.path.exists(path):
        path = "configs/tiny.py"
    return path


def run_train(args: argparse.Namespace) -> int:
    """Train to ``train.steps``; returns 0, or 130 after Ctrl-C stopped it at a checkpoint (a multi-process
    failure exits the process with code 3)."""
    cfg, layout = load_config_and_layout(_config_path(args), overrides(args))  # the run's one layout
    note_workdir(cfg.train.workdir)
    if layout.uneven:  # the split is said once, at the start (a balanced split was not asked for)
        print(layout.stage_split_line(), file=sys.stderr, flush=True)
    from jaxpar.distributed import initialize_from_env, simulate_local_devices

    simulate_local_devices(layout.devices)
    from jaxpar.port.weights import load_checked
    from jaxpar.train.loop import Trainer

    distributed = initialize_from_env()
    try:
        trainer = Trainer(cfg, layout, progress=not args.no_progress, weights_loader=load_checked)
        trainer.run()
    except JaxparError:  # bad input (a config value, a diverged run): exit 2 on every process
        raise
    except Exception as e:
        if not distributed:
            raise
        peer_failure(e)
    if getattr(trainer, "stop_signal", None) == signal.SIGINT:  # Ctrl-C: stopped at a checkpoint (it said where)
        print("interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    return 0


def peer_failure(error: Exception) -> None:
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
