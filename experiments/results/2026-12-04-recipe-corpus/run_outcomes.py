"""Run `jaxpar port` once on every corpus file and record exit code + first 3 stderr lines.

Usage: python3 experiments/results/2026-12-04-recipe-corpus/run_outcomes.py OUT.json [EXTRA.json]
EXTRA.json maps a corpus file to a list of extra arguments (e.g. --world-size 8, --var NAME=VALUE),
inserted before -o; when EXTRA.json is given, only the files it lists are run.
"""

import json
import os
import subprocess
import sys

ROOT = "/work/wt-corpus"
KIND = {"megatron": "megatron", "torchtitan": "torchtitan", "deepspeed": "deepspeed", "accelerate": "fsdp"}


def kind(row):
    if row["format"] == "megatron_deepspeed":
        return "deepspeed" if row["file"].endswith(".json") else "megatron"
    return KIND[row["format"]]


rows = json.load(open(os.path.join(ROOT, "tests/fixtures/recipes/corpus/manifest.json")))
extra = json.load(open(sys.argv[2])) if len(sys.argv) > 2 else {}
os.makedirs("/tmp/corpus_out", exist_ok=True)
out = []
for r in rows:
    if extra and r["file"] not in extra:
        continue
    name = os.path.splitext(os.path.basename(r["file"]))[0]
    o = f"/tmp/corpus_out/{r['format']}__{name}.py"
    if os.path.exists(o):
        os.remove(o)
    cmd = ["timeout", "60", "python3", "-m", "jaxpar", "port", kind(r), r["file"], *extra.get(r["file"], []), "-o", o]
    p = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True)
    out.append(
        dict(
            file=r["file"],
            format=r["format"],
            cmd=" ".join(cmd),
            rc=p.returncode,
            stderr3=p.stderr.splitlines()[:3],
            stderr=p.stderr,
            stdout=p.stdout,
            wrote=os.path.exists(o),
        )
    )
    print(p.returncode, r["file"], (p.stderr.splitlines() or [""])[0][:200], flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
