"""Child processes die with their parent: each process jaxpar starts is tracked here, in a process group
of its own, and ends (with its own children) when the parent is stopped.

``jaxpar sweep`` (its worker process) and ``jaxpar drill`` (its training runs, a launcher's processes
included) start their children through :func:`started`. A SIGINT (:mod:`jaxpar.interrupt`) or a SIGTERM
(:func:`supervised`) of the parent calls :func:`stop_all` before anything else: SIGTERM to every
tracked group, SIGKILL to what is left after :data:`STOP_S`, a bounded wait until no member runs; then
the parent exits 130 or 143 with one line naming what it stopped (:func:`summary`). A child left by any
other exception is stopped the same way when :func:`started`'s block exits. A signal that lands while
a child is being started waits until it is tracked (:func:`deferred`). A Python child can also ask the
kernel for a SIGKILL when its parent dies by a signal no handler sees (:func:`die_with_parent`, Linux).
Standard library only: a leaf module, like :mod:`jaxpar.interrupt`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

STOP_S = 5.0  # after SIGTERM to a child's group, how long before SIGKILL
KILL_WAIT_S = 5.0  # after SIGKILL, how long to wait for the group to be gone
GRACE_S = 10.0  # after a SIGTERM was handled, how long the unwinding may take before the process just ends
EXIT_TERMINATED = 128 + signal.SIGTERM
T = TypeVar("T")


@dataclasses.dataclass
class Child:
    pid: int  # also its process group's id, once it made its own group
    what: str  # "the sweep's worker process", in the stop line


class Terminated(KeyboardInterrupt):
    """The parent got SIGTERM (its children are already stopped); a KeyboardInterrupt so that the code
    that lets Ctrl-C through (never wrapping it into a bad-input error) lets this through too."""


_children: dict[int, Child] = {}
_stopped: list[str] = []
_starting = 0  # > 0 while a child is being started: a signal then waits (deferred)
_pending: list[int] = []
_terminated = False


def _members(pgid: int) -> list[int]:
    """The live (not zombie) processes of group ``pgid``, from /proc; without /proc, ``[pgid]`` while
    the group can be signalled."""
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in (b"Z", b"X") and int(fields[2]) == pgid:
            out.append(int(name))
    return out


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent's wait does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        if os.path.isdir("/proc/self"):
            return False
    try:
        os.kill(pid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _alive(child: Child) -> bool:
    return _running(child.pid) or bool(_members(child.pid))


def _signal(child: Child, sig: int) -> None:
    """``sig`` to the child's group and to the child itself (not yet in a group of its own, it is in none)."""
    for send, target in ((os.killpg, child.pid), (os.kill, child.pid)):
        try:
            send(target, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_gone(children: list[Child], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.05)


def track(pid: int, what: str) -> None:
    """Track the child ``pid`` (its own process group, or about to make one) until :func:`untrack`."""
    _children[pid] = Child(pid, what)


def untrack(pid: int) -> None:
    """Stop tracking ``pid`` (it ended, its owner waited for it)."""
    _children.pop(pid, None)


def stop(pids: list[int] | None = None, grace_s: float = STOP_S) -> str:
    """End the groups of the tracked children ``pids`` (default: all): SIGTERM, SIGKILL to what is left
    after ``grace_s``, then wait at most :data:`KILL_WAIT_S`. Returns what was stopped, in words."""
    chosen = [c for c in _children.values() if pids is None or c.pid in pids]
    try:
        return _stop([c for c in chosen if _alive(c)], grace_s)  # one that ended already is not stopped
    finally:
        for c in chosen:  # tracked until gone: a second signal meanwhile still kills them (kill_all)
            untrack(c.pid)


def _stop(children: list[Child], grace_s: float) -> str:
    if not children:
        return ""
    counts = {c.pid: max(len(_members(c.pid)), 1) for c in children}
    for c in children:
        _signal(c, signal.SIGTERM)
    _wait_gone(children, grace_s)
    for c in children:
        if _alive(c):
            _signal(c, signal.SIGKILL)
    _wait_gone(children, KILL_WAIT_S)
    text = ", ".join(
        f"{c.what} (pid {c.pid}" + (f", {counts[c.pid]} processes in its group)" if counts[c.pid] > 1 else ")")
        for c in children
    )
    left = [c.pid for c in children if _alive(c)]
    if left:
        text += f"; still running after SIGKILL: {', '.join(map(str, left))}"
    _stopped.append(text)
    return text


def stop_all() -> str:
    """:func:`stop` every tracked child (the parent is being stopped)."""
    return stop()


def kill_all() -> None:
    """SIGKILL to every tracked group at once, no wait (the parent leaves this instant)."""
    for c in list(_children.values()):
        _signal(c, signal.SIGKILL)


def forget_stopped() -> None:
    """Start a new command's record of what it stopped (:func:`summary` names only its own)."""
    _stopped.clear()


def summary() -> str:
    """``: stopped <what> (pid N)`` for the line the parent ends with; empty when it stopped nothing."""
    return f": stopped {'; '.join(_stopped)}" if _stopped else ""


def deferred(signum: int) -> bool:
    """Whether a handler should leave ``signum`` for later: a child is being started, and stopping now
    would miss it; the signal is sent again once the child is tracked."""
    if _starting:
        _pending.append(signum)
        return True
    return False


@contextlib.contextmanager
def started(start: Callable[[], T], what: str, pid: Callable[[T], int]) -> Iterator[T]:
    """``start()`` a child and track it while the block runs; a block left by an exception (a signal's
    included) stops the child's group first. ``pid`` gives the started object's process id."""
    global _starting
    _starting += 1
    try:
        child = start()
        track(pid(child), what)
    finally:
        _starting -= 1
        if not _starting and _pending:
            os.kill(os.getpid(), _pending.pop(0))  # now that the child is tracked
            _pending.clear()
    try:
        yield child
    except BaseException:
        stop([pid(child)])
        raise
    finally:
        untrack(pid(child))


def leave(word: str = "terminated", code: int = EXIT_TERMINATED) -> NoReturn:
    """End the process at once (a second signal, or the unwinding after the first took too long):
    SIGKILL to the children, one line (``<word>: stopped ...``), exit ``code``. The SIGTERM and the
    Ctrl-C (:mod:`jaxpar.interrupt`) paths both leave through here."""
    kill_all()
    try:
        os.write(2, f"{word}{summary()}\n".encode())
    finally:
        os._exit(code)


def stop_then_raise(grace_s: float, leave_late: Callable[[], object], error: type[BaseException]) -> NoReturn:
    """A first stop signal: stop the tracked children, call ``leave_late`` ``grace_s`` from now should
    the unwinding not have ended the process (an exception some code swallowed), raise ``error`` (a
    class: an instance held here would tie the traceback's frames in a cycle, and the unwinding's
    finalisers, multiprocessing's semaphores among them, would not run before exit)."""
    stop_all()
    timer = threading.Timer(grace_s, leave_late)
    timer.daemon = True
    timer.start()
    raise error


def _on_sigterm(signum: int, _frame: Any) -> None:
    global _terminated
    if _terminated:
        leave()
    if deferred(signum):
        return
    _terminated = True
    stop_then_raise(GRACE_S, leave, Terminated)


@contextlib.contextmanager
def supervised() -> Iterator[None]:
    """While the block runs, SIGTERM stops the tracked children, then raises :class:`Terminated` (the CLI
    prints ``terminated: stopped ...`` and exits 143). Main thread only; the previous handler is restored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def die_with_parent(parent: int) -> None:
    """In a child: the kernel sends it SIGKILL when its parent thread dies (Linux ``PR_SET_PDEATHSIG``);
    a child whose parent ``parent`` is already gone exits at once."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(1)


def dying_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen` (Linux): the started program gets SIGKILL when the
    thread that started it dies, even by a SIGKILL no handler sees (``PR_SET_PDEATHSIG`` survives
    ``exec``); one whose parent is already gone exits at once. None where there is no ``prctl``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the forked child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    return preexec
