"""``jaxpar inspect``: compile one layout ahead of time and show what XLA made of it.

For ``--config FILE [--config.x.y=v ...]`` it builds the layout's train step from abstract
arrays on simulated CPU devices (nothing is allocated or run), then prints each collective
(kind, mesh axes, executions per step, ring bytes per device) and the per-device memory beside
the formula values of :mod:`jaxpar.analysis.compiled`, with their ratio. A ratio far from 1 is
either a formula that misses something or a step that does more than it should: the per-op list
(``--json`` carries it under ``ops`` with ``--ops``) names the jax source of every collective.

This module imports JAX lazily: the CLI builds its parser before JAX starts, so that the number
of simulated devices can still be set (:func:`jaxpar.distributed.ensure_host_devices`).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from jaxpar.axes import MESH_AXES
from jaxpar.cli.common import config_or_default, needs, overrides
from jaxpar.config import load_config_and_layout
from jaxpar.distributed import ensure_host_devices
from jaxpar.layout import ParallelLayout

HELP = "compile a layout (AOT) and report its collectives and per-device memory against the formulas"


def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``jaxpar inspect`` (``--config.x.y=v`` overrides are split off by the CLI)."""
    parser.add_argument("--config", default=None, help="config file, optionally FILE:arg (default: configs/tiny.py)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--ops", action="store_true", help="with --json: include every collective op")


def run_inspect(args: argparse.Namespace) -> int:
    """Compile the configured layout and print its collectives and memory against the formulas.

    Raises :class:`~jaxpar.config.ConfigError` on bad input (the CLI turns it into exit code 2).
    """
    needs("inspect", "--ops", getattr(args, "ops", False), "--json", getattr(args, "json", False))
    cfg, layout = load_config_and_layout(config_or_default(args), overrides(args))
    ensure_host_devices(layout.devices)
    from jaxpar.analysis.compiled import analyze_layout

    report = analyze_layout(cfg, layout=layout)
    schedule = pipeline_schedule(layout)
    terms = estimated_peak_terms(cfg, layout)
    if getattr(args, "json", False):
        out = report.to_dict()
        if not getattr(args, "ops", False):
            out.pop("ops")
        if schedule is not None:
            out["pipeline"] = schedule
        out["peak_terms"] = [{"term": name, "bytes": value} for name, value in terms]
        print(json.dumps(out))
    else:
        render(report, title=f"{config_or_default(args)}  {_layout_text(report.layout)}")
        mem = report.memory
        if mem is not None and mem.estimated_peak_bytes:
            from jaxpar.analysis.estimate import format_peak_terms

            print(
                f"estimated peak {mem.estimated_peak_bytes / 2**30:.3f} GiB, largest terms: "
                f"{format_peak_terms(terms, mem.estimated_peak_bytes)}"
            )
        if schedule is not None:
            print(schedule["diagram"])
            if schedule["stage_split"]:
                print(schedule["stage_split"])
    return 0


def estimated_peak_terms(cfg: Any, layout: ParallelLayout, top: int = 3) -> list[tuple[str, float]]:
    """The largest ``top`` terms of the layout's estimated peak per device
    (:func:`jaxpar.analysis.estimate.peak_terms`, in the config's dtypes)."""
    from jaxpar.analysis.estimate import peak_terms

    return peak_terms(cfg.model, layout, cfg.optim, top)


def pipeline_schedule(layout: ParallelLayout) -> dict[str, Any] | None:
    """The pipeline schedule table of a layout (None without pipeline): diagram, bubble, sends."""
    if layout.pipeline <= 1:
        return None
    from jaxpar.parallel import pipeline

    p, m, v = layout.pipeline, layout.microbatches, layout.virtual_stages
    from jaxpar.parallel.pipeline.timing import published_bubble, timed

    table = pipeline.build_schedule(layout.pipeline_schedule, p, m, v)
    forward, backward = pipeline.boundary_sends(table)
    timing = timed(table)
    published = published_bubble(layout.pipeline_schedule, p, m, v)
    return {
        "schedule": layout.pipeline_schedule,
        "ticks": table.ticks,
        "bubble_fraction": pipeline.bubble_fraction(table),
        "expected_bubble_fraction": pipeline.expected_bubble_fraction(layout.pipeline_schedule, p, m, v),
        "bubble_rate": timing.bubble,
        "published_bubble_rate": published,
        "in_flight": list(timing.in_flight),
        "boundary_sends_forward": forward,
        "boundary_sends_backward": backward,
        "diagram": pipeline.render_schedule(table)
        + f"\nbubble rate {timing.bubble:.4f} with equal F, B, W times (published {published:.4f}); "
        + f"microbatches in flight per stage {list(timing.in_flight)}",
        "layers_per_stage": list(layout.stage_layers),  # [] = num_layers / pipeline on every stage
        "stage_split": layout.stage_split_line(),
    }


def _layout_text(layout: dict[str, Any]) -> str:
    text = f"data={layout['data']} x tensor={layout['tensor']} x pipeline={layout['pipeline']}"
    if layout.get("context", 1) > 1:
        text += f" x context={layout['context']} ({layout['context_exchange']})"
    if layout.get("expert", 1) > 1:
        text += f" x expert={layout['expert']}"
    text += f", ZeRO-{layout['zero_stage']}"
    if layout["sequence_parallel"]:
        text += ", SP"
    return text + f", {layout['microbatches']} microbatch(es), recompute {layout['recompute']}"


def _fmt(value: float | None, scale: float, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"<{10**-digits:.{digits}f}" if 0 < value / scale < 10**-digits else f"{value / scale:,.{digits}f}"


def _fmt_ratio(ratio: float | None, measured: float = 0.0, estimated: float | None = None) -> str:
    if ratio is None:
        return "unexpected" if estimated == 0 and measured > 0 else "-"
    return f"{ratio:.3f}"


def render(report: Any, title: str = "", console: Any = None) -> None:
    """Rich tables: collectives (MB = 1e6 bytes per device per step) and memory (GiB per device)."""
    from rich.table import Table

    from jaxpar.analysis.clusters import GIB
    from jaxpar.analysis.compiled import MB
    from jaxpar.console import wide_console

    console = console or wide_console()
    table = Table(title=f"collectives: ring MB per device per step  {title}".strip())
    for name, justify in (
        ("kind", "left"),
        ("axes", "left"),
        ("count", "right"),
        ("MB", "right"),
        ("estimated", "right"),
        ("ratio", "right"),
    ):
        table.add_column(name, justify=justify, no_wrap=True)
    for r in report.rows:
        table.add_row(
            r.kind,
            ",".join(r.axes),
            str(r.count),
            _fmt(r.bytes_per_device, MB),
            _fmt(r.estimated_bytes, MB),
            _fmt_ratio(r.ratio, r.bytes_per_device, r.estimated_bytes),
        )
    measured = report.total_bytes()
    estimated = report.total_estimated_bytes() if any(r.estimated_bytes is not None for r in report.rows) else None
    table.add_row(
        "total",
        "",
        "",
        _fmt(measured, MB),
        _fmt(estimated, MB),
        _fmt_ratio(measured / estimated if estimated else None),
    )
    console.print(table)
    mem = report.memory
    if mem is not None:
        mt = Table(title="memory per device (memory_analysis), GiB")
        for name in ("", "GiB", "estimated", "ratio"):
            mt.add_column(name, justify="left" if not name else "right")
        for label, measured, estimated, ratio in (
            ("argument", mem.argument_bytes, mem.estimated_argument_bytes, mem.argument_ratio),
            ("temp", mem.temp_bytes, mem.estimated_temp_bytes, mem.temp_ratio),
            ("output", mem.output_bytes, mem.estimated_output_bytes, mem.output_ratio),
            ("peak (argument + temp)", mem.peak_bytes, mem.estimated_peak_bytes, mem.peak_ratio),
        ):
            mt.add_row(label, _fmt(measured, GIB, 4), _fmt(estimated, GIB, 4), _fmt_ratio(ratio))
        for stage, estimated in enumerate(mem.estimated_stage_temp_bytes):
            mt.add_row(f"  temp, stage {stage}", "", _fmt(estimated, GIB, 4), "")
        console.print(mt)
    if report.stages:
        st = Table(title="pipeline stages: ring MB per device per step, measured / estimated (ratio)")
        st.add_column("stage", justify="right")
        for axis in MESH_AXES:
            st.add_column(axis, justify="right", no_wrap=True)
        for stage in report.stages:
            cells = []
            for axis in MESH_AXES:
                measured, estimated = stage[axis], stage.get("estimated", {}).get(axis)
                ratio = measured / estimated if estimated else None
                cells.append(f"{_fmt(measured, MB)} / {_fmt(estimated, MB)} ({_fmt_ratio(ratio, measured, estimated)})")
            st.add_row(str(stage["stage"]), *cells)
        console.print(st)
    for line in report.warnings:
        console.print(f"[yellow]warning:[/yellow] {line}")
