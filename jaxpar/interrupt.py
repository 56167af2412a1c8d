"""Ctrl-C, wherever it lands, ends the ``jaxpar`` program with one line (``interrupted``) and exit code 130.

A leaf module (standard library and the leaf :mod:`jaxpar.children`, whose processes it stops first),
installed before the CLI's imports start JAX. Python's KeyboardInterrupt does not always reach the
CLI: raised while a C extension loads it becomes an ImportError, in a garbage-collector callback or
finaliser it is printed and lost, in an exit hook it prints a traceback. So :func:`install` records
that a Ctrl-C came (:func:`interrupted`: the CLI reports any later error as the interrupt), raises
the KeyboardInterrupt for the cleanups, and ends the process itself :data:`GRACE_S` later, at a
second Ctrl-C, or when Python reports the interrupt swallowed; after ``main`` returned,
:func:`leave_at_once` ends it at once. (``jaxpar train`` installs its own handler while training:
Ctrl-C stops at the next step with a checkpoint.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from jaxpar import children

EXIT_INTERRUPTED = 130
GRACE_S = 5.0  # after a Ctrl-C, how long the KeyboardInterrupt's cleanups may take before the process just ends
_hit = False
_deferred = False


def interrupted() -> bool:
    """Whether a Ctrl-C came since :func:`install`."""
    return _hit


def _leave(*_args: Any) -> None:  # also a signal handler (signum, frame) and a timer's callback
    children.leave("interrupted", EXIT_INTERRUPTED)  # SIGKILL to the children: no orphans, even now


def _on_sigint(signum: int, _frame: Any) -> None:
    global _hit
    if _hit:  # the second Ctrl-C: the first did not end it
        _leave()
    if children.deferred(signum):  # a child is being started: this signal comes again once it is tracked
        return
    _hit = True
    if _deferred:  # while modules load: a KeyboardInterrupt inside a C extension's start can crash it
        return
    # the children first; a KeyboardInterrupt some code swallowed still ends the process GRACE_S later
    children.stop_then_raise(GRACE_S, _leave, KeyboardInterrupt)


def install(defer: bool = False) -> None:
    """Take over SIGINT for the ``jaxpar`` program (main thread only; a library caller keeps its own).
    ``defer``: only record a Ctrl-C (while the CLI's modules load; the caller checks :func:`interrupted`
    after), instead of raising KeyboardInterrupt."""
    global _deferred
    if threading.current_thread() is not threading.main_thread():
        return
    _deferred = defer
    signal.signal(signal.SIGINT, _on_sigint)
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            _leave()  # swallowed where it was raised (a gc callback, a finaliser): it would be lost
        previous(unraisable)

    sys.unraisablehook = hook


@contextlib.contextmanager
def deferring() -> Iterator[None]:
    """Inside the block a Ctrl-C is only noted (JAX's C extension loads there: a KeyboardInterrupt
    inside its start can crash the process), then raised as KeyboardInterrupt when the block ends."""
    global _deferred
    before, _deferred = _deferred, True
    try:
        yield
    finally:
        _deferred = before
    if _hit and not before:
        raise KeyboardInterrupt


def exit_now(code: int = EXIT_INTERRUPTED) -> None:
    """End the process with ``code`` without the interpreter's shutdown: after a Ctrl-C cut a C
    extension's loading short, its finalisation can crash (a segmentation fault, measured on jaxlib)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def leave_at_once() -> None:
    """From now on (``main`` returned; exit hooks run) Ctrl-C ends the process at once: one line, 130."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _leave)


if os.path.basename(sys.argv[0] if sys.argv else "") == "jaxpar":  # the console script: jaxpar.cli imports
    install(defer=True)  # this module first, then the subcommands, which start JAX (python -m jaxpar: __main__)
