"""jaxpar against MaxText 0.2.5 on the same tiny LLaMA and the same 8 simulated CPU devices.

For each of MaxText's four layouts (``configs/maxtext_tiny.py``: DP-8, FSDP-8, FSDP-4 x TP-2,
DP-2 x TP-2 x PP-2) it AOT-compiles jaxpar's train step and prints, per device per step, the ring
bytes of its collectives (pipeline: the busiest stage, counted from the schedule) and
``memory_analysis()`` arguments + temporaries, beside MaxText's numbers and the ratio
(jaxpar / MaxText: below 1 is better). Also ZeRO-3's bytes against the ideal 3(n-1)/n * P * 4.

    python experiments/maxtext_layouts.py          # ~20 s on 2 cores
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAXTEXT = {"dp8": (33.1, 105.8), "fsdp8": (62.0, 29.6), "fsdp4_tp2": (61.1, 28.7), "dp2_tp2_pp2": (64.8, 31.2)}


def main() -> int:
    from jaxpar.distributed import ensure_host_devices

    ensure_host_devices(8)
    from jaxpar.analysis.compiled import analyze_layout
    from jaxpar.config import load_config
    from jaxpar.models.inventory import count_params

    print(
        f"{'layout':<13} {'jaxpar MB':>10} {'MaxText MB':>11} {'ratio':>6}   {'jaxpar MiB':>10} {'MaxText MiB':>11} "
        f"{'ratio':>6}"
    )
    for name, (mt_mb, mt_mib) in MAXTEXT.items():
        cfg = load_config(f"{ROOT / 'configs' / 'maxtext_tiny.py'}:{name}")
        report = analyze_layout(cfg)
        mb = sum(r.bytes_per_device for r in report.rows) / 1e6
        mib = report.memory.args_plus_temps_mib
        print(
            f"{name:<13} {mb:>10.2f} {mt_mb:>11.1f} {mb / mt_mb:>6.3f}   {mib:>10.2f} {mt_mib:>11.1f} {mib / mt_mib:>6.3f}"
        )
        if cfg.parallel.zero_stage == 3 and cfg.mesh.tensor == 1:
            n = cfg.mesh.data
            ideal = 3 * (n - 1) / n * count_params(cfg.model) * 4 / 1e6
            print(f"{'':<13} ZeRO-3 ideal {ideal:.2f} MB: jaxpar at {mb / ideal:.3f} of it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
