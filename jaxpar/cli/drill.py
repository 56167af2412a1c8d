"""``jaxpar drill``: kill training with SIGKILL at random steps, resume, and check the end state is identical.

The flags and the printed summary (exit 1 when the resumed run ends elsewhere than the uninterrupted
one); the drill is :func:`jaxpar.drill.run_drill`.
"""

from __future__ import annotations

import argparse

from jaxpar import children
from jaxpar.cli.common import overrides
from jaxpar.cli.errors import note_workdir
from jaxpar.config import ConfigError

HELP = "kill training with SIGKILL at random steps, resume, and check the end state is identical"


def add_drill_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``jaxpar drill``."""
    parser.add_argument("--config", default=None, help="config file (default: configs/tiny.py)")
    parser.add_argument("--processes", type=int, default=1, help="processes per run (scripts/launch_local.sh)")
    parser.add_argument("--trials", type=int, default=3, help="kill/resume trials")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill times")
    parser.add_argument("--workdir", default="runs/drill", help="where the two runs go")


def run_drill(args: argparse.Namespace) -> int:
    """Run the drill and print each failure, the steps lost and whether the end state matches."""
    from jaxpar import drill

    config = args.config or str(drill.ROOT / "configs" / "tiny.py")
    if args.processes < 1 or 8 % args.processes:
        raise ConfigError(f"--processes {args.processes}: use 1, 2, 4 or 8")
    if args.trials < 1:
        raise ConfigError(f"--trials {args.trials}: use at least 1")
    if any(o.partition("=")[0] == "--config.train.workdir" for o in overrides(args)):
        raise ConfigError(
            "drill: --config.train.workdir: the drill puts its two runs under --workdir; give --workdir instead"
        )
    note_workdir(args.workdir)
    with children.supervised():  # SIGTERM: the training runs end with this process (exit 143)
        result = drill.run_drill(config, overrides(args), args.workdir, args.processes, args.trials, args.seed)
    for i, f in enumerate(result["failures"], 1):
        print(
            f"failure {i}: killed at step {f['killed_at_step']}, resumed from step {f['resumed_from_step']}, "
            f"{f['steps_lost']} steps lost"
        )
    lost = [f["steps_lost"] for f in result["failures"]]
    print(f"steps lost per failure: mean {sum(lost) / len(lost):.1f}, max {max(lost)}")
    print(f"per-step losses match the uninterrupted run: {'yes' if result['losses_match'] else 'NO'}")
    print(f"final parameters and optimizer state bitwise identical: {'yes' if result['state_match'] else 'NO'}")
    print(f"drill took {result['seconds']:.0f} s")
    return 0 if result["losses_match"] and result["state_match"] else 1
