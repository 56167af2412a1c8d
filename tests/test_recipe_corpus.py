"""The corpus of real recipes (``tests/fixtures/recipes/corpus``): verbatim files from public
repositories, each listed in ``manifest.json`` with its repository, path, commit and sha256, and in
``expected.json`` with what ``jaxpar port`` must do with it, written by reading the recipe: the exit
code with the user's inputs, the one-line error's reason for an exit 2, and for an exit 0 the mesh
sizes, ZeRO stage, batch, precision and model shape the recipe states. An exit 0 is a promise that
the config trains the recipe's model: no exit 0 here may carry a model change or jaxpar's default
(toy) model, and each states the recipe's shape. Where the recipe's model is not jaxpar's, ``approximate`` checks the same port
with ``--approximate``: exit 0, the model changes listed first, and the rest of the recipe's values.

Rows with ``xfail`` are known shortfalls of the importers, strict: they fail the suite once fixed, so
the mark comes off.
``experiments/port_recipes.py`` counts the outcomes.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import re

import pytest

from jaxpar.cli import main
from jaxpar.config import default_config, load_config
from jaxpar.port.report import SHAPE_FIELDS
from tests.helpers import ROOT

CORPUS = ROOT / "tests" / "fixtures" / "recipes" / "corpus"
MANIFEST = json.loads((CORPUS / "manifest.json").read_text())
EXPECTED = json.loads((CORPUS / "expected.json").read_text())["recipes"]
KIND = {"megatron": "megatron", "megatron_deepspeed": "megatron", "torchtitan": "torchtitan", "accelerate": "fsdp"}
# what every exit 0 must state (the rest where the recipe states it: precision, sequence, schedule, ...)
REQUIRED = ("mesh.data", "mesh.tensor", "mesh.pipeline", "parallel.zero_stage", "train.global_batch", *SHAPE_FIELDS)


def test_manifest_lists_every_file_with_its_source():
    files = {str(p.relative_to(ROOT)) for p in CORPUS.glob("*/*") if p.is_file()}
    assert files == {row["file"] for row in MANIFEST}
    assert len(files) >= 40
    for row in MANIFEST:
        assert re.fullmatch(r"[0-9a-f]{40}", row["commit"]), row
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", row["repo"]), row
        assert hashlib.sha256((ROOT / row["file"]).read_bytes()).hexdigest() == row["sha256"], row["file"]
        assert row["path"] in (CORPUS / "SOURCES.md").read_text()


def test_every_recipe_has_its_expected_outcome():
    assert [f"tests/fixtures/recipes/corpus/{row['file']}" for row in EXPECTED] == [row["file"] for row in MANIFEST]
    for row in EXPECTED:
        assert row["exit"] in (0, 2) and row["reading"], row["file"]
        if row["exit"] == 2:
            assert row["error"] and "expect" not in row, row["file"]
        else:
            assert set(REQUIRED) <= set(row["expect"]), (row["file"], set(REQUIRED) - set(row["expect"]))
        if "approximate" in row:
            assert row["exit"] == 2 and row["approximate"]["changes"], row["file"]
            assert {"mesh.data", "parallel.zero_stage"} <= set(row["approximate"]["expect"]), row["file"]


def _kind(file: str) -> str:
    return "deepspeed" if file.endswith(".json") else KIND[file.split("/")[0]]


def _port(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["port", *argv])
    return code, out.getvalue(), err.getvalue()


def _value(cfg, key: str):
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _check_values(cfg, expect: dict, file: str) -> None:
    wrong = {
        key: (_value(cfg, key), want)
        for key, want in expect.items()
        if not (
            _value(cfg, key) == want or (isinstance(want, float) and math.isclose(_value(cfg, key), want, rel_tol=1e-9))
        )
    }
    assert not wrong, f"{file}: (ported, recipe) {wrong}"


def _params(with_approximate: bool = False) -> list:
    rows = [r for r in EXPECTED if "approximate" in r] if with_approximate else EXPECTED
    return [
        pytest.param(
            row,
            id=row["file"],
            marks=[pytest.mark.xfail(strict=True, reason=row["xfail"])] if "xfail" in row else [],
        )
        for row in rows
    ]


@pytest.mark.parametrize("row", _params())
def test_port_does_what_the_recipe_says(row, tmp_path):
    """The recipe's exit code; an exit 2 in one line naming the reason; an exit 0 with the recipe's values,
    its model (no shape field left at jaxpar's default, no model change) and a config that loads."""
    out = tmp_path / "out.py"
    code, printed, err = _port([_kind(row["file"]), str(CORPUS / row["file"]), *row["args"], "--json", "-o", str(out)])
    assert "Traceback" not in err
    if row["exit"] == 2:
        assert code == 2, f"{row['file']}: exit {code}, expected a refusal: {row['error']}"
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
        assert re.search(row["error"], err), f"{row['file']}: {err.strip()} does not say {row['error']!r}"
        assert not out.exists()
        return
    assert code == 0, f"{row['file']}: {err.strip()}"
    report = json.loads(printed[: printed.rindex("}") + 1])["report"]
    assert report["model_changes"] == [] and report["closing"].startswith("model: the recipe's"), report["closing"]
    cfg = load_config(str(out))
    defaults = default_config()
    assert any(_value(cfg, f) != _value(defaults, f) for f in SHAPE_FIELDS), "exit 0 with jaxpar's default model"
    _check_values(cfg, row["expect"], row["file"])


@pytest.mark.parametrize("row", _params(with_approximate=True))
def test_approximate_lists_the_model_changes_first(row, tmp_path):
    """With --approximate the refused recipe ports: its model changes are the first rows, the closing line
    says the model changed, and everything else is the recipe's."""
    approx = row["approximate"]
    out = tmp_path / "out.py"
    argv = [_kind(row["file"]), str(CORPUS / row["file"]), *row["args"], *approx["args"], "--approximate"]
    code, printed, err = _port([*argv, "-o", str(out)])
    assert code == 0, err
    lines = printed.splitlines()
    changes = approx["changes"]
    assert [line.split(" = ")[0].removeprefix("  MODEL CHANGE ").strip() for line in lines[1 : 1 + len(changes)]] == (
        changes
    ), printed
    assert not lines[1 + len(changes)].startswith("  MODEL CHANGE")
    assert f"MODEL CHANGED ({len(changes)}: {', '.join(changes)})" in printed
    assert "MODEL CHANGED" in out.read_text()  # the written config says so too
    _check_values(load_config(str(out)), approx["expect"], row["file"])
