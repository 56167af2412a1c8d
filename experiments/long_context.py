"""Long sequences on 8 simulated devices: compiled temporaries per device and measured tokens/s.

For sequence lengths 2048 -> 32768 of the tiny LLaMA (fp32, one sequence per data shard), each
layout is AOT-compiled (``memory_analysis()``: arguments and temporaries per device, nothing
allocated) and, where its arguments + temporaries fit the ``--budget-gib`` per device, trained for a
few steps to measure tokens/s (median of the steps after the first; only up to ``--max-run-seq``:
on two CPU cores a step at 32k tokens takes minutes). Layouts:

* ``d8 dot_product``: today's attention, the (s, s) score matrix per head;
* ``d8 blockwise``: flash-style attention (``model.attention=blockwise``), no s x s buffer;
* ``d4 c2 ring``, ``d2 c4 ring``, ``c8 ring``: context parallelism, the sequence split over
  ``context`` with the ring exchange; ``d2 c4 all_gather``: the all-gather exchange.

Writes a table (markdown) and a PNG (temporaries and tokens/s against the sequence length)::

    python experiments/long_context.py -o experiments/results/<date>-long-context [--seqs 2048,4096] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

GIB = 1 << 30
LAYOUTS = {
    "d8 dot_product": ["--config.mesh.data=8", "--config.model.attention=dot_product"],
    "d8 blockwise": ["--config.mesh.data=8"],
    "d4 c2 ring": ["--config.mesh.data=4", "--config.mesh.context=2"],
    "d2 c4 ring": ["--config.mesh.data=2", "--config.mesh.context=4"],
    "c8 ring": ["--config.mesh.data=1", "--config.mesh.context=8"],
    "d2 c4 all_gather": [
        "--config.mesh.data=2",
        "--config.mesh.context=4",
        "--config.parallel.context_exchange=all_gather",
    ],
}


def config(seq: int, overrides: list[str], batch: int | None = None, block: int = 512):
    """The tiny model at ``seq`` tokens, fp32, one sequence per data shard (``batch``: sequences per step)."""
    from jaxpar.config import load_config

    data = int(next(o.split("=")[1] for o in overrides if o.startswith("--config.mesh.data=")))
    return load_config(
        str(ROOT / "configs" / "tiny.py"),
        [
            "--config.model.compute_dtype=float32",
            f"--config.model.max_seq_len={seq}",
            f"--config.train.seq_len={seq}",
            f"--config.train.global_batch={batch or data}",
            "--config.mesh.tensor=1",
            "--config.model.attention=blockwise",
            f"--config.model.attention_block={block}",
            "--config.optim.warmup_steps=1",
            *overrides,
        ],
    )


def compiled_memory(cfg) -> dict[str, int]:
    """Arguments and temporaries per device of the compiled train step (AOT: nothing allocated)."""
    import jax

    from jaxpar.config import validate
    from jaxpar.mesh import make_mesh
    from jaxpar.train.state import Setup

    layout = validate(cfg)
    setup = Setup(cfg, layout, make_mesh(layout, jax.devices()[: layout.devices]))
    mem = setup.lower_train_step().compile().memory_analysis()
    return {"argument_bytes": int(mem.argument_size_in_bytes), "temp_bytes": int(mem.temp_size_in_bytes)}


def tokens_per_second(cfg, steps: int) -> float:
    """Median tokens/s of ``steps`` training steps after the first (which compiles)."""
    import jax
    import numpy as np

    from jaxpar.config import validate
    from jaxpar.mesh import make_mesh
    from jaxpar.train.state import Setup

    layout = validate(cfg)
    setup = Setup(cfg, layout, make_mesh(layout, jax.devices()[: layout.devices]))
    params, opt = setup.init(0)
    rng = np.random.default_rng(0)
    times = []
    for _ in range(steps + 1):
        rows = rng.integers(0, cfg.model.vocab_size, size=(cfg.train.global_batch, cfg.train.seq_len + 1))
        batch = setup.feed.make_batch(rows)
        start = time.perf_counter()
        params, opt, metrics = setup.train_step(params, opt, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return layout.tokens_per_step / float(np.median(times[1:]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--seqs", default="2048,4096,8192,16384,32768")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget-gib", type=float, default=2.5, help="arguments + temporaries per device to run a layout")
    ap.add_argument(
        "--max-run-seq",
        type=int,
        default=8192,
        help="measure tokens/s only up to this length (on 2 CPU cores a 32k step takes minutes)",
    )
    ap.add_argument("--only", default="", help="comma-separated layout names")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in LAYOUTS if not args.only or n in args.only.split(",")]
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        for name in names:
            cfg = config(seq, LAYOUTS[name])
            row = {"layout": name, "seq_len": seq, **compiled_memory(cfg)}
            peak = row["argument_bytes"] + row["temp_bytes"]
            row["fits"] = peak <= args.budget_gib * GIB
            run = row["fits"] and args.steps and seq <= args.max_run_seq
            row["tokens_per_s"] = tokens_per_second(cfg, args.steps) if run else None
            rows.append(row)
            tps = f"{row['tokens_per_s']:.0f}" if row["tokens_per_s"] else "-"
            print(f"{name:18s} seq {seq:6d}  temp {row['temp_bytes'] / GIB:8.3f} GiB  tokens/s {tps}", flush=True)
    (out / "long_context.json").write_text(json.dumps(rows, indent=1))
    lines = ["| layout | seq | temporaries GiB/device | arguments GiB/device | tokens/s |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        tps = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else ("does not fit" if not r["fits"] else "-")
        lines.append(
            f"| {r['layout']} | {r['seq_len']} | {r['temp_bytes'] / GIB:.3f} | {r['argument_bytes'] / GIB:.4f} | {tps} |"
        )
    (out / "long_context.md").write_text("\n".join(lines) + "\n")
    _plot(rows, names, out / "long_context.png")
    print(f"wrote {out}/long_context.{{json,md,png}}")
    return 0


def _plot(rows: list[dict], names: list[str], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_tps) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in names:
        mine = [r for r in rows if r["layout"] == name]
        ax_mem.plot([r["seq_len"] for r in mine], [r["temp_bytes"] / GIB for r in mine], marker="o", label=name)
        run = [r for r in mine if r["tokens_per_s"]]
        if run:
            ax_tps.plot([r["seq_len"] for r in run], [r["tokens_per_s"] for r in run], marker="o", label=name)
    for ax in (ax_mem, ax_tps):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.grid(alpha=0.3)
    ax_mem.set_yscale("log")
    ax_mem.set_ylabel("compiled temporaries per device (GiB)")
    ax_tps.set_ylabel("tokens/s (8 simulated CPU devices)")
    ax_mem.legend(fontsize=8)
    ax_mem.set_title("memory: tiny LLaMA, fp32, one sequence per data shard")
    ax_tps.set_title("throughput (layouts that fit)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
