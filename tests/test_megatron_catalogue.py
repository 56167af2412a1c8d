"""Every option of Megatron-LM's parser (megatron/training/arguments.py at a pinned commit) has its
class in ``tests/fixtures/catalogue/megatron_lm.json``, and ``jaxpar port megatron`` gives each that
class today (:mod:`tests.megatron_catalogue`; regenerate with ``experiments/megatron_catalogue.py``
when an importer change moves one). ``unclassified`` rows are real options the importer still calls
"unknown": the gap the catalogue makes visible."""

from __future__ import annotations

import collections
import json

from tests.megatron_catalogue import probe
from tests.port_recipes import ROOT

CATALOGUE = json.loads((ROOT / "tests" / "fixtures" / "catalogue" / "megatron_lm.json").read_text())
CLASSES = ("mapped", "approximated", "no-effect", "refused", "unclassified")


def test_catalogue_is_the_pinned_parser():
    src = CATALOGUE["source"]
    assert (src["repo"], src["path"], src["commit"]) == (
        "NVIDIA/Megatron-LM",
        "megatron/training/arguments.py",
        "e70f83123f31cb432fcecb50848126bd245f3005",
    )
    rows = CATALOGUE["options"]
    assert len(rows) == 306 and len({r["option"] for r in rows}) == 306
    assert {r["class"] for r in rows} <= set(CLASSES)
    assert CATALOGUE["counts"] == dict(sorted(collections.Counter(r["class"] for r in rows).items()))


def test_every_option_gets_its_class():
    wrong = {}
    for row in CATALOGUE["options"]:
        got = probe(row["option"], row["value"])[0]
        if got != row["class"]:
            wrong[row["option"]] = (got, row["class"])
    assert not wrong, f"(port says, catalogue says): {wrong}; rerun experiments/megatron_catalogue.py if intended"
