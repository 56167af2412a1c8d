"""Pipeline schedules' activation memory as the number of microbatches grows.

For GPipe, 1F1B and interleaved 1F1B on 8 simulated CPU devices (data 2 x pipeline 4, tiny model,
fp32, fixed microbatch size) it AOT-compiles the train step for m = p, 2p, 4p microbatches and
prints ``memory_analysis()`` temporaries and their ratio to m = p: GPipe keeps every microbatch's
activations (grows with m), 1F1B at most p stage inputs (flat), interleaved 1F1B at most its
warm-up's. Also the measured bubble beside (p-1)/(m+p-1) (interleaved (p-1)/(vm+p-1)).

    python experiments/pipeline_memory.py          # ~1 min on 2 cores
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
P, MICROBATCH = 4, 2  # pipeline stages, sequences per microbatch per data shard


def main() -> int:
    from jaxpar.distributed import ensure_host_devices

    ensure_host_devices(8)
    from jaxpar.analysis.compiled import analyze_layout
    from jaxpar.config import load_config
    from jaxpar.parallel import pipeline

    print(f"{'schedule':<12} {'m':>3} {'temp MiB':>9} {'x m=p':>6} {'bubble':>7} {'formula':>8}")
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        base = None
        for m in (P, 2 * P, 4 * P):
            cfg = load_config(
                str(ROOT / "configs" / "tiny.py"),
                [
                    "--config.mesh.data=2",
                    "--config.mesh.tensor=1",
                    f"--config.mesh.pipeline={P}",
                    f"--config.parallel.pipeline_schedule={schedule}",
                    f"--config.parallel.virtual_stages={v}",
                    "--config.model.num_layers=8",
                    f"--config.parallel.microbatches={m}",
                    f"--config.train.global_batch={2 * m * MICROBATCH}",
                    "--config.train.seq_len=128",
                    "--config.model.compute_dtype=float32",
                ],
            )
            temp = analyze_layout(cfg).memory.temp_bytes / 2**20
            base = base or temp
            table = pipeline.build_schedule(schedule, P, m, v)
            print(
                f"{schedule:<12} {m:>3} {temp:>9.2f} {temp / base:>6.2f} {pipeline.bubble_fraction(table):>7.1%} "
                f"{pipeline.expected_bubble_fraction(schedule, P, m, v):>8.1%}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
