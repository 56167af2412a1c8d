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
"""

from __future__ import annotations

import collections
import json
import math
import os
import shlex
import signal
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from jaxpar import data as data_lib
from jaxpar.axes import MeshAxis
from jaxpar.checkpoint import Checkpointer
from jaxpar.config import ConfigDict, ConfigError
from jaxpar.errors import JaxparError
from jaxpar.layout import ParallelLayout
from jaxpar.mesh import make_mesh
from jaxpar.metrics import MetricsLog, device_peak_flops, model_flops_per_token
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
    """``<workdir>/config.json`` (the resolved config) and ``command.txt`` (the command line)."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "config.json")
    with open(path, "w") as f:
        json.dump(cfg.to_dict(), f, indent=1, sort_keys=True)
    with open(os.path.join(workdir, "command.txt"), "w") as f:
        f.write(shlex.join(sys.argv if argv is None else argv) + "\n")
    return path


class BadStepGuard:
    """Host side of bad-step handling: the loss threshold for the next step (``spike_factor`` x the
    median of the last good losses, once there are enough of them) and the skip counters."""

    WINDOW, MIN_HISTORY = 64, 10

    def __init__(self, spike_factor: float):
        self.spike_factor = spike_factor
        self.history: collections.deque[float] = collections.deque(maxlen=self.WINDOW)
        self.consecutive = 0
        self.total = 0

    def max_loss(self) -> float:
        if not self.spike_factor or len(self.history) < self.MIN_HISTORY:
            return float("inf")
        return self.spike_factor * statistics.median(self.history)

    def observe(self, loss: float, skipped: bool) -> None:
        if skipped:
            self.consecutive += 1
            self.total += 1
        else:
            self.consecutive = 0
            self.history.append(loss)


class TrainingDiverged(JaxparError):
    """A run that ended without a finite loss: bad input (a config value, the data or the weights)."""


class Trainer:
    """Owns one run: the layout (:class:`Setup`), the data iterators, the state and the log."""

    def __init__(self, cfg: ConfigDict, echo: Callable[[str], None] = print, progress: bool = True,
                 weights_loader: Callable[[str, ConfigDict, Any], Any] | None = None):
        """``weights_loader(path, model_cfg, shardings)``: reads ``train.init_from`` onto the mesh
        (the CLI passes :func:`jaxpar.port.weights.load_checked`: the HF format lives with the
        importers, and the trainer does not import them)."""
        self.cfg, self.show_progress, self.weights_loader = cfg, progress, weights_loader
        self.echo = echo if jax.process_index() == 0 else (lambda _: None)
        self.layout = ParallelLayout.from_config(cfg)
        self.mesh = make_mesh(self.layout)
        self.setup = Setup(cfg, self.mesh)
        t = cfg.train
        pidx, pcount = self.setup.feed.data_split  # the rows of this process's data shards
        self.batches = data_lib.make_batches(
            cfg.data, vocab_size=cfg.model.vocab_size, seq_len=t.seq_len, global_batch=t.global_batch,
            seed=t.seed, split="train", process_index=pidx, process_count=pcount,
        )
        unit_rows = math.lcm(self.mesh.shape[MeshAxis.DATA], pcount)  # eval rows must split over both
        eval_rows = unit_rows * max(1, (t.global_batch // t.microbatches) // unit_rows)
        self.eval_data = data_lib.eval_batches(
            cfg.data, vocab_size=cfg.model.vocab_size, seq_len=t.seq_len, global_batch=eval_rows,
            seed=t.seed, num_batches=t.eval_batches, process_index=pidx, process_count=pcount,
        )
        peak, self.peak_source = device_peak_flops(self.layout.devices)
        self.log = MetricsLog(
            t.workdir, model_flops_per_token(cfg.model, t.seq_len), peak, self.layout.devices,
            t.warmup_steps_excluded, write=pidx == 0,
        )
        self.checkpoints = Checkpointer(t.workdir, cfg.checkpoint.every, cfg.checkpoint.keep, self.echo,
                                        model=cfg.model)
        self.params: Any = None
        self.opt_state: Any = None
        self.step = 0
        self.stop_signal: int | None = None
        self.guard = BadStepGuard(t.spike_factor)
        self.good_steps = 0  # steps of this process with a finite loss whose update was applied
        self.inject_bad = {int(x) for x in t.inject_bad_steps.split(",") if x.strip()}
        self.profile = profile_range(t)
        self.profiling = False

    # ------------------------------------------------------------------ pieces
    def initialize(self) -> None:
        """Resume from the newest complete checkpoint (``train.resume``), else initialise."""
        resume = str(self.cfg.train.resume)
        restored = None
        if resume != "never":
            params, opt, _ = self.setup.abstract_state(model_form=True)
            step = int(resume) if resume.isascii() and resume.isdigit() else None
            restored = self.checkpoints.restore({"params": params, "opt_state": opt}, step=step)
        if restored is None:
            if self.cfg.train.init_from:  # fine-tuning: start from HF weights, a fresh optimizer
                if self.weights_loader is None:
                    raise ConfigError("train.init_from is set but this trainer has no weights loader; run "
                                      "`jaxpar train`, or pass Trainer(weights_loader=jaxpar.port.weights.load_checked)")

                hf = self.weights_loader(self.cfg.train.init_from, self.cfg.model, self.setup.model_param_shardings)
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
            self.checkpoints.save(self.step, params, opt, self.batches.state(), self.cfg)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stop_signal = signum  # finish the current step, then checkpoint and exit

    def evaluate(self) -> float:
        """Mean validation loss over the fixed evaluation batches, in bits per byte/token."""
        total, count = 0.0, 0
        for rows in self.eval_data:
            batch = self.setup.feed.make_eval_batch(rows)
            total += float(self.setup.eval_step(self.params, batch))
            count += batch.shape[0] * (batch.shape[1] - 1)
        return total / count / math.log(2)

    def train_step(self) -> dict[str, float]:
        batch_number = self.batches.state()["step"] + 1  # the data position: a rollback does not rewind it
        rows = self.batches.next()
        batch = self.setup.feed.make_batch(rows)
        offset = float("nan") if batch_number in self.inject_bad else 0.0
        self._profile_start(self.step + 1)
        start = time.perf_counter()
        self.params, self.opt_state, metrics = self.setup.train_step(
            self.params, self.opt_state, batch, max_loss=self.guard.max_loss(), loss_offset=offset
        )
        values = jax.device_get(metrics)  # blocks: the step time includes the device work
        elapsed = time.perf_counter() - start
        self.step += 1
        self._profile_stop(self.step)
        self.guard.observe(float(values["loss"]), bool(values["skipped"]))
        self.good_steps += int(not values["skipped"] and np.isfinite(values["loss"]))
        row = self.log.record(self.step, elapsed, self.layout.tokens_per_step,
                              {**values, "bad_steps_total": self.guard.total})
        if values["skipped"]:
            self.echo(f"step {self.step}: update skipped (loss {float(values['loss']):.4g}, grad norm "
                      f"{float(values['grad_norm']):.4g}; {self.guard.consecutive} in a row, {self.guard.total} in all)")
        if self.guard.consecutive >= self.cfg.train.max_bad_steps:
            self.rollback()
        return row

    def _profile_start(self, step: int) -> None:
        if self.profile and not self.profiling and self.profile[0] <= step <= self.profile[1]:
            jax.profiler.start_trace(os.path.join(self.cfg.train.workdir, "profile"))
            self.profiling = True

    def _profile_stop(self, step: int, force: bool = False) -> None:
        if self.profiling and (force or step >= self.profile[1]):
            jax.profiler.stop_trace()
            self.profiling = False
            self.echo(f"profile of steps {self.profile[0]}-{min(step, self.profile[1])}: "
                      f"{os.path.join(self.cfg.train.workdir, 'profile')}")

    def rollback(self) -> None:
        """Too many bad steps in a row: restore the newest checkpoint, keep the data position (the
        offending batches are skipped) and go on."""
        bad_at = self.step
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
        self.log.record_event({"step": bad_at, "rollback_to": self.step, "data_position": self.batches.state()})
        self.echo(f"step {bad_at}: rolled back to the checkpoint of step {self.step}; the offending data is skipped")

    # ------------------------------------------------------------------ run
    def run(self) -> dict[str, Any]:
        cfg, unit = self.cfg, bits_unit(self.cfg.model)
        m = cfg.mesh
        self.echo(
            f"jaxpar train: {self.layout.devices} devices ({jax.devices()[0].platform}), mesh data={m.data} "
            f"tensor={m.tensor} pipeline={m.pipeline}"
            + (f" context={m.context} ({cfg.parallel.context_exchange})" if m.context > 1 else "")
            + f", zero_stage={cfg.parallel.zero_stage}, "
            f"sequence_parallel={cfg.parallel.sequence_parallel}, {cfg.train.steps} steps of "
            f"{self.layout.tokens_per_step} tokens"
        )
        p = cfg.parallel
        if p.zero_stage == 3 and p.grad_reduce_dtype != cfg.model.compute_dtype:
            self.echo(f"note: ZeRO-3 gathers parameters and reduce-scatters their gradients in {cfg.model.compute_dtype} "
                      f"(model.compute_dtype); parallel.grad_reduce_dtype={p.grad_reduce_dtype} applies to the "
                      "parameters ZeRO cannot split")
        if jax.process_index() == 0:
            write_run_config(cfg, cfg.train.workdir)
        self.initialize()
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._run(unit)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._profile_stop(self.step, force=True)
            self.log.close()
            self.checkpoints.close()

    def _run(self, unit: str) -> dict[str, Any]:
        cfg = self.cfg
        if cfg.model.attention != self.setup.attention:  # auto: say what it picked on this backend
            self.echo(f"attention: {self.setup.attention} (model.attention={cfg.model.attention})")
        val_start = self.evaluate()
        self.echo(f"validation at step {self.step}: {val_start:.3f} {unit}")
        self.log.record_event({"step": self.step, "val_bits": val_start, "unit": unit})
        last: dict[str, float] = {}
        eval_every = cfg.train.eval_every
        with self._progress() as progress:
            task = progress.add_task("train", total=cfg.train.steps, completed=self.step, loss=float("nan"))
            while self.step < cfg.train.steps:
                last = self.train_step()
                progress.update(task, advance=1, loss=last["loss"])
                if self.checkpoints.should_save(self.step) or self.stop_signal is not None:
                    self.save()
                if self.stop_signal is not None:
                    self.checkpoints.wait()
                    name = signal.Signals(self.stop_signal).name
                    self.echo(f"{name}: checkpoint of step {self.step} written to {self.checkpoints.directory}; exiting")
                    return {"preempted": True, "step": self.step}
                if not np.isfinite(last["loss"]):
                    self.echo(f"step {self.step}: loss is {last['loss']}")
                if cfg.train.log_every and self.step % cfg.train.log_every == 0 and not self.show_progress:
                    self.echo(f"step {self.step}: loss {last['loss']:.4f} {LOSS_UNIT} {last['tokens_per_s']:.0f} tok/s")
                if eval_every and self.step % eval_every == 0 and self.step < cfg.train.steps:
                    self.log.record_event({"step": self.step, "val_bits": self.evaluate(), "unit": unit})
        if cfg.checkpoint.every:
            self.save()
        val_end = self.evaluate()
        self.log.record_event({"step": self.step, "val_bits": val_end, "unit": unit})
        self._require_finite(val_start, val_end, ran=bool(last))
        steady = self.log.steady_state()
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

    def _require_finite(self, val_start: float, val_end: float, ran: bool) -> None:
        """A run that trained steps but applied none with a finite loss, or ends with a non-finite
        validation loss, failed: a :class:`TrainingDiverged` (exit code 2), never a quiet exit 0."""
        if ran and self.good_steps == 0:
            raise TrainingDiverged(
                f"training produced no finite loss in {self.guard.total} steps (validation {val_end:.4g}); "
                "check the config values (optim.lr, model.init_std) and the data, or train.init_from's weights")
        if not math.isfinite(val_end):
            raise TrainingDiverged(
                f"validation loss at step {self.step} is {val_end} (start {val_start:.4g}): the run diverged; lower "
                "optim.lr or check train.init_from's weights")

    def _progress(self) -> Progress:
        return Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} loss {task.fields[loss]:.3f} " + LOSS_UNIT),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            disable=not self.show_progress or jax.process_index() != 0,
        )
