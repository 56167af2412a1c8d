"""What every subcommand shares: the argparse class, the default config, flag checks. Bad flags
are user errors like bad config fields: a one-line :class:`~jaxpar.config.ConfigError` (exit 2)."""

from __future__ import annotations

import argparse
import os

from jaxpar.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CONFIG = os.path.join(ROOT, "configs", "tiny.py")


class Parser(argparse.ArgumentParser):
    """argparse that reports bad flags in one line (a ConfigError: exit code 2) instead of exiting."""

    def error(self, message: str) -> None:  # noqa: D102
        raise ConfigError(f"{self.prog}: {message} (see --help)")


def config_or_default(args: argparse.Namespace) -> str:
    """``--config``, or the repository's configs/tiny.py."""
    return args.config or DEFAULT_CONFIG


def overrides(args: argparse.Namespace) -> list[str]:
    """The ``--config.x.y=v`` overrides the CLI split off (none when a caller built ``args`` itself)."""
    return list(getattr(args, "overrides", None) or [])


def needs(command: str, flag: str, given: bool, other: str, present: bool) -> None:
    """Refuse ``flag`` without ``other`` (``flag`` only means something together with ``other``)."""
    if given and not present:
        raise ConfigError(f"{command}: {flag} applies only with {other}; add {other} or drop {flag}")


def at_least_one(**flags: int | None) -> None:
    """Refuse an integer flag below 1 (``None``: not given); keyword names are the flags, ``_`` for ``-``."""
    for name, value in flags.items():
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: use an integer >= 1")


def at_most(limit: int, **flags: int | None) -> None:
    """Refuse an integer flag above ``limit`` (sizes no machine or batch has); names as in :func:`at_least_one`."""
    for name, value in flags.items():
        if value is not None and value > limit:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: more than any run uses; give at most {limit}")


def share(flag: str, value: float) -> None:
    """Refuse a share of peak (efficiency) outside (0, 1]."""
    if not 0 < value <= 1:
        raise ConfigError(f"{flag} {value}: use a value in (0, 1]")


def excludes(command: str, flag: str, given: bool, other: str, present: bool) -> None:
    """Refuse ``flag`` together with ``other`` (they say the same thing two ways)."""
    if given and present:
        raise ConfigError(f"{command}: {flag} and {other} both set the same thing; give one of them")
