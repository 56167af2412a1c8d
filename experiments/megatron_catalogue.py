"""Write ``tests/fixtures/catalogue/megatron_lm.json``: every option of Megatron-LM's argument parser
at a pinned commit, with a sample value and the class ``jaxpar port megatron`` gives it
(:mod:`tests.megatron_catalogue`). The parser is read with :mod:`ast` (nothing of Megatron is
imported); a sample value is the base recipe's, else the option's first choice, else its default, else
2 / 0.5 / x by type.

    git -C Megatron-LM show e70f83123f31cb432fcecb50848126bd245f3005:megatron/training/arguments.py > /tmp/a.py
    PYTHONPATH=. python experiments/megatron_catalogue.py /tmp/a.py e70f83123f31cb432fcecb50848126bd245f3005
"""

from __future__ import annotations

import ast
import collections
import json
import pathlib
import sys

from tests.megatron_catalogue import BASE, probe

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "catalogue" / "megatron_lm.json"


def _sample(kw: dict[str, ast.expr]) -> str:
    if "choices" in kw:
        try:
            return str(ast.literal_eval(kw["choices"])[0])
        except (ValueError, TypeError, IndexError):
            pass
    if "default" in kw:
        try:
            default = ast.literal_eval(kw["default"])
        except ValueError:
            default = None
        if isinstance(default, (list, tuple)):
            default = " ".join(map(str, default)) or None
        if default is not None:
            return str(default)
    return {"int": "2", "float": "0.5"}.get(getattr(kw.get("type"), "id", "str"), "x")


def options(source: str) -> list[dict[str, str]]:
    rows = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"):
            continue
        longs = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
        if not longs:
            continue
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        action = kw["action"].value if isinstance(kw.get("action"), ast.Constant) else "store"
        dest = kw["dest"].value if isinstance(kw.get("dest"), ast.Constant) else longs[0][2:].replace("-", "_")
        value = "" if action in ("store_true", "store_false") else _sample(kw)
        value = next((b.split(" ", 1)[1] for b in BASE if b.split(" ")[0] == longs[0] and " " in b), value)
        rows.append({"option": longs[0], "dest": dest, "action": action, "value": value})
    return rows


def main() -> None:
    path, commit = sys.argv[1], sys.argv[2]
    rows = options(pathlib.Path(path).read_text())
    for row in rows:
        row["class"], row["note"] = probe(row["option"], row["value"])
    counts = collections.Counter(r["class"] for r in rows)
    OUT.write_text(
        json.dumps(
            {
                "source": {"repo": "NVIDIA/Megatron-LM", "path": "megatron/training/arguments.py", "commit": commit},
                "counts": dict(sorted(counts.items())),
                "options": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"{len(rows)} options: {dict(sorted(counts.items()))} -> {OUT}")


if __name__ == "__main__":
    main()
