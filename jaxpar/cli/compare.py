"""``jaxpar compare``: chosen layouts side by side: memory, step time, MFU, communication (``--aot``: compiled too).

The flags, the ``--layout KEY=VALUE,...`` parser and the output (the plan table in the order given,
relative to the first, the AOT table, or JSON); the evaluation is :func:`jaxpar.analysis.compare.compare_layouts`.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from jaxpar.analysis.clusters import GIB, PRESETS, get_cluster
from jaxpar.analysis.compare import choice_sources, compare_layouts, config_choices, device_count, relative_to_first
from jaxpar.analysis.estimate import DTYPE_BYTES
from jaxpar.analysis.plan import PlanOptions, flops_convention, plan_summary
from jaxpar.axes import MESH_AXES
from jaxpar.cli.common import (
    at_least_one,
    at_most,
    override_notes,
    overrides,
    print_notes,
    refuse_flag_and_override,
    refuse_unread_overrides,
    share,
    unread_notes,
)
from jaxpar.cli.plan import render_aot, render_table
from jaxpar.config import MAX_DEVICES, MAX_DIM, ConfigError, load_config
from jaxpar.console import wide_console

HELP = "chosen layouts side by side: memory, step time, MFU, communication (--aot: compiled too)"
KEYS = {  # key -> (ParallelLayout field, parser)
    **{axis.value: (axis.value, int) for axis in MESH_AXES},  # one mesh size per axis
    "virtual": ("virtual_stages", int),
    "zero": ("zero_stage", int),
    "microbatches": ("microbatches", int),
    "recompute": ("recompute", str),
    "sp": ("sequence_parallel", str),
    "schedule": ("pipeline_schedule", str),
    "exchange": ("context_exchange", str),  # with context > 1: ring | all_gather
}


def parse_compare_layout(text: str) -> dict[str, Any]:
    """``data=2,tensor=4,zero=1,sp=1`` -> pinned ParallelLayout fields; a one-line ConfigError otherwise."""
    out: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, raw = (part.strip() for part in item.partition("="))
        if not sep or key not in KEYS or not raw:
            raise ConfigError(
                f"--layout '{text}': expected comma-separated KEY=VALUE with KEY in {'|'.join(KEYS)}, "
                "e.g. --layout data=2,tensor=4,zero=1,sp=1"
            )
        field, kind = KEYS[key]
        if field in out:
            raise ConfigError(f"--layout '{text}': {key} given twice; give each key once")
        if kind is int:
            if not (raw.isascii() and raw.isdigit() and len(raw) < 19) or not (
                key == "zero" or 1 <= int(raw) <= MAX_DEVICES
            ):
                raise ConfigError(
                    f"--layout '{text}': {key}={raw} must be an integer in [{0 if key == 'zero' else 1}, {MAX_DEVICES}]"
                )
            out[field] = int(raw)
        elif key == "sp":
            if raw.lower() not in ("0", "1", "true", "false"):
                raise ConfigError(f"--layout '{text}': sp={raw}: use 0 or 1")
            out[field] = raw.lower() in ("1", "true")
        else:
            out[field] = raw
    if not out:
        raise ConfigError(f"--layout '{text}': empty; e.g. --layout data=8,zero=3")
    if out.get("virtual_stages", 1) > 1:
        out.setdefault("pipeline_schedule", "interleaved")
    return out


def _compiled_fit(aot: list, index: int, budget_bytes: float) -> str:
    """`` (does not fit (compiled))`` when the compiled peak of layout ``index`` exceeds the budget."""
    if not aot or aot[index].skipped or aot[index].fits_compiled(budget_bytes):
        return ""
    return " (does not fit (compiled))"


def _choices_text(estimate: Any, sources: dict[str, str]) -> str:
    """``from the config: zero=1, recompute=none; chosen: microbatches=4`` for one layout."""
    layout, parts = estimate.layout, []
    short = {
        "zero_stage": "zero",
        "sequence_parallel": "sp",
        "virtual_stages": "virtual",
        "pipeline_schedule": "schedule",
    }
    for kind, label in (("config", "from the config"), ("chosen", "chosen by the search")):
        names = [
            n
            for n, src in sources.items()
            if src == kind and (layout.pipeline > 1 or n not in ("pipeline_schedule", "virtual_stages"))
        ]
        if names:
            parts.append(f"{label}: " + ", ".join(f"{short.get(n, n)}={getattr(layout, n)}" for n in names))
    return "; ".join(parts) or "all choices given"


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``jaxpar compare`` (``--config.x.y=v`` overrides arrive in ``args.overrides``)."""
    parser.add_argument("--config", default=None, help="config file (default: the built-in tiny model)")
    parser.add_argument(
        "--layout",
        action="append",
        required=True,
        dest="layouts",
        metavar="SPEC",
        help=f"a layout, KEY=VALUE,... with KEY in {'|'.join(KEYS)}; repeat for each layout",
    )
    parser.add_argument("--cluster", default="h100-80g", help=f"cluster preset: {', '.join(PRESETS)}")
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: config)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: config train.seq_len)")
    parser.add_argument("--headroom", type=float, default=0.1, help="share of device memory kept free")
    parser.add_argument("--efficiency", type=float, default=0.55, help="achieved share of peak FLOP/s")
    parser.add_argument("--aot", action="store_true", help="also compile every layout on simulated CPU devices")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


COMPARE_UNREAD = {"mesh.": "each --layout gives the mesh sizes (data=2,tensor=4)"}


def run_compare(args: argparse.Namespace) -> int:
    """Evaluate each ``--layout`` (all on the same device count) and print them side by side."""
    at_least_one(global_batch=args.global_batch, seq=args.seq)
    at_most(MAX_DIM, global_batch=args.global_batch, seq=args.seq)
    share("--efficiency", args.efficiency)
    flags = {"--global-batch": (args.global_batch, "train.global_batch"), "--seq": (args.seq, "train.seq_len")}
    refuse_flag_and_override("compare", flags, overrides(args))
    refuse_unread_overrides("compare", overrides(args), COMPARE_UNREAD)
    cfg = load_config(args.config, overrides(args))
    notes = []  # a user's file: what --layout and the flags replace in it is said (after the checks)
    if args.config is not None:
        notes = unread_notes("compare", cfg, COMPARE_UNREAD, "each --layout gives the mesh")
        notes += override_notes("compare", flags, cfg)
    model, cluster = cfg.model, get_cluster(args.cluster)
    pinned = [parse_compare_layout(text) for text in args.layouts]
    num_devices = device_count(pinned)
    if not 0 <= args.headroom < 1:
        raise ConfigError(f"--headroom {args.headroom}: use a value in [0, 1)")
    options = PlanOptions(
        headroom=args.headroom,
        efficiency=args.efficiency,
        grad_reduce_bytes=DTYPE_BYTES[cfg.parallel.grad_reduce_dtype],
        optim=cfg.optim,
    )
    global_batch, seq_len = args.global_batch or cfg.train.global_batch, args.seq or cfg.train.seq_len
    if args.aot:  # before the estimates: the parameter inventory starts JAX
        from jaxpar.analysis.aot import ensure_aot_devices

        ensure_aot_devices(num_devices)
    defaults = config_choices(cfg)
    estimates = compare_layouts(model, cluster, pinned, global_batch, seq_len, options, defaults)
    sources = [choice_sources(p, e, defaults) for p, e in zip(pinned, estimates)]
    print_notes(notes)
    aot, aot_s = [], 0.0
    if args.aot:
        from jaxpar.analysis.aot import run_aot

        start = time.perf_counter()
        aot = run_aot(cfg, [e.layout for e in estimates], options.convention, cfg.parallel.grad_reduce_dtype)
        aot_s = time.perf_counter() - start
    relative = relative_to_first(estimates)
    if args.json:
        doc = plan_summary(model, cluster, num_devices, estimates, options)
        doc |= {"global_batch": global_batch, "seq_len": seq_len}
        for row, rel, i in zip(doc["layouts"], relative, range(len(estimates))):
            row["relative_to_first"] = rel
            row["choices"] = sources[i]
            if aot:
                row["aot"] = aot[i].to_dict()
                if not aot[i].skipped:
                    row["aot"]["fits_compiled"] = aot[i].fits_compiled(doc["memory_budget_bytes"])
        print(json.dumps(doc, indent=2))
        return 0
    console = wide_console()
    budget = cluster.memory_bytes * (1 - options.headroom) / GIB
    console.print(
        f"[bold]{model.name}[/] on {num_devices} x {cluster.name}; global batch {global_batch} x seq "
        f"{seq_len}; memory budget {budget:.1f} GiB per device (red: does not fit)"
    )
    render_table(estimates, cluster, title="the layouts as given")
    console.print(f"MFU counts {flops_convention(model)}.")
    for i, (e, rel) in enumerate(zip(estimates, relative), 1):
        console.print(
            f"#{i}: memory {rel['memory']:.2f}x, step time {rel['step_time']:.2f}x of #1; MFU {e.mfu:.1%}"
            + ("" if e.fits else " (does not fit)")
            + _compiled_fit(aot, i - 1, budget * GIB)
            + "; "
            + _choices_text(e, sources[i - 1])
        )
    if aot:
        render_aot(aot, list(range(1, len(aot) + 1)), console, budget * GIB)
        console.print(f"Compiled {sum(not r.skipped for r in aot)} of {len(aot)} layouts in {aot_s:.1f} s.")
    return 0
