"""What every subcommand shares: the argparse class, the default config, flag checks. Bad flags
are user errors like bad config fields: a one-line :class:`~jaxpar.config.ConfigError` (exit 2)."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

from jaxpar.config import ConfigDict, ConfigError, default_config, flatten

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CONFIG = os.path.join(ROOT, "configs", "tiny.py")


# flags that take several values by design (``action="append"``...): given again, they add one
LIST_ACTIONS = (
    argparse._AppendAction,
    argparse._AppendConstAction,
    argparse._CountAction,
    argparse._HelpAction,
    argparse._VersionAction,
)


class Parser(argparse.ArgumentParser):
    """argparse that reports bad flags in one line (a ConfigError: exit code 2) instead of exiting, and
    refuses a flag given twice (argparse would keep the last value) unless it is a list flag."""

    def error(self, message: str) -> None:  # noqa: D102
        raise ConfigError(f"{self.prog}: {message} (see --help)")

    def add_argument(self, *args, **kwargs):  # noqa: D102
        action = super().add_argument(*args, **kwargs)
        if action.option_strings and not isinstance(action, LIST_ACTIONS):
            action.__class__ = _given_once(type(action))
        return action

    def parse_known_args(self, args=None, namespace=None):  # noqa: D102
        self.given: dict[str, tuple[str, str]] = {}  # dest -> (option, flag and value) as first given
        return super().parse_known_args(args, namespace)


def _shown(option_string: str | None, values) -> str:
    """A flag as the user gave it: ``--steps 3``, ``--json``."""
    if isinstance(values, list):
        values = " ".join(str(v) for v in values)
    return f"{option_string} {values}".strip() if values not in (None, "") else str(option_string)


@functools.cache
def _given_once(cls: type) -> type:
    """``cls`` that raises a ConfigError the second time its flag (or another flag of its dest) is given."""

    class Once(cls):
        def __call__(self, parser, namespace, values, option_string=None):
            given = getattr(parser, "given", None)
            if given is None:  # a parser of another class
                return super().__call__(parser, namespace, values, option_string)
            now = (option_string, _shown(option_string, [] if self.nargs == 0 else values))
            if self.dest in given:
                first = given[self.dest]
                flag = option_string if first[0] == option_string else " / ".join(self.option_strings)
                raise ConfigError(f"{parser.prog}: {flag} given twice ({first[1]}, then {now[1]}); give {flag} once")
            given[self.dest] = now
            return super().__call__(parser, namespace, values, option_string)

    Once.__name__ = Once.__qualname__ = f"Once{cls.__name__}"
    return Once


def refuse_repeated_overrides(command: str, items: list[str]) -> None:
    """A ``--config.x.y=v`` key given twice is a one-line ConfigError (the last would win silently)."""
    seen: dict[str, str] = {}
    for item in items:
        key = item.partition("=")[0]
        if key in seen:
            raise ConfigError(f"jaxpar {command}: {key} given twice ({seen[key]}, then {item}); give {key} once")
        seen[key] = item


def _override_key(item: str) -> str:
    return item.partition("=")[0].removeprefix("--").removeprefix("config.")


def refuse_flag_and_override(command: str, flags: dict[str, tuple[Any, str]], items: list[str]) -> None:
    """A flag (``name -> (value, None when not given; the config field it sets)``) and a ``--config``
    override of the same field in one command: a one-line ConfigError naming both."""
    given = {_override_key(item): item for item in items}
    for flag, (value, field) in flags.items():
        if value is not None and field in given:
            raise ConfigError(f"{command}: {flag} and {given[field]} both set {field}; give one of them")


def refuse_unread_overrides(command: str, items: list[str], unread: dict[str, str]) -> None:
    """A ``--config`` override of a field ``command`` does not read (``unread``: a field or a section,
    ``section.``, -> what to give instead): a one-line ConfigError, never silently ignored."""
    for item in items:
        key = _override_key(item)
        for field, instead in unread.items():
            if key == field or (field.endswith(".") and key.startswith(field)):
                raise ConfigError(f"{command}: {item}: {command} does not read {key}; {instead}")


def unread_notes(command: str, cfg: ConfigDict, unread: dict[str, str], why: str) -> list[str]:
    """A ``note:`` line naming the fields of ``unread`` (as in :func:`refuse_unread_overrides`) that the
    config file sets away from their defaults: ``command`` does not read them, and says so."""
    default, mine = flatten(default_config().to_dict()), flatten(cfg.to_dict())
    keys = [k for k in mine if any(k == f or (f.endswith(".") and k.startswith(f)) for f in unread)]
    changed = [f"{k}={mine[k]}" for k in keys if mine[k] != default[k]]
    return [f"{command}: note: not used from the config ({why}): {', '.join(changed)}"] if changed else []


def override_notes(command: str, flags: dict[str, tuple[Any, str]], cfg: ConfigDict) -> list[str]:
    """A ``note:`` line per flag of ``flags`` (as in :func:`refuse_flag_and_override`) that replaces a
    different value of the config file's: the flag wins, and the command says so."""
    mine = flatten(cfg.to_dict())
    return [
        f"{command}: note: {flag} {value} replaces the config's {field}={mine[field]}"
        for flag, (value, field) in flags.items()
        if value is not None and mine[field] != value
    ]


def print_notes(notes: list[str]) -> None:
    """The notes on stderr, once the command got past its checks (a refusal stays one line)."""
    for line in notes:
        print(line, file=sys.stderr)


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
