"""Three ways to run the same MoE layer, measured in one process on 8 simulated CPU devices.

``configs/tiny_mixtral.py`` (4 layers, width 128, 8 experts of 192, top-2, load-balancing loss 0.01)
at expert=4 x data=2, fp32, on the stdlib-text batches ``jaxpar train`` uses: the grouped dropless
dispatch (``jax.lax.ragged_dot`` over the routed tokens, the default), the dense one-hot dispatch
(every expert on every token, weighted by the routing: ``model.moe_dispatch=dense``) and the
grouped dispatch with a capacity of 1.25 (``model.moe_capacity_factor=1.25``: Switch / GShard token
dropping). Each variant trains ``--steps`` steps from the same initialisation on the same batches;
printed per variant: the median step time over the steps after the first ``--warmup``, the
compiled step's temporary bytes per device (``memory_analysis``) and the train loss over the last
10 steps. The variants alternate step by step (round robin), so a change in the machine's load
falls on all three alike.

    python experiments/moe_dispatch.py              # ~3 min on 2 cores
    python experiments/moe_dispatch.py --steps 20   # quicker

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from jaxpar.config import load_config_and_layout  # noqa: E402
from jaxpar.data import make_batches  # noqa: E402
from jaxpar.mesh import make_mesh  # noqa: E402
from jaxpar.train.state import Setup  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = [
    "--config.mesh.data=2",
    "--config.mesh.expert=4",
    "--config.model.compute_dtype=float32",
    "--config.train.seq_len=128",
    "--config.train.global_batch=16",
]
VARIANTS = {
    "grouped dropless": [],
    "dense one-hot": ["--config.model.moe_dispatch=dense"],
    "grouped capacity 1.25": ["--config.model.moe_capacity_factor=1.25"],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    runs = {}
    for name, extra in VARIANTS.items():
        cfg, layout = load_config_and_layout(os.path.join(ROOT, "configs", "tiny_mixtral.py"), [*COMMON, *extra])
        setup = Setup(cfg, layout, make_mesh(layout))
        memory = setup.lower_train_step().compile().memory_analysis()
        params, opt = setup.init(cfg.train.seed)
        runs[name] = {
            "setup": setup,
            "state": (params, opt),
            "times": [],
            "losses": [],
            "temp": memory.temp_size_in_bytes,
        }
    cfg = runs["grouped dropless"]["setup"].cfg
    batches = make_batches(
        cfg.data,
        vocab_size=cfg.model.vocab_size,
        seq_len=cfg.train.seq_len,
        global_batch=cfg.train.global_batch,
        seed=cfg.train.seed,
    )
    for _ in range(args.steps):
        rows = batches.next()
        for run in runs.values():
            setup = run["setup"]
            params, opt = run["state"]
            batch = setup.feed.make_batch(rows)
            start = time.perf_counter()
            params, opt, metrics = setup.train_step(params, opt, batch)
            loss = float(jax.device_get(metrics["loss"]))
            run["times"].append(time.perf_counter() - start)
            run["losses"].append(loss)
            run["state"] = (params, opt)
    out = {}
    for name, run in runs.items():
        steady = run["times"][args.warmup :]
        out[name] = {
            "median_step_ms": round(1000 * statistics.median(steady), 1),
            "temp_bytes": run["temp"],
            "loss_last10": round(statistics.mean(run["losses"][-10:]), 4),
            "loss_first": round(run["losses"][0], 4),
        }
        print(
            f"{name:24s} {out[name]['median_step_ms']:8.1f} ms/step  temp {run['temp'] / 2**20:7.1f} MiB  "
            f"loss {out[name]['loss_first']:.3f} -> {out[name]['loss_last10']:.3f} (mean of the last 10)"
        )
    print(json.dumps({"steps": args.steps, "variants": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
