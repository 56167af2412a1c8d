"""The one error path of every subcommand.

- bad input (:class:`~jaxpar.errors.JaxparError`, e.g. :class:`~jaxpar.config.ConfigError`):
  ``error: <one line>`` on stderr, exit code 2;
- anything else is a bug: one line ``jaxpar: internal error (<Type>: <first line>); traceback
  written to <path>`` on stderr, exit code 1, the full traceback in ``<path>``: a file in the run's
  workdir when the subcommand has named one (:func:`note_workdir`) and it exists, else
  ``<tmp>/jaxpar-error-<pid>.log``;
- an :class:`OSError` that names a file (a path the OS refuses: missing, too long, not
  readable, a folder where a file belongs) is bad input too: ``error: <reason>: '<path>'``, exit 2;
- Ctrl-C: ``interrupted``, exit code 130.

(``jaxpar train`` in a multi-process job has one more: a failed collective exits with code 3,
see :mod:`jaxpar.cli.train`.)
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import traceback

EXIT_INTERNAL = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
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
    text = (f"{datetime.datetime.now(datetime.UTC).isoformat()} jaxpar {' '.join(argv)}\n"
            + "".join(traceback.format_exception(error)))
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
