"""The planner's MoE figures against the compiled step, on more layouts than tests/test_memory_moe.py:
argument memory, the rows over ``expert`` and the temporaries and peak of the tiny Mixtral
(``configs/tiny_mixtral.py``, fp32, s=128, AOT on 8 simulated CPU devices).

    python experiments/results/2026-12-05-moe-planner/moe_grid.py [NAME ...]   # ~15 s a layout on 2 cores
    DUMP=/tmp/moe python .../moe_grid.py e8      # also XLA dumps and the live set at the peak (experiments/live_set.py)

Prints per layout: compiled / estimated temporaries and peak, the argument ratio (estimate.estimated_argument_bytes)
and the compiled / expected ratio of every row over ``expert`` (a pipeline: every stage's expert bytes).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
S = 128


def grid():
    from jaxpar.layout import ParallelLayout

    def lay(**kw):
        return ParallelLayout(**{"seq_len": S, "microbatch_size": 2, **kw})

    return {  # name -> (layout, model overrides); the first six are the test's
        "e4_d2": (lay(data=2, expert=4), {}),
        "e2_t2_d2_zero3": (lay(data=2, expert=2, tensor=2, zero_stage=3), {}),
        "e2_p2_d2_1f1b": (lay(data=2, expert=2, pipeline=2, microbatches=4, microbatch_size=1), {}),
        "e2_c2_d2": (lay(data=2, expert=2, context=2, attention="blockwise", attention_block=32), {}),
        "e8": (lay(expert=8), {}),
        "e4_d2_capacity": (lay(data=2, expert=4), {"moe_capacity_factor": 1.25}),
        "e4_d2_full": (lay(data=2, expert=4, recompute="full"), {}),
        "e4_d2_selective": (lay(data=2, expert=4, recompute="selective"), {}),
        "e2_t2_d2_sp": (lay(data=2, expert=2, tensor=2, sequence_parallel=True), {}),
        "e4_d2_shared": (lay(data=2, expert=4), {"name": "llama", "shared_expert_dim": 256}),
        "e4_d2_dense_dispatch": (lay(data=2, expert=4), {"moe_dispatch": "dense"}),
        "e2_d4_zero1_m2": (lay(data=4, expert=2, zero_stage=1, microbatches=2), {}),
        "e4_d2_zero2": (lay(data=2, expert=4, zero_stage=2), {}),
        "e2_p2_d2_1f1b_full": (
            lay(data=2, expert=2, pipeline=2, microbatches=4, microbatch_size=1, recompute="full", zero_stage=1),
            {},
        ),
    }


def main() -> None:
    from jaxpar.distributed import ensure_host_devices

    ensure_host_devices(8)
    from jaxpar.analysis.aot import layout_config
    from jaxpar.analysis.compiled import AOT_COMPILER_OPTIONS, analyze_layout
    from jaxpar.analysis.estimate import estimated_argument_bytes
    from jaxpar.config import load_config

    layouts, dump = grid(), os.environ.get("DUMP")
    for name in sys.argv[1:] or list(layouts):
        layout, model = layouts[name]
        cfg = load_config(str(ROOT / "configs" / "tiny_mixtral.py"))
        for key, value in model.items():
            cfg.model[key] = value
        cfg = layout_config(cfg, layout)
        cfg.model.compute_dtype = cfg.parallel.grad_reduce_dtype = "float32"
        options = dict(AOT_COMPILER_OPTIONS)
        if dump:
            options |= {"xla_dump_to": f"{dump}/{name}", "xla_dump_hlo_as_text": True}
        report = analyze_layout(cfg, compiler_options=options)
        mem = report.memory
        arguments = mem.argument_bytes / estimated_argument_bytes(cfg.model, layout, "jaxpar", cfg.optim)
        if report.stages:
            expert = [f"stage {st['stage']} {st['expert'] / st['estimated']['expert']:.4f}" for st in report.stages]
        else:
            expert = [f"{r.kind} {r.ratio:.4f}" for r in report.rows if r.axes == ("expert",)]
        print(
            f"{name}: temp {mem.temp_bytes / 2**20:.2f} MiB est {mem.estimated_temp_bytes / 2**20:.2f} "
            f"(ratio {mem.temp_ratio:.3f}), peak {mem.peak_ratio:.3f}, arguments {arguments:.5f}; expert: "
            + ", ".join(expert),
            flush=True,
        )
        if dump:
            live = ROOT / "experiments" / "live_set.py"
            subprocess.run([sys.executable, str(live), f"{dump}/{name}", "--top", "40"], check=False)


if __name__ == "__main__":
    main()
