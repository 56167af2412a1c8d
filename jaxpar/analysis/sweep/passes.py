"""The sweep's passes over the grid, and the loss check against the reference layout (the first run,
pure data parallelism): losses beyond the tolerance are a ``mismatch``; a layout that raises or kills
its process is ``crashed`` with its one-line error, and the sweep goes on."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from jaxpar.analysis.aot import layout_config
from jaxpar.analysis.estimate import ParallelLayout
from jaxpar.analysis.sweep.grid import device_cluster, layout_name, select, sweep_layouts
from jaxpar.analysis.sweep.measure import PROBE_STEPS, SweepRecord, summarize_times
from jaxpar.analysis.sweep.worker import Workers
from jaxpar.config import ConfigDict, ConfigError

PASS_STEPS = 5  # steps of each later pass, unless --steps is fewer
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-2}  # relative loss difference from the reference
STATUSES = ("ok", "mismatch", "crashed")


def check_losses(records: list[SweepRecord], tolerance: float) -> SweepRecord | None:
    """Compare every layout's losses with the reference (the first layout that ran); mark the ones
    beyond ``tolerance`` as ``mismatch``. Returns the reference."""
    reference = next((r for r in records if r.status != "crashed"), None)
    if reference is None:
        return None
    ref = reference.losses
    for r in records:
        if r.status == "crashed":
            continue
        diffs = [abs(a - b) / abs(b) for a, b in zip(r.losses, ref)]
        r.loss_rel_diff = max(diffs) if diffs and len(r.losses) == len(ref) else float("inf")
        if not (r.loss_rel_diff <= tolerance):
            r.status = "mismatch"
            r.error = f"loss differs from {reference.name} by {r.loss_rel_diff:.2e} relative (> {tolerance:g})"
    return reference


# --------------------------------------------------------------------------- the sweep


def run_sweep_layouts(
    cfg: ConfigDict,
    num_devices: int,
    *,
    steps: int,
    warmup: int,
    only: Iterable[str] = (),
    tolerance: float | None = None,
    progress: bool = True,
    repeats: int = 6,
    pass_steps: int | None = None,
) -> tuple[list[SweepRecord], dict]:
    """Every selected layout of ``num_devices``, each for ``steps`` steps on the same batches;
    returns the records and the run's conditions (host, peak, cluster, tolerance, wall time).

    ``repeats`` passes: the first compiles, analyses and runs every layout; each later pass runs the
    list again for ``pass_steps`` steps (default ``min(PASS_STEPS, steps)``) with pass 1's
    executables (never the persistent compilation cache: :func:`time_again`) and must reproduce
    pass 1's first losses bit for bit. Step-time statistics pool the passes (:func:`summarize_times`):
    many short passes, because a layout's median moves between passes minutes apart by more than its
    steps vary within one, and only passes put that movement inside the spread a re-run is checked
    against. Every layout's steps are preceded by a :class:`HostProbe` (``host_probe_s``)."""
    import os
    import platform

    from jaxpar.analysis.aot import ensure_aot_devices

    if steps < 1 or not 0 <= warmup < steps:
        raise ConfigError(f"--steps {steps} / --warmup {warmup}: need steps >= 1 and 0 <= warmup < steps")
    ensure_aot_devices(num_devices)
    import jax

    from jaxpar import data as data_lib
    from jaxpar.host_memory import steady_malloc
    from jaxpar.metrics import device_peak_flops

    load_before = os.getloadavg()
    started = time.perf_counter()
    peak, peak_source = device_peak_flops(num_devices)
    cluster = device_cluster(num_devices, peak)
    t = cfg.train
    layouts = select(sweep_layouts(cfg.model, num_devices, t.global_batch, t.seq_len, cluster), only)
    stream = data_lib.make_batches(
        cfg.data, vocab_size=cfg.model.vocab_size, seq_len=t.seq_len, global_batch=t.global_batch, seed=t.seed
    )
    batches = [stream.next() for _ in range(steps)]
    tolerance = TOLERANCE[cfg.model.compute_dtype] if tolerance is None else tolerance
    if repeats < 1:
        raise ConfigError(f"--repeats {repeats}: use at least 1 pass")
    pass_steps = min(PASS_STEPS, steps) if pass_steps is None else pass_steps
    if not warmup < pass_steps <= steps:
        raise ConfigError(
            f"--pass-steps {pass_steps}: use a value in ({warmup}, {steps}]: more than --warmup, at most --steps"
        )
    records: list[SweepRecord] = []
    saved = os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)  # never read compiles back (time_again)
    try:
        with (
            _progress(progress) as bar,
            Workers(cfg, num_devices, batches, steps, warmup, peak, cluster, probe=layouts[0]) as workers,
        ):
            over = bar.add_task("layouts", total=len(layouts) * repeats, name="", loss=float("nan"))
            inner = bar.add_task("steps", total=steps, name="", loss=float("nan"))
            for layout in layouts:
                name = layout_name(layout)
                bar.reset(inner, total=steps, name=name, loss=float("nan"))
                bar.update(over, name=name)
                record = workers.run(layout, on_step=lambda k, loss: bar.update(inner, completed=k, loss=loss))
                records.append(record)
                if record.status == "crashed":
                    bar.console.print(f"[red]{name} crashed:[/] {record.error}")
                bar.update(over, advance=1, loss=record.final_loss)
            for number in range(2, repeats + 1):
                for layout, record in zip(layouts, records):
                    bar.reset(inner, total=pass_steps, name=f"{record.name} (pass {number})", loss=float("nan"))
                    if record.status != "crashed":
                        out = workers.again(
                            layout, pass_steps, on_step=lambda k, loss: bar.update(inner, completed=k, loss=loss)
                        )
                        _add_pass(record, out, number, cfg, layout, warmup, peak)
                        if record.status == "crashed":
                            bar.console.print(f"[red]{record.name} crashed in pass {number}:[/] {record.error}")
                    bar.update(over, advance=1)
    finally:
        if saved is not None:
            os.environ["JAX_COMPILATION_CACHE_DIR"] = saved
    reference = check_losses(records, tolerance)
    meta = {
        "devices": num_devices,
        "platform": jax.devices()[0].platform,
        "device_kind": jax.devices()[0].device_kind,
        "host_cores": os.cpu_count(),
        "host": _cpu_model() or platform.machine(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "jax_version": jax.__version__,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "peak_flops_per_device": peak,
        "peak_source": peak_source,
        "cluster_for_estimates": cluster.to_dict(),
        "steps": steps,
        "warmup_steps_excluded": warmup,
        "repeats": repeats,
        "pass_steps": pass_steps,
        "compute_dtype": cfg.model.compute_dtype,
        "tolerance": tolerance,
        "reference": reference.name if reference else None,
        "global_batch": t.global_batch,
        "seq_len": t.seq_len,
        "tokens_per_step": t.global_batch * t.seq_len,
        "wall_s": time.perf_counter() - started,
        "host_probe": {
            "layout": layout_name(layouts[0]),
            "steps_per_layout_and_pass": PROBE_STEPS,
            "median_s": _median([p for r in records for p in r.host_probe_s]),
        },
        "allocator": steady_malloc(apply=False),  # what each worker process set (jaxpar.analysis.sweep.worker)
        "layouts": len(records),
        "counts": {s: sum(r.status == s for r in records) for s in STATUSES},
    }
    return records, meta


def _add_pass(
    record: SweepRecord,
    out: dict[str, Any],
    number: int,
    cfg: ConfigDict,
    layout: ParallelLayout,
    warmup: int,
    peak: float,
) -> None:
    """Fold a later pass into ``record``: its step times, or a crash; losses that are not bitwise
    pass 1's first ones make the layout a mismatch (the same program on the same inputs must repeat
    itself)."""
    if "error" in out:
        record.status, record.error = "crashed", f"pass {number}: {out['error']}"
        return
    record.repeat_step_times_s.append(out["times"])
    record.minor_faults.append(out.get("faults", []))
    if "probe_s" in out:
        record.host_probe_s.append(out["probe_s"])
    if out["losses"] != record.losses[: len(out["losses"])] and record.status == "ok":
        diff = max((abs(a - b) / abs(b) if b else abs(a - b)) for a, b in zip(out["losses"], record.losses))
        record.status = "mismatch"
        record.error = f"pass {number} losses differ from pass 1 by {diff:.2e} relative (not deterministic)"
    summarize_times(record, layout_config(cfg, layout), layout, warmup, peak)


def _median(values: list[float]) -> float:
    import statistics

    return statistics.median(values) if values else float("nan")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def _progress(enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[name]}"),
        TextColumn("loss {task.fields[loss]:.4f} nats/token"),
        TimeElapsedColumn(),
        disable=not enabled,
    )
