"""One layout of a sweep, measured: compile, analyse and run its train step, and its step-time figures.

Per layout (:class:`SweepRecord`): compile time; step time median / min / max after ``warmup``;
tokens/s; MFU (:func:`jaxpar.metrics.device_peak_flops`); compiled argument, temporary and
collective bytes beside the planner's estimates; every step's loss. One executable is both analysed
(:func:`jaxpar.analysis.compiled.analyze_compiled`) and run. In every pass :class:`HostProbe` times
the reference layout's step beside each layout's, so a re-run on a host that has sped up or slowed
down can be compared after dividing that out (:func:`jaxpar.analysis.sweep.report.compare_runs`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

from jaxpar.analysis.aot import estimated_argument_bytes, layout_run
from jaxpar.analysis.clusters import Cluster
from jaxpar.analysis.estimate import ParallelLayout
from jaxpar.analysis.plan import PlanOptions, evaluate_layout
from jaxpar.analysis.sweep.grid import AXES, layout_name
from jaxpar.config import ConfigDict


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
    host_probe_s: list[float] = dataclasses.field(default_factory=list)  # HostProbe.measure before each pass
    minor_faults: list[list[int]] = dataclasses.field(default_factory=list)  # per pass, per step (all steps)
    minor_faults_per_step: float = 0.0  # median over the steady steps of every pass (jaxpar.host_memory)

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
        return dataclasses.asdict(self) | {
            "bytes_per_step": self.bytes_per_step,
            "est_bytes_per_step": self.est_bytes_per_step,
        }


def _one_line(error: BaseException) -> str:
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first}"[:300]


def run_layout(
    cfg: ConfigDict,
    layout: ParallelLayout,
    batches: list,
    *,
    steps: int,
    warmup: int,
    peak_flops: float,
    cluster: Cluster,
    on_step: Callable[[int, float], None] | None = None,
    keep: dict[str, Any] | None = None,
    probe: HostProbe | None = None,
) -> SweepRecord:
    """Compile ``layout`` once, analyse the executable, run it for ``steps`` steps; never raises
    for a failing layout (the record says ``crashed`` and why). ``keep``: where to leave the
    compiled step for :func:`time_again` (keyed by the layout's name); ``probe``: timed just before
    the steps (``host_probe_s``)."""
    record = SweepRecord(layout_name(layout), layout.to_dict())
    try:
        _run(record, cfg, layout, batches, steps, warmup, peak_flops, cluster, on_step, keep, probe)
    except Exception as e:  # noqa: BLE001 - one broken layout must not end the sweep
        record.status, record.error = "crashed", _one_line(e)
        record.layout["traceback_tail"] = traceback.format_exc().strip().splitlines()[-1][:300]
    return record


def _run(
    record: SweepRecord,
    cfg: ConfigDict,
    layout: ParallelLayout,
    batches: list,
    steps: int,
    warmup: int,
    peak_flops: float,
    cluster: Cluster,
    on_step: Callable[[int, float], None] | None,
    keep: dict[str, Any] | None = None,
    probe: HostProbe | None = None,
) -> None:
    from jaxpar.analysis.aot import compiled_axis_bytes
    from jaxpar.analysis.compiled import analyze_compiled
    from jaxpar.analysis.estimate import DTYPE_BYTES

    lcfg, run = layout_run(cfg, layout)
    lcfg.train.steps = steps
    grad_bytes = DTYPE_BYTES[lcfg.parallel.grad_reduce_dtype]
    est = evaluate_layout(
        lcfg.model, cluster, layout, PlanOptions(headroom=0.0, grad_reduce_bytes=grad_bytes, optim=lcfg.optim)
    )
    record.est_argument_bytes = estimated_argument_bytes(lcfg.model, layout, optim=lcfg.optim)
    mem = est.memory
    record.est_temp_bytes = mem.gradient_bytes + mem.activation_bytes + mem.transient_bytes
    # an axis the communication estimate does not price yet (context) counts 0 rather than crashing the sweep
    record.est_collective_bytes = {
        axis: est.communication[axis].bytes if axis in est.communication else 0.0 for axis in AXES
    }
    record.est_step_time_s = est.step_time_s

    start = time.perf_counter()
    setup, compiled = _compile_step(lcfg, run)
    record.compile_s = time.perf_counter() - start
    report = analyze_compiled(compiled, setup.mesh, pipeline=setup.pipeline)
    if report.memory is not None:
        record.argument_bytes, record.temp_bytes = report.memory.argument_bytes, report.memory.temp_bytes
    record.collective_bytes = compiled_axis_bytes(report)
    if keep is not None:
        keep[record.name] = (setup, compiled, lcfg)

    if probe is not None:
        record.host_probe_s = [probe.measure()]
    record.step_times_s, record.losses, faults = _timed_steps(setup, compiled, lcfg, batches, steps, on_step)
    record.minor_faults = [faults]
    summarize_times(record, lcfg, layout, warmup, peak_flops)


def _compile_step(lcfg: ConfigDict, run: ParallelLayout) -> tuple[Any, Any]:
    """The ``Setup`` of ``lcfg`` and its validated layout ``run`` (:func:`jaxpar.analysis.aot.layout_run`),
    and its train step compiled ahead of time from abstract arrays."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpar.analysis.compiled import mesh_for
    from jaxpar.train.state import Setup

    setup = Setup(lcfg, run, mesh_for(run))
    guard = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=NamedSharding(setup.mesh, P()))
    return setup, setup.train_step.jitted.lower(*setup.abstract_state(), guard).compile()


def _never_skip(mesh: Any) -> Any:
    """The train step's spike guard set so that no step is ever skipped (threshold inf)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return jax.device_put(np.array([np.inf, 0.0], np.float32), NamedSharding(mesh, P()))


def _timed_steps(
    setup: Any, compiled: Any, lcfg: ConfigDict, batches: list, steps: int, on_step: Callable[[int, float], None] | None
) -> tuple[list[float], list[float], list[int]]:
    """Run ``steps`` steps from the config's initialisation; (seconds per step, loss per step, the
    process's minor page faults during each step: see :mod:`jaxpar.host_memory`)."""
    import jax

    params, opt = setup.init(lcfg.train.seed)
    guard = _never_skip(setup.mesh)
    times, losses, faults = [], [], []
    for k in range(steps):
        batch = setup.feed.make_batch(batches[k])
        before = _minor_faults()
        tick = time.perf_counter()
        params, opt, metrics = compiled(params, opt, batch, guard)
        # wait for every output, not only the loss: the time then covers the whole update, and no
        # collective of this step is still running when the next one (or the next layout) starts
        params, opt, metrics = jax.block_until_ready((params, opt, metrics))
        times.append(time.perf_counter() - tick)
        faults.append(_minor_faults() - before)
        losses.append(float(metrics["loss"]))
        if on_step is not None:
            on_step(k + 1, losses[-1])
    del params, opt
    return times, losses, faults


def _minor_faults() -> int:
    """Minor page faults of this process so far (every thread: the simulated devices' too)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_again(
    cfg: ConfigDict,
    layout: ParallelLayout,
    batches: list,
    *,
    steps: int,
    on_step: Callable[[int, float], None] | None = None,
    kept: dict[str, Any] | None = None,
    probe: HostProbe | None = None,
    run_steps: int | None = None,
) -> dict[str, Any]:
    """A later pass over ``layout``: pass 1's first ``steps`` steps again with the executable pass 1
    compiled (``kept``, from :func:`run_layout`'s ``keep``; compiled afresh when absent, as after a
    worker died, for pass 1's ``run_steps``, which the learning-rate schedule spans);
    ``{"times": [...], "losses": [...], "faults": [...]}`` (and ``"probe_s"``, ``probe`` timed just
    before the steps) or ``{"error": one line}``. Never JAX's persistent compilation cache: on
    XLA:CPU (jax 0.10.2) pipeline executables read back from it compute wrong losses
    (docs/performance.md, "Sweeps"), which this check found."""
    try:
        if kept is not None and layout_name(layout) in kept:
            setup, compiled, lcfg = kept[layout_name(layout)]
        else:
            lcfg, run = layout_run(cfg, layout)
            lcfg.train.steps = steps if run_steps is None else run_steps
            setup, compiled = _compile_step(lcfg, run)
        probed = {"probe_s": probe.measure()} if probe is not None else {}
        times, losses, faults = _timed_steps(setup, compiled, lcfg, batches, steps, on_step)
    except Exception as e:  # noqa: BLE001 - one broken layout must not end the sweep
        return {"error": _one_line(e)}
    return {"times": times, "losses": losses, "faults": faults, **probed}


PROBE_STEPS = 3


class HostProbe:
    """The host's speed now: the median time of :data:`PROBE_STEPS` steps of one fixed layout (the
    sweep's reference, compiled once per process with its own parameters), timed just before a
    layout's steps. A train step, not a matmul or a copy, because what drifts on a shared host
    (stolen CPU time, memory bandwidth, the scheduling of the simulated devices' threads) is what
    such a step spends its time on, in the same mix. Only the probe's (shape-fixed) time matters."""

    def __init__(self, cfg: ConfigDict, layout: ParallelLayout, batch: Any, kept: dict[str, Any] | None = None):
        self.cfg, self.layout, self.batch, self.kept = cfg, layout, batch, kept
        self._state: list[Any] | None = None

    def measure(self) -> float:
        """Median seconds per probe step. The first call takes the layout's executable from ``kept``
        (what :func:`run_layout` left there) or compiles it, outside the timing."""
        import jax

        if self._state is None:
            name = layout_name(self.layout)
            if self.kept is not None and name in self.kept:
                setup, compiled, lcfg = self.kept[name]
            else:
                lcfg, run = layout_run(self.cfg, self.layout)
                setup, compiled = _compile_step(lcfg, run)
            params, opt = setup.init(lcfg.train.seed)
            self._state = [compiled, params, opt, setup.feed.make_batch(self.batch), _never_skip(setup.mesh)]
        compiled, params, opt, batch, guard = self._state
        times = []
        for _ in range(PROBE_STEPS):
            tick = time.perf_counter()
            params, opt, _ = jax.block_until_ready(compiled(params, opt, batch, guard))
            times.append(time.perf_counter() - tick)
        self._state[1:3] = params, opt
        return statistics.median(times)


def summarize_times(
    record: SweepRecord, lcfg: ConfigDict, layout: ParallelLayout, warmup: int, peak_flops: float
) -> None:
    """Step-time statistics over the steady steps (the first ``warmup`` of each pass left out) of
    every pass, pooled: median, min, max, each pass's median, the tokens/s and MFU of the median, and
    the median minor page faults per step. Pooling passes minutes apart keeps the spread honest: a
    shared host's speed drifts over minutes by more than one pass's steps vary (docs/performance.md,
    "Sweeps")."""
    from jaxpar.metrics import model_flops_per_token

    passes = [record.step_times_s, *record.repeat_step_times_s]
    steady = [t for times in passes for t in (times[warmup:] or times)]
    record.pass_medians_s = [statistics.median(times[warmup:] or times) for times in passes]
    record.step_time_median_s = statistics.median(steady)
    record.step_time_min_s, record.step_time_max_s = min(steady), max(steady)
    faults = [f for per_pass in record.minor_faults for f in (per_pass[warmup:] or per_pass)]
    record.minor_faults_per_step = statistics.median(faults) if faults else 0.0
    record.tokens_per_s = layout.tokens_per_step / record.step_time_median_s
    flops = model_flops_per_token(lcfg.model, layout.seq_len) * record.tokens_per_s
    record.mfu = flops / layout.devices / peak_flops
    record.final_loss = record.losses[-1] if record.losses else float("nan")
