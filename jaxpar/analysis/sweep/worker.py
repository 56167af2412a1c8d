"""The sweep's child process: layouts run one after another in a process of their own.

An XLA check failure aborts a process outright (no exception to catch), as XLA:CPU's in-process
collectives once did in sweeps (fixed in the model: :mod:`jaxpar.analysis.collective_order`). For
whatever else aborts, the child allows collectives 10 minutes (:data:`COLLECTIVE_TIMEOUT_FLAGS`:
simulated devices on busy cores can be late), and a layout whose child dies is tried once more in a
new child, then recorded as crashed with the fatal line. The child fixes glibc's malloc thresholds
(:func:`jaxpar.host_memory.steady_malloc`) before JAX starts, so a layout's step time does not
depend on what the layouts before it allocated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxpar import children
from jaxpar.analysis.clusters import Cluster
from jaxpar.analysis.estimate import ParallelLayout
from jaxpar.analysis.sweep.grid import layout_name
from jaxpar.analysis.sweep.measure import HostProbe, SweepRecord, run_layout, time_again
from jaxpar.config import ConfigDict

COLLECTIVE_TIMEOUT_FLAGS = (
    "--xla_cpu_collective_call_terminate_timeout_seconds=600",
    "--xla_cpu_collective_timeout_seconds=600",
)
ABORT_ENV = "JAXPAR_SWEEP_ABORT"  # a layout name: its worker process aborts (tests of crash recording)


class Workers:
    """Runs layouts in a child process, one after another; when a layout kills it (an XLA check
    failure aborts the whole process, no exception to catch), the layout is recorded as crashed with
    the first fatal line of the child's stderr, and a fresh child takes the next layout."""

    def __init__(
        self,
        cfg: ConfigDict,
        num_devices: int,
        batches: list,
        steps: int,
        warmup: int,
        peak: float,
        cluster: Cluster,
        probe: ParallelLayout | None = None,
    ):
        import multiprocessing

        self.ctx = multiprocessing.get_context("spawn")  # a fresh JAX per child (fork would copy the parent's)
        self.args = (
            cfg.to_dict(),
            num_devices,
            batches,
            steps,
            warmup,
            peak,
            cluster.to_dict(),
            dataclasses.asdict(probe) if probe is not None else None,
        )
        self.steps = steps  # pass 1's; a later pass says its own (:meth:`again`)
        self.proc: Any = None

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        self._stop(at_once=kind is not None)  # an error or a signal: no layout's end to wait for

    def _start(self) -> None:
        import os
        import signal
        import tempfile

        self.errors = tempfile.NamedTemporaryFile("w+", prefix="jaxpar-sweep-", suffix=".err", delete=False)
        self.tasks, self.results = self.ctx.Queue(), self.ctx.Queue()
        proc = self.ctx.Process(
            target=_worker,
            args=(*self.args, self.tasks, self.results, self.errors.name, os.getpid()),
            daemon=True,
        )
        # SIGINT blocked while it starts: the child keeps the mask (a Ctrl-C before it is in a group of its
        # own is the parent's to handle, which stops it); the parent gets a Ctrl-C of that moment after
        masked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self._tracked = children.started(proc.start, "the sweep's worker process", lambda _: proc.pid)
            self._tracked.__enter__()
            self.proc = proc
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, masked)

    def _stop(self, at_once: bool = False) -> None:
        if self.proc is not None:
            if self.proc.is_alive() and not at_once:
                self.tasks.put(None)
                self.proc.join(timeout=30)
            if self.proc.is_alive():
                children.stop([self.proc.pid])
                self.proc.join(timeout=children.KILL_WAIT_S)
            self._tracked.__exit__(None, None, None)
            self.proc = None
            for queue in (self.tasks, self.results):  # their semaphores go now: no "leaked" warning at exit
                queue.close()
                queue.join_thread()
            self.tasks = self.results = None
            import os

            os.unlink(self.errors.name)

    def run(self, layout: ParallelLayout, on_step: Callable[[int, float], None], retry: bool = True) -> SweepRecord:
        """The layout's record; a layout whose process dies is tried once more in a new one
        (``retried`` keeps the first death), then recorded as crashed."""
        return self._ask(False, layout, on_step, retry, self.steps)

    def again(self, layout: ParallelLayout, steps: int, on_step: Callable[[int, float], None]) -> dict[str, Any]:
        """A later pass of ``steps`` steps (:func:`time_again`): ``{"times", "losses", ...}`` or
        ``{"error"}``; a process that dies is tried once more, as in :meth:`run`."""
        out = self._ask(True, layout, on_step, True, steps)
        return {"error": out.error} if isinstance(out, SweepRecord) else out

    def _ask(
        self, again: bool, layout: ParallelLayout, on_step: Callable[[int, float], None], retry: bool, steps: int
    ) -> Any:
        import queue

        if self.proc is None:
            self._start()
        self.tasks.put((again, dataclasses.asdict(layout), steps))
        while True:
            try:
                kind, *payload = self.results.get(timeout=1.0)
            except queue.Empty:
                if self.proc.is_alive():
                    continue
                error = f"the process died (exit code {self.proc.exitcode}): {self._fatal_line()}"
                self._stop()
                if retry:  # a fresh process, once: overloaded hosts make XLA:CPU collectives time out
                    record = self._ask(again, layout, on_step, False, steps)
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


def _worker(
    cfg_dict: dict,
    num_devices: int,
    batches: list,
    steps: int,
    warmup: int,
    peak: float,
    cluster_dict: dict,
    probe_layout: dict | None,
    tasks: Any,
    results: Any,
    errors: str,
    parent: int,
) -> None:
    """The child: a process group of its own (the parent stops it with its group, :mod:`jaxpar.children`),
    dead with the parent; stderr into ``errors``, then layouts from ``tasks`` until None."""
    import os

    os.setpgid(0, 0)
    children.die_with_parent(parent)
    fd = os.open(errors, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 2)
    from jaxpar.host_memory import steady_malloc

    steady_malloc()
    # XLA:CPU aborts a collective whose participants do not all arrive within 40 s; 8 simulated
    # devices on 2 busy cores can be that late: allow 10 minutes before JAX starts
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *COLLECTIVE_TIMEOUT_FLAGS]).strip()
    from jaxpar.analysis.aot import ensure_aot_devices
    from jaxpar.config import merge_into_defaults

    ensure_aot_devices(num_devices)
    cfg, cluster = merge_into_defaults(cfg_dict), Cluster(**cluster_dict)
    kept: dict[str, Any] = {}  # layout name -> pass 1's compiled step, for the later passes
    probe = HostProbe(cfg, ParallelLayout(**probe_layout), batches[0], kept) if probe_layout else None
    while (task := tasks.get()) is not None:
        again, item, pass_steps = task
        if os.environ.get(ABORT_ENV) == layout_name(ParallelLayout(**item)):  # the crash drill of the tests
            os.write(2, f"Fatal: {ABORT_ENV} drill aborts this process\n".encode())
            os.abort()
        on_step = lambda k, loss: results.put(("step", k, loss))  # noqa: E731
        if again:
            results.put(
                (
                    "done",
                    time_again(
                        cfg,
                        ParallelLayout(**item),
                        batches,
                        steps=pass_steps,
                        on_step=on_step,
                        kept=kept,
                        probe=probe,
                        run_steps=steps,
                    ),
                )
            )
            continue
        record = run_layout(
            cfg,
            ParallelLayout(**item),
            batches,
            steps=steps,
            warmup=warmup,
            peak_flops=peak,
            cluster=cluster,
            on_step=on_step,
            keep=kept,
            probe=probe,
        )
        results.put(("done", record.to_dict()))
