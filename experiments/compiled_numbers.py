"""Exact compiled numbers of eight layouts, as JSON: the guard that a refactor changed no behaviour.

For the four MaxText layouts (``configs/maxtext_tiny.py``) and four tiny ones (ZeRO-1 d4 x t2,
ZeRO-2 d8, ZeRO-3 + SP d4 x t2 selective remat, interleaved ZeRO-2 d2 x t2 x p2), it AOT-compiles the
train step (:func:`jaxpar.analysis.compiled.analyze_layout`) and writes every collective row (kind,
axes, count, bytes per device) and ``memory_analysis()`` (arguments, outputs, temporaries, aliases).
With ``--against OLD.json`` it says which layouts differ (``generated_code_bytes`` is ignored; an
output written while the planner's values were named ``expected_*`` is read under their
``estimated_*`` names).

    python experiments/compiled_numbers.py out.json [--against before.json]   # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = ["--config.model.compute_dtype=float32", "--config.train.global_batch=8", "--config.train.seq_len=64"]
TINY_LAYOUTS = {
    "z1_d4t2": ["--config.mesh.data=4", "--config.mesh.tensor=2", "--config.parallel.zero_stage=1"],
    "z2_d8_acc2": [
        "--config.mesh.data=8",
        "--config.mesh.tensor=1",
        "--config.parallel.zero_stage=2",
        "--config.parallel.microbatches=1",
    ],
    "z3_d4t2_sp": [
        "--config.mesh.data=4",
        "--config.mesh.tensor=2",
        "--config.parallel.zero_stage=3",
        "--config.parallel.sequence_parallel=true",
        "--config.parallel.recompute=selective",
    ],
    "pp_int_d2t2p2": [
        "--config.mesh.data=2",
        "--config.mesh.tensor=2",
        "--config.mesh.pipeline=2",
        "--config.parallel.pipeline_schedule=interleaved",
        "--config.parallel.virtual_stages=2",
        "--config.parallel.microbatches=4",
        "--config.parallel.zero_stage=2",
    ],
}


def _current_key(key: str) -> str:
    """A memory key of an earlier output under today's name: ``expected_*`` became ``estimated_*``."""
    return "estimated_" + key.removeprefix("expected_") if key.startswith("expected_") else key


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output")
    parser.add_argument("--against", default=None, help="an earlier output to compare with")
    args = parser.parse_args()
    from jaxpar.distributed import ensure_host_devices

    ensure_host_devices(8)
    from jaxpar.analysis.compiled import analyze_layout
    from jaxpar.config import load_config

    cases = {
        f"mt_{n}": (f"{ROOT / 'configs' / 'maxtext_tiny.py'}:{n}", [])
        for n in ("dp8", "fsdp8", "fsdp4_tp2", "dp2_tp2_pp2")
    }
    cases |= {name: (str(ROOT / "configs" / "tiny.py"), SMALL + overrides) for name, overrides in TINY_LAYOUTS.items()}
    out = {}
    for name, (path, overrides) in cases.items():
        report = analyze_layout(load_config(path, overrides))
        memory = {k: v for k, v in vars(report.memory).items() if isinstance(v, (int, float))}
        out[name] = {
            "rows": sorted([r.kind, list(r.axes), r.count, r.bytes_per_device] for r in report.rows),
            "mem": memory,
        }
        print(name, json.dumps(memory), flush=True)
    pathlib.Path(args.output).write_text(json.dumps(out, indent=1, sort_keys=True))
    if args.against:
        before = json.loads(pathlib.Path(args.against).read_text())
        for name in out:
            same = (
                name in before
                and out[name]["rows"] == before[name]["rows"]
                and all(
                    out[name]["mem"].get(_current_key(k)) == v
                    for k, v in before[name]["mem"].items()
                    if k != "generated_code_bytes"
                )
            )
            print(f"{name:<16} {'bitwise equal' if same else 'DIFFERS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
