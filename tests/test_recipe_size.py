"""The recipe readers are linear in their input: a recipe of thousands of unknown keys (each importer),
an unclosed bash array, a long backslash-continued command and a deeply nested YAML end in a report or
one line. The default cases are small and assert the outcome; ``JAXPAR_SLOW=1`` fills each recipe to
just under the 1 MiB recipe cap (measured 0.1-3.4 s each, input generation included, in one process on 2 shared cores; before the
fixes: DeepSpeed 106 s, the unclosed array 56 s, YAML 21 s through ``jaxpar port``) and bounds the time."""

from __future__ import annotations

import json
import time

import pytest

from jaxpar.errors import ConfigError
from jaxpar.files import CAPS, load_yaml
from jaxpar.port.bash import Shell, launch_flags
from jaxpar.port.report import SUGGESTED, Report
from tests.fuzzkit import FULL, bounded
from tests.test_fuzz_recipes import SEEDS, SUFFIX, _port

SLOW_BOUND_S = 60  # generous: each case measured at most 3.4 s on 2 shared cores


def _unknown_keys(kind: str, n: int) -> str:
    """The seed recipe of ``kind`` with ``n`` unknown keys (flags) added."""
    if kind == "deepspeed":
        return json.dumps({**json.loads(SEEDS[kind]), **{f"unknown_key_{i}": i for i in range(n)}})
    if kind == "fsdp":
        return SEEDS[kind] + "".join(f"unknown_key_{i}: {i}\n" for i in range(n))
    if kind == "torchtitan":
        return "".join(f"unknown_key_{i} = {i}\n" for i in range(n)) + SEEDS[kind]
    return SEEDS[kind] + "\n" + "".join(f"--unknown-flag-{i} {i}\n" for i in range(n))


def _count_to_fill(make, cap: int) -> int:
    """The largest count whose text stays under ``cap`` bytes (linear in the count: bisect)."""
    lo, hi = 1, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(make(mid).encode()) <= cap else (lo, mid - 1)
    return lo


@pytest.mark.parametrize("kind", sorted(SEEDS))
def test_a_recipe_of_many_unknown_keys_ports_in_linear_time(kind, tmp_path):
    make = lambda n: _unknown_keys(kind, n)  # noqa: E731
    n = _count_to_fill(make, CAPS["recipe"] - 1000) if FULL else 2000
    path = tmp_path / f"big{SUFFIX[kind]}"
    path.write_text(make(n))
    start = time.monotonic()
    with bounded(SLOW_BOUND_S):
        _cfg, report = _port(kind, path)
    elapsed = time.monotonic() - start
    unknown = [e for e in report.entries if e.status == "unknown"]
    assert len(unknown) == n
    assert {e.source.rsplit("_", 1)[-1].rsplit("-", 1)[-1] for e in unknown} == {str(i) for i in range(n)}
    if FULL:
        assert elapsed < SLOW_BOUND_S, f"{kind}: {n} unknown keys took {elapsed:.1f} s"


def _megatron(text: str):
    return launch_flags(text, Shell({}))


def test_an_unclosed_bash_array_is_one_line():
    lines = 40_000 if FULL else 2000
    text = "GPUS=8\nARGS=(\n" + "".join(f"  --flag-{i} {i}\n" for i in range(lines))
    start = time.monotonic()
    with bounded(SLOW_BOUND_S), pytest.raises(ConfigError) as e:
        _megatron(text)
    assert str(e.value) == (
        "megatron: line 2: the array ARGS=( is never closed (bash: unexpected end of file); add its closing ')'"
    )
    if FULL:
        assert time.monotonic() - start < SLOW_BOUND_S


def test_a_closed_array_over_many_lines_keeps_every_word():
    text = "ARGS=(\n" + "".join(f"  --flag-{i} {i}\n" for i in range(500)) + ")\npython pretrain_gpt.py ${ARGS[@]}\n"
    flags, stray, _ = _megatron(text)
    assert flags == [(f"--flag-{i}", [str(i)]) for i in range(500)] and stray == []


def test_a_long_continued_command_keeps_every_flag_and_its_line():
    n = 30_000 if FULL else 1000
    text = "\n\npython pretrain_gpt.py \\\n" + "".join(f"  --flag-{i} {i} \\\n" for i in range(n)) + "  --last 1\n"
    start = time.monotonic()
    with bounded(SLOW_BOUND_S):
        flags, stray, _ = _megatron(text)
    assert flags == [*((f"--flag-{i}", [str(i)]) for i in range(n)), ("--last", ["1"])] and stray == []
    if FULL:
        assert time.monotonic() - start < SLOW_BOUND_S


@pytest.mark.parametrize("depth", [101, 100_000])
def test_deep_yaml_nesting_is_one_line(depth):
    with bounded(SLOW_BOUND_S), pytest.raises(ConfigError) as e:
        load_yaml("a: " + "[" * depth + "]" * depth, "fsdp")
    assert (
        str(e.value)
        == "fsdp: the YAML nests more than 100 levels deep (line 1); a config needs a few, write it flatter"
    )


def test_yaml_nested_100_levels_loads():
    assert load_yaml("a: " + "[" * 99 + "1" + "]" * 99, "fsdp")["a"] == eval("[" * 99 + "1" + "]" * 99)  # noqa: S307


def test_only_the_first_unknown_keys_get_a_suggestion():
    report = Report("deepspeed")
    for i in range(SUGGESTED + 5):
        report.unknown(f"train_batch_sizee{i}", i, ["train_batch_size"], "DeepSpeed")
    hinted = [e for e in report.entries if e.note.startswith("did you mean 'train_batch_size'?")]
    assert len(report.entries) == SUGGESTED + 5 and hinted == report.entries[:SUGGESTED]
