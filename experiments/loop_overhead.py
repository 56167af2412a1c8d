"""Step time of the training loop in this tree against another commit: the same training run (the tiny
config on 8 simulated CPU devices) in each tree in turn, several alternating rounds.

    python experiments/loop_overhead.py --against 0c4a87f              # the blocking loop before issue 13
    python experiments/loop_overhead.py --against main --steps 40 --rounds 3 --config.train.seq_len=64

``--against REF`` exports REF with ``git archive`` into a temporary folder; each round runs
``jaxpar.train.loop.Trainer`` for ``--steps`` steps in a fresh process of each tree (PYTHONPATH = that
tree), with no checkpoints, one evaluation batch and no progress bar. Per run it takes the wall time
per step over steps ``--warmup``+1..``--steps`` from the ``time`` field of ``metrics.jsonl`` (when each
step's row was written: throughput, whatever either loop puts in ``step_time_s``) and every step's
loss, grad norm, lr and skip flag. It prints each run, the ratios this tree / REF (the median over
rounds of each round's pair, and fastest over fastest) and whether the per-step values agree bit for
bit. Extra ``--config.*`` flags go to both runs. The machine's other load moves the numbers: the
rounds alternate so that load hits both trees alike.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHILD = """
import sys
from jaxpar.distributed import ensure_host_devices
ensure_host_devices(8)
from jaxpar.config import load_config_and_layout
from jaxpar.train.loop import Trainer
Trainer(*load_config_and_layout("configs/tiny.py", sys.argv[1:]), echo=lambda _: None, progress=False).run()
"""
FIELDS = ("loss", "grad_norm", "lr", "skipped")


def export(ref: str, into: str) -> str:
    """``git archive REF`` unpacked under ``into``; returns the folder."""
    tree = os.path.join(into, "ref")
    os.makedirs(tree)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    return tree


def run_once(tree: str, workdir: str, steps: int, warmup: int, overrides: list[str]) -> dict:
    """One training run in ``tree``: wall seconds per step after ``warmup`` and the per-step values."""
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "PYTHONPATH": tree, "JAX_PLATFORMS": "cpu"}
    args = [
        f"--config.train.steps={steps}",
        f"--config.train.workdir={workdir}",
        "--config.checkpoint.every=0",
        "--config.train.eval_batches=1",
        "--config.train.log_every=0",
        "--config.train.resume=never",
        *overrides,
    ]
    subprocess.run([sys.executable, "-c", CHILD, *args], cwd=tree, env=env, check=True)
    rows = [json.loads(x) for x in pathlib.Path(workdir, "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    times = [r["time"] for r in rows]
    return {
        "s_per_step": (times[-1] - times[warmup - 1]) / (len(times) - warmup),
        "median_step_time_s": statistics.median(r["step_time_s"] for r in rows[warmup:]),
        "values": [[r[f] for f in FIELDS] for r in rows],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", required=True, help="the git commit (or branch) to compare with")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out (compilation)")
    parser.add_argument("--rounds", type=int, default=3)
    args, overrides = parser.parse_known_args(argv)
    if not 1 <= args.warmup < args.steps:
        parser.error("--warmup must be in [1, --steps)")
    with tempfile.TemporaryDirectory(prefix="jaxpar_loop_") as tmp:
        trees = {"ref": export(args.against, tmp), "this": str(ROOT)}
        results: dict[str, list[dict]] = {"ref": [], "this": []}
        for i in range(args.rounds):
            for name, tree in trees.items():
                result = run_once(tree, os.path.join(tmp, f"{name}{i}"), args.steps, args.warmup, overrides)
                results[name].append(result)
                print(
                    f"round {i + 1} {name:4s}: {result['s_per_step'] * 1e3:8.1f} ms/step wall, "
                    f"median step_time_s {result['median_step_time_s'] * 1e3:8.1f} ms",
                    flush=True,
                )
    ref = [r["s_per_step"] for r in results["ref"]]
    this = [r["s_per_step"] for r in results["this"]]
    same = all(r["values"] == results["ref"][0]["values"] for r in results["ref"] + results["this"])
    summary = {
        "against": args.against,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "overrides": overrides,
        "ref_ms_per_step": [round(x * 1e3, 1) for x in ref],
        "this_ms_per_step": [round(x * 1e3, 1) for x in this],
        # each round's pair ran back to back (similar load); the fastest runs are the least disturbed
        "ratio_median_of_rounds": statistics.median(t / r for t, r in zip(this, ref, strict=True)),
        "ratio_of_fastest": min(this) / min(ref),
        "per_step_values_identical": same,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
