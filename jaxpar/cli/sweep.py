"""``jaxpar sweep``: arguments and printing only (the work is in :mod:`jaxpar.analysis.sweep`, the
files in :mod:`jaxpar.analysis.sweep.report`). No JAX at import.

    jaxpar sweep --config configs/tiny.py --devices 8 -o runs/sweep
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shlex
import sys

from jaxpar import children, files, write_guard
from jaxpar.cli.common import overrides, print_notes, refuse_unread_overrides, unread_notes
from jaxpar.config import MAX_DEVICES, ConfigError, load_config

HELP = "run every valid layout of N devices for K steps: times, memory, bytes, losses, report + plots"

# The sweep's problem unless the command line overrides it: fp32 (the 1e-5 loss check is then
# meaningful), a short sequence and a small batch so every layout compiles and runs in seconds.
SWEEP_DEFAULTS = (
    "--config.model.compute_dtype=float32",
    "--config.train.seq_len=64",
    "--config.train.global_batch=16",
    "--config.optim.warmup_steps=2",
)


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``jaxpar sweep`` (``--config.x.y=v`` overrides arrive in ``args.overrides``)."""
    parser.add_argument("--config", default=None, help="config file (default: configs/tiny.py)")
    parser.add_argument("--devices", type=int, default=8, help="devices (CPU: simulated) to lay out")
    parser.add_argument("--steps", type=int, default=8, help="steps per layout")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the step-time statistics")
    parser.add_argument(
        "--repeats",
        type=int,
        default=6,
        help="passes over the whole layout list (default 6); step times pool them (the later passes reuse the "
        "compiles and must reproduce the losses bit for bit)",
    )
    parser.add_argument(
        "--pass-steps",
        type=int,
        default=None,
        help="steps of each later pass (default: 5, or --steps if fewer); more, shorter passes put "
        "more of the host's drift inside the spread",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="REGEX",
        help="run only layouts whose name matches (repeatable), e.g. --only 'z3' --only '^d2t2'",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="relative loss tolerance vs the reference (default: fp32 1e-5, bf16 2e-2)",
    )
    parser.add_argument("--baseline", default=None, help="an earlier results.json to check this run against")
    parser.add_argument("--list", action="store_true", help="list the layouts and exit")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("-o", "--output", default="runs/sweep", help="output directory")


SWEEP_UNREAD = {
    "mesh.": "the sweep lays out --devices devices in every layout it runs (--only picks some)",
    "train.steps": "give --steps",
}


def run_sweep(args: argparse.Namespace) -> int:
    """Run the sweep, write DIR/{results.csv,results.json,report.md,*.png}; exit 1 if any layout
    crashed or missed the reference loss."""
    from jaxpar.analysis import sweep as sweep_lib
    from jaxpar.analysis.sweep import report as sweep_report

    config = args.config or ("configs/tiny.py" if os.path.exists("configs/tiny.py") else None)
    refuse_unread_overrides("sweep", overrides(args), SWEEP_UNREAD)
    cfg = load_config(config, [*SWEEP_DEFAULTS, *overrides(args)])
    _check_flags(args)
    if not args.list:  # before hours of runs: -o replaces only an earlier sweep's folder, never an input
        write_guard.check_apart(args.output, "sweep -o", inputs={"--config": config, "--baseline": args.baseline})
        write_guard.check_folder_output(args.output, "sweep -o", write_guard.SWEEP, overwrite=True, older=older_sweep)
    previous = None
    if args.baseline:
        text = files.read_text(args.baseline, "sweep results", "--baseline", "pass an earlier sweep's results.json")
        try:
            previous = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise ConfigError(f"--baseline {args.baseline}: cannot read it ({e})") from None
    if args.list:
        from jaxpar.analysis.sweep import cpu_cluster, layout_name, select, sweep_layouts

        cluster = cpu_cluster(args.devices, 1e9, 1.0)  # layouts do not depend on the cluster's speeds
        t = cfg.train
        for layout in select(sweep_layouts(cfg.model, args.devices, t.global_batch, t.seq_len, cluster), args.only):
            print(layout_name(layout))
        return 0
    if args.config is not None:  # a user's file: its mesh is not the sweep's, and the sweep says so
        print_notes(unread_notes("sweep", cfg, {"mesh.": ""}, "the sweep runs its own layouts of --devices devices"))
    with children.supervised():  # SIGTERM: the worker process ends with this one (exit 143)
        records, meta = sweep_lib.run_sweep_layouts(
            cfg,
            args.devices,
            steps=args.steps,
            warmup=args.warmup,
            only=args.only,
            tolerance=args.tolerance,
            progress=not args.no_progress,
            repeats=args.repeats,
            pass_steps=args.pass_steps,
        )
    meta["command"] = (
        "jaxpar " + shlex.join(sys.argv[1:])
        if sys.argv[0].endswith(("jaxpar", "__main__.py"))
        else (shlex.join(["jaxpar", "sweep", *_argv(args)]))
    )
    meta["config"] = config
    comparison = sweep_report.compare_runs(previous, records) if previous else None
    written: dict[str, str] = {}  # into a temporary sibling, renamed over an earlier sweep's folder at the end
    write_guard.replace_folder(
        args.output,
        write_guard.SWEEP,
        flag="sweep -o",
        overwrite=True,
        older=older_sweep,
        fill=lambda tmp: written.update(sweep_report.write_results(records, meta, str(tmp), comparison)),
    )
    paths = {name: os.path.join(args.output, os.path.basename(path)) for name, path in written.items()}
    c = meta["counts"]
    print(
        f"{meta['layouts']} layouts: {c['ok']} ok, {c['mismatch']} loss mismatches, {c['crashed']} crashed "
        f"({meta['wall_s'] / 60:.1f} min); reference {meta['reference']}, tolerance {meta['tolerance']:g}"
    )
    for r in records:
        if not r.ok:
            print(f"  {r.name}: {r.status}: {r.error}")
    for line in comparison or []:
        print(f"  re-run: {line}")
    print(f"report: {paths['md']}")
    return 0 if c["ok"] == meta["layouts"] else 1


SWEEP_FILES = (
    "results.csv",
    "results.json",
    "report.md",
    "memory_vs_bytes.png",
    "step_time.png",
    "estimate_vs_measured.png",
)


def older_sweep(folder: pathlib.Path, names: list[str]) -> bool:
    """Whether an unmarked folder is a sweep's from before the write guard's markers: only a sweep's files,
    and a results.json of a sweep (``meta`` and ``layouts``); it may be replaced like a marked one."""
    if "results.json" not in names or not set(names) <= set(SWEEP_FILES):
        return False
    try:
        results = json.loads(files.read_text(folder / "results.json", "sweep results", "sweep -o", ""))
    except (ConfigError, ValueError, RecursionError):
        return False
    return isinstance(results, dict) and {"meta", "layouts"} <= set(results)


MAX_STEPS = 10**6
MAX_REPEATS = 20


def _check_flags(args: argparse.Namespace) -> None:
    """Every flag in its domain, and none that ``--list`` would ignore: one-line errors."""
    if not 1 <= args.devices <= MAX_DEVICES:
        raise ConfigError(f"--devices {args.devices}: use a device count in [1, {MAX_DEVICES}]")
    if not 1 <= args.steps <= MAX_STEPS:
        raise ConfigError(f"--steps {args.steps}: use a step count in [1, {MAX_STEPS}]")
    if not 1 <= args.repeats <= MAX_REPEATS:
        raise ConfigError(f"--repeats {args.repeats}: use a pass count in [1, {MAX_REPEATS}]")
    if not 0 <= args.warmup < args.steps:
        raise ConfigError(f"--warmup {args.warmup}: use a value in [0, --steps) so some steps are timed")
    if args.pass_steps is not None and not args.warmup < args.pass_steps <= args.steps:
        raise ConfigError(
            f"--pass-steps {args.pass_steps}: use a value in ({args.warmup}, {args.steps}]: more than "
            "--warmup so some steps are timed, at most --steps"
        )
    if args.tolerance is not None and not (math.isfinite(args.tolerance) and args.tolerance > 0):
        raise ConfigError(f"--tolerance {args.tolerance}: use a finite relative tolerance > 0, e.g. 1e-5")
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise ConfigError(f"-o {args.output}: is a file, not a folder; pick another path")
    if args.list:
        parser = argparse.ArgumentParser()
        add_sweep_arguments(parser)  # the defaults, from the one place that declares them
        for name in ("steps", "warmup", "repeats", "pass_steps", "tolerance", "baseline", "output", "no_progress"):
            if getattr(args, name) != parser.get_default(name):
                flag = "-o" if name == "output" else f"--{name.replace('_', '-')}"
                raise ConfigError(
                    f"sweep {flag} has no effect with --list (it only lists the layouts); drop one of them"
                )


def _argv(args: argparse.Namespace) -> list[str]:
    out = [
        "--config",
        args.config or "configs/tiny.py",
        "--devices",
        str(args.devices),
        "--steps",
        str(args.steps),
        "--repeats",
        str(args.repeats),
    ]
    if args.pass_steps is not None:
        out += ["--pass-steps", str(args.pass_steps)]
    for pattern in args.only:
        out += ["--only", pattern]
    return [*out, *(getattr(args, "overrides", None) or []), "-o", args.output]
