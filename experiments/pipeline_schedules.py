"""Pipeline schedules side by side on 8 simulated CPU devices, measured in one run.

data=2 x pipeline=4, the tiny llama (8 layers, width 256, seq 256, fp32), m=8 microbatches of 2
sequences per data shard. For each schedule: the median step time over rounds that alternate the
schedules' order, the matmul FLOPs the compiled step executes (:mod:`jaxpar.analysis.executed_flops`,
all pipeline ranks summed, over the unpipelined step's), compiled temporaries, and the table's bubble
rate under equal F, B, W costs beside the published formula (:mod:`jaxpar.parallel.pipeline.timing`).

``1f1b-recompute`` is the 1F1B executor as it ran before the stash: its backward recomputes the
stage forward with ``parallel.recompute=none`` (selected here by building the program without a stash,
which the executor still runs for ``parallel.recompute=full``).

    python experiments/pipeline_schedules.py -o experiments/results/<date>-pipeline-schedules
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
P, M = 4, 8
SCHEDULES = [  # (label, parallel.pipeline_schedule, virtual stages, stash)
    ("gpipe", "gpipe", 1, True),
    ("1f1b-recompute", "1f1b", 1, False),
    ("1f1b", "1f1b", 1, True),
    ("interleaved", "interleaved", 2, True),
    ("zb-h1", "zb-h1", 1, True),
    ("zb-v", "zb-v", 2, True),
]
OVERRIDES = [
    "--config.mesh.data=2",
    "--config.mesh.tensor=1",
    "--config.model.num_layers=8",
    "--config.model.embed_dim=256",
    "--config.model.mlp_dim=768",
    "--config.model.num_heads=4",
    "--config.model.num_kv_heads=4",
    "--config.model.head_dim=64",
    "--config.train.seq_len=256",
    "--config.model.max_seq_len=256",
    "--config.train.global_batch=32",
    "--config.model.compute_dtype=float32",
]


def _setup(schedule: str, v: int, p: int, stash: bool):
    from jaxpar.config import load_config_and_layout
    from jaxpar.mesh import make_mesh
    from jaxpar.parallel.pipeline import executor
    from jaxpar.train.state import Setup

    extra = [f"--config.mesh.pipeline={p}", f"--config.parallel.microbatches={M}"]
    if p > 1:
        extra += [f"--config.parallel.pipeline_schedule={schedule}", f"--config.parallel.virtual_stages={v}"]
    cfg, layout = load_config_and_layout(str(ROOT / "configs" / "tiny.py"), [*OVERRIDES, *extra])
    keeps = executor.keeps_activations
    if not stash:  # the executor before the stash: the backward recomputes the stage forward
        executor.keeps_activations = lambda layout: False
    try:
        import jax

        return Setup(cfg, layout, make_mesh(layout, jax.devices()[: layout.devices]))
    finally:
        executor.keeps_activations = keeps


def _flops(setup, compiled) -> float:
    from jaxpar.analysis.executed_flops import executed_dot_flops

    text = compiled.as_text()
    if setup.pipeline is None:
        return executed_dot_flops(text)
    return sum(executed_dot_flops(text, setup.pipeline, s) for s in range(setup.pipeline.table.stages))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", type=pathlib.Path, help="folder for results.json and schedules.png")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per schedule and round")
    args = ap.parse_args(argv)
    from jaxpar.distributed import ensure_host_devices

    ensure_host_devices(8)
    import jax
    import numpy as np

    from jaxpar.parallel.pipeline import build_schedule
    from jaxpar.parallel.pipeline.timing import published_bubble, timed

    runs: dict[str, dict] = {}
    base = _setup("1f1b", 1, 1, True)
    base_flops = _flops(base, base.lower_train_step().compile())
    for label, schedule, v, stash in SCHEDULES:
        setup = _setup(schedule, v, P, stash)
        compiled = setup.lower_train_step().compile()
        params, opt = setup.init(0)
        rows = np.random.default_rng(0).integers(0, setup.cfg.model.vocab_size, (32, 257))
        batch = setup.feed.make_batch(rows)
        for _ in range(2):  # compile and warm up
            params, opt, metrics = setup.train_step(params, opt, batch)
        jax.block_until_ready(metrics)
        timing = timed(build_schedule(schedule, P, M, v))
        runs[label] = {
            "setup": setup,
            "state": (params, opt, batch),
            "times": [],
            "flops_ratio": _flops(setup, compiled) / base_flops,
            "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20,
            "bubble_rate": timing.bubble,
            "published": published_bubble(schedule, P, M, v),
            "in_flight": list(timing.in_flight),
        }
        print(f"compiled {label}", flush=True)
    for r in range(args.rounds):
        order = [s[0] for s in SCHEDULES][:: 1 if r % 2 == 0 else -1]
        for label in order:
            run = runs[label]
            params, opt, batch = run["state"]
            for _ in range(args.steps):
                start = time.perf_counter()
                params, opt, metrics = run["setup"].train_step(params, opt, batch)
                jax.block_until_ready(metrics)
                run["times"].append(time.perf_counter() - start)
            run["state"] = (params, opt, batch)
    out = []
    ref = statistics.median(runs["1f1b"]["times"])
    print(
        f"{'schedule':<16}{'step s':>8}{'x 1f1b':>8}{'flops x':>9}{'temp MiB':>10}{'bubble':>8}{'paper':>8}  in flight"
    )
    for label, *_ in SCHEDULES:
        run = runs[label]
        step = statistics.median(run["times"])
        row = {k: run[k] for k in ("flops_ratio", "temp_mib", "bubble_rate", "published", "in_flight")}
        row |= {"schedule": label, "step_s": step, "vs_1f1b": step / ref, "times": run["times"]}
        out.append(row)
        published = "-" if row["published"] is None else f"{row['published']:.3f}"
        print(
            f"{label:<16}{step:>8.3f}{step / ref:>8.3f}{row['flops_ratio']:>9.3f}{row['temp_mib']:>10.1f}"
            f"{row['bubble_rate']:>8.3f}{published:>8}  {row['in_flight']}"
        )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"p": P, "m": M, "overrides": OVERRIDES, "jax": jax.__version__, "devices": str(jax.devices()[0])}
        (args.out / "results.json").write_text(json.dumps({"meta": meta, "runs": out}, indent=1))
        _plot(out, args.out / "schedules.png")
    return 0


def _plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = [r["schedule"] for r in rows]
    ax1.bar(names, [r["step_s"] for r in rows], color="tab:blue")
    ax1.set_ylabel("median step time (s)")
    ax1.set_title(f"p={P}, m={M}, data=2, 8 CPU devices")
    ax1.tick_params(axis="x", rotation=30)
    ax2.bar(names, [r["bubble_rate"] for r in rows], color="tab:orange", label="table, equal costs")
    stated = [(n, r["published"]) for n, r in zip(names, rows) if r["published"] is not None]
    ax2.scatter([n for n, _ in stated], [b for _, b in stated], color="black", zorder=3, label="published formula")
    ax2.set_ylabel("bubble rate")
    ax2.tick_params(axis="x", rotation=30)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
