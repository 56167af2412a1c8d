"""Train a real-shape model for a few dozen steps and print step time, tokens/s and MFU.

The accelerator check of the project: on one GPU (or a node of them) it trains ``configs/llama_1b.py``
(1.1B parameters, bf16 compute, fp32 master weights and Adam state, selective remat, sequence 2048)
on synthetic tokens over all local devices (``data`` = device count, ZeRO-3 when there are several)
and prints the steady-state figures the trainer measures (steps after the first few, which include
compilation): median step time, tokens/s, TFLOP/s per device and MFU against the device's data-sheet
bf16 peak. ``--quick`` runs a tiny shape on 8 simulated CPU devices (a smoke check of the script).

    python experiments/bench_train.py                       # GPU: llama_1b, 30 steps
    python experiments/bench_train.py --batch 16 --steps 50 --config.parallel.recompute=none
    python experiments/bench_train.py --quick               # CPU smoke run

The last line is one JSON object (``--json`` prints only that).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUICK = [  # a tiny shape: seconds on CPU
    "--config.model.num_layers=2",
    "--config.model.embed_dim=128",
    "--config.model.num_heads=4",
    "--config.model.num_kv_heads=2",
    "--config.model.head_dim=32",
    "--config.model.mlp_dim=256",
    "--config.model.vocab_size=512",
    "--config.model.max_seq_len=128",
    "--config.train.seq_len=128",
    "--config.model.compute_dtype=float32",
    "--config.parallel.grad_reduce_dtype=float32",
]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "llama_1b.py"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="sequences per device per step")
    parser.add_argument("--quick", action="store_true", help="tiny shape on 8 simulated CPU devices")
    parser.add_argument("--json", action="store_true", help="print only the JSON summary")
    args, overrides = parser.parse_known_args(argv)

    from jaxpar.distributed import ensure_host_devices, gpu_xla_flags

    if args.quick:
        ensure_host_devices(8)
    else:
        os.environ["XLA_FLAGS"] = gpu_xla_flags()  # the cluster profile, after what the user set
    import jax

    from jaxpar.config import ConfigError, load_config_and_layout
    from jaxpar.models.inventory import count_params
    from jaxpar.train.loop import Trainer

    n = len(jax.devices())
    layout = [
        f"--config.mesh.data={n}",
        "--config.mesh.tensor=1",
        "--config.mesh.pipeline=1",
        f"--config.parallel.zero_stage={3 if n > 1 else 0}",
        f"--config.train.global_batch={args.batch * n}",
        "--config.parallel.microbatches=1",
    ]
    run = [
        f"--config.train.steps={args.steps}",
        "--config.data.source=synthetic",
        "--config.checkpoint.every=0",
        "--config.train.eval_batches=1",
        "--config.train.resume=never",
        "--config.optim.warmup_steps=5",
        f"--config.train.workdir={tempfile.mkdtemp(prefix='jaxpar_bench_')}",
        "--config.train.log_every=0",
    ]
    try:
        cfg, run_layout = load_config_and_layout(
            args.config, [*layout, *(QUICK if args.quick else []), *run, *overrides]
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    trainer = Trainer(cfg, run_layout, echo=(lambda _: None) if args.json else print, progress=False)
    result = trainer.run()
    steady = result["steady"] or {}
    summary = {
        "config": args.config,
        "platform": jax.devices()[0].platform,
        "device_kind": jax.devices()[0].device_kind,
        "devices": n,
        "params": count_params(cfg.model),
        "compute_dtype": cfg.model.compute_dtype,
        "recompute": cfg.parallel.recompute,
        "zero_stage": cfg.parallel.zero_stage,
        "seq_len": cfg.train.seq_len,
        "global_batch": cfg.train.global_batch,
        "steps": args.steps,
        "steady_steps": steady.get("steps"),
        "step_time_s": steady.get("median_step_time_s"),
        "tokens_per_s": steady.get("tokens_per_s"),
        "tflops_per_device": steady.get("tflops_per_device"),
        "mfu": steady.get("mfu"),
        "peak": trainer.peak_source,
        "loss_last": result["final"].get("loss"),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
