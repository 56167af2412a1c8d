"""The one error path of every subcommand.

- bad input (:class:`~jaxpar.errors.JaxparError`, e.g. :class:`~jaxpar.config.ConfigError`):
  ``error: <one line>`` on stderr, exit code 2;
- anything else is a bug: ``jaxpar: internal error (<Type>: <first line>); traceback written to
  <path>``, exit code 1, the traceback in the run's workdir when the subcommand named one that
  exists (:func:`note_workdir`), else ``<tmp>/jaxpar-error-<pid>.log``;
- OS errors are the user's (:func:`os_error`): one naming a file (missing, too long, unreadable, a
  folder where a file belongs) is ``error: <reason>: '<path>'``, exit 2; a closed pipe on stdout
  (``jaxpar ... | head``) ends quietly with exit 141 (128 + SIGPIPE, as shells show); a full disk is
  ``error: no space left on the device of '<path>'; ...``, exit 2 (:mod:`jaxpar.write_guard` left
  the earlier output as it was), stdout included;
- an installed library that fails while it is being imported (:func:`broken_dependency`: flax
  0.12.8 under jax 0.11.2 did, on a GPU machine) is the environment's: one line naming both
  versions and the fix, exit 2;
- Ctrl-C: ``interrupted``, exit code 130, anywhere (:mod:`jaxpar.interrupt`).

A multi-process ``jaxpar train`` has one more: a failed collective exits 3 (:mod:`jaxpar.cli.train`).
"""

from __future__ import annotations

import datetime
import errno
import os
import signal
import sys
import tempfile
import traceback

from jaxpar.versions import installed

EXIT_INTERNAL = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE
STDOUT = "<standard output>"  # the file name of an OSError raised writing stdout (NamedStdout)
MAX_MESSAGE = 300  # characters of the exception's first line kept on stderr

_workdir: str | None = None


def note_workdir(path: str | None) -> None:
    """Where this command's run lives; an internal error writes its traceback there (if it exists)."""
    global _workdir
    _workdir = path


def one_line(text: str) -> str:
    """``text`` on one line (a multi-line message joined with spaces)."""
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def bad_input(error: BaseException) -> int:
    """Print ``error: <one line>`` on stderr; returns the exit code 2."""
    print(f"error: {one_line(str(error))}", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT


def bad_path(error: OSError) -> int:
    """Print ``error: <reason>: '<path>'; check the path`` on stderr; returns the exit code 2."""
    name = str(error.filename)
    name = name if len(name) <= 200 else name[:200] + "..."
    reason = error.strerror or type(error).__name__
    print(f"error: {reason}: '{name}'; check the path", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT


def log_path() -> str:
    """The traceback file: ``<workdir>/jaxpar-error-<pid>.log`` when the run's workdir exists, else in the
    system temporary folder."""
    name = f"jaxpar-error-{os.getpid()}.log"
    if _workdir and os.path.isdir(_workdir):
        return os.path.join(_workdir, name)
    return os.path.join(tempfile.gettempdir(), name)


def internal_error(error: BaseException, argv: list[str]) -> int:
    """Write the traceback to :func:`log_path` and print one line naming the error and the file; returns 1."""
    text = f"{datetime.datetime.now(datetime.UTC).isoformat()} jaxpar {' '.join(argv)}\n" + "".join(
        traceback.format_exception(error)
    )
    path = log_path()
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError:  # an unwritable workdir: the temporary folder still takes it
        path = os.path.join(tempfile.gettempdir(), f"jaxpar-error-{os.getpid()}.log")
        with open(path, "w") as f:
            f.write(text)
    first = (str(error).strip().splitlines() or [""])[0].strip()[:MAX_MESSAGE]
    what = f"{type(error).__name__}: {first}" if first else type(error).__name__
    print(f"jaxpar: internal error ({what}); traceback written to {path}", file=sys.stderr, flush=True)
    return EXIT_INTERNAL


# The libraries jaxpar imports that are built against one JAX (import name: distribution name).
DEPENDENCIES = {"flax": "flax", "optax": "optax", "orbax": "orbax-checkpoint", "chex": "chex"}


def _version(distribution: str) -> str:
    return installed(distribution) or "?"


def broken_dependency(error: BaseException) -> str | None:
    """The one-line message for ``error`` when it was raised by a dependency's own module code while
    Python imported it (a library made for another JAX), else None."""
    if not isinstance(error, ImportError | AttributeError | TypeError | NameError):
        return None
    frames = traceback.extract_tb(error.__traceback__)
    if not frames or frames[-1].name != "<module>":
        return None
    parts = frames[-1].filename.replace(os.sep, "/").split("/")
    package = next((p for p in reversed(parts[:-1]) if p in DEPENDENCIES), None)
    if package is None or "site-packages" not in parts and "dist-packages" not in parts:
        return None
    first = (str(error).strip().splitlines() or [""])[0].strip()[:MAX_MESSAGE]
    return (
        f"{DEPENDENCIES[package]} {_version(DEPENDENCIES[package])} does not import under jax {_version('jax')} "
        f"({type(error).__name__}: {first}); install releases made for each other: jaxpar is tested with "
        "jax 0.10.2 + flax 0.12.8 (Python 3.11) and jax 0.12 + flax 0.12.12 (Python 3.12), e.g. "
        "pip install 'jax>=0.12,<0.12.2' 'flax>=0.12.12'"
    )


class NamedStdout:
    """``sys.stdout`` whose write errors name it: an OSError without a file name raised writing or
    flushing gets :data:`STDOUT` as its file name, so that :func:`os_error` can tell a closed pipe or a
    full disk under stdout from a bug. Everything else is the wrapped stream's."""

    def __init__(self, stream):
        self._stream = stream

    def _named(self, call, *args):
        try:
            return call(*args)
        except OSError as e:
            if e.filename is None and e.errno is not None:
                raise type(e)(e.errno, e.strerror or os.strerror(e.errno), STDOUT) from e
            raise

    def write(self, text: str) -> int:  # noqa: D102
        return self._named(self._stream.write, text)

    def flush(self) -> None:  # noqa: D102
        self._named(self._stream.flush)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def quiet_stdout() -> None:
    """Point fd 1 at /dev/null: the interpreter's last flush of a closed pipe must not print
    "Exception ignored ... BrokenPipeError" after the command ended quietly."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.__stdout__.fileno())
        os.close(devnull)
    except (OSError, AttributeError, ValueError):  # no real stdout (a test's StringIO): nothing to silence
        pass


def os_error(error: OSError, argv: list[str]) -> int:
    """The exit code of an OSError that reached the CLI: a closed pipe on stdout (quiet, 141), a full
    disk (one line naming the path, 2), another error naming a path (:func:`bad_path`, 2), else a bug (1)."""
    if (isinstance(error, BrokenPipeError) or error.errno == errno.EPIPE) and error.filename in (None, STDOUT):
        quiet_stdout()
        return EXIT_BROKEN_PIPE
    if error.filename is None:  # not about a path the user gave: a bug
        return internal_error(error, argv)
    if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        name = str(error.filename)
        name = name if len(name) <= 200 else name[:200] + "..."
        if name == STDOUT:
            print(
                f"error: no space left on the device of the standard output ({error.strerror}); free space "
                "there or redirect the output elsewhere",
                file=sys.stderr,
                flush=True,
            )
        else:
            print(
                f"error: no space left on the device of '{name}' ({error.strerror}); free space there or write "
                "elsewhere (an earlier output there is left as it was)",
                file=sys.stderr,
                flush=True,
            )
        return EXIT_BAD_INPUT
    return bad_path(error)
