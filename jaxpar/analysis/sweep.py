"""``jaxpar sweep``: run every valid layout of N devices on the same problem and measure it.

The layouts are the planner's (:func:`jaxpar.analysis.plan.search_layouts` decides what is valid):
every (data, tensor, pipeline) mesh whose sizes divide the model, ZeRO 0-3, sequence parallelism,
and for pipelines each schedule (GPipe, 1F1B, interleaved with each number of virtual stages), with
recompute off. A pipeline gets ``2 * pipeline`` microbatches when the batch allows (fewer otherwise,
never fewer than ``pipeline``); without a pipeline the batch is one microbatch. Each layout is built
(:class:`jaxpar.train.state.Setup`), its train step compiled once, and that executable both analysed
(``memory_analysis`` and the HLO's collectives, :func:`jaxpar.analysis.compiled.analyze_compiled`)
and run for ``steps`` steps from the same initialisation (``Setup.init(seed)``) on the same batches.

Per layout (:class:`SweepRecord`): compile time; step time median / min / max over the steps after
``warmup`` (the first calls include one-off work); tokens/s; MFU against
:func:`jaxpar.metrics.device_peak_flops` (CPU: a measured matmul rate; GPU: the data sheet); compiled
argument and temporary bytes per device and collective bytes per axis, each beside the planner's
estimate; every step's loss and the largest relative difference from the reference layout (the
first one run: pure data parallelism). A layout whose losses differ by more than the tolerance is a
``mismatch``; one that raises is ``crashed`` with its one-line error, and the sweep goes on. The
layouts run in a child process (:class:`Workers`): an XLA check failure aborts a process outright.
XLA:CPU's in-process collectives did abort in sweeps ("Check failed: id < num_threads" in a
reduce-scatter rendezvous; "Termination timeout ... of 40 seconds exceeded"), on layout
``d4t2p1-z3-sp-m1``: a head collective ran concurrently with the layer scan's collectives of the same
rendezvous key, fixed in the model (:mod:`jaxpar.analysis.collective_order`). The isolation stays
for whatever else aborts: the child allows collectives 10 minutes (:data:`COLLECTIVE_TIMEOUT_FLAGS`:
simulated devices on busy cores can be late), a layout whose child dies is tried once more in a new
child, then recorded as crashed with the fatal line, and the sweep goes on.

The planner's time estimate needs a cluster: on a GPU the data-sheet preset of that GPU; on CPU a
"cluster" of simulated devices (:func:`cpu_cluster`) whose peak is the measured matmul rate and whose
link bandwidth is a measured host memory copy rate shared by the devices -- a rough model, and the
estimate-vs-measured figure shows how rough.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from jaxpar.analysis.aot import estimated_argument_bytes, layout_config
from jaxpar.analysis.clusters import GB, PRESETS, Cluster
from jaxpar.analysis.estimate import ParallelLayout
from jaxpar.analysis.plan import PlanOptions, evaluate_layout, search_layouts
from jaxpar.axes import MESH_AXES
from jaxpar.config import ConfigDict, ConfigError

AXES = tuple(axis.value for axis in MESH_AXES)
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-2}  # relative loss difference from the reference
STATUSES = ("ok", "mismatch", "crashed")
COLLECTIVE_TIMEOUT_FLAGS = ("--xla_cpu_collective_call_terminate_timeout_seconds=600",
                            "--xla_cpu_collective_timeout_seconds=600")
ABORT_ENV = "JAXPAR_SWEEP_ABORT"  # a layout name: its worker process aborts (tests of crash recording)


def layout_name(layout: ParallelLayout) -> str:
    """A short unique name: ``d2t2p2v2-z1-sp-interleaved-m4`` (mesh, ZeRO, +SP, schedule, microbatches);
    with context parallelism ``c<size>`` after the mesh (``c<size>ag`` for the all-gather exchange)."""
    name = f"d{layout.data}t{layout.tensor}p{layout.pipeline}"
    name += f"v{layout.virtual_stages}" if layout.virtual_stages > 1 else ""
    if layout.context > 1:
        name += f"c{layout.context}" + ("ag" if layout.context_exchange == "all_gather" else "")
    name += f"-z{layout.zero_stage}" + ("-sp" if layout.sequence_parallel else "")
    if layout.pipeline > 1:
        name += f"-{layout.schedule}"
    return name + f"-m{layout.microbatches}"


def _microbatches(layout: ParallelLayout) -> int:
    """The sweep's microbatch count: 1 without a pipeline; else 2p if the batch allows, at least p."""
    per_shard = layout.microbatches * layout.microbatch_size
    if layout.pipeline == 1:
        return 1
    for m in (2 * layout.pipeline, layout.pipeline):
        if per_shard % m == 0:
            return m
    return layout.microbatches


def sweep_layouts(model: ConfigDict, num_devices: int, global_batch: int, seq_len: int,
                  cluster: Cluster) -> list[ParallelLayout]:
    """Every layout of ``num_devices`` the planner accepts for this batch, recompute off, one
    microbatch count per layout (see the module docstring), pure data parallelism first."""
    options = PlanOptions(headroom=0.0)
    found: dict[str, ParallelLayout] = {}
    for schedule in ("1f1b", "gpipe", "interleaved"):
        fixed = {"recompute": "none", "schedule": schedule}
        try:
            estimates = search_layouts(model, cluster, num_devices, global_batch, seq_len, options, fixed,
                                       keep_unfit=True)
        except ConfigError:
            continue  # e.g. no layout of this schedule
        for est in estimates:
            lay = est.layout
            if schedule != "1f1b" and lay.pipeline == 1:
                continue  # the schedule is moot without a pipeline: counted once, under 1f1b
            m = _microbatches(lay)
            if lay.schedule == "interleaved" and m % lay.pipeline:
                continue
            lay = dataclasses.replace(lay, microbatches=m, microbatch_size=global_batch // (lay.data * m))
            found.setdefault(layout_name(lay), lay)
    order = {"1f1b": 0, "gpipe": 1, "interleaved": 2}
    return sorted(found.values(), key=lambda x: (x.pipeline, x.tensor, x.virtual_stages, order[x.schedule],
                                                 x.zero_stage, x.sequence_parallel))


def select(layouts: list[ParallelLayout], only: Iterable[str] = ()) -> list[ParallelLayout]:
    """The layouts whose name matches any of the ``only`` regular expressions (all without any)."""
    patterns = []
    for text in only:
        try:
            patterns.append(re.compile(text))
        except re.error as e:
            raise ConfigError(f"--only '{text}': not a regular expression ({e}); e.g. --only 'z3|p4'") from None
    chosen = [lay for lay in layouts if not patterns or any(p.search(layout_name(lay)) for p in patterns)]
    if not chosen:
        names = ", ".join(layout_name(lay) for lay in layouts[:6])
        raise ConfigError(f"--only {' '.join(only)}: matches none of the {len(layouts)} layouts (e.g. {names})")
    return chosen


# --------------------------------------------------------------------------- estimates


def measure_copy_gbps(megabytes: int = 64) -> float:
    """Host memory copy rate, GB/s (best of 5 numpy copies): the link of simulated CPU devices."""
    import numpy as np

    src = np.ones(megabytes * 2**20 // 8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return src.nbytes / best / GB


def cpu_cluster(num_devices: int, peak_flops: float, copy_gbps: float) -> Cluster:
    """Simulated CPU devices as a one-node cluster: the measured peak per device; links at the
    measured copy rate shared by the devices; memory unbounded for the planner (host RAM)."""
    link = max(copy_gbps / num_devices, 1e-3)
    return Cluster("cpu-simulated", peak_flops / 1e12, 1e15, copy_gbps, num_devices, link, link,
                   "simulated CPU devices: measured fp32 matmul peak and memory copy rate, shared")


def device_cluster(num_devices: int, peak_flops: float) -> Cluster:
    """The data-sheet preset of the accelerator in use, else :func:`cpu_cluster`."""
    import jax

    kind = getattr(jax.devices()[0], "device_kind", "").lower()
    for name, cluster in PRESETS.items():
        if name.split("-")[0] in kind:
            return dataclasses.replace(cluster, devices_per_node=max(cluster.devices_per_node, num_devices))
    return cpu_cluster(num_devices, peak_flops, measure_copy_gbps())


# --------------------------------------------------------------------------- one layout


@dataclasses.dataclass
class SweepRecord:
    """One layout's measurements beside the planner's estimates (bytes per device; seconds)."""

    name: str
    layout: dict[str, Any]
    status: str = "ok"  # ok | mismatch | crashed
    error: str = ""
    compile_s: float = 0.0
    step_time_median_s: float = 0.0
    step_time_min_s: float = 0.0
    step_time_max_s: float = 0.0
    step_times_s: list[float] = dataclasses.field(default_factory=list)  # pass 1, warm-up steps included
    repeat_step_times_s: list[list[float]] = dataclasses.field(default_factory=list)  # passes 2, 3, ...
    pass_medians_s: list[float] = dataclasses.field(default_factory=list)  # steady-state median of each pass
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    argument_bytes: int = 0
    temp_bytes: int = 0
    collective_bytes: dict[str, float] = dataclasses.field(default_factory=dict)  # axis -> ring bytes/step
    est_argument_bytes: float = 0.0
    est_temp_bytes: float = 0.0  # gradients + activations + transients of the planner's memory estimate
    est_collective_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
    est_step_time_s: float = 0.0
    losses: list[float] = dataclasses.field(default_factory=list)
    final_loss: float = float("nan")
    loss_rel_diff: float = float("nan")  # max over steps of |loss - reference| / |reference|
    retried: str = ""  # why the first attempt's process died, when a second attempt ran

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def bytes_per_step(self) -> float:
        return sum(self.collective_bytes.values())

    @property
    def est_bytes_per_step(self) -> float:
        return sum(self.est_collective_bytes.values())

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"bytes_per_step": self.bytes_per_step,
                                           "est_bytes_per_step": self.est_bytes_per_step}


def _one_line(error: BaseException) -> str:
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first}"[:300]


def run_layout(cfg: ConfigDict, layout: ParallelLayout, batches: list, *, steps: int, warmup: int, peak_flops: float,
               cluster: Cluster, on_step: Callable[[int, float], None] | None = None,
               keep: dict[str, Any] | None = None) -> SweepRecord:
    """Compile ``layout`` once, analyse the executable, run it for ``steps`` steps; never raises
    for a failing layout (the record says ``crashed`` and why). ``keep``: where to leave the
    compiled step for :func:`time_again` (keyed by the layout's name)."""
    record = SweepRecord(layout_name(layout), layout.to_dict())
    try:
        _run(record, cfg, layout, batches, steps, warmup, peak_flops, cluster, on_step, keep)
    except Exception as e:  # noqa: BLE001 - one broken layout must not end the sweep
        record.status, record.error = "crashed", _one_line(e)
        record.layout["traceback_tail"] = traceback.format_exc().strip().splitlines()[-1][:300]
    return record


def _run(record: SweepRecord, cfg: ConfigDict, layout: ParallelLayout, batches: list, steps: int, warmup: int,
         peak_flops: float, cluster: Cluster, on_step: Callable[[int, float], None] | None,
         keep: dict[str, Any] | None = None) -> None:
    from jaxpar.analysis.aot import _compiled_axis_bytes
    from jaxpar.analysis.compiled import analyze_compiled
    from jaxpar.analysis.estimate import DTYPE_BYTES

    lcfg = layout_config(cfg, layout)
    lcfg.train.steps = steps
    grad_bytes = DTYPE_BYTES[lcfg.parallel.grad_reduce_dtype]
    est = evaluate_layout(lcfg.model, cluster, layout, PlanOptions(headroom=0.0, grad_reduce_bytes=grad_bytes,
                                                                   optim=lcfg.optim))
    record.est_argument_bytes = estimated_argument_bytes(lcfg.model, layout, optim=lcfg.optim)
    mem = est.memory
    record.est_temp_bytes = mem.gradient_bytes + mem.activation_bytes + mem.transient_bytes
    # an axis the communication estimate does not price yet (context) counts 0 rather than crashing the sweep
    record.est_collective_bytes = {axis: est.communication[axis].bytes if axis in est.communication else 0.0
                                   for axis in AXES}
    record.est_step_time_s = est.step_time_s

    start = time.perf_counter()
    setup, compiled = _compile_step(lcfg)
    record.compile_s = time.perf_counter() - start
    report = analyze_compiled(compiled, setup.mesh, pipeline=setup.pipeline)
    if report.memory is not None:
        record.argument_bytes, record.temp_bytes = report.memory.argument_bytes, report.memory.temp_bytes
    record.collective_bytes = _compiled_axis_bytes(report)
    if keep is not None:
        keep[record.name] = (setup, compiled, lcfg)

    record.step_times_s, record.losses = _timed_steps(setup, compiled, lcfg, batches, steps, on_step)
    summarize_times(record, lcfg, layout, warmup, peak_flops)


def _compile_step(lcfg: ConfigDict) -> tuple[Any, Any]:
    """The layout's ``Setup`` and its train step compiled ahead of time from abstract arrays."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpar.analysis.compiled import mesh_for
    from jaxpar.train.state import Setup

    setup = Setup(lcfg, mesh_for(lcfg))
    guard = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=NamedSharding(setup.mesh, P()))
    return setup, setup.train_step.jitted.lower(*setup.abstract_state(), guard).compile()


def _timed_steps(setup: Any, compiled: Any, lcfg: ConfigDict, batches: list, steps: int,
                 on_step: Callable[[int, float], None] | None) -> tuple[list[float], list[float]]:
    """Run ``steps`` steps from the config's initialisation; (seconds per step, loss per step)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    params, opt = setup.init(lcfg.train.seed)
    guard = jax.device_put(np.array([np.inf, 0.0], np.float32), NamedSharding(setup.mesh, P()))  # never skip
    times, losses = [], []
    for k in range(steps):
        batch = setup.feed.make_batch(batches[k])
        tick = time.perf_counter()
        params, opt, metrics = compiled(params, opt, batch, guard)
        # wait for every output, not only the loss: the time then covers the whole update, and no
        # collective of this step is still running when the next one (or the next layout) starts
        params, opt, metrics = jax.block_until_ready((params, opt, metrics))
        times.append(time.perf_counter() - tick)
        losses.append(float(metrics["loss"]))
        if on_step is not None:
            on_step(k + 1, losses[-1])
    del params, opt
    return times, losses


def time_again(cfg: ConfigDict, layout: ParallelLayout, batches: list, *, steps: int,
               on_step: Callable[[int, float], None] | None = None, kept: dict[str, Any] | None = None
               ) -> dict[str, Any]:
    """A later pass over ``layout``: run the same steps again with the executable pass 1 compiled
    (``kept``, from :func:`run_layout`'s ``keep``; compiled afresh when absent, as after a worker
    died); ``{"times": [...], "losses": [...]}`` or ``{"error": one line}``.

    Never JAX's persistent compilation cache: on XLA:CPU (jax 0.10.2) pipeline executables read
    back from it compute wrong, run-to-run different losses (measured: first-step loss 5.5698 and
    5.5767 instead of 5.6041 for ``d2t2p2-z0-sp-1f1b-m4``; 6 of the 28 pipeline layouts of the tiny
    sweep differed from their fresh compile by 6-34%), and this check is what found it."""
    try:
        if kept is not None and layout_name(layout) in kept:
            setup, compiled, lcfg = kept[layout_name(layout)]
        else:
            lcfg = layout_config(cfg, layout)
            lcfg.train.steps = steps
            setup, compiled = _compile_step(lcfg)
        times, losses = _timed_steps(setup, compiled, lcfg, batches, steps, on_step)
    except Exception as e:  # noqa: BLE001 - one broken layout must not end the sweep
        return {"error": _one_line(e)}
    return {"times": times, "losses": losses}


def summarize_times(record: SweepRecord, lcfg: ConfigDict, layout: ParallelLayout, warmup: int,
                    peak_flops: float) -> None:
    """Step-time statistics over the steady steps (the first ``warmup`` of each pass left out) of
    every pass, pooled: median, min, max, each pass's median, and the tokens/s and MFU of the median.

    Pooling passes that ran minutes apart is what makes the spread honest: on a shared or virtual
    host the speed drifts over minutes by more than one pass's steps vary (measured: two runs of
    the tiny sweep on an idle 2-core VM, one pass each, 8% median and up to 36% difference per
    layout, while a pass's own spread was 5-30%)."""
    from jaxpar.metrics import model_flops_per_token

    passes = [record.step_times_s, *record.repeat_step_times_s]
    steady = [t for times in passes for t in (times[warmup:] or times)]
    record.pass_medians_s = [statistics.median(times[warmup:] or times) for times in passes]
    record.step_time_median_s = statistics.median(steady)
    record.step_time_min_s, record.step_time_max_s = min(steady), max(steady)
    record.tokens_per_s = layout.tokens_per_step / record.step_time_median_s
    flops = model_flops_per_token(lcfg.model, layout.seq_len) * record.tokens_per_s
    record.mfu = flops / layout.devices / peak_flops
    record.final_loss = record.losses[-1] if record.losses else float("nan")


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


def run_sweep_layouts(cfg: ConfigDict, num_devices: int, *, steps: int, warmup: int, only: Iterable[str] = (),
                      tolerance: float | None = None, progress: bool = True, repeats: int = 3
                      ) -> tuple[list[SweepRecord], dict]:
    """Every selected layout of ``num_devices``, each for ``steps`` steps on the same batches;
    returns the records and the run's conditions (host, peak, cluster, tolerance, wall time).

    ``repeats`` passes: the first compiles, analyses and runs every layout; each later pass runs the
    whole list again with pass 1's executables (kept in the worker process; JAX's persistent
    compilation cache is switched off for the workers, see :func:`time_again`) and must reproduce
    pass 1's losses bit for bit. Step-time statistics pool the passes (:func:`summarize_times`)."""
    import os
    import platform

    from jaxpar.analysis.aot import ensure_aot_devices

    if steps < 1 or not 0 <= warmup < steps:
        raise ConfigError(f"--steps {steps} / --warmup {warmup}: need steps >= 1 and 0 <= warmup < steps")
    ensure_aot_devices(num_devices)
    import jax

    from jaxpar import data as data_lib
    from jaxpar.metrics import device_peak_flops

    load_before = os.getloadavg()
    started = time.perf_counter()
    peak, peak_source = device_peak_flops(num_devices)
    cluster = device_cluster(num_devices, peak)
    t = cfg.train
    layouts = select(sweep_layouts(cfg.model, num_devices, t.global_batch, t.seq_len, cluster), only)
    stream = data_lib.make_batches(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=t.seq_len,
                                   global_batch=t.global_batch, seed=t.seed)
    batches = [stream.next() for _ in range(steps)]
    tolerance = TOLERANCE[cfg.model.compute_dtype] if tolerance is None else tolerance
    if repeats < 1:
        raise ConfigError(f"--repeats {repeats}: use at least 1 pass")
    records: list[SweepRecord] = []
    saved = os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)  # never read compiles back (time_again)
    try:
        with _progress(progress) as bar, Workers(cfg, num_devices, batches, steps, warmup, peak, cluster) as workers:
            over = bar.add_task("layouts", total=len(layouts) * repeats, name="", loss=float("nan"))
            inner = bar.add_task("steps", total=steps, name="", loss=float("nan"))
            for lay in layouts:
                name = layout_name(lay)
                bar.reset(inner, total=steps, name=name, loss=float("nan"))
                bar.update(over, name=name)
                record = workers.run(lay, on_step=lambda k, loss: bar.update(inner, completed=k, loss=loss))
                records.append(record)
                if record.status == "crashed":
                    bar.console.print(f"[red]{name} crashed:[/] {record.error}")
                bar.update(over, advance=1, loss=record.final_loss)
            for number in range(2, repeats + 1):
                for lay, record in zip(layouts, records):
                    bar.reset(inner, total=steps, name=f"{record.name} (pass {number})", loss=float("nan"))
                    if record.status != "crashed":
                        out = workers.again(lay, on_step=lambda k, loss: bar.update(inner, completed=k, loss=loss))
                        _add_pass(record, out, number, cfg, lay, warmup, peak)
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
        "compute_dtype": cfg.model.compute_dtype,
        "tolerance": tolerance,
        "reference": reference.name if reference else None,
        "global_batch": t.global_batch,
        "seq_len": t.seq_len,
        "tokens_per_step": t.global_batch * t.seq_len,
        "wall_s": time.perf_counter() - started,
        "layouts": len(records),
        "counts": {s: sum(r.status == s for r in records) for s in STATUSES},
    }
    return records, meta


def _add_pass(record: SweepRecord, out: dict[str, Any], number: int, cfg: ConfigDict, layout: ParallelLayout,
              warmup: int, peak: float) -> None:
    """Fold a later pass into ``record``: its step times, or a crash; losses that are not bitwise
    pass 1's make the layout a mismatch (the same program on the same inputs must repeat itself)."""
    if "error" in out:
        record.status, record.error = "crashed", f"pass {number}: {out['error']}"
        return
    record.repeat_step_times_s.append(out["times"])
    if out["losses"] != record.losses and record.status == "ok":
        diff = max((abs(a - b) / abs(b) if b else abs(a - b)) for a, b in zip(out["losses"], record.losses))
        record.status = "mismatch"
        record.error = f"pass {number} losses differ from pass 1 by {diff:.2e} relative (not deterministic)"
    summarize_times(record, layout_config(cfg, layout), layout, warmup, peak)


# --------------------------------------------------------------------------- the worker process


class Workers:
    """Runs layouts in a child process, one after another; when a layout kills it (an XLA check
    failure aborts the whole process, no exception to catch), the layout is recorded as crashed with
    the first fatal line of the child's stderr, and a fresh child takes the next layout."""

    def __init__(self, cfg: ConfigDict, num_devices: int, batches: list, steps: int, warmup: int, peak: float,
                 cluster: Cluster):
        import multiprocessing

        self.ctx = multiprocessing.get_context("spawn")  # a fresh JAX per child (fork would copy the parent's)
        self.args = (cfg.to_dict(), num_devices, batches, steps, warmup, peak, cluster.to_dict())
        self.proc: Any = None

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop()

    def _start(self) -> None:
        import tempfile

        self.errors = tempfile.NamedTemporaryFile("w+", prefix="jaxpar-sweep-", suffix=".err", delete=False)
        self.tasks, self.results = self.ctx.Queue(), self.ctx.Queue()
        self.proc = self.ctx.Process(target=_worker, args=(*self.args, self.tasks, self.results, self.errors.name),
                                     daemon=True)
        self.proc.start()

    def _stop(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                self.tasks.put(None)
                self.proc.join(timeout=30)
            if self.proc.is_alive():
                self.proc.kill()
            self.proc = None
            import os

            os.unlink(self.errors.name)

    def run(self, layout: ParallelLayout, on_step: Callable[[int, float], None], retry: bool = True) -> SweepRecord:
        """The layout's record; a layout whose process dies is tried once more in a new one
        (``retried`` keeps the first death), then recorded as crashed."""
        return self._ask(False, layout, on_step, retry)

    def again(self, layout: ParallelLayout, on_step: Callable[[int, float], None]) -> dict[str, Any]:
        """A later pass (:func:`time_again`): ``{"times", "losses"}`` or ``{"error"}``; a process
        that dies is tried once more, as in :meth:`run`."""
        out = self._ask(True, layout, on_step, True)
        return {"error": out.error} if isinstance(out, SweepRecord) else out

    def _ask(self, again: bool, layout: ParallelLayout, on_step: Callable[[int, float], None], retry: bool) -> Any:
        import queue

        if self.proc is None:
            self._start()
        self.tasks.put((again, dataclasses.asdict(layout)))
        while True:
            try:
                kind, *payload = self.results.get(timeout=1.0)
            except queue.Empty:
                if self.proc.is_alive():
                    continue
                error = f"the process died (exit code {self.proc.exitcode}): {self._fatal_line()}"
                self._stop()
                if retry:  # a fresh process, once: overloaded hosts make XLA:CPU collectives time out
                    record = self._ask(again, layout, on_step, False)
                    if isinstance(record, SweepRecord):
                        record.retried = error
                    return record
                return SweepRecord(layout_name(layout), layout.to_dict(), status="crashed", error=error)
            if kind == "step":
                on_step(*payload)
            elif again:
                return payload[0]
            else:
                fields = {f.name for f in dataclasses.fields(SweepRecord)}
                return SweepRecord(**{k: v for k, v in payload[0].items() if k in fields})

    def _fatal_line(self) -> str:
        with open(self.errors.name) as f:
            lines = [line.strip() for line in f if line.strip()]
        fatal = [line for line in lines if "Check failed" in line or line.startswith(("F", "Fatal"))]
        return ((fatal or lines or ["no output"])[0])[:300]


def _worker(cfg_dict: dict, num_devices: int, batches: list, steps: int, warmup: int, peak: float,
            cluster_dict: dict, tasks: Any, results: Any, errors: str) -> None:
    """The child: stderr into ``errors``, then layouts from ``tasks`` until None."""
    import os

    fd = os.open(errors, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 2)
    # XLA:CPU aborts a collective whose participants do not all arrive within 40 s; 8 simulated
    # devices on 2 busy cores can be that late: allow 10 minutes before JAX starts
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *COLLECTIVE_TIMEOUT_FLAGS]).strip()
    from jaxpar.analysis.aot import ensure_aot_devices
    from jaxpar.config import merge_into_defaults

    ensure_aot_devices(num_devices)
    cfg, cluster = merge_into_defaults(cfg_dict), Cluster(**cluster_dict)
    kept: dict[str, Any] = {}  # layout name -> pass 1's compiled step, for the later passes
    while (task := tasks.get()) is not None:
        again, item = task
        if os.environ.get(ABORT_ENV) == layout_name(ParallelLayout(**item)):  # the crash drill of the tests
            os.write(2, f"Fatal: {ABORT_ENV} drill aborts this process\n".encode())
            os.abort()
        on_step = lambda k, loss: results.put(("step", k, loss))  # noqa: E731
        if again:
            results.put(("done", time_again(cfg, ParallelLayout(**item), batches, steps=steps, on_step=on_step,
                                            kept=kept)))
            continue
        record = run_layout(cfg, ParallelLayout(**item), batches, steps=steps, warmup=warmup, peak_flops=peak,
                            cluster=cluster, on_step=on_step, keep=kept)
        results.put(("done", record.to_dict()))


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def _progress(enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[name]}"), TextColumn("loss {task.fields[loss]:.4f} nats/token"),
        TimeElapsedColumn(), disable=not enabled,
    )
