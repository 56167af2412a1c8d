"""A two-process ``jaxpar drill`` leaves nothing running when it is SIGKILLed: the launcher
(scripts/launch_local.sh) gets SIGKILL from the kernel when the drill dies (jaxpar.children's
PR_SET_PDEATHSIG), and each process the launcher started gets it when the launcher dies (the script
starts them through a PR_SET_PDEATHSIG prefix). SIGTERM / SIGINT of the drill are tests/test_children.py's.

The default suite kills a launcher of two ``sleep`` processes (about a second); the drill itself
(two ``jaxpar train`` processes under it) is a few seconds more.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT, child_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc (Linux)")
GONE_S = 5.0  # every process the killed parent started must be gone this soon after the SIGKILL
LAUNCH = str(ROOT / "scripts" / "launch_local.sh")


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid``; None once it is gone."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return fields[0].decode(), int(fields[1])


def _running(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in "ZX"


def _cmdline(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _children_of(pid: int, holding: str) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        stat = _stat(int(name)) if name.isdigit() else None
        if stat and stat[1] == pid and stat[0] not in "ZX" and holding in _cmdline(int(name)):
            out.append(int(name))
    return out


def _wait_for(find, count: int, parent: subprocess.Popen, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while len(found := find()) < count and parent.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def _kill_and_check_gone(parent: subprocess.Popen, pids: list[int]) -> float:
    """SIGKILL ``parent`` alone; the seconds until every one of ``pids`` is gone (asserted < GONE_S)."""
    assert all(_running(p) for p in pids), [(_cmdline(p), _stat(p)) for p in pids]
    killed = time.monotonic()
    parent.kill()
    parent.wait()
    while (left := [p for p in pids if _running(p)]) and time.monotonic() - killed < GONE_S:
        time.sleep(0.05)
    assert not left, f"still running {GONE_S} s after the SIGKILL: " + "; ".join(_cmdline(p)[:120] for p in left)
    return time.monotonic() - killed


def _cleanup(parent: subprocess.Popen, pids: list[int]) -> None:
    if parent.poll() is None:
        parent.kill()
        parent.wait()
    for pid in pids:  # never leave one behind, whatever failed
        if _running(pid):
            os.kill(pid, signal.SIGKILL)


def test_the_processes_of_a_sigkilled_launcher_end(tmp_path):
    launcher = subprocess.Popen(["bash", LAUNCH, "2", "sleep", "300"], cwd=tmp_path, start_new_session=True)
    procs: list[int] = []
    try:
        procs = _wait_for(lambda: _children_of(launcher.pid, "sleep 300"), 2, launcher, 30)
        assert len(procs) == 2, (procs, launcher.poll())
        _kill_and_check_gone(launcher, procs)
    finally:
        _cleanup(launcher, procs)


DRILL = ["drill", "--processes", "2", "--trials", "1", "--workdir", "drill", "--config.train.global_batch=8"]
DRILL += ["--config.train.seq_len=64", "--config.train.steps=500", "--config.train.eval_batches=0"]
DRILL += ["--config.checkpoint.every=5"]


def test_a_sigkilled_two_process_drill_leaves_no_process(tmp_path):
    drill = subprocess.Popen(
        [sys.executable, "-m", "jaxpar", *DRILL],
        cwd=tmp_path,
        env=child_env(PYTHONPATH=str(ROOT)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ours: list[int] = []
    try:
        launchers = _wait_for(lambda: _children_of(drill.pid, "launch_local.sh"), 1, drill, 180)
        assert len(launchers) == 1, (launchers, drill.poll())
        ours = list(launchers)
        trains = _wait_for(lambda: _children_of(launchers[0], "jaxpar train"), 2, drill, 60)
        assert len(trains) == 2, (trains, drill.poll())
        ours += trains
        time.sleep(1.0)  # the training processes are importing JAX / starting jax.distributed
        seconds = _kill_and_check_gone(drill, ours)
        print(f"two-process drill SIGKILL: launcher and 2 processes gone {seconds:.2f} s after")
    finally:
        _cleanup(drill, ours)
