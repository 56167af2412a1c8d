"""Runs own their workdir (jaxpar.workdir): one live run per workdir (the second is refused naming the
first one's pid; a dead one's lock is taken over), ``resume=never`` does not mix with old checkpoints
unless ``restart`` asks to start over, and another optimizer's checkpoint is refused by name, never deleted."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from jaxpar import workdir, write_guard
from jaxpar.checkpoint import Checkpointer
from jaxpar.config import ConfigError
from tests.fuzzkit import cli_refused
from tests.test_write_guard import FAST, snapshot

HOLD = (
    "import fcntl, os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "os.write(fd, f'{os.getpid()} host-a\\n'.encode())\n"
    "print('held', flush=True)\n"
    "time.sleep(120)\n"
)


def _run_workdir(path: pathlib.Path) -> pathlib.Path:
    """A previous run's workdir: marked, a config.json of a run, a checkpoint folder at step 3."""
    path.mkdir(parents=True)
    write_guard.mark(path, write_guard.WORKDIR)
    (path / "checkpoints" / "3").mkdir(parents=True)
    (path / "checkpoints" / "3" / "state").write_bytes(b"the run's state")
    (path / "metrics.jsonl").write_text('{"step": 3}\n')
    return path


def test_a_second_run_in_a_live_runs_workdir_is_refused_naming_its_pid(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run / workdir.LOCK)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        line = cli_refused("workdir lock", ["train", "--no-progress", f"--config.train.workdir={run}", *FAST])
    finally:
        holder.kill()
        holder.wait()
    assert line == (
        f"error: train.workdir='{run}' is in use by another jaxpar run (pid {holder.pid} on host-a, lock "
        f"{run / workdir.LOCK}); wait for it to end or give another train.workdir"
    )
    assert sorted(p.name for p in run.iterdir()) == [workdir.LOCK]  # nothing else written


def test_a_dead_runs_lock_is_taken_over(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / workdir.LOCK).write_text("999999999 host-b\n")  # no process holds it: the run that wrote it died
    workdir.claim(str(run), "auto")
    try:
        assert workdir.holder(str(run)) == os.getpid()
        assert write_guard.read_marker(run)["kind"] == write_guard.WORKDIR
    finally:
        workdir.release(str(run))


RESUMES = [
    (
        "never",
        "refused",
        [
            "train.resume=never: train.workdir='@RUN' holds checkpoints [3] of an earlier run",
            "set train.resume=restart to delete them and start over",
        ],
    ),
    ("auto", "kept", []),
    ("3", "kept", []),
    ("restart", "deleted", []),
]


@pytest.mark.parametrize("resume, outcome, words", RESUMES, ids=[r[0] for r in RESUMES])
def test_resume_modes_do_what_they_say(tmp_path, resume, outcome, words):
    run = _run_workdir(tmp_path / "run")
    before = snapshot(run)
    if outcome == "refused":
        line = cli_refused(
            "workdir resume",
            ["train", "--no-progress", f"--config.train.workdir={run}", f"--config.train.resume={resume}", *FAST],
        )
        assert all(w.replace("@RUN", str(run)) in line for w in words), line
        assert {k: v for k, v in snapshot(run).items() if k != workdir.LOCK} == before
        return
    workdir.claim(str(run), resume)
    workdir.release(str(run))
    after = {k: v for k, v in snapshot(run).items() if k != workdir.LOCK}
    if outcome == "kept":
        assert after == before
    else:  # restart: the run's own checkpoints and metrics go, its marker stays
        assert sorted(after) == [write_guard.MARKER]


def test_restart_is_a_resume_mode_the_config_admits():
    from tests.helpers import tiny_config

    assert tiny_config("--config.train.resume=restart").train.resume == "restart"
    with pytest.raises(ConfigError, match="use auto, never, restart"):
        tiny_config("--config.train.resume=fresh")


def test_another_optimizers_checkpoint_is_refused_by_name_and_kept(tmp_path_factory):
    from tests.test_fuzz_files import _small, make_checkpoints

    run = make_checkpoints(tmp_path_factory)  # saved with optim.name=adamw
    before = snapshot(run)
    cfg = _small(f"--config.train.workdir={run}", "--config.optim.name=lion")
    params, opt = _abstract(cfg)
    ckpt = Checkpointer(str(run), 1, 5, echo=lambda _: None, model=cfg.model, optimizer=cfg.optim.name)
    try:
        with pytest.raises(ConfigError) as raised:
            ckpt.restore({"params": params, "opt_state": opt})
    finally:
        ckpt.close()
    assert str(raised.value) == (
        f"checkpoint 2 in {run / 'checkpoints'} holds the state of optimizer "
        "optim.name='adamw' but the config has 'lion'; set --config.optim.name=adamw to "
        "resume it, train.resume=restart to start over, or point train.workdir at another "
        "folder"
    )
    assert snapshot(run) == before  # nothing deleted as "damaged"


def _abstract(cfg):
    from jaxpar.train.state import one_device_checkpoint_state

    return one_device_checkpoint_state(cfg)


@pytest.mark.skipif(os.environ.get("JAXPAR_SLOW") != "1", reason="JAXPAR_SLOW=1: two real runs in one workdir")
def test_two_real_runs_in_one_workdir(tmp_path):
    """The first ``jaxpar train`` holds the lock while it lives; the second is refused naming its pid;
    once the first is killed (SIGKILL: no cleanup), a third run takes the lock over."""
    import time

    from tests.helpers import ROOT

    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxpar",
            "train",
            "--no-progress",
            f"--config.train.workdir={run}",
            "--config.train.steps=100000",
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while workdir.holder(str(run)) != first.pid:
            assert time.monotonic() < deadline and first.poll() is None, "the first run never took the lock"
            time.sleep(0.1)
        line = cli_refused("workdir lock", ["train", "--no-progress", f"--config.train.workdir={run}", *FAST])
        assert f"is in use by another jaxpar run (pid {first.pid} on " in line, line
    finally:
        first.kill()
        first.wait()
    workdir.claim(str(run), "auto")  # the dead run's lock: taken over
    try:
        assert workdir.holder(str(run)) == os.getpid()
    finally:
        workdir.release(str(run))


ENTRIES = [  # (an entry a run writes, made of the wrong kind; the words of the refusal)
    ("checkpoints", "file", "checkpoints is not a regular file, where a run keeps its checkpoints folder"),
    ("config.json", "folder", "config.json is a folder, where a run keeps its config.json file"),
    ("metrics.jsonl", "link", "metrics.jsonl is a link, where a run keeps its metrics.jsonl file"),
]
if os.environ.get("JAXPAR_SLOW") != "1":
    ENTRIES = ENTRIES[:1]


@pytest.mark.parametrize("name, kind, words", ENTRIES, ids=[e[0] for e in ENTRIES])
def test_a_workdir_entry_of_the_wrong_kind_is_refused_in_one_line(tmp_path, name, kind, words):
    """(``checkpoints`` a file: orbax's writer thread failed and the process never ended.)"""
    run = tmp_path / "run"
    run.mkdir()
    target = run / name
    if kind == "file":
        target.write_text("x")
    elif kind == "folder":
        target.mkdir()
    else:
        (tmp_path / "elsewhere").write_text("mine")
        target.symlink_to(tmp_path / "elsewhere")
    before = snapshot(tmp_path)
    line = cli_refused(
        "workdir entries",
        ["train", "--no-progress", f"--config.train.workdir={run}", "--config.checkpoint.every=1", *FAST],
    )
    assert line == f"error: train.workdir='{run}': {words}; move it away or give another workdir"
    assert snapshot(tmp_path) == before  # nothing written, the link's target untouched
