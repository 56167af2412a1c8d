"""Children die with their parent (jaxpar.children): SIGTERM or SIGINT to ``jaxpar sweep`` or ``jaxpar drill``
ends its worker / training runs (their process groups, a launcher's processes included), then the
parent exits 143 / 130 with one line naming what it stopped, and nothing of its session is left.

Each case starts the command in a session of its own, waits until its child runs, signals the parent
and looks for the session's processes in /proc. The default suite signals each command once (SIGTERM);
``JAXPAR_SLOW=1`` adds SIGINT, the two-process drill (scripts/launch_local.sh) and a later signal.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from jaxpar import children
from tests.helpers import ROOT, child_env

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads processes from /proc (Linux)")
SLOW = os.environ.get("JAXPAR_SLOW") == "1"
GONE_S = 20  # the session must be empty this long after the parent was signalled


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, parent pid, process group, session) of ``pid``; None once it is gone."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3])


def _sessions(sids: set[int]) -> list[int]:
    """The live (not zombie) processes of the sessions ``sids``."""
    out = []
    for name in os.listdir("/proc"):
        stat = _stat(int(name)) if name.isdigit() else None
        if stat and stat[0] not in "ZX" and stat[3] in sids:
            out.append(int(name))
    return out


def _cmdline(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _children_of(pid: int) -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit() and (_stat(int(n)) or ("", 0))[1] == pid]


def _signalled(tmp: pathlib.Path, argv: list[str], child: str, sig: int, after_s: float) -> tuple[int, list[str]]:
    """Start ``jaxpar ARGV``, wait for a child whose command line holds ``child`` (then ``after_s``),
    send ``sig`` to the parent; returns (exit code, stderr lines) once nothing of it runs any more."""
    err = tmp / "stderr"
    with open(err, "w") as f:
        parent = subprocess.Popen(
            [sys.executable, "-m", "jaxpar", *argv],
            cwd=tmp,
            env=child_env(PYTHONPATH=str(ROOT)),
            stdout=subprocess.DEVNULL,
            stderr=f,
            start_new_session=True,
        )
    ours: list[int] = []
    sids = {parent.pid}
    try:
        deadline = time.monotonic() + 180
        while not ours and parent.poll() is None and time.monotonic() < deadline:
            ours = [c for c in _children_of(parent.pid) if child in _cmdline(c)]
            time.sleep(0.1)
        assert ours, f"no child '{child}' started: exit {parent.poll()}, {err.read_text()[-2000:]}"
        time.sleep(after_s)
        assert parent.poll() is None, err.read_text()[-2000:]
        # the parent's session and those its children made (the drill's runs start sessions of their own)
        sids |= {stat[3] for stat in map(_stat, ours) if stat}
        signalled = time.monotonic()
        parent.send_signal(sig)
        code = parent.wait(timeout=60)
        while (left := _sessions(sids)) and time.monotonic() - signalled < GONE_S:
            time.sleep(0.1)
        assert not left, f"still running {time.monotonic() - signalled:.0f} s after the signal: " + "; ".join(
            _cmdline(p)[:120] for p in left
        )
        print(f"{argv[0]} {signal.Signals(sig).name}: exit {code}, all gone {time.monotonic() - signalled:.1f} s after")
        return code, [x for x in err.read_text().splitlines() if x.strip()]
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait()
        for pid in _sessions(sids):  # never leave one behind, whatever failed
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _running(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in "ZX"


SWEEP = ["sweep", "--devices", "2", "--steps", "2", "--warmup", "0", "--repeats", "1", "--no-progress"]
SWEEP += ["--only", "^d2t1p1-z0", "-o", "out"]
DRILL = ["drill", "--trials", "1", "--workdir", "drill", "--config.train.global_batch=8", "--config.train.seq_len=64"]
DRILL += ["--config.train.steps=500", "--config.train.eval_batches=0", "--config.checkpoint.every=5"]

# (case, argv, the child's command line holds, signal, seconds after the child appears, line)
CASES = [
    ("sweep SIGTERM", SWEEP, "spawn_main", signal.SIGTERM, 1.0, "terminated: stopped the sweep's worker process"),
    ("drill SIGTERM", DRILL, "jaxpar train", signal.SIGTERM, 1.0, "terminated: stopped the drill's reference"),
]
SLOW_CASES = [
    ("sweep SIGINT", SWEEP, "spawn_main", signal.SIGINT, 1.0, "interrupted: stopped the sweep's worker process"),
    ("sweep SIGTERM running", SWEEP, "spawn_main", signal.SIGTERM, 8.0, "terminated: stopped the sweep's worker"),
    ("drill SIGINT", DRILL, "jaxpar train", signal.SIGINT, 1.0, "interrupted: stopped the drill's reference"),
    (
        "drill of 2 processes SIGTERM",
        ["drill", "--processes", "2", *DRILL[1:]],
        "launch_local.sh",
        signal.SIGTERM,
        8.0,
        "terminated: stopped the drill's reference training run (pid",
    ),
]


@pytest.mark.parametrize(
    "argv, child, sig, after_s, words",
    [c[1:] for c in CASES]
    + [pytest.param(*c[1:], marks=pytest.mark.skipif(not SLOW, reason="JAXPAR_SLOW=1 (~15 s)")) for c in SLOW_CASES],
    ids=[c[0] for c in CASES + SLOW_CASES],
)
def test_a_signal_to_the_parent_ends_its_children(tmp_path, argv, child, sig, after_s, words):
    code, lines = _signalled(tmp_path, argv, child, sig, after_s)
    assert code == 128 + sig, (code, lines)
    assert len(lines) == 1 and lines[0].startswith(words), lines


def _sleeper_tree(tmp: pathlib.Path) -> subprocess.Popen:
    """A shell in a session of its own with two background sleeps (a launcher and its processes)."""
    return subprocess.Popen(
        ["bash", "-c", "sleep 300 & sleep 300 & wait"], cwd=tmp, start_new_session=True, stdout=subprocess.DEVNULL
    )


def test_stop_ends_a_tracked_group_and_names_it(tmp_path):
    with children.started(lambda: _sleeper_tree(tmp_path), "a test's shell", lambda p: p.pid) as proc:
        deadline = time.monotonic() + 10
        while len(_sessions({proc.pid})) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = _sessions({proc.pid})
        assert len(tree) == 3
        text = children.stop([proc.pid], grace_s=2.0)
    proc.wait(timeout=10)
    assert text == f"a test's shell (pid {proc.pid}, 3 processes in its group)"
    assert not [p for p in tree if _running(p)]
    assert children.stop([proc.pid]) == ""  # untracked (and gone): nothing more to stop


def test_an_error_in_the_block_stops_the_child(tmp_path):
    with pytest.raises(RuntimeError), children.started(lambda: _sleeper_tree(tmp_path), "t", lambda p: p.pid) as proc:
        while len(_sessions({proc.pid})) < 3:
            time.sleep(0.05)
        raise RuntimeError("the owner failed")
    proc.wait(timeout=10)
    assert not _sessions({proc.pid})


def test_a_child_dies_with_a_parent_killed_by_sigkill(tmp_path):
    """PR_SET_PDEATHSIG: a SIGKILL of the parent, which no handler sees, still ends the child."""
    script = (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', "
        "'import os, time\\nfrom jaxpar import children\\nchildren.die_with_parent(os.getppid())\\n"
        "print(os.getpid(), flush=True)\\ntime.sleep(300)'])\n"
        "time.sleep(300)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], env=child_env(PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, text=True
    )
    try:
        pid = int(parent.stdout.readline())
        assert _running(pid)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(pid)
    finally:
        parent.kill()
        parent.wait()


def test_a_program_started_dying_with_its_parent_ends_with_a_sigkill_of_it(tmp_path):
    """The drill's training runs (any program, not only Python) get PR_SET_PDEATHSIG before exec."""
    script = (
        "import subprocess, time\n"
        "from jaxpar import children\n"
        "child = subprocess.Popen(['sleep', '300'], start_new_session=True, preexec_fn=children.dying_with_parent())\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], env=child_env(PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, text=True
    )
    pid = int(parent.stdout.readline())
    try:
        assert _running(pid) and "sleep" in _cmdline(pid)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(pid)
    finally:
        parent.kill()
        parent.wait()
        if _running(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_command_names_only_the_processes_it_stopped(tmp_path, capsys, monkeypatch):
    """The record of stopped children is per command: ``jaxpar.cli.main`` starts a new one, so a later
    command in the same process (the tests run many) does not name an earlier one's children."""
    from jaxpar import cli
    from jaxpar.cli import plan as plan_cli

    with children.started(lambda: _sleeper_tree(tmp_path), "an earlier command's shell", lambda p: p.pid) as proc:
        assert children.stop([proc.pid], grace_s=2.0)
    proc.wait(timeout=10)
    assert "an earlier command's shell" in children.summary()

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(plan_cli, "run_plan", interrupted)
    assert cli.main(["plan"]) == 130
    assert capsys.readouterr().err == "interrupted\n"
