"""``jaxpar drill``: kill a training run with SIGKILL at random steps, resume it, and check that it
ends exactly where an uninterrupted run ends.

One reference run, then one run killed ``--trials`` times (the whole process group, as a node
failure would) and resumed from its newest complete checkpoint each time. :func:`run_drill` reports
each kill's step, the checkpoint resumed from, the steps lost, and whether the per-step losses and
final state match the reference bit for bit; flags and output are :mod:`jaxpar.cli.drill`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

from jaxpar import children, files, write_guard
from jaxpar.config import ConfigDict, ConfigError, load_config
from jaxpar.distributed import without_device_count
from jaxpar.metrics import read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Failure:
    killed_at_step: int
    resumed_from_step: int

    @property
    def steps_lost(self) -> int:
        return self.killed_at_step - self.resumed_from_step


MARKER = ".jaxpar-drill"  # in each run folder the drill made: only those are replaced


def _check_workdir(base: pathlib.Path, runs: tuple[pathlib.Path, ...]) -> None:
    """ConfigError unless ``base`` can hold the drill's runs without losing anything: it is a folder
    (or absent), and each run folder is absent, empty or one an earlier drill made."""
    if base.exists() and not base.is_dir():
        raise ConfigError(f"--workdir {base}: is a file, not a folder; pick another path")
    for run in runs:
        if run.exists() and not (run.is_dir() and ((run / MARKER).is_file() or not any(run.iterdir()))):
            raise ConfigError(
                f"--workdir {base}: {run.name} exists and was not made by jaxpar drill; "
                "pick another --workdir (the drill replaces its run folders)"
            )
    probe = base if base.exists() else next(p for p in base.parents if p.exists())
    if not os.access(probe, os.W_OK):
        raise ConfigError(f"--workdir {base}: {probe} is not writable; pick another path")


def _raise_run_failure(what: str, workdir: pathlib.Path, code: int) -> None:
    """A run of the drill failed: its own one-line refusal (exit code 2) is the drill's, as a ConfigError;
    anything else is a RuntimeError pointing at the run's log."""
    log = workdir.parent / f"{workdir.name}.log"
    text = files.read_bytes(log, "metrics log", "drill", "give another --workdir") if log.exists() else b""
    errors = [x for x in text.decode(errors="replace").splitlines() if x.startswith("error: ")]
    if code == 2 and errors:
        raise ConfigError(f"{what} refused its input ({errors[-1][len('error: ') :]}); see {log}")
    raise RuntimeError(f"{what} failed with exit code {code}; see {log}")


def _logged_step(workdir: pathlib.Path) -> int:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return 0
    return max((r["step"] for r in read_metrics(str(path)) if "loss" in r), default=0)


def _launch(config: str, overrides: list[str], workdir: pathlib.Path, processes: int) -> subprocess.Popen:
    train = [
        sys.executable,
        "-m",
        "jaxpar",
        "train",
        "--config",
        config,
        "--no-progress",
        *overrides,
        f"--config.train.workdir={workdir}",
    ]
    cmd = train if processes == 1 else ["bash", str(ROOT / "scripts" / "launch_local.sh"), str(processes), *train]
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "JAXPAR_HEARTBEAT_TIMEOUT": os.environ.get("JAXPAR_HEARTBEAT_TIMEOUT", "10"),
        "XLA_FLAGS": without_device_count(os.environ.get("XLA_FLAGS", "")),
    }  # train sets each process's share
    log = open(workdir.parent / f"{workdir.name}.log", "a")  # noqa: SIM115 - closed with the process
    # a session of its own (stopped as a group), and SIGKILL when the drill dies (launch_local.sh passes
    # that on: its processes get SIGKILL when it dies; tests/test_drill_children.py)
    return subprocess.Popen(
        cmd,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=children.dying_with_parent(),  # noqa: PLW1509 - only prctl and getppid run before exec
    )


@contextlib.contextmanager
def _run(config: str, overrides: list[str], workdir: pathlib.Path, processes: int) -> Iterator[subprocess.Popen]:
    """:func:`_launch` a training run, tracked while the block runs: a SIGTERM or Ctrl-C of the drill, or
    any error, ends the run's whole session (launcher and processes) before the drill goes (jaxpar.children)."""
    what = f"the drill's {workdir.name} training run"
    with children.started(lambda: _launch(config, overrides, workdir, processes), what, lambda p: p.pid) as proc:
        yield proc


def _finish(proc: subprocess.Popen, timeout_s: float) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise RuntimeError(f"training did not finish within {timeout_s:.0f} s") from None


def _checkpoint_steps(workdir: pathlib.Path) -> list[int]:
    ckpt = workdir / "checkpoints"
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.exists() else []


def run_drill(
    config: str, overrides: list[str], workdir: str, processes: int, trials: int, seed: int, timeout_s: float = 900.0
) -> dict:
    """Run the reference and the interrupted run under ``workdir``; returns ``failures`` (kill and
    resume steps), ``losses_match``, ``state_match`` and ``seconds``."""
    cfg = load_config(config, overrides)
    if cfg.checkpoint.every <= 0:
        raise ConfigError("checkpoint.every=0: the drill needs checkpoints; pass e.g. --config.checkpoint.every=2")
    steps = cfg.train.steps
    if steps < trials + 2:
        raise ConfigError(f"train.steps={steps}: too few steps for {trials} kills; use at least {trials + 2}")
    base = pathlib.Path(workdir).resolve()
    reference, interrupted = base / "reference", base / "interrupted"
    _check_workdir(base, (reference, interrupted))  # every check before anything is deleted
    for d in (reference, interrupted):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        (d / MARKER).write_text("made by jaxpar drill; the next drill in this folder replaces it\n")
        write_guard.mark(d, write_guard.WORKDIR)  # a run's workdir: the runs the drill starts claim it
    start = time.time()
    with _run(config, overrides, reference, processes) as proc:
        code = _finish(proc, timeout_s)
    if code != 0:
        _raise_run_failure("the reference run", reference, code)
    rng = random.Random(seed)
    failures: list[Failure] = []
    while True:
        with _run(config, overrides, interrupted, processes) as proc:
            if len(failures) == trials:
                code = _finish(proc, timeout_s)
                if code != 0:
                    _raise_run_failure("the resumed run", interrupted, code)
                break
            done = _logged_step(interrupted)
            target = rng.randint(done + 1, max(done + 1, steps - 1))
            deadline = time.time() + timeout_s
            while proc.poll() is None and _logged_step(interrupted) < target and time.time() < deadline:
                time.sleep(0.05)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole job dies at once, like a node failure
            proc.wait()
        killed_at = _logged_step(interrupted)
        ckpts = [s for s in _checkpoint_steps(interrupted) if s <= killed_at]
        failures.append(Failure(killed_at, max(ckpts, default=0)))
    losses_match = _last_losses(reference) == _last_losses(interrupted)
    state_match = _same_final_state(cfg, reference, interrupted)
    return {
        "failures": [dataclasses.asdict(f) | {"steps_lost": f.steps_lost} for f in failures],
        "losses_match": losses_match,
        "state_match": state_match,
        "seconds": time.time() - start,
    }


def _last_losses(workdir: pathlib.Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(str(workdir / "metrics.jsonl")) if "loss" in r}


def _same_final_state(cfg: ConfigDict, a: pathlib.Path, b: pathlib.Path) -> bool:
    """Restore both final checkpoints on one device and compare every array bit for bit."""
    import jax
    import numpy as np

    from jaxpar.checkpoint import Checkpointer
    from jaxpar.train.state import one_device_checkpoint_state

    params, opt = one_device_checkpoint_state(cfg)
    abstract = {"params": params, "opt_state": opt}
    states = []
    for workdir in (a, b):
        ckpt = Checkpointer(str(workdir), 0, 100, echo=lambda _: None, model=cfg.model)
        step = cfg.train.steps
        restored = ckpt.restore(abstract, step=step)
        ckpt.close()
        states.append(jax.device_get(restored[1]))
    return all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1]), strict=True)
    )
