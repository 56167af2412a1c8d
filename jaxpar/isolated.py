"""Run user code (a ``--config`` file) in a child process with a time limit; only its result comes back.

A config file is Python: it may loop forever, start a thread that never ends, call ``os._exit`` or
crash the interpreter. Run in the ``jaxpar`` process itself, any of these would hang or end the
command. :func:`call` runs ``module.function(*args)`` in a child instead and returns what it returned,
sent back as JSON (so only plain values: dicts, lists, strings, numbers, bools, None); the child then
ends with ``os._exit``, its threads with it. A child that does not answer within the limit is killed
(SIGKILL) and the caller gets a one-line :class:`~jaxpar.errors.ConfigError`.

The child is a fork of this process where that is safe (Linux, one Python thread, no JAX backend
started: about 10 ms, the modules already loaded); otherwise, e.g. once JAX runs, a fresh interpreter
(``sys.executable``), which costs an interpreter start and the imports. Standard library only (and
the leaf :mod:`jaxpar.children`, whose ``die_with_parent`` the child calls).
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

from jaxpar import children
from jaxpar.errors import ConfigError, JaxparError

MAX_RESULT = 16 << 20  # bytes of JSON a child may send back
_HEADER = 12  # the result's length, as 12 ASCII digits, before it


def fork_is_safe() -> bool:
    """Whether this process may fork to run Python code: Linux, no Python thread besides this one (a
    fork copies only the calling thread; a lock another thread held stays held in the child) and no
    JAX backend started (XLA's thread pools). Native worker pools that handle a fork themselves, such
    as the OpenBLAS pool NumPy starts at import, do not count."""
    if not sys.platform.startswith("linux") or threading.active_count() > 1:
        return False
    bridge = sys.modules.get("jax._src.xla_bridge")
    started = getattr(bridge, "backends_are_initialized", None)
    return bridge is None or (started is not None and not started())


def _answer(module: str, function: str, args: list[Any]) -> bytes:
    """What the child sends: ``{"ok": result}``, ``{"error": one line}`` (bad input) or ``{"crash": ...}``."""
    try:
        result = {"ok": getattr(importlib.import_module(module), function)(*args)}
    except JaxparError as e:
        result = {"error": str(e)}
    except KeyboardInterrupt:
        result = {"interrupted": True}
    except BaseException as e:  # noqa: BLE001 - the parent reports it as the child's failure
        result = {"crash": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"}
    try:
        body = json.dumps(result).encode()
    except (TypeError, ValueError) as e:
        body = json.dumps({"crash": f"its result cannot be sent back ({e})"}).encode()
    return f"{len(body):0{_HEADER}d}".encode() + body


def _child(fd: int, parent: int, module: str, function: str, args: list[Any]) -> None:
    """The child's whole life: answer on ``fd``, then end at once (no atexit hooks, no threads kept)."""
    code = 0
    try:
        children.die_with_parent(parent)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handler (it stops the parent's children)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)  # a config that reads stdin gets end-of-file, not a wait
        os.dup2(null, 0)
        os.close(null)
        data = _answer(module, function, args)
        while data:
            data = data[os.write(fd, data) :]
    except BaseException:  # noqa: BLE001 - the parent sees no answer and says so
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001, S110 - a closed stdout must not keep the child alive
                pass
        os._exit(code)


def child_main() -> None:
    """Entry of a fresh-interpreter child: ``python -c ... FD PARENT MODULE FUNCTION ARGS_JSON``."""
    fd, parent, module, function, args = sys.argv[1:6]
    _child(int(fd), int(parent), module, function, json.loads(args))


def _start(write_fd: int, module: str, function: str, args: list[Any]) -> int:
    parent = os.getpid()
    if fork_is_safe():
        for stream in (sys.stdout, sys.stderr):  # else the child flushes the parent's buffered output again
            stream.flush()
        with warnings.catch_warnings():  # Python 3.12+ warns of any thread, the native pools' included
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            _child(write_fd, parent, module, function, args)
        return pid
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    code = "from jaxpar.isolated import child_main; child_main()"
    argv = [sys.executable, "-c", code, str(write_fd), str(parent), module, function, json.dumps(args)]
    return subprocess.Popen(argv, pass_fds=(write_fd,), env=env, stdin=subprocess.DEVNULL).pid


def _read(fd: int, deadline: float) -> bytes | None:
    """The child's answer, or None when the deadline passed first; b"" when it ended without one."""
    data = b""
    want = _HEADER
    while len(data) < want:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b""
        data += chunk
        if want == _HEADER and len(data) >= _HEADER:
            if not data[:_HEADER].isdigit() or int(data[:_HEADER]) > MAX_RESULT:
                return b""
            want = _HEADER + int(data[:_HEADER])
    return data[_HEADER:want]


def _reap(pid: int, deadline: float) -> int | None:
    """The child's exit status once it ended (by the deadline), else None after a SIGKILL."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return None
        time.sleep(0.005)


def call(module: str, function: str, args: list[Any], limit_s: float, what: str, fix: str) -> Any:
    """``module.function(*args)`` run in a child process, its JSON-able result; at most ``limit_s``
    seconds, else a one-line ConfigError naming ``what``, the limit and ``fix``. A ConfigError the
    function raised comes back as the same line; another exception as one line naming it."""
    read_fd, write_fd = os.pipe()
    pid = None
    try:
        pid = _start(write_fd, module, function, args)
        os.close(write_fd)
        write_fd = -1
        answer = _read(read_fd, time.monotonic() + limit_s)
        code = _reap(pid, time.monotonic() + (0.0 if answer is None else 1.0))
        pid = None
    finally:
        if write_fd >= 0:
            os.close(write_fd)
        os.close(read_fd)
        if pid is not None:  # left by an exception (Ctrl-C, SIGTERM): the child goes too
            _reap(pid, 0.0)
    if answer is None:
        raise ConfigError(f"{what}: did not finish within {limit_s:g} s (it was stopped); {fix}")
    if not answer:
        ended = f"exit code {code}" if code is not None and code >= 0 else f"signal {-code if code else 'KILL'}"
        raise ConfigError(f"{what}: the process running it ended without a result ({ended}); {fix}")
    result = json.loads(answer)
    if "error" in result:
        raise ConfigError(result["error"])
    if "interrupted" in result:
        raise KeyboardInterrupt
    if "crash" in result:
        raise ConfigError(f"{what}: {result['crash']}; {fix}")
    return result["ok"]
