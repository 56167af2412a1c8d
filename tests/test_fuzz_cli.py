"""Fuzz: generated bad values for every flag of every subcommand, run through ``jaxpar.cli.main`` in
this process. Each case must exit 2 with one ``error:`` line, or (only where the value is in the
flag's domain, listed in ``VALID``) exit 0 with well-formed output; never exit 1 (internal error),
never a hang (a time bound per case).

Flags are read from the parser itself, so a new flag is fuzzed without editing this file; a
subcommand without a base command line below fails :func:`test_every_subcommand_has_a_base`.
"""

from __future__ import annotations

import argparse
import json

import pytest

from jaxpar.cli import build_parser
from tests import fuzzkit
from tests.fuzzkit import COUNTS, run_cli
from tests.test_fuzz_recipes import SEEDS

NUMBERS = ["abc", "1.5", "", "9" * 30, "9" * 5000, "-1", "0", "nan", "inf", "-inf", "1e308", "0x10", "\u00b2"]
STRINGS = ["", "/nonexistent/path", "@DIR", "@BINARY", "@EMPTY", "bad\x00byte", "-", "x" * 5000]
# (subcommand, flag, value) whose run is correct: the value lies in the flag's domain.
VALID = {
    ("plan", "--top", "9" * 30),
    ("plan", "--headroom", "0"),
    ("plan", "--zero", "0"),
    ("compare", "--headroom", "0"),
    ("drill", "--seed", "0"),
    ("drill", "--seed", "-1"),
    ("drill", "--seed", "9" * 30),
    ("drill", "--seed", "0x10"),
    # port -o replaces an existing file (its overwrite rule is another change's); "-" is a file name
    ("port", "--output", "@BINARY"),
    ("port", "--output", "@EMPTY"),
    ("port", "--output", "-"),
}


def _bases(tmp_path) -> dict[str, list[str]]:
    """A command line per subcommand that runs in well under a second (drill and export end in a
    one-line refusal that has nothing to do with the fuzzed flag: they would train otherwise)."""
    recipe = tmp_path / "ds.json"
    recipe.write_text(SEEDS["deepspeed"])
    return {
        "train": ["train", "--config.train.eval_batches=-1"],  # refused after the flags are read
        "inspect": ["inspect", "--json", "--config.model.head_dim=31"],
        "plan": ["plan", "--json"],
        "compare": ["compare", "--json", "--layout", "data=8", "--layout", "data=4,tensor=2"],
        "port": ["port", "deepspeed", str(recipe), "--json", "--world-size", "8"],
        "export": ["export", "-o", str(tmp_path / "out"), f"--config.train.workdir={tmp_path / 'empty'}"],
        "drill": ["drill", "--config.checkpoint.every=0", f"--workdir={tmp_path / 'drill'}"],
        "sweep": ["sweep", "--list"],  # lists layouts from the planner, compiles nothing
    }


def _flags() -> list[tuple[str, argparse.Action]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [
        (name, action)
        for name, p in sub.choices.items()
        for action in p._actions
        if action.option_strings and action.nargs != 0 and not isinstance(action, argparse._HelpAction)
    ]


def _value(text: str, tmp_path) -> str:
    special = {"@DIR": tmp_path, "@BINARY": tmp_path / "binary.bin", "@EMPTY": tmp_path / "empty.txt"}
    (tmp_path / "binary.bin").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "empty.txt").write_text("")
    return str(special.get(text, text))


def test_every_subcommand_has_a_base(tmp_path):
    assert {name for name, _ in _flags()} | {"train"} == set(_bases(tmp_path))


def _cases(tmp_path) -> list[tuple[str, str, str]]:
    out = []
    for name, action in _flags():
        values = NUMBERS if action.type in (int, float) else ["bogus", ""] if action.choices else STRINGS
        out += [(name, action.option_strings[-1], v) for v in values]
    return out


@pytest.mark.parametrize("part", range(3))
def test_bad_flag_values_exit_2_in_one_line(tmp_path, part, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative path a case writes lands here
    bases = _bases(tmp_path)
    cases = fuzzkit.sample("cli: flag values", _cases(tmp_path), 60)[part::3]
    for name, flag, text in cases:
        argv = [*bases[name], flag, _value(text, tmp_path)]
        if (name, flag, text) in VALID:
            COUNTS["cli: flag values (valid)"] += 1
            code, out, err = run_cli(argv)
            assert code == 0 or (code == 2 and err.count("\n") == 1 and err.startswith("error: ")), (argv, err)
            if code == 0 and "--json" in argv:
                json.loads(out)
            continue
        fuzzkit.cli_refused(f"cli: flag values ({name})", argv)


def test_unknown_and_repeated_flags(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bases = _bases(tmp_path)
    for base in bases.values():
        fuzzkit.cli_refused("cli: unknown flag", [*base, "--no-such-flag"])
        fuzzkit.cli_refused("cli: unknown override key", [*base, "--config.model.embed_dimm=8"])
    fuzzkit.cli_refused("cli: unknown flag", ["bogus-command"])
    fuzzkit.cli_refused("cli: unknown flag", [])
