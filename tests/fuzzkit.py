"""Shared pieces of the hostile-input fuzz suite (tests/test_fuzz_*.py, tests/test_hostile.py).

Every generated case must end in one of two ways within a time bound: a one-line
:class:`~jaxpar.errors.JaxparError` (exit code 2 on the command line) or a correct result. Never a
traceback (an internal error, exit code 1), a hang, or a silently accepted bad value.

Sampling: each family draws a seeded sample of its cases (``SAMPLE`` per family) so the suite stays
well under a minute; ``JAXPAR_SLOW=1`` runs every case. :data:`COUNTS` collects the number of cases
run per family; tests/conftest.py prints it in the terminal summary.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import random
import signal
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

from jaxpar.errors import JaxparError

FULL = os.environ.get("JAXPAR_SLOW") == "1"
SEED = int(os.environ.get("JAXPAR_FUZZ_SEED", "0"))
COUNTS: collections.Counter[str] = collections.Counter()
CASE_LIMIT_S = 30.0  # any one case: a hang is a failure, not a stuck CI job
T = TypeVar("T")


def sample(family: str, cases: Sequence[T], k: int) -> list[T]:
    """``k`` cases of ``cases`` drawn with a seed fixed per family (all of them under JAXPAR_SLOW=1)."""
    cases = list(cases)
    if FULL or len(cases) <= k:
        return cases
    return random.Random(f"{SEED}:{family}").sample(cases, k)


class Hang(Exception):
    """A case ran past its time bound."""


@contextlib.contextmanager
def bounded(seconds: float = CASE_LIMIT_S) -> Iterator[None]:
    """Raise :class:`Hang` in the main thread when the block runs longer than ``seconds``."""

    def fire(_signum: int, _frame: Any) -> None:
        raise Hang(f"ran past {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def one_line_error(error: BaseException) -> str:
    """The message of a user-facing error, checked to be one non-empty line."""
    assert isinstance(error, JaxparError), f"{type(error).__name__} is not a user-facing error: {error}"
    text = str(error)
    assert text and "\n" not in text and "Traceback" not in text, repr(text)
    return text


def expect_refused(family: str, fn: Any, *args: Any, **kwargs: Any) -> str:
    """Run ``fn`` on a case that must be refused: a one-line JaxparError within the bound; returns it."""
    COUNTS[family] += 1
    start = time.perf_counter()
    try:
        with bounded():
            result = fn(*args, **kwargs)
    except JaxparError as e:
        return one_line_error(e)
    raise AssertionError(
        f"{family}: accepted silently ({args!r} {kwargs!r}) -> {result!r} after {time.perf_counter() - start:.1f} s"
    )


def expect_refused_or_ok(family: str, fn: Any, *args: Any, **kwargs: Any) -> tuple[str | None, Any]:
    """Run ``fn`` on a case that may be harmless: (one-line message, None) or (None, result)."""
    COUNTS[family] += 1
    try:
        with bounded():
            return None, fn(*args, **kwargs)
    except JaxparError as e:
        return one_line_error(e), None


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``jaxpar ARGV`` in this process within the time bound: (exit code, stdout, stderr)."""
    from jaxpar.cli import main

    out, err = io.StringIO(), io.StringIO()
    with bounded(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def cli_refused(family: str, argv: list[str]) -> str:
    """``jaxpar ARGV`` must exit 2 with one ``error:`` line on stderr; returns that line."""
    COUNTS[family] += 1
    code, out, err = run_cli(argv)
    lines = [x for x in err.splitlines() if x.strip()]
    shown = [a if len(a) < 80 else a[:60] + f"...({len(a)} chars)" for a in argv]
    assert code == 2, f"jaxpar {shown}: exit {code}\nstdout: {out[-1000:]}\nstderr: {err[-1000:]}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"jaxpar {shown}: stderr {err[-1000:]!r}"
    return lines[0]


# --------------------------------------------------------------------------- byte mutations


def mutations(data: bytes, rng: random.Random) -> dict[str, bytes]:
    """Damaged versions of a file's bytes: truncations, garbage, flipped bytes, an empty file."""
    n = len(data)
    garbage = bytes(rng.randrange(256) for _ in range(min(n, 512) or 64))
    flipped = bytearray(data)
    for _ in range(max(1, n // 50)):
        if flipped:
            i = rng.randrange(len(flipped))
            flipped[i] ^= 0xFF
    return {
        "empty": b"",
        "truncated_half": data[: n // 2],
        "truncated_last": data[:-1],
        "binary_garbage": garbage,
        "flipped_bytes": bytes(flipped),
        "nul_prefix": b"\x00" * 16 + data,
        "latin1_bytes": data + b"\xff\xfe\xe9",
    }
