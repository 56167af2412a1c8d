"""Compile the six layouts of issue 31 (fp32, AOT on simulated CPU devices) and print compiled vs
estimated temporaries and peak with the estimate's terms. ``--dump DIR`` also writes XLA's buffer
assignment of each compile (``xla_dump_to``) for the live-set analysis.

    python experiments/results/2026-12-04-memory-six/six.py [--only NAME] [--dump /tmp/six] [--json out.json]
        [--attention dot_product]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
SIX = {
    "tiny_d8_z0_none": (
        "tiny.py",
        ["mesh.data=8", "mesh.tensor=1", "parallel.zero_stage=0", "parallel.recompute=none"],
    ),
    "tiny_d8_z3_full": (
        "tiny.py",
        ["mesh.data=8", "mesh.tensor=1", "parallel.zero_stage=3", "parallel.recompute=full"],
    ),
    "tiny_d4t2_z1_selective": (
        "tiny.py",
        ["mesh.data=4", "mesh.tensor=2", "parallel.zero_stage=1", "parallel.recompute=selective"],
    ),
    "tiny_d2t2p2_z0_full_m4": (
        "tiny.py",
        [
            "mesh.data=2",
            "mesh.tensor=2",
            "mesh.pipeline=2",
            "parallel.zero_stage=0",
            "parallel.recompute=full",
            "parallel.microbatches=4",
        ],
    ),
    "tiny_d4p2_z2_none_m4": (
        "tiny.py",
        [
            "mesh.data=4",
            "mesh.tensor=1",
            "mesh.pipeline=2",
            "parallel.zero_stage=2",
            "parallel.recompute=none",
            "parallel.microbatches=4",
        ],
    ),
    "1b_d4t2_z3_selective": (
        "llama_1b.py",
        ["mesh.data=4", "mesh.tensor=2", "parallel.zero_stage=3", "parallel.recompute=selective"],
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--dump")
    ap.add_argument("--json")
    ap.add_argument("--attention", help="model.attention for every layout (default: the config's)")
    args = ap.parse_args()
    from jaxpar.distributed import ensure_host_devices

    ensure_host_devices(8)
    from jaxpar.analysis import temporaries as T
    from jaxpar.analysis.compiled import AOT_COMPILER_OPTIONS, analyze_layout
    from jaxpar.config import load_config
    from jaxpar.layout import ParallelLayout

    out = {}
    for name, (cfgfile, ov) in SIX.items():
        if args.only and name not in args.only:
            continue
        ov = ov + ["model.compute_dtype=float32", "parallel.grad_reduce_dtype=float32"]
        ov += [f"model.attention={args.attention}"] if args.attention else []
        cfg = load_config(str(ROOT / "configs" / cfgfile), [f"--config.{o}" for o in ov])
        opts = dict(AOT_COMPILER_OPTIONS)
        if args.dump:
            opts |= {"xla_dump_to": f"{args.dump}/{name}", "xla_dump_hlo_as_text": True}
        t0 = time.time()
        mem = analyze_layout(cfg, compiler_options=opts).memory
        lay = ParallelLayout.from_config(cfg)
        terms = [t.to_dict() for t in T.stage_temps(cfg.model, lay)]
        out[name] = {
            "temp_bytes": mem.temp_bytes,
            "expected_temp_bytes": mem.estimated_temp_bytes,
            "argument_bytes": mem.argument_bytes,
            "expected_argument_bytes": mem.estimated_argument_bytes,
            "temp_ratio": mem.temp_ratio,
            "peak_ratio": mem.peak_ratio,
            "terms": terms,
            "compile_s": time.time() - t0,
            "b": lay.microbatch_size,
            "s": lay.seq_len,
        }
        MiB = 2**20
        print(
            f"{name}: b={lay.microbatch_size} s={lay.seq_len} temp {mem.temp_bytes / MiB:.1f} MiB est "
            f"{mem.estimated_temp_bytes / MiB:.1f} (compiled/est {mem.temp_ratio:.3f}, est/compiled "
            f"{1 / mem.temp_ratio:.3f}); peak c/e {mem.peak_ratio:.3f} (e/c {1 / mem.peak_ratio:.3f}); "
            f"args {mem.argument_bytes / MiB:.1f} MiB; {time.time() - t0:.0f}s",
            flush=True,
        )
        for t in terms:
            print("   ", {k: (round(v / MiB, 2) if isinstance(v, float) else v) for k, v in t.items()}, flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
