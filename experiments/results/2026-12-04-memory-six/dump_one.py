"""Compile one config (fp32, AOT) with XLA dumps and print compiled vs estimated temporaries and the live
set at the peak (experiments/live_set.py).  python .../dump_one.py DUMPDIR CONFIG [--config.x.y=v ...]"""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))


def main() -> None:
    dump, cfgfile, *ov = sys.argv[1:]
    from jaxpar.distributed import ensure_host_devices

    ensure_host_devices(8)
    from jaxpar.analysis import activations as A
    from jaxpar.analysis import temporaries as T
    from jaxpar.analysis.compiled import AOT_COMPILER_OPTIONS, analyze_layout
    from jaxpar.config import load_config
    from jaxpar.layout import ParallelLayout

    cfg = load_config(
        cfgfile, ov + ["--config.model.compute_dtype=float32", "--config.parallel.grad_reduce_dtype=float32"]
    )
    opts = dict(AOT_COMPILER_OPTIONS) | {"xla_dump_to": dump, "xla_dump_hlo_as_text": True}
    mem = analyze_layout(cfg, compiler_options=opts).memory
    lay = ParallelLayout.from_config(cfg)
    MiB = 2**20
    print(
        f"temp {mem.temp_bytes / MiB:.2f} est {mem.estimated_temp_bytes / MiB:.2f} ratio {mem.temp_ratio:.3f} "
        f"peak {mem.peak_ratio:.3f}"
    )
    d = A.Dims.of(cfg.model, lay)
    print(
        f"units MiB: ebsh {d.e * d.b * d.s * d.h / MiB:.3f} ebsf {d.e * d.b * d.s * d.f / MiB:.3f} F32*bns2 {4 * d.b * d.n * d.s * d.s / MiB:.3f} "
        f"ebsv {d.e * d.b * d.s * d.v / MiB:.3f} layer_w {d.e * A.layer_params(cfg.model, lay) / MiB:.3f}"
    )
    for t in T.stage_temps(cfg.model, lay):
        print("  ", {k: (round(v / MiB, 3) if isinstance(v, float) else v) for k, v in t.to_dict().items()})
    subprocess.run(
        [sys.executable, str(pathlib.Path(__file__).resolve().parents[2] / "live_set.py"), dump, "--top", "45"]
    )


if __name__ == "__main__":
    main()
