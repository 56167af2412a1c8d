"""A flag or ``--config.x.y=v`` override given twice is refused in one line naming it, both values and
the fix (argparse alone keeps the last one silently); list flags (``action="append"``) stay repeatable.

The tables come from the parsers themselves: every flag of every subcommand is given twice, so a flag
added later is covered without a new case.
"""

from __future__ import annotations

import argparse

import pytest

from jaxpar.cli import build_parser
from jaxpar.cli.common import LIST_ACTIONS
from jaxpar.errors import ConfigError
from tests.fuzzkit import cli_refused, run_cli

# what each subcommand needs besides the flag under test (positionals, required flags)
BASE = {
    "port": ["port", "deepspeed", "ds.json"],
    "compare": ["compare", "--layout", "data=8"],
    "export": ["export", "-o", "out"],
}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _value(action: argparse.Action, second: bool = False) -> list[str]:
    """A value the flag's type and choices accept (another one for the second time, where there is one)."""
    if action.nargs == 0:
        return []
    if action.choices:
        choices = list(action.choices)
        return [str(choices[min(int(second), len(choices) - 1)])]
    if action.dest in ("layout", "layouts"):
        return ["data=8" if not second else "data=4"]
    return ["2" if second else "1"]


def _flags(list_flags: bool) -> list[tuple[str, str, argparse.Action]]:
    out = []
    for command, parser in _subparsers().items():
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, LIST_ACTIONS) == list_flags:
                out.append((command, action.option_strings[-1], action))
    return out


def _argv(command: str, flag: str, action: argparse.Action) -> list[str]:
    base = list(BASE.get(command, [command]))
    for option in set(action.option_strings) & set(base):  # a required flag under test: only its two here
        base[base.index(option) : base.index(option) + 2] = []
    return [*base, flag, *_value(action), flag, *_value(action, second=True)]


SCALAR = _flags(list_flags=False)
LISTS = _flags(list_flags=True)


def test_the_tables_cover_every_subcommand_and_the_list_flags():
    assert {c for c, _, _ in SCALAR} == set(_subparsers())
    assert {(c, f) for c, f, _ in LISTS} == {
        ("port", "--var"),
        ("port", "--set"),
        ("compare", "--layout"),
        ("sweep", "--only"),
    }


@pytest.mark.parametrize("command, flag, action", SCALAR, ids=[f"{c} {f}" for c, f, _ in SCALAR])
def test_a_scalar_flag_given_twice_is_refused_at_parse_time(command, flag, action):
    argv = _argv(command, flag, action)
    with pytest.raises(ConfigError) as caught:
        build_parser().parse_args(argv)
    message = str(caught.value)
    assert "\n" not in message and f"{flag} given twice" in message and "once" in message, message
    for value in (*_value(action), *_value(action, second=True)):
        assert value in message, message


@pytest.mark.parametrize("command, flag, action", LISTS, ids=[f"{c} {f}" for c, f, _ in LISTS])
def test_a_list_flag_given_twice_keeps_both_values(command, flag, action):
    argv = _argv(command, flag, action)
    args = build_parser().parse_args(argv)
    kept = getattr(args, action.dest)
    assert kept[-2:] == [*_value(action), *_value(action, second=True)], kept


# through the CLI: exit code 2 and one line on stderr, for every subcommand (one scalar flag each) and
# an override given twice (port takes none: it says so instead)
CLI = [
    ("train", ["train", "--no-progress", "--no-progress"], "--no-progress given twice"),
    ("inspect", ["inspect", "--json", "--ops", "--json"], "--json given twice"),
    ("plan", ["plan", "--top", "3", "--top", "5"], "--top given twice (--top 3, then --top 5)"),
    ("compare", ["compare", "--layout", "data=8", "--seq", "64", "--seq", "128"], "--seq given twice"),
    ("sweep", ["sweep", "--list", "--devices", "2", "--devices", "4"], "--devices given twice"),
    ("port", ["port", "deepspeed", "ds.json", "--world-size", "8", "--world-size", "16"], "--world-size given"),
    ("export", ["export", "-o", "a", "--output", "b"], "-o / --output given twice (-o a, then --output b)"),
    ("drill", ["drill", "--trials", "1", "--trials", "2"], "--trials given twice"),
    ("plan --layout", ["plan", "--layout", "data=8", "--layout", "data=4"], "--layout given twice"),
    ("plan --no-x", ["plan", "--sequence-parallel", "--no-sequence-parallel"], "--no-sequence-parallel given twice"),
    ("abbreviated", ["sweep", "--dev", "2", "--devices", "4"], "--devices given twice (--devices 2, then"),
    *(
        (
            f"{command} override",
            [*BASE.get(command, [command]), "--config.train.steps=5", "--config.train.steps=7"],
            "--config.train.steps given twice (--config.train.steps=5, then --config.train.steps=7); "
            "give --config.train.steps once",
        )
        for command in ("train", "inspect", "plan", "compare", "sweep", "export", "drill")
    ),
    ("drill's own workdir", ["drill", "--config.train.workdir=x"], "the drill puts its two runs under --workdir"),
    ("port override", ["port", "deepspeed", "ds.json", "--config.a.b=1", "--config.a.b=2"], "use --set a.b=VALUE"),
]


@pytest.mark.parametrize("argv, words", [c[1:] for c in CLI], ids=[c[0] for c in CLI])
def test_the_cli_refuses_a_repeat_in_one_line(argv, words):
    line = cli_refused("repeated flags", argv)
    assert words in line, line


def test_the_list_flags_still_run_when_repeated():
    code, out, err = run_cli(["sweep", "--list", "--devices", "2", "--only", "1f1b", "--only", "v2"])
    assert code == 0 and out.split() == ["d1t1p2-z0-1f1b-m4", "d1t1p2v2-z0-interleaved-m4"], err
