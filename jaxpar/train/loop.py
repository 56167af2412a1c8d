"""The training loop: data -> step -> metrics (-> checkpoint), with evaluation at start and end.

Validation loss is reported in bits per byte when the vocabulary is bytes (``vocab_size`` 256:
one token is one byte, so bits/byte = nats/token / ln 2), otherwise in bits per token; the training
loss (progress bar, metrics.jsonl) is the mean cross-entropy in nats per token.

What a run leaves in ``train.workdir`` besides checkpoints: ``config.json`` (the resolved config,
written at start; reload with ``jaxpar.config.merge_into_defaults``), ``command.txt`` (the command
line), ``metrics.jsonl`` and TensorBoard event files of the same per-step numbers
(:class:`jaxpar.metrics.TensorBoardWriter`), and with ``train.profile_steps=a,b`` a
``jax.profiler`` trace of steps a..b under ``profile/`` (open it in TensorBoard's profile plugin
or Perfetto).

The host never waits for the device in steady state (:meth:`Trainer.train_step`): a turn of the loop
dispatches step n+1, then reads the metrics of step n (the only per-step device-to-host transfer; the
device runs step n+1 meanwhile), then assembles the batch of step n+2 and starts placing it on the
mesh. The spike threshold of each step is computed on the device (:class:`jaxpar.train.guard.SpikeThreshold`).
A step after which something needs the state or its metrics (a checkpoint, an evaluation, the end of
a profile, the last step, a stop signal) has its metrics read before anything else is dispatched, so
checkpoints and rollbacks see exactly what a blocking loop would. A step's ``step_time_s`` runs from
the end of the step before it (or its own dispatch, if later) to the moment its metrics are on the host.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from jaxpar import data as data_lib
from jaxpar import workdir as workdir_lib
from jaxpar import write_guard
from jaxpar.checkpoint import Checkpointer
from jaxpar.config import ConfigDict, ConfigError
from jaxpar.errors import JaxparError
from jaxpar.layout import ParallelLayout
from jaxpar.mesh import make_mesh
from jaxpar.metrics import MetricsLog, device_peak_flops, model_flops_per_token
from jaxpar.train import loss_scale as loss_scale_lib
from jaxpar.train.guard import BadStepGuard, SpikeThreshold
from jaxpar.train.state import Setup


def bits_unit(model_cfg: ConfigDict) -> str:
    return "bits/byte" if model_cfg.vocab_size == 256 else "bits/token"


LOSS_UNIT = "nats/token"  # the training loss: mean cross-entropy, natural log


def profile_range(train_cfg: ConfigDict) -> tuple[int, int] | None:
    """``train.profile_steps`` ("a,b", validated by :func:`jaxpar.config.validate`) as (a, b), or None."""
    if not train_cfg.profile_steps:
        return None
    first, last = (int(x) for x in train_cfg.profile_steps.split(","))
    return first, last


def write_run_config(cfg: ConfigDict, workdir: str, argv: list[str] | None = None) -> str:
    """``<workdir>/config.json`` (the resolved config) and ``command.txt`` (the command line), into a
    workdir the run has claimed (:func:`jaxpar.workdir.claim`: never a user's folder)."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "config.json")
    with write_guard.naming(path), open(path, "w") as f:
        json.dump(cfg.to_dict(), f, indent=1, sort_keys=True)
    command = os.path.join(workdir, "command.txt")
    with write_guard.naming(command), open(command, "w") as f:
        f.write(shlex.join(sys.argv if argv is None else argv) + "\n")
    return path


@dataclasses.dataclass
class _Fed:
    """A training batch placed on the mesh, and where it sits in the data."""

    number: int  # its data position, from 1 (train.inject_bad_steps counts these; a rollback does not rewind it)
    before: dict[str, Any]  # the data iterator's state before it was drawn: the position while it is unused
    array: jax.Array


@dataclasses.dataclass
class _InFlight:
    """A dispatched step whose metrics have not been read yet."""

    step: int
    fed: _Fed
    metrics: dict[str, jax.Array]  # on the device
    dispatched_at: float  # time.perf_counter() before its dispatch


class TrainingDiverged(JaxparError):
    """A run that ended without a finite loss: bad input (a config value, the data or the weights)."""


class Trainer:
    """Owns one run: the layout (:class:`Setup`), the data iterators, the state and the log."""

    def __init__(
        self,
        cfg: ConfigDict,
        layout: ParallelLayout,
        echo: Callable[[str], None] = print,
        progress: bool = True,
        weights_loader: Callable[[str, ConfigDict, Any], Any] | None = None,
    ):
        """``layout``: ``cfg``'s layout as :func:`jaxpar.config.validate` returned it (built once per
        run and passed down to :class:`Setup`). ``weights_loader(path, model_cfg, shardings)``: reads
        ``train.init_from`` onto the mesh (the CLI passes :func:`jaxpar.port.weights.load_checked`: the HF format lives with the
        importers, and the trainer does not import them)."""
        self.cfg, self.show_progress, self.weights_loader = cfg, progress, weights_loader
        self.echo = echo if jax.process_index() == 0 else (lambda _: None)
        if jax.process_index() == 0:  # before anything is written there: a user's folder or a live run's is refused
            workdir_lib.claim(cfg.train.workdir, str(cfg.train.resume), cfg.train.init_from)
        self.layout = layout
        self.mesh = make_mesh(layout, cross_node_tensor=cfg.parallel.cross_node_tensor)
        self.setup = Setup(cfg, layout, self.mesh)
        t = cfg.train
        pidx, pcount = self.setup.feed.data_split  # the rows of this process's data shards
        self.batches = data_lib.make_batches(
            cfg.data,
            vocab_size=cfg.model.vocab_size,
            seq_len=layout.seq_len,
            global_batch=layout.global_batch,
            seed=t.seed,
            split="train",
            process_index=pidx,
            process_count=pcount,
        )
        unit_rows = math.lcm(layout.batch_shards, pcount)  # eval rows must split over both
        eval_rows = unit_rows * max(1, layout.microbatch_sequences // unit_rows)
        self.eval_data = (
            data_lib.eval_batches(
                cfg.data,
                vocab_size=cfg.model.vocab_size,
                seq_len=layout.seq_len,
                global_batch=eval_rows,
                seed=t.seed,
                num_batches=t.eval_batches,
                process_index=pidx,
                process_count=pcount,
            )
            if t.eval_batches
            else []
        )
        peak, self.peak_source = device_peak_flops(self.layout.devices)
        self.log = MetricsLog(
            t.workdir,
            model_flops_per_token(cfg.model, layout.seq_len),
            peak,
            self.layout.devices,
            t.warmup_steps_excluded,
            write=jax.process_index() == 0,  # one writer, whatever the mesh
        )
        self.checkpoints = Checkpointer(
            t.workdir, cfg.checkpoint.every, cfg.checkpoint.keep, self.echo, model=cfg.model, optimizer=cfg.optim.name
        )
        self.params: Any = None
        self.opt_state: Any = None
        self.step = 0
        self._closed = False
        self.stop_signal: int | None = None
        self.guard = BadStepGuard(t.spike_factor)  # skip counters, from the metrics read
        self.spike = SpikeThreshold(t.spike_factor, self.setup.train_step.replicated)  # each step's guard
        self.good_steps = 0  # steps of this process with a finite loss whose update was applied
        self.inject_bad = {int(x) for x in t.inject_bad_steps.split(",") if x.strip()}
        self.profile = profile_range(t)
        self.profiling = False
        self._next: _Fed | None = None  # the prefetched batch of the next step
        self._inflight: _InFlight | None = None  # the step dispatched last, until its metrics are read
        self._last_read_at = -math.inf  # when the metrics of the step read last reached the host

    # ------------------------------------------------------------------ pieces
    def initialize(self) -> None:
        """Resume from the newest complete checkpoint (``train.resume``), else initialise."""
        resume = str(self.cfg.train.resume)
        restored = None
        if resume not in ("never", "restart"):  # restart: jaxpar.workdir.claim deleted the checkpoints
            params, opt, _ = self.setup.abstract_state(model_form=True)
            step = int(resume) if resume.isascii() and resume.isdigit() else None
            restored = self.checkpoints.restore({"params": params, "opt_state": opt}, step=step)
        if restored is None:
            if self.cfg.train.init_from:  # fine-tuning: start from HF weights, a fresh optimizer
                if self.weights_loader is None:
                    raise ConfigError(
                        "train.init_from is set but this trainer has no weights loader; run "
                        "`jaxpar train`, or pass Trainer(weights_loader=jaxpar.port.weights.load_checked)"
                    )

                hf = self.weights_loader(
                    self.cfg.train.init_from, self.cfg.model, self.setup.model_form.param_shardings
                )
                self.params, self.opt_state = self.setup.init_from_hf(hf)
                self.echo(f"initialised from HF weights in {self.cfg.train.init_from}")
            else:
                self.params, self.opt_state = self.setup.init(self.cfg.train.seed)
            self.step = 0
            return
        self.step, state, meta = restored
        self.params, self.opt_state = self.setup.from_model_order(state["params"], state["opt_state"])
        self.batches.restore(meta["data"])
        self.echo(f"resumed from checkpoint at step {self.step} in {self.checkpoints.directory}")

    def save(self) -> None:
        if self.step not in self.checkpoints.steps():  # e.g. just rolled back onto this step
            params, opt = self.setup.to_model_order(self.params, self.opt_state)
            self.checkpoints.save(self.step, params, opt, self.data_position, self.cfg)

    @property
    def data_position(self) -> dict[str, Any]:
        """The data iterator's state after the batches given to steps (a prefetched one is not)."""
        return self._next.before if self._next is not None else self.batches.state()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stop_signal = signum  # finish the current step, then checkpoint and exit

    def evaluate(self) -> float | None:
        """Mean validation loss over the fixed evaluation batches, in bits per byte/token; None
        without validation (``train.eval_batches=0``: nothing compiled or run)."""
        if not self.eval_data:
            return None
        total, count = 0.0, 0
        for rows in self.eval_data:
            batch = self.setup.feed.make_eval_batch(rows)
            total += float(self.setup.eval_step(self.params, batch))
            count += batch.shape[0] * (batch.shape[1] - 1)
        return total / count / math.log(2)

    def train_step(self) -> list[dict[str, float]]:
        """One turn of the loop: dispatch step n+1, read the metrics of step n (the delayed read: the
        device runs step n+1 meanwhile), assemble and place the batch of step n+2; at a sync step
        (:meth:`_sync_due`) read step n+1's metrics too. Returns the metrics rows read, oldest first."""
        previous = self._inflight
        self._dispatch()
        rows = [] if previous is None else [self._complete(previous)]  # may roll back: nothing in flight then
        if self.step < self.cfg.train.steps:
            self.prefetch()
        if self._inflight is not None and self._sync_due(self._inflight.step):
            rows.append(self._complete(self._inflight))
        return rows

    def prefetch(self) -> None:
        """Draw the next batch and start placing it on the mesh (asynchronous), unless one is waiting."""
        if self._next is None:
            before = self.batches.state()
            rows = self.batches.next()
            self._next = _Fed(before["step"] + 1, before, self.setup.feed.make_batch(rows))

    def _dispatch(self) -> None:
        """Start step ``self.step + 1`` on the prefetched batch; nothing here waits for the device."""
        self.prefetch()
        fed, self._next = self._next, None
        self._profile_start(self.step + 1)
        start = time.perf_counter()
        guard = self.spike.guard(inject=fed.number in self.inject_bad)
        self.params, self.opt_state, metrics = self.setup.train_step(
            self.params, self.opt_state, fed.array, guard=guard
        )
        self.spike.dispatched(metrics)
        self.step += 1
        self._inflight = _InFlight(self.step, fed, metrics, start)

    def _sync_due(self, step: int) -> bool:
        """Whether the loop reads ``step``'s metrics before dispatching another step: the steps after
        which it checkpoints, evaluates, ends a profile, stops or finishes."""
        t = self.cfg.train
        return bool(
            step >= t.steps
            or self.checkpoints.should_save(step)
            or (t.eval_every and step % t.eval_every == 0)
            or (self.profile and step == self.profile[1])
            or self.stop_signal is not None
        )

    def _drain(self) -> list[dict[str, float]]:
        """Read the step in flight, if any."""
        return [] if self._inflight is None else [self._complete(self._inflight)]

    def _complete(self, flight: _InFlight) -> dict[str, float]:
        """Read one step's metrics (the loop's only per-step device-to-host transfer), record them,
        count a skipped update and roll back after too many in a row."""
        values = jax.device_get(flight.metrics)  # waits for this step, not for a step dispatched after it
        now = time.perf_counter()
        elapsed = now - max(flight.dispatched_at, self._last_read_at)
        self._last_read_at = now
        if self._inflight is flight:
            self._inflight = None
        self._profile_stop(flight.step)
        overflow = bool(values.get("overflow", 0))  # fp16: gradients overflowed the loss scale
        self.guard.observe(float(values["loss"]), bool(values["skipped"]), overflow)
        self.good_steps += int(not values["skipped"] and np.isfinite(values["loss"]))
        row = self.log.record(
            flight.step, elapsed, self.layout.tokens_per_step, {**values, "bad_steps_total": self.guard.total}
        )
        if overflow:
            self.echo(loss_scale_lib.overflow_line(flight.step, values, self.setup.loss_scale, self.guard.total))
        elif values["skipped"]:
            self.echo(
                f"step {flight.step}: update skipped (loss {float(values['loss']):.4g}, grad norm "
                f"{float(values['grad_norm']):.4g}; {self.guard.consecutive} in a row, {self.guard.total} in all)"
            )
        if values.get("loss_scale_stop"):
            raise TrainingDiverged(loss_scale_lib.stop_line(flight.step, self.setup.loss_scale))
        if self.guard.consecutive >= self.cfg.train.max_bad_steps:
            self.rollback(flight.step)
        return row

    def _profile_start(self, step: int) -> None:
        if self.profile and not self.profiling and self.profile[0] <= step <= self.profile[1]:
            jax.profiler.start_trace(os.path.join(self.cfg.train.workdir, "profile"))
            self.profiling = True

    def _profile_stop(self, step: int, force: bool = False) -> None:
        if self.profiling and (force or step >= self.profile[1]):
            jax.profiler.stop_trace()
            self.profiling = False
            self.echo(
                f"profile of steps {self.profile[0]}-{min(step, self.profile[1])}: "
                f"{os.path.join(self.cfg.train.workdir, 'profile')}"
            )

    def rollback(self, bad_at: int) -> None:
        """Too many bad steps in a row, the last at step ``bad_at``: restore the newest checkpoint, keep
        the data position (the offending batches are skipped) and go on. A step dispatched after
        ``bad_at`` is thrown away and its batch fed to the next step."""
        if self._inflight is not None:
            assert self._next is None and self._inflight.step == bad_at + 1
            self._next, self._inflight = self._inflight.fed, None
            self.spike.discard()
        self.checkpoints.wait()
        # The newest checkpoint from before the run of bad steps; later ones are dropped.
        before = [s for s in self.checkpoints.steps() if s <= bad_at - self.guard.consecutive]
        restored = None
        if before:
            self.checkpoints.discard_after(before[-1])
            params, opt, _ = self.setup.abstract_state(model_form=True)
            restored = self.checkpoints.restore({"params": params, "opt_state": opt})
        if restored is None:
            raise ConfigError(
                f"train.max_bad_steps: {self.guard.consecutive} bad steps in a row at step {bad_at} and no checkpoint "
                "to roll back to; set --config.checkpoint.every, or lower optim.lr"
            )
        self.step, state, _ = restored
        self.params, self.opt_state = self.setup.from_model_order(state["params"], state["opt_state"])
        self.guard.consecutive = 0
        self.log.record_event({"step": bad_at, "rollback_to": self.step, "data_position": self.data_position})
        self.echo(f"step {bad_at}: rolled back to the checkpoint of step {self.step}; the offending data is skipped")

    # ------------------------------------------------------------------ run
    def run(self) -> dict[str, Any]:
        cfg, unit, layout = self.cfg, bits_unit(self.cfg.model), self.layout
        self.echo(
            f"jaxpar train: {layout.devices} devices ({jax.devices()[0].platform}), mesh data={layout.data} "
            f"tensor={layout.tensor} pipeline={layout.pipeline}"
            + (f" context={layout.context} ({layout.context_exchange})" if layout.context > 1 else "")
            + (f" expert={layout.expert}" if layout.expert > 1 else "")
            + f", zero_stage={layout.zero_stage}, "
            f"sequence_parallel={layout.sequence_parallel}, {cfg.train.steps} steps of "
            f"{layout.tokens_per_step} tokens"
        )
        p = cfg.parallel
        if layout.shards_parameters and p.grad_reduce_dtype != cfg.model.compute_dtype:
            self.echo(
                f"note: ZeRO-3 gathers parameters and reduce-scatters their gradients in {cfg.model.compute_dtype} "
                f"(model.compute_dtype); parallel.grad_reduce_dtype={p.grad_reduce_dtype} applies to the "
                "parameters ZeRO cannot split"
            )
        if jax.process_index() == 0:
            write_run_config(cfg, cfg.train.workdir)
        try:
            self.initialize()
        except BaseException:  # a refused checkpoint: close what __init__ opened, before the interpreter exits
            self.close()
            raise
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._run(unit)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._profile_stop(self.step, force=True)
            if self._next is not None:  # a batch drawn for a step that never ran: leave the iterator before it
                self.batches.restore(self._next.before)
                self._next = None
            self.close()

    def close(self) -> None:
        """Close the metrics log and the checkpointer and let go of the workdir; :meth:`run` calls it, and a
        caller that drives :meth:`initialize` and :meth:`train_step` itself calls it when done (a second call
        does nothing). Left open, the writers are closed by atexit hooks at interpreter shutdown, where
        Python 3.12 refuses to start the thread tensorboardX's close needs (a traceback after the run)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.log.close()
            self.checkpoints.close()
        finally:
            workdir_lib.release(self.cfg.train.workdir)

    def _run(self, unit: str) -> dict[str, Any]:
        cfg = self.cfg
        if cfg.model.attention != self.setup.attention:  # auto: say what it picked on this backend
            self.echo(f"attention: {self.setup.attention} (model.attention={cfg.model.attention})")
        val_start = self.evaluate()
        if val_start is None:
            self.echo("validation: off (train.eval_batches=0)")
        else:
            self.echo(f"validation at step {self.step}: {val_start:.3f} {unit}")
            self.log.record_event({"step": self.step, "val_bits": val_start, "unit": unit})
        last: dict[str, float] = {}
        eval_every = cfg.train.eval_every
        with self._progress() as progress:
            task = progress.add_task("train", total=cfg.train.steps, completed=self.step, loss=float("nan"))
            while self.step < cfg.train.steps:
                rows = self.train_step()
                if self.stop_signal is not None:
                    rows += self._drain()
                for last in rows:
                    progress.update(task, advance=1, loss=last["loss"])
                    if not np.isfinite(last["loss"]):
                        self.echo(f"step {last['step']}: loss is {last['loss']}")
                    if cfg.train.log_every and last["step"] % cfg.train.log_every == 0 and not self.show_progress:
                        dropped = f", {last['moe_dropped']:.2%} of choices dropped" if "moe_dropped" in last else ""
                        self.echo(
                            f"step {last['step']}: loss {last['loss']:.4f} {LOSS_UNIT} {last['tokens_per_s']:.0f} tok/s"
                            + dropped
                        )
                if self._inflight is not None:
                    continue  # not a sync step: no checkpoint, evaluation or stop is due after it
                if self.checkpoints.should_save(self.step) or self.stop_signal is not None:
                    self.save()
                if self.stop_signal is not None:
                    self.checkpoints.wait()
                    name = signal.Signals(self.stop_signal).name
                    self.echo(
                        f"{name}: checkpoint of step {self.step} written to {self.checkpoints.directory}; exiting"
                    )
                    return {"preempted": True, "step": self.step}
                if eval_every and self.step % eval_every == 0 and self.step < cfg.train.steps:
                    self.log.record_event({"step": self.step, "val_bits": self.evaluate(), "unit": unit})
        if cfg.checkpoint.every:
            self.save()
        val_end = self.evaluate()
        self._require_finite(val_start, val_end, ran=bool(last))
        steady = self.log.steady_state()
        if val_end is not None:
            self.log.record_event({"step": self.step, "val_bits": val_end, "unit": unit})
            drop = 1 - val_end / val_start
            self.echo(f"validation at step {self.step}: {val_end:.3f} {unit} (start {val_start:.3f}, {drop:.1%} lower)")
        if steady:
            self.echo(
                f"steady state over {steady['steps']} steps: {steady['median_step_time_s'] * 1e3:.0f} ms/step, "
                f"{steady['tokens_per_s']:.0f} tokens/s, {steady['tflops_per_device']:.4f} TFLOP/s per device, "
                f"MFU {steady['mfu']:.1%} (peak: {self.peak_source})"
            )
        self.echo(f"metrics: {self.log.path}")
        return {"val_start": val_start, "val_end": val_end, "final": last, "steady": steady, "unit": unit}

    def _require_finite(self, val_start: float | None, val_end: float | None, ran: bool) -> None:
        """A run that trained steps but applied none with a finite loss, or ends with a non-finite
        validation loss, failed: a :class:`TrainingDiverged` (exit code 2), never a quiet exit 0."""
        if ran and self.good_steps == 0:
            seen = f" (validation {val_end:.4g})" if val_end is not None else ""
            raise TrainingDiverged(
                f"training produced no finite loss in {self.guard.total} steps{seen}; "
                "check the config values (optim.lr, model.init_std) and the data, or train.init_from's weights"
            )
        if val_end is not None and not math.isfinite(val_end):
            raise TrainingDiverged(
                f"validation loss at step {self.step} is {val_end} (start {val_start:.4g}): the run diverged; lower "
                "optim.lr or check train.init_from's weights"
            )

    def _progress(self) -> Progress:
        return Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} loss {task.fields[loss]:.3f} " + LOSS_UNIT),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            disable=not self.show_progress or jax.process_index() != 0,
        )
