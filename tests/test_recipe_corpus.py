"""The corpus of real recipes (``tests/fixtures/recipes/corpus``): verbatim files from public
repositories, each listed in ``manifest.json`` with its repository, path, commit and sha256, and
every one met by ``jaxpar port`` with exit 0 or a one-line exit-2 error, never a traceback.

What each port gives is recorded in ``experiments/results/2026-12-04-recipe-corpus/outcomes.md``;
whether each exit 0 is faithful is issue 28's work, not asserted here.
"""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from jaxpar.cli import main
from tests.helpers import ROOT

CORPUS = ROOT / "tests" / "fixtures" / "recipes" / "corpus"
MANIFEST = json.loads((CORPUS / "manifest.json").read_text())
KIND = {"megatron": "megatron", "megatron_deepspeed": "megatron", "torchtitan": "torchtitan", "accelerate": "fsdp"}


def test_manifest_lists_every_file_with_its_source():
    files = {str(p.relative_to(ROOT)) for p in CORPUS.glob("*/*") if p.is_file()}
    assert files == {row["file"] for row in MANIFEST}
    assert len(files) >= 40
    for row in MANIFEST:
        assert re.fullmatch(r"[0-9a-f]{40}", row["commit"]), row
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", row["repo"]), row
        assert hashlib.sha256((ROOT / row["file"]).read_bytes()).hexdigest() == row["sha256"], row["file"]
        assert row["path"] in (CORPUS / "SOURCES.md").read_text()


def _kind(row: dict) -> str:
    return "deepspeed" if row["file"].endswith(".json") else KIND[row["format"]]


@pytest.mark.parametrize("row", MANIFEST, ids=lambda r: r["file"].removeprefix("tests/fixtures/recipes/corpus/"))
def test_port_ends_cleanly(row, tmp_path, capsys):
    code = main(["port", _kind(row), str(ROOT / row["file"]), "-o", str(tmp_path / "out.py")])
    err = capsys.readouterr().err.strip()
    assert code in (0, 2), (code, err)
    assert "Traceback" not in err
    if code == 2:
        assert len(err.splitlines()) == 1 and err.startswith("error: "), err
