"""``jaxpar plan``: estimate and rank layouts for a cluster before renting it; ``--aot`` compiles the top ones.

The flags, their own checks, and the output: the ranked layouts (:func:`render_table`, shared with
``jaxpar compare``), the AOT table (:func:`render_aot`) or one JSON document. The search is
:func:`jaxpar.analysis.plan.search_layouts`, the compile check :func:`jaxpar.analysis.aot.run_aot`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

from jaxpar.analysis.aot import AotComparison, run_aot
from jaxpar.analysis.clusters import GIB, PRESETS, Cluster, get_cluster
from jaxpar.analysis.estimate import CONVENTIONS, DTYPE_BYTES, RECOMPUTE, count_params, format_peak_terms
from jaxpar.analysis.plan import LayoutEstimate, PlanOptions, flops_convention, plan_summary, search_layouts
from jaxpar.axes import MESH_AXES, MeshAxis
from jaxpar.cli.common import (
    at_least_one,
    at_most,
    excludes,
    needs,
    override_notes,
    overrides,
    print_notes,
    refuse_flag_and_override,
    refuse_unread_overrides,
    share,
    unread_notes,
)
from jaxpar.config import MAX_DEVICES, MAX_DIM, ConfigError, load_config
from jaxpar.console import wide_console
from jaxpar.layout import SCHEDULES

HELP = "estimate and rank layouts for a cluster before renting it"
LAYOUT_KEYS = {**{axis.value: axis.value for axis in MESH_AXES}, "virtual": "virtual_stages"}
DEFAULT_AOT_TOP = 3


def parse_layout(text: str) -> dict[str, int]:
    """``data=1,tensor=8,pipeline=8,virtual=3`` -> ParallelLayout fields; a one-line ConfigError otherwise."""
    out: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, raw = item.partition("=")
        number = raw.strip()
        if (
            not sep
            or key.strip() not in LAYOUT_KEYS
            or not (number.isascii() and number.isdigit() and len(number) < 19)
            or int(number) < 1
        ):
            raise ConfigError(
                f"--layout '{text}': expected comma-separated {'|'.join(LAYOUT_KEYS)}=<int >= 1>, "
                "e.g. --layout data=1,tensor=8,pipeline=8,virtual=3"
            )
        if LAYOUT_KEYS[key.strip()] in out:
            raise ConfigError(f"--layout '{text}': {key.strip()} given twice; give each key once")
        out[LAYOUT_KEYS[key.strip()]] = int(raw)
    if not out:
        raise ConfigError(f"--layout '{text}': empty; e.g. --layout data=1,tensor=8,pipeline=8")
    if out.get("virtual_stages", 1) > 1:
        out["pipeline_schedule"] = "interleaved"
    if {MeshAxis.DATA, MeshAxis.TENSOR, MeshAxis.PIPELINE} <= set(out):
        out.setdefault(MeshAxis.CONTEXT.value, 1)  # the three classic axes pin the mesh, as before context existed
    return out


# --------------------------------------------------------------------------- output


def render_table(estimates: list[LayoutEstimate], cluster: Cluster, title: str = "", console: Any = None) -> None:
    """Print the ranked layouts as a rich table (the memory column is the busiest stage's peak)."""
    from rich.table import Table

    console = console or wide_console()
    table = Table(title=title, title_justify="left")
    context = any(e.layout.context > 1 for e in estimates)  # the columns appear only when a layout uses it
    expert = any(e.layout.expert > 1 for e in estimates)
    for col in (
        "#",
        "data",
        "tensor",
        "pipe",
        *(("ctx",) if context else ()),
        *(("exp",) if expert else ()),
        "v",
        "ZeRO",
        "m",
        "b",
        "recompute",
        "SP",
        "schedule",
    ):
        table.add_column(col, justify="right" if col not in ("recompute", "schedule") else "left")
    for col in (
        "states GiB",
        "act GiB",
        "total GiB",
        "step s",
        "MFU",
        "bubble",
        "TP s",
        "PP s",
        *(("CP s",) if context else ()),
        *(("EP s",) if expert else ()),
        "DP s*",
    ):
        table.add_column(col, justify="right")
    for i, e in enumerate(estimates, 1):
        layout, mem, t = e.layout, e.memory, e.time
        style = None if e.fits else "red"
        ctx = (f"{layout.context}{'ag' if layout.context_exchange == 'all_gather' else ''}",) if context else ()
        ctx += (str(layout.expert),) if expert else ()
        table.add_row(
            str(i), str(layout.data), str(layout.tensor), str(layout.pipeline), *ctx, str(layout.virtual_stages),
            str(layout.zero_stage), str(layout.microbatches), str(layout.microbatch_size), layout.recompute,
            "y" if layout.sequence_parallel else "", layout.pipeline_schedule if layout.pipeline > 1 else "-",
            gib(mem.model_states_bytes),
            gib(mem.activation_bytes + mem.transient_bytes), gib(mem.total_bytes),
            f"{e.step_time_s:.2f}", f"{e.mfu:.1%}", f"{e.bubble_fraction:.1%}", f"{t.tensor_s:.2f}",
            f"{t.pipeline_s:.2f}", *((f"{e.context_s:.2f}",) if context else ()),
            *((f"{t.expert_s:.2f}",) if expert else ()), f"{t.data_exposed_s:.2f}",
            style=style,
        )  # fmt: skip
    console.print(table)


def gib(value: float | None) -> str:
    """A per-device memory figure in GiB, three significant digits (every memory table uses it)."""
    return "-" if value is None else f"{value / GIB:.3g}"


def _human_bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def _versus(estimated: float | None, compiled: float | None) -> str:
    """``est -> compiled (ratio)`` for one table cell."""
    ratio = compiled / estimated if compiled is not None and estimated else None
    return f"{_human_bytes(estimated)} -> {_human_bytes(compiled)} ({'-' if ratio is None else f'{ratio:.3f}'})"


def _versus_gib(estimated: float | None, compiled: float | None) -> str:
    """``est -> compiled (ratio)`` of a memory figure, in GiB per device."""
    ratio = compiled / estimated if compiled is not None and estimated else None
    return f"{gib(estimated)} -> {gib(compiled)} ({'-' if ratio is None else f'{ratio:.3f}'})"


def render_aot(
    results: list[AotComparison], ranks: list[int], console: Any = None, budget_bytes: float | None = None
) -> None:
    """The AOT check as a rich table: estimated vs compiled arguments, temporaries and peak (GiB per
    device) and collective bytes per axis (per device per step), with compiled / estimated ratios;
    a layout whose compiled peak exceeds ``budget_bytes`` is marked "does not fit (compiled)";
    skipped layouts with their reason."""
    from rich.table import Table

    console = console or wide_console()
    done = [(rank, r) for rank, r in zip(ranks, results) if not r.skipped]
    if done:
        axes = [a for a in MESH_AXES if any(getattr(r.layout, a) > 1 for _, r in done)]
        dtypes = sorted({f"compute {r.compute_dtype}, reduce {r.grad_reduce_dtype} on {r.platform}" for _, r in done})
        table = Table(
            title=f"AOT: the compiled train step per device per step ({'; '.join(dtypes)})", title_justify="left"
        )
        memory_cols = ("args GiB: est -> AOT (ratio)", "temp GiB: est -> AOT (ratio)", "peak GiB: est -> AOT (ratio)")
        for col in ("#", "compile s", *memory_cols, *(f"{a} bytes: est -> AOT (ratio)" for a in axes)):
            table.add_column(col, justify="right")
        if budget_bytes is not None:
            table.add_column("compiled peak", justify="left")
        for rank, r in done:
            cells = [
                str(rank),
                f"{r.compile_s:.1f}",
                _versus_gib(r.estimated_argument_bytes, r.argument_bytes),
                _versus_gib(r.estimated_temp_bytes, r.temp_bytes),
                _versus_gib(r.estimated_peak_bytes, r.peak_bytes),
            ]
            cells += [_versus(r.estimated_bytes.get(axis), r.compiled_bytes.get(axis)) for axis in axes]
            if budget_bytes is not None:
                fits = r.fits_compiled(budget_bytes)
                cells.append("fits" if fits else "[red]does not fit (compiled)[/]")
            table.add_row(*cells)
        console.print(table)
        for rank, r in done:
            if r.peak_terms and r.estimated_peak_bytes:
                console.print(
                    f"#{rank} estimated peak {gib(r.estimated_peak_bytes)} GiB, largest terms: "
                    + format_peak_terms(r.peak_terms, r.estimated_peak_bytes)
                )
        staged = [(rank, r) for rank, r in done if r.estimated_stage_temp_bytes]
        for rank, r in staged:
            console.print(
                f"#{rank} estimated temp GiB per pipeline stage: "
                + ", ".join(gib(t) for t in r.estimated_stage_temp_bytes)
                + f" (compiled: one buffer for every stage, {gib(r.temp_bytes)})"
            )
    for rank, r in zip(ranks, results):
        if r.skipped:
            console.print(f"[yellow]#{rank} not compiled:[/] {r.skipped}")
    if any(r.platform == "cpu" for _, r in done):
        console.print(
            "AOT ran on simulated CPU devices with float32 compute and reductions (XLA:CPU runs bf16 collectives "
            "in fp32); the est columns use the same dtypes. args = parameters + optimizer state + batch; temp = "
            "XLA:CPU temporaries (activations in fp32: a bf16 step on GPU holds less); peak = args + temp."
        )


# --------------------------------------------------------------------------- command line


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``jaxpar plan`` (``--config.x.y=v`` overrides arrive separately in ``args.overrides``)."""
    parser.add_argument("--config", default=None, help="config file (default: the built-in tiny model)")
    parser.add_argument("--cluster", default="h100-80g", help=f"cluster preset: {', '.join(PRESETS)}")
    parser.add_argument("--nodes", type=int, default=None, help="nodes (default 1, or the --layout product)")
    parser.add_argument("--devices", type=int, default=None, help="total devices (instead of --nodes)")
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: config)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: config train.seq_len)")
    parser.add_argument("--top", type=int, default=10, help="rows to show")
    parser.add_argument("--headroom", type=float, default=0.1, help="share of device memory kept free")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--layout",
        default=None,
        help="pin mesh sizes, e.g. data=1,tensor=8,pipeline=8,virtual=3 (context=1 unless given)",
    )
    parser.add_argument("--microbatches", type=int, default=None, help="pin microbatches per step")
    parser.add_argument("--recompute", choices=RECOMPUTE, default=None, help="pin the recompute policy")
    parser.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=None, help="pin the ZeRO stage")
    parser.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default=None,
        help="pin the pipeline schedule (searched: 1f1b, interleaved, zb-h1, zb-v; zb-v holds virtual=2 chunks)",
    )
    parser.add_argument("--convention", choices=CONVENTIONS, default="jaxpar", help="byte convention of the estimates")
    parser.add_argument("--efficiency", type=float, default=0.55, help="achieved share of peak FLOP/s")
    parser.add_argument("--grad-reduce-dtype", choices=("float32", "bfloat16"), default=None)
    parser.add_argument(
        "--aot",
        action="store_true",
        help="compile the top --aot-top layouts shown on simulated devices and compare with the estimates",
    )
    parser.add_argument("--aot-top", type=int, default=None, help="layouts to compile with --aot")


# the config fields plan's flags set, and those the search picks unless a flag pins them
def plan_flag_fields(args: argparse.Namespace) -> dict[str, tuple[object, str]]:
    """``flag -> (its value or None, the config field it overrides)`` for ``jaxpar plan``."""
    return {
        "--global-batch": (args.global_batch, "train.global_batch"),
        "--seq": (args.seq, "train.seq_len"),
        "--microbatches": (args.microbatches, "parallel.microbatches"),
        "--recompute": (args.recompute, "parallel.recompute"),
        "--sequence-parallel": (args.sequence_parallel, "parallel.sequence_parallel"),
        "--zero": (args.zero, "parallel.zero_stage"),
        "--schedule": (args.schedule, "parallel.pipeline_schedule"),
        "--grad-reduce-dtype": (args.grad_reduce_dtype, "parallel.grad_reduce_dtype"),
    }


PLAN_UNREAD = {
    "mesh.": "plan searches the mesh; pin sizes with --layout, e.g. --layout data=2,tensor=4",
    "parallel.zero_stage": "plan searches the ZeRO stage; pin it with --zero",
    "parallel.sequence_parallel": "plan searches it; pin it with --sequence-parallel / --no-sequence-parallel",
    "parallel.microbatches": "plan searches the microbatches; pin them with --microbatches",
    "parallel.recompute": "plan searches the recompute policy; pin it with --recompute",
    "parallel.pipeline_schedule": "plan searches the schedule; pin it with --schedule",
    "parallel.virtual_stages": "plan searches the virtual stages; pin them with --layout virtual=N",
}


def run_plan(args: argparse.Namespace) -> int:
    """``jaxpar plan``: search (or evaluate the pinned) layouts and print a table or JSON. Returns 0."""
    aot_top = getattr(args, "aot_top", None)
    needs("plan", "--aot-top", aot_top is not None, "--aot", getattr(args, "aot", False))
    excludes("plan", "--devices", args.devices is not None, "--nodes", args.nodes is not None)
    at_least_one(
        devices=args.devices,
        nodes=args.nodes,
        global_batch=args.global_batch,
        seq=args.seq,
        top=args.top,
        microbatches=args.microbatches,
    )
    at_most(MAX_DIM, global_batch=args.global_batch, seq=args.seq, microbatches=args.microbatches)
    share("--efficiency", args.efficiency)
    refuse_flag_and_override("plan", plan_flag_fields(args), overrides(args))
    refuse_unread_overrides("plan", overrides(args), PLAN_UNREAD)
    cfg = load_config(args.config, overrides(args))
    model = cfg.model  # the plan chooses the layout: the config's is named on stderr when it has one
    notes = []  # a user's file: what the flags and the search replace in it is said (after the checks)
    if args.config is not None:
        notes = unread_notes("plan", cfg, PLAN_UNREAD, "plan chooses the layout; flags pin parts of it, see --help")
        notes += override_notes("plan", plan_flag_fields(args), cfg)
    cluster = get_cluster(args.cluster)
    fixed = parse_layout(args.layout) if args.layout else {}
    for name, value in (
        ("microbatches", args.microbatches),
        ("recompute", args.recompute),
        ("sequence_parallel", args.sequence_parallel),
        ("zero_stage", args.zero),
        ("pipeline_schedule", args.schedule),
    ):
        if value is not None:
            fixed[name] = value
    dpn = cluster.devices_per_node
    if args.devices is not None:
        num_devices = args.devices
    elif args.nodes is not None:
        num_devices = args.nodes * dpn
    elif set(MESH_AXES) <= set(fixed):
        num_devices = math.prod(fixed[axis] for axis in MESH_AXES)
    else:
        num_devices = dpn
    if num_devices > MAX_DEVICES:
        raise ConfigError(
            f"plan: {num_devices} devices is more than any cluster has; use at most {MAX_DEVICES} "
            f"({MAX_DEVICES // dpn} nodes of {dpn})"
        )
    if num_devices < 1 or num_devices % dpn:
        raise ConfigError(
            f"plan: {num_devices} devices is not a multiple of {dpn} devices per node on {cluster.name}; "
            f"use --nodes or a multiple of {dpn}"
        )
    others = [axis for axis in MESH_AXES if axis != MeshAxis.DATA]
    if all(axis in fixed for axis in others) and MeshAxis.DATA not in fixed:
        fixed[MeshAxis.DATA.value] = num_devices // math.prod(fixed[axis] for axis in others)
    product = math.prod(fixed.get(axis, 1) for axis in MESH_AXES)
    if set(MESH_AXES) <= set(fixed) and product != num_devices:
        raise ConfigError(f"--layout: {'*'.join(MESH_AXES)} = {product} but the plan has {num_devices} devices")
    global_batch = args.global_batch or cfg.train.global_batch
    seq_len = args.seq or cfg.train.seq_len
    if model.position == "learned" and seq_len > model.max_seq_len:
        raise ConfigError(f"--seq {seq_len} exceeds model.max_seq_len={model.max_seq_len} (learned positions)")
    if not 0 <= args.headroom < 1:
        raise ConfigError(f"--headroom {args.headroom}: use a value in [0, 1)")
    grad_dtype = args.grad_reduce_dtype or cfg.parallel.grad_reduce_dtype
    options = PlanOptions(
        headroom=args.headroom,
        convention=args.convention,
        grad_reduce_bytes=DTYPE_BYTES[grad_dtype],
        efficiency=args.efficiency,
        optim=cfg.optim,
    )
    if getattr(args, "aot", False):  # before the search: the parameter inventory starts JAX
        from jaxpar.analysis.aot import ensure_aot_devices

        ensure_aot_devices(num_devices)
    start = time.perf_counter()
    pinned = bool(args.layout)
    estimates = search_layouts(model, cluster, num_devices, global_batch, seq_len, options, fixed, keep_unfit=pinned)
    elapsed = time.perf_counter() - start
    print_notes(notes)
    shown = estimates[: args.top]
    aot: list[AotComparison] = []
    aot_s = 0.0
    if getattr(args, "aot", False):
        aot_top = DEFAULT_AOT_TOP if aot_top is None else aot_top
        if aot_top < 1:
            raise ConfigError(f"--aot-top {aot_top}: compile at least 1 layout")
        start = time.perf_counter()
        aot = run_aot(cfg, [e.layout for e in shown[:aot_top]], options.convention, grad_dtype)
        aot_s = time.perf_counter() - start
    if args.json:
        doc = plan_summary(model, cluster, num_devices, shown, options)
        doc |= {
            "global_batch": global_batch,
            "seq_len": seq_len,
            "searched": getattr(estimates, "considered", len(estimates)),
            "fitting": getattr(estimates, "fitting", sum(e.fits for e in estimates)),
            "search_s": elapsed,
        }
        for row, result in zip(doc["layouts"], aot):
            row["aot"] = result.to_dict()
            if not result.skipped:
                row["aot"]["fits_compiled"] = result.fits_compiled(doc["memory_budget_bytes"])
        if aot:
            doc["aot_s"] = aot_s
        print(json.dumps(doc, indent=2))
        return 0
    console = wide_console()
    budget = cluster.memory_bytes * (1 - options.headroom) / GIB
    console.print(
        f"[bold]{model.name}[/] ({count_params(model) / 1e9:.2f}B params) on {num_devices} x {cluster.name} "
        f"({num_devices // dpn} nodes); global batch {global_batch} x seq {seq_len}; memory budget {budget:.1f} GiB "
        f"per device ({cluster.memory_gb:g} GB data sheet - {options.headroom:.0%} headroom); "
        f"{options.convention} state convention; compute at {options.efficiency:.0%} of peak"
    )
    considered = getattr(estimates, "considered", len(estimates))  # counted before those over budget are dropped
    fitting = getattr(estimates, "fitting", sum(e.fits for e in estimates))
    render_table(shown, cluster, title=f"{fitting} of {considered} layouts fit; top {len(shown)} by step time")
    if estimates[0].why:
        console.print(f"[bold]why #1:[/] {estimates[0].why}")
    elif pinned:
        console.print("[red]the pinned layout does not fit the memory budget[/]")
    console.print(
        f"* DP s = exposed data-axis time. MFU counts {flops_convention(model)}. Searched in {elapsed:.2f} s."
    )
    if aot:
        render_aot(aot, list(range(1, len(aot) + 1)), console, cluster.memory_bytes * (1 - options.headroom))
        console.print(f"Compiled {sum(not r.skipped for r in aot)} of {len(aot)} layouts in {aot_s:.1f} s.")
    return 0
