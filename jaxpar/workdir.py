"""A run owns its workdir: claimed (checked, marked, locked) before anything is written there.

:func:`claim`, the first thing :class:`~jaxpar.train.loop.Trainer` calls, requires:

- a folder that is new, empty or a previous run's (its :data:`~jaxpar.write_guard.MARKER` says
  ``workdir``, or, unmarked, it holds only what a run writes), never a user's folder nor the
  ``train.init_from`` weights;
- the lock (:data:`LOCK`, an ``flock`` held while the run lives, with its pid): a second run in the
  workdir is refused naming the first one's pid; a dead process's lock is released by the OS;
- ``train.resume``: ``never`` into a workdir with checkpoints is refused (keep-N would delete the
  new run's first); ``restart`` deletes its checkpoints and metrics and starts from step 0;
- entries of the right kind (``checkpoints`` a folder, ``config.json`` a file).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pathlib
import shutil
import socket

from jaxpar import files, write_guard
from jaxpar.errors import ConfigError

KIND = write_guard.WORKDIR
LOCK = ".jaxpar-lock"
# what a run leaves in its workdir (a folder holding only these, without a marker, is an older run's)
RUN_FILES = ("config.json", "command.txt", "metrics.jsonl", "checkpoints", "profile", LOCK, ".jaxpar-drill")
RUN_PREFIXES = ("events.out.tfevents.", "jaxpar-error-")

_held: dict[str, int] = {}  # real path -> open lock fd, of the workdirs this process holds


def _older_run(folder: pathlib.Path, names: list[str]) -> bool:
    """Whether an unmarked ``folder`` holds only what a run writes (and its config.json is a run's)."""
    if not all(n in RUN_FILES or n.startswith(RUN_PREFIXES) for n in names):
        return False
    config = folder / "config.json"
    if os.path.lexists(config):
        try:
            saved = json.loads(files.read_text(config, "run record", "train.workdir", ""))
        except (ConfigError, ValueError, RecursionError):
            return False
        return isinstance(saved, dict) and {"model", "train", "mesh"} <= set(saved)
    return True


def check_owned(workdir: str, init_from: str = "") -> None:
    """Refuse a ``train.workdir`` that is a user's folder or is or contains ``train.init_from``."""
    folder = pathlib.Path(workdir)
    if init_from and os.path.exists(init_from):
        weights, home = write_guard.real(init_from), write_guard.real(folder)
        if weights == home or home in weights.parents:
            raise ConfigError(
                f"train.workdir='{workdir}' is or contains train.init_from='{init_from}', the weights "
                "this run reads; a run writes config.json and checkpoints there: give a new workdir"
            )
    if not folder.is_dir():
        return
    names = sorted(p.name for p in folder.iterdir())
    marker = write_guard.read_marker(folder)
    if not names or (marker is not None and marker["kind"] == KIND) or (marker is None and _older_run(folder, names)):
        return
    foreign = [n for n in names if n not in RUN_FILES and not n.startswith(RUN_PREFIXES)] or ["a config.json"]
    why = (
        f"is a jaxpar {marker['kind']} folder"
        if marker is not None
        else f"holds files no run wrote ({', '.join(foreign)[:120]})"
    )
    raise ConfigError(
        f"train.workdir='{workdir}' {why}; a run writes config.json, metrics and checkpoints "
        "there: give a new or empty folder, or a previous run's"
    )


def lock(workdir: str) -> None:
    """Hold ``<workdir>/.jaxpar-lock`` while this process lives (or until :func:`release`); ConfigError
    naming the holder's pid when another live process holds it. A lock left by a dead process is taken over."""
    key = str(write_guard.real(workdir))
    if key in _held:
        return  # this process holds it already (a second Trainer of one run, in one process)
    path = os.path.join(workdir, LOCK)
    with write_guard.naming(path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.read(fd, 200).decode(errors="replace").split()
        os.close(fd)
        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise
        pid = holder[0] if holder else "unknown"
        raise ConfigError(
            f"train.workdir='{workdir}' is in use by another jaxpar run (pid {pid}"
            f"{' on ' + holder[1] if len(holder) > 1 else ''}, lock {path}); wait for it to end or "
            "give another train.workdir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
    _held[key] = fd


def holder(workdir: str) -> int | None:
    """The pid written in ``workdir``'s lock, or None (no lock, or an unreadable one)."""
    try:
        text = files.read_text(pathlib.Path(workdir, LOCK), "run record", "train.workdir", "").split()
        return int(text[0]) if text else None
    except (ConfigError, ValueError):
        return None


def release(workdir: str) -> None:
    """Let go of ``workdir``'s lock (the run ended); the file stays, holding no lock."""
    fd = _held.pop(str(write_guard.real(workdir)), None)
    if fd is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def checkpoint_steps(workdir: str) -> list[int]:
    """The step folders under ``<workdir>/checkpoints`` (complete or not), without opening orbax."""
    ckpt = pathlib.Path(workdir, "checkpoints")
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.is_dir() else []


FOLDERS, FILES = ("checkpoints", "profile"), ("config.json", "command.txt", "metrics.jsonl")


def check_entries(workdir: str) -> None:
    """Refuse a workdir whose entries a run writes are of the wrong kind (``checkpoints`` a file, ``config.json``
    a folder): the writers would fail there, orbax's in a thread that never lets the process end."""
    for name, want in [(n, "folder") for n in FOLDERS] + [(n, "file") for n in FILES]:
        path = pathlib.Path(workdir, name)
        if not os.path.lexists(path):
            continue
        ok = path.is_dir() if want == "folder" else path.is_file()
        if path.is_symlink() or not ok:
            got = "a link" if path.is_symlink() else ("a folder" if path.is_dir() else "not a regular file")
            raise ConfigError(
                f"train.workdir='{workdir}': {name} is {got}, where a run keeps its {name} "
                f"{want}; move it away or give another workdir"
            )


def claim(workdir: str, resume: str, init_from: str = "") -> None:
    """Check, create, mark and lock ``workdir`` for a run, then apply ``resume``'s start-over rule
    (``never``: refused when checkpoints are there; ``restart``: they and the metrics are deleted)."""
    check_entries(workdir)
    check_owned(workdir, init_from)
    with write_guard.naming(workdir):
        os.makedirs(workdir, exist_ok=True)
    lock(workdir)
    if write_guard.read_marker(workdir) is None:
        with write_guard.naming(os.path.join(workdir, write_guard.MARKER)):
            write_guard.mark(workdir, KIND)
    steps = checkpoint_steps(workdir)
    if resume == "never" and steps:
        release(workdir)
        raise ConfigError(
            f"train.resume=never: train.workdir='{workdir}' holds checkpoints {steps[:5]}"
            f"{'...' if len(steps) > 5 else ''} of an earlier run, which would mix with this one's; "
            "set train.resume=restart to delete them and start over, auto to continue, or give "
            "another workdir"
        )
    if resume == "restart":  # the workdir is this run's (checked above): its own checkpoints and metrics go
        checkpoints = pathlib.Path(workdir, "checkpoints")
        if checkpoints.is_dir() and not checkpoints.is_symlink():
            shutil.rmtree(checkpoints)
        pathlib.Path(workdir, "metrics.jsonl").unlink(missing_ok=True)
