"""What ``jaxpar port`` does with each recipe of the corpus (tests/fixtures/recipes/corpus), counted.

Every recipe is ported once, in-process, with the user's inputs of
``tests/fixtures/recipes/corpus/expected.json`` (``args``: world sizes, shell variables, "auto"
values) and ``--json``, and classified:

* ``exit 2``            -- refused with one line;
* ``exit 0 toy``        -- exit 0, but every shape field (layers, width, heads, kv heads, head dim,
  MLP, vocabulary) is jaxpar's default: the 4-layer test model, not the recipe's;
* ``exit 0 faithful``   -- exit 0, no ``unsupported``/``unknown`` row and no model change;
* ``exit 0 approximated`` -- exit 0 with ``unsupported``/``unknown`` rows (disclosed approximations).

``wrong`` counts exit-0 ports whose config differs from a value ``expected.json`` states (read from
the recipe), and ``as expected`` the recipes whose exit code (and error or values) match it.

Usage (from anywhere; the ``jaxpar`` imported is the one on PYTHONPATH, so another checkout's code can
be measured on this corpus)::

    PYTHONPATH=/work/wt28 python /work/wt28/experiments/port_recipes.py [--table]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "fixtures" / "recipes" / "corpus"
KIND = {"megatron": "megatron", "megatron_deepspeed": "megatron", "torchtitan": "torchtitan", "accelerate": "fsdp"}
SHAPE = ("num_layers", "embed_dim", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "vocab_size")


def kind(file: str) -> str:
    """The ``jaxpar port`` kind of a corpus file (``megatron/x.sh``)."""
    return "deepspeed" if file.endswith(".json") else KIND[file.split("/")[0]]


def run(argv: list[str]) -> tuple[int, str, str]:
    """``jaxpar ARGV`` in-process: (exit code, stdout, stderr)."""
    from jaxpar.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse: an option this jaxpar does not have
            code = e.code if isinstance(e.code, int) else 2
    return code, out.getvalue(), err.getvalue()


def lookup(config: dict, key: str):
    node = config
    for part in key.split("."):
        node = node[part]
    return node


def classify(row: dict) -> dict:
    """Port one corpus recipe as ``row`` says; its class, first error line and differences from ``row``."""
    from jaxpar.config import default_config

    file = str(CORPUS / row["file"])
    code, out, err = run(["port", kind(row["file"]), file, *row["args"], "--json"])
    result = {"file": row["file"], "exit": code, "error": (err.strip().splitlines() or [""])[0], "wrong": []}
    if code != 0:
        result["class"] = f"exit {code}"
        result["as_expected"] = code == row["exit"] and bool(re.search(row.get("error", ""), result["error"]))
        return result
    doc = json.loads(out)
    config, report = doc["config"], doc["report"]
    defaults = default_config().to_dict()["model"]
    toy = all(config["model"][f] == defaults[f] for f in SHAPE)
    approximations = (
        report["counts"]["unsupported"] + report["counts"]["unknown"] + len(report.get("model_changes", []))
    )
    result["class"] = "exit 0 toy" if toy else "exit 0 approximated" if approximations else "exit 0 faithful"
    for key, want in row.get("expect", {}).items():
        got = lookup(config, key)
        if got != want and not (isinstance(want, float) and abs(got - want) <= 1e-9 * abs(want)):
            result["wrong"].append(f"{key}={got!r} (recipe: {want!r})")
    result["as_expected"] = row["exit"] == 0 and not result["wrong"] and not toy
    return result


CLASSES = ("exit 0 faithful", "exit 0 approximated", "exit 0 toy", "exit 2")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", action="store_true", help="print one line per recipe")
    args = parser.parse_args(argv)
    rows = json.loads((CORPUS / "expected.json").read_text())["recipes"]
    results = [classify(row) for row in rows]
    if args.table:
        for r in results:
            tail = "; ".join(r["wrong"]) if r["wrong"] else r["error"][:150]
            mark = "" if r["as_expected"] else "  [NOT AS EXPECTED]"
            print(f"{r['class']:<20} {r['file']:<56} {tail}{mark}")
    counts = {c: sum(r["class"] == c for r in results) for c in CLASSES}
    other = len(results) - sum(counts.values())
    wrong = sum(bool(r["wrong"]) for r in results)
    expected = sum(r["as_expected"] for r in results)
    print(
        f"{len(results)} recipes: "
        + ", ".join(f"{c}: {n}" for c, n in counts.items())
        + (f", other exit: {other}" if other else "")
        + f"; exit 0 with a value differing from the recipe: {wrong}; as expected.json says: {expected}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
