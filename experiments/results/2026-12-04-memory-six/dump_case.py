"""Compile one draw of tests/test_memory_random.py (fp32, AOT) with XLA's dumps, print compiled vs
estimated temporaries by term and the live set at the peak (experiments/live_set.py).

    python experiments/results/2026-12-04-memory-six/dump_case.py DUMPDIR SEED CASE [--slow]
"""

from __future__ import annotations

import os
import pathlib
import random
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]


def main() -> None:
    dump, seed, case, *rest = sys.argv[1:]
    os.environ["JAXPAR_SLOW"] = "1" if "--slow" in rest else "0"
    from jaxpar.distributed import ensure_host_devices

    ensure_host_devices(8)
    import test_memory_random as T

    from jaxpar.analysis import activations as A
    from jaxpar.analysis import temporaries as TE
    from jaxpar.analysis.compiled import AOT_COMPILER_OPTIONS, analyze_layout
    from jaxpar.config import ConfigError

    rng = random.Random(int(seed) * 1000 + int(case))
    for _ in range(T.TRIES):
        name, model, lay = T._draw(rng)
        if lay.devices > T.DEVICES:
            continue
        try:
            cfg = T._config(name, model, lay)
            opts = dict(AOT_COMPILER_OPTIONS) | {"xla_dump_to": dump, "xla_dump_hlo_as_text": True}
            mem = analyze_layout(cfg, compiler_options=opts).memory
        except ConfigError:
            continue
        break
    MiB = 2**20
    print(f"{name} {model} {lay}")
    print(
        f"temp {mem.temp_bytes / MiB:.2f} est {mem.estimated_temp_bytes / MiB:.2f} ratio {mem.temp_ratio:.3f} "
        f"peak {mem.peak_ratio:.3f}"
    )
    d = A.Dims.of(cfg.model, lay)
    print(
        f"units MiB: ebsh {d.e * d.b * d.s * d.h / MiB:.3f} ebsf {d.e * d.b * d.s * d.f / MiB:.3f} "
        f"ebsq {d.e * d.b * d.s * d.q / MiB:.3f} F32*bns2 {4 * d.b * d.n * d.s * d.s / MiB:.3f} "
        f"F32*bn*blk*blk {4 * d.b * d.n * lay.attention_block**2 / MiB:.3f} "
        f"ebsv {d.e * d.b * d.s * d.v / MiB:.3f} layer_w {d.e * A.layer_params(cfg.model, lay) / MiB:.3f}"
    )
    for t in TE.stage_temps(cfg.model, lay):
        print("  ", {k: (round(v / MiB, 3) if isinstance(v, float) else v) for k, v in t.to_dict().items()})
    sys.stdout.flush()
    subprocess.run([sys.executable, str(ROOT / "experiments" / "live_set.py"), dump, "--top", "45"])


if __name__ == "__main__":
    main()
