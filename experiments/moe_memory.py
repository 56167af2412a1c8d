"""The MoE temporaries estimate against compiles at real expert shapes: Qwen3-30B-A3B cut to 4 layers
(128 experts of 768, hidden 2048, top-8: wider than its experts) and the tiny DeepSeek-V3 (experts of
``model.moe_mlp_dim``), fp32, AOT on 8 simulated CPU devices with ``AOT_COMPILER_OPTIONS``, s=128.

    python experiments/moe_memory.py            # every layout below
    python experiments/moe_memory.py q_d2e4_full

Prints compiled / estimated temporaries and peak, and the largest live set of the temporaries over the
estimate (``experiments/live_set.py``: where it is the allocation's, no heap hole is involved).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "experiments")]

# name -> (config, layers (None: the config's), layout fields)
LAYOUTS = {
    "q_d2e4_full": ("qwen3_30b_a3b", 4, dict(data=2, expert=4, recompute="full")),
    "q_d2e4_none": ("qwen3_30b_a3b", 4, dict(data=2, expert=4, recompute="none")),
    "q_d2e4_selective": ("qwen3_30b_a3b", 4, dict(data=2, expert=4, recompute="selective")),
    "q_d2e4_zero1_full": ("qwen3_30b_a3b", 4, dict(data=2, expert=4, zero_stage=1, recompute="full")),
    "q_d2e4_zero3_full": ("qwen3_30b_a3b", 4, dict(data=2, expert=4, zero_stage=3, recompute="full")),
    "q_e4t2_zero2_full": ("qwen3_30b_a3b", 4, dict(expert=4, tensor=2, zero_stage=2, recompute="full")),
    "q_e8_zero1_full": ("qwen3_30b_a3b", 4, dict(expert=8, zero_stage=1, recompute="full")),
    "ds_d2e4_full": ("tiny_deepseek_v3", None, dict(data=2, expert=4, recompute="full")),
    "ds_d2e4_none": ("tiny_deepseek_v3", None, dict(data=2, expert=4, recompute="none")),
    "ds_d2e2t2_zero3_full": (
        "tiny_deepseek_v3",
        None,
        dict(data=2, expert=2, tensor=2, zero_stage=3, recompute="full"),
    ),
    "ds_d4e2_zero2_full_b2s256": (
        "tiny_deepseek_v3",
        None,
        dict(data=4, expert=2, zero_stage=2, recompute="full", microbatch_size=2, seq_len=256),
    ),
}


def main() -> None:
    names = sys.argv[1:] or list(LAYOUTS)
    dump = pathlib.Path(tempfile.mkdtemp(prefix="moe_memory_"))
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()
    from jaxpar.distributed import ensure_host_devices

    ensure_host_devices(8)
    from live_set import live_peak_bytes

    from jaxpar.analysis.aot import layout_config
    from jaxpar.analysis.compiled import AOT_COMPILER_OPTIONS, analyze_layout
    from jaxpar.config import load_config
    from jaxpar.layout import ParallelLayout

    for name in names:
        config, layers, fields = LAYOUTS[name]
        cfg = load_config(str(ROOT / "configs" / f"{config}.py"))
        if layers:
            cfg.model.num_layers = layers
        cfg = layout_config(cfg, ParallelLayout(**({"seq_len": 128, "microbatch_size": 1} | fields)))
        cfg.model.compute_dtype = cfg.parallel.grad_reduce_dtype = "float32"
        mem = analyze_layout(cfg, compiler_options=AOT_COMPILER_OPTIONS).memory
        _, live = live_peak_bytes(dump)
        shutil.rmtree(dump, ignore_errors=True)
        dump.mkdir()
        print(
            f"{name}: temp {mem.temp_bytes / 2**20:.1f} MiB est {mem.estimated_temp_bytes / 2**20:.1f} "
            f"(compiled/est {mem.temp_ratio:.3f}), peak {mem.peak_ratio:.3f}, "
            f"largest live set / est {live / mem.estimated_temp_bytes:.3f}",
            flush=True,
        )
    shutil.rmtree(dump, ignore_errors=True)


if __name__ == "__main__":
    main()
