"""A sweep's output: results.csv, results.json, report.md and matplotlib figures.

The figures (:func:`render_plots`; each function returns its ``Figure``, for the tests): memory per
device vs collective bytes per step, step time per layout (median, min-max whiskers), and the
planner's estimates against the measurements (y = x line). :func:`compare_runs` checks a re-run
against an earlier results.json: memory and collective bytes must match exactly, and each median
step time should fall inside the earlier min-max spread, raw and host-corrected (:func:`host_factor`).
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
from typing import Any

from jaxpar.analysis.sweep.grid import AXES
from jaxpar.analysis.sweep.measure import SweepRecord

MIB = 2**20
PLOTS = {
    "memory_vs_bytes": "memory per device vs collective bytes per step",
    "step_time": "step time per layout (median, min-max whiskers)",
    "estimate_vs_measured": "planner estimate vs measured (memory, step time)",
}
CSV_FIELDS = (
    "name",
    "status",
    "data",
    "tensor",
    "pipeline",
    "context",
    "virtual_stages",
    "zero_stage",
    "sequence_parallel",
    "pipeline_schedule",
    "microbatches",
    "compile_s",
    "step_time_median_s",
    "step_time_min_s",
    "step_time_max_s",
    "pass_medians_s",
    "host_probe_s",
    "minor_faults_per_step",
    "tokens_per_s",
    "mfu",
    "argument_bytes",
    "est_argument_bytes",
    "temp_bytes",
    "est_temp_bytes",
    *(f"{a}_bytes" for a in AXES),
    *(f"est_{a}_bytes" for a in AXES),
    "est_step_time_s",
    "final_loss",
    "loss_rel_diff",
    "error",
)


def csv_row(r: SweepRecord) -> dict[str, Any]:
    row = {k: r.layout.get(k) for k in CSV_FIELDS if k in r.layout} | {
        k: getattr(r, k) for k in CSV_FIELDS if hasattr(r, k)
    }
    for a in AXES:
        row[f"{a}_bytes"], row[f"est_{a}_bytes"] = r.collective_bytes.get(a, 0.0), r.est_collective_bytes.get(a, 0.0)
    return row


def _ran(records: list[SweepRecord]) -> list[SweepRecord]:
    return [r for r in records if r.status != "crashed"]


# --------------------------------------------------------------------------- figures


def plot_memory_vs_bytes(records: list[SweepRecord]):
    """Per-device memory (compiled arguments + temporaries) against collective bytes per step."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7), layout="constrained")
    ax = fig.add_subplot()
    for r in _ran(records):
        x, y = r.bytes_per_step / MIB, (r.argument_bytes + r.temp_bytes) / MIB
        ax.scatter(x, y, s=18, color="tab:red" if r.status == "mismatch" else "tab:blue")
        ax.annotate(r.name, (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
    ax.set_xlabel("collective bytes per device per step (MiB, ring traffic, busiest stage)")
    ax.set_ylabel("compiled memory per device (MiB, arguments + temporaries)")
    ax.set_title("memory vs communication per layout")
    ax.grid(alpha=0.3)
    return fig


def plot_step_times(records: list[SweepRecord]):
    """Median step time per layout with min-max whiskers over the steady-state steps."""
    from matplotlib.figure import Figure

    ran = _ran(records)
    fig = Figure(figsize=(max(8, 0.28 * len(ran) + 2), 6), layout="constrained")
    ax = fig.add_subplot()
    med = [r.step_time_median_s * 1e3 for r in ran]
    low = [m - r.step_time_min_s * 1e3 for m, r in zip(med, ran)]
    high = [r.step_time_max_s * 1e3 - m for m, r in zip(med, ran)]
    colors = ["tab:red" if r.status == "mismatch" else "tab:blue" for r in ran]
    ax.bar(range(len(ran)), med, yerr=[low, high], capsize=2, color=colors)
    ax.set_xticks(range(len(ran)), [r.name for r in ran], rotation=90, fontsize=6)
    ax.set_xlabel("layout")
    ax.set_ylabel("step time (ms): median, whiskers min-max")
    ax.set_title("step time per layout")
    ax.grid(axis="y", alpha=0.3)
    return fig


def plot_estimate_vs_measured(records: list[SweepRecord]):
    """Two panels: planner memory estimate vs compiled memory, estimated vs measured step time; y = x."""
    from matplotlib.figure import Figure

    ran = _ran(records)
    fig = Figure(figsize=(12, 5.5), layout="constrained")
    panels = (
        (
            "memory per device (MiB)",
            [(r.est_argument_bytes + r.est_temp_bytes) / MIB for r in ran],
            [(r.argument_bytes + r.temp_bytes) / MIB for r in ran],
        ),
        ("step time (ms)", [r.est_step_time_s * 1e3 for r in ran], [r.step_time_median_s * 1e3 for r in ran]),
    )
    for k, (what, est, measured) in enumerate(panels):
        ax = fig.add_subplot(1, 2, k + 1)
        ax.scatter(est, measured, s=14)
        for r, x, y in zip(ran, est, measured):
            ax.annotate(r.name, (x, y), fontsize=5, xytext=(2, 2), textcoords="offset points")
        finite = [v for v in est + measured if v > 0 and math.isfinite(v)]
        if finite:
            lo, hi = min(finite) * 0.8, max(finite) * 1.25
            ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="y = x")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.legend(loc="upper left")
        ax.set_xlabel(f"planner estimate: {what}")
        ax.set_ylabel(f"measured: {what}")
        ax.set_title(f"estimate vs measured: {what.split(' (')[0]}")
        ax.grid(alpha=0.3)
    return fig


def render_plots(records: list[SweepRecord], outdir: str) -> dict[str, tuple[str, Any]]:
    """Write the three PNGs into ``outdir``; returns name -> (path, Figure)."""
    os.makedirs(outdir, exist_ok=True)
    out = {}
    for name, make in (
        ("memory_vs_bytes", plot_memory_vs_bytes),
        ("step_time", plot_step_times),
        ("estimate_vs_measured", plot_estimate_vs_measured),
    ):
        fig = make(records)
        path = os.path.join(outdir, f"{name}.png")
        fig.savefig(path, dpi=130)
        out[name] = (path, fig)
    return out


# --------------------------------------------------------------------------- tables and files


def _mib(value: float) -> str:
    return f"{value / MIB:.2f}"


def markdown_table(records: list[SweepRecord]) -> str:
    head = (
        "layout",
        "status",
        "compile s",
        "step ms med [min, max]",
        "tokens/s",
        "MFU",
        "args MiB (est)",
        "temps MiB (est)",
        *(f"{a} MiB (est)" for a in AXES),
        "est step ms",
        "final loss",
        "rel. diff",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        if r.status == "crashed":
            lines.append(f"| {r.name} | **crashed** | " + " | ".join(["-"] * (len(head) - 3)) + f" | {r.error} |")
            continue
        status = "ok" if r.ok else f"**{r.status}**"
        axes = [f"{_mib(r.collective_bytes.get(a, 0))} ({_mib(r.est_collective_bytes.get(a, 0))})" for a in AXES]
        lines.append(
            f"| {r.name} | {status} | {r.compile_s:.1f} | {r.step_time_median_s * 1e3:.0f} "
            f"[{r.step_time_min_s * 1e3:.0f}, {r.step_time_max_s * 1e3:.0f}] | {r.tokens_per_s:.0f} | {r.mfu:.1%} | "
            f"{_mib(r.argument_bytes)} ({_mib(r.est_argument_bytes)}) | {_mib(r.temp_bytes)} ({_mib(r.est_temp_bytes)})"
            f" | {' | '.join(axes)} | {r.est_step_time_s * 1e3:.1f} | {r.final_loss:.7f} | {r.loss_rel_diff:.1e} |"
        )
    return "\n".join(lines)


def write_results(
    records: list[SweepRecord], meta: dict[str, Any], outdir: str, comparison: list[str] | None = None
) -> dict[str, str]:
    """results.csv, results.json, the PNGs and report.md in ``outdir``; returns name -> path."""
    os.makedirs(outdir, exist_ok=True)
    paths = {
        "csv": os.path.join(outdir, "results.csv"),
        "json": os.path.join(outdir, "results.json"),
        "md": os.path.join(outdir, "report.md"),
    }
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in records:
            writer.writerow(csv_row(r))
    with open(paths["json"], "w") as f:
        json.dump({"meta": meta, "layouts": [r.to_dict() for r in records]}, f, indent=1)
    plots = render_plots(records, outdir)
    with open(paths["md"], "w") as f:
        f.write(report_markdown(records, meta, comparison))
    return paths | {name: path for name, (path, _) in plots.items()}


def report_markdown(records: list[SweepRecord], meta: dict[str, Any], comparison: list[str] | None = None) -> str:
    c = meta.get("counts", {})
    failures = [r for r in records if not r.ok]
    cluster = meta.get("cluster_for_estimates", {})
    parts = [
        "# jaxpar sweep",
        "",
        f"Command: `{meta.get('command', '')}`",
        "",
        f"{meta['layouts']} layouts of {meta['devices']} {meta['platform']} devices ({meta['device_kind']}), "
        f"{meta['steps']} steps each of {meta['tokens_per_step']} tokens (global batch {meta['global_batch']} x seq "
        f"{meta['seq_len']}), {meta['compute_dtype']} compute; all from the same initialisation on the same batches. "
        f"Step times: median, min and max over {_passes(meta)}. Reference layout: "
        f"{meta['reference']}; tolerance "
        f"{meta['tolerance']:g} relative on every step's loss.",
        "",
        f"Result: {c.get('ok', 0)} ok, {c.get('mismatch', 0)} loss mismatches, {c.get('crashed', 0)} crashed; "
        f"{meta['wall_s'] / 60:.1f} min wall.",
        "",
        f"Conditions: {meta['host_cores']} host cores ({meta['host']}), load average {_load(meta['load_average_before'])}"
        f" before and {_load(meta['load_average_after'])} after ({_load_note(meta)}), jax "
        f"{meta['jax_version']}, {meta['date_utc']} UTC. MFU peak: {meta['peak_flops_per_device'] / 1e9:.2f} GFLOP/s "
        f"per device ({meta['peak_source']}). Time estimates use the planner's model on cluster "
        f"'{cluster.get('name')}' ({cluster.get('intra_node_gbps', 0):.2f} GB/s links).",
        "",
        _probe_note(records, meta),
        "",
        _faults_note(records, meta),
        "",
        "Columns: compiled per-device arguments (parameters, optimizer state, batch) and temporaries "
        "(`memory_analysis`), collective ring bytes per device per step by mesh axis (pipelines: the busiest stage), "
        "each with the planner's estimate in parentheses (temporaries: gradients + activations + transients).",
        "",
        markdown_table(records),
        "",
    ]
    if failures:
        parts += ["## Failures", ""] + [f"- {r.name}: {r.status}: {r.error}" for r in failures] + [""]
    retried = [r for r in records if r.retried]
    if retried:
        parts += (
            ["## Retried in a new process", ""]
            + [f"- {r.name} ({r.status} on the second attempt); the first attempt: {r.retried}" for r in retried]
            + [""]
        )
    if comparison:
        parts += ["## Re-run against the earlier results", ""] + [f"- {line}" for line in comparison] + [""]
    parts += ["## Figures", ""] + [f"![{title}]({name}.png)\n" for name, title in PLOTS.items()]
    return "\n".join(parts)


def _probe_note(records: list[SweepRecord], meta: dict[str, Any]) -> str:
    """The host probe's figures: how steady the host was over the sweep."""
    times = [p for r in records for p in r.host_probe_s]
    probe = meta.get("host_probe") or {}
    if not times:
        return "Host probe: none (no layout ran)."
    return (
        f"Host probe (the host's speed, timed before every layout's steps in every pass: "
        f"{probe.get('steps_per_layout_and_pass', '?')} steps of {probe.get('layout', '?')}, median): "
        f"{statistics.median(times) * 1e3:.1f} ms over the sweep, range {min(times) * 1e3:.1f}-"
        f"{max(times) * 1e3:.1f} ms. A re-run with `--baseline` divides this out."
    )


def _faults_note(records: list[SweepRecord], meta: dict[str, Any]) -> str:
    """Minor page faults per timed step: a step that faults pays for fresh pages, and how many it
    gets depends on the worker process's allocation history (:mod:`jaxpar.host_memory`)."""
    ran = [r for r in records if r.status != "crashed"]
    if not ran:
        return "Page faults: none measured (no layout ran)."
    worst = max(ran, key=lambda r: r.minor_faults_per_step)
    faulting = sum(r.minor_faults_per_step > 0 for r in ran)
    head = (
        f"Allocator: {meta.get('allocator', 'not recorded')}. Minor page faults per timed step (median over "
        "the steady steps): "
    )
    if not faulting:
        return head + f"0 on all {len(ran)} layouts."
    return head + (
        f"0 on {len(ran) - faulting} of {len(ran)} layouts; the most, {worst.minor_faults_per_step:.0f}, "
        f"on {worst.name}."
    )


def _load(values: Any) -> str:
    return "/".join(f"{v:.1f}" for v in values)


def _passes(meta: dict[str, Any]) -> str:
    """Which steps the step-time statistics pool."""
    warmup, steps, repeats = meta["warmup_steps_excluded"], meta["steps"], meta.get("repeats", 1)
    first = f"steps {warmup + 1}-{steps} (the first {warmup} excluded)"
    if repeats <= 1:
        return f"{first} of one pass"
    later = meta.get("pass_steps", steps)
    return (
        f"{first} of pass 1 and steps {warmup + 1}-{later} of each of the {repeats - 1} later passes of {later} "
        f"steps, pooled (the whole list ran {repeats} times, minutes apart, so the spread includes the host's "
        "drift; each later pass reproduced pass 1's losses bit for bit, or the layout is marked)"
    )


def _load_note(meta: dict[str, Any]) -> str:
    """What the load average says. Only the load *before* the sweep tells whether other jobs ran:
    the load after it counts the sweep's own threads (8 simulated devices alone show ~5 on 2 cores)."""
    cores = meta["host_cores"] or 1
    before = meta["load_average_before"][0]
    if before < cores:
        return "the host was otherwise idle when the sweep started; the load after counts the sweep's own threads"
    return f"other jobs were running when the sweep started (1-minute load {before:.1f} on {cores} cores)"


def host_factor(previous: dict[str, Any], records: list[SweepRecord]) -> float | None:
    """How much slower the host ran during this sweep than during the earlier one: the ratio of the
    medians of each run's :class:`jaxpar.analysis.sweep.measure.HostProbe` times (one per layout
    and pass); None when either run has none. One factor per run, not per layout: one probe varies
    by ~10%, so a per-layout ratio would add noise to every corrected time, while a median over all
    probes carries ~1% (docs/performance.md, "Sweeps"). It removes the slow drift of the host;
    what varies within a sweep stays in its pooled spread."""
    before = [p for row in previous["layouts"] for p in row.get("host_probe_s") or []]
    now = [p for r in records for p in r.host_probe_s]
    if not before or not now:
        return None
    return statistics.median(now) / statistics.median(before)


def compare_runs(previous: dict[str, Any], records: list[SweepRecord]) -> list[str]:
    """A re-run against an earlier results.json: memory and collective bytes must be identical; the
    median step time should fall inside the earlier min-max spread. Raw, and host-corrected: the
    median divided by :func:`host_factor` (what it would have been had the host run as fast as
    during the earlier sweep), when both runs timed the same probe layout."""
    before = {row["name"]: row for row in previous["layouts"]}
    probe_then = (previous.get("meta", {}).get("host_probe") or {}).get("layout")
    probe_now = next((r.name for r in records), None)
    factor = host_factor(previous, records) if probe_then is not None and probe_then == probe_now else None
    lines, same, inside, corrected_inside, common = [], 0, 0, 0, 0
    for r in records:
        old = before.get(r.name)
        if old is None or r.status == "crashed" or old["status"] == "crashed":
            continue
        common += 1
        exact = (old["argument_bytes"], old["temp_bytes"], old["collective_bytes"]) == (
            r.argument_bytes,
            r.temp_bytes,
            r.collective_bytes,
        )
        same += exact
        if not exact:
            lines.append(f"{r.name}: memory or collective bytes differ from the earlier run")
        low, high = old["step_time_min_s"], old["step_time_max_s"]
        inside += low <= r.step_time_median_s <= high
        spread = f"the earlier spread [{low * 1e3:.0f}, {high * 1e3:.0f}] ms"
        if factor is not None:
            fixed = r.step_time_median_s / factor
            corrected_inside += low <= fixed <= high
            if not low <= fixed <= high:
                lines.append(
                    f"{r.name}: median {r.step_time_median_s * 1e3:.0f} ms, host-corrected "
                    f"{fixed * 1e3:.0f} ms, outside {spread}"
                )
        elif not low <= r.step_time_median_s <= high:
            lines.append(f"{r.name}: median {r.step_time_median_s * 1e3:.0f} ms outside {spread}")
    head = [
        f"{same} of {common} layouts have identical memory and collective bytes",
        f"{inside} of {common} median step times fall inside the earlier run's min-max spread",
    ]
    if factor is not None:
        head.append(
            f"{corrected_inside} of {common} host-corrected median step times fall inside it (the host "
            f"probe, {probe_now}, took x{factor:.3f} its earlier median time: each median divided by that)"
        )
    elif probe_then != probe_now:
        head.append(
            f"no host correction: the earlier run's probe layout ({probe_then}) is not this run's ({probe_now})"
        )
    return head + lines
