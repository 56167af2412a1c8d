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
    # every real option is classed: none left as "unknown" (a setting the port would call "not a setting")
    assert CATALOGUE["counts"] == {"approximated": 18, "mapped": 61, "no-effect": 188, "refused": 39}


def test_settings_that_change_training_are_refused_not_ignored():
    """Options that change what is trained are refused by name: document masking and a RETRO retriever as
    model changes, fp8 and separate data paths as unsupported rows; a dead alias Megatron stops on too."""
    rows = {r["option"]: r for r in CATALOGUE["options"]}
    for option in ("--eod-mask-loss", "--reset-attention-mask", "--retro-add-retriever", "--fp8-interval"):
        assert rows[option]["class"] == "refused", option
    assert probe("--reset-position-ids", "")[1].startswith("positions restart after each end-of-document token")
    assert probe("--train-data-path", "x") == (
        "refused",
        "no separate train/valid/test datasets; set data.path to one Megatron prefix",
    )
    assert probe("--batch-size", "4")[1].startswith("Megatron-LM stops on it")
    assert probe("--dino-teacher-temp", "0.07")[0] == "no-effect"


def test_every_option_gets_its_class():
    wrong = {}
    for row in CATALOGUE["options"]:
        got = probe(row["option"], row["value"])[0]
        if got != row["class"]:
            wrong[row["option"]] = (got, row["class"])
    assert not wrong, f"(port says, catalogue says): {wrong}; rerun experiments/megatron_catalogue.py if intended"
