"""Re-estimate a logged run of tests/test_memory_random.py without compiling: the compiled temporaries
in the log do not depend on the estimate, so a changed estimate can be held against them again.

    python experiments/results/2026-12-04-memory-six/reestimate_random.py LOG SEED [LOG SEED ...]
"""

from __future__ import annotations

import os
import pathlib
import random
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
os.environ["JAXPAR_SLOW"] = "1"  # the slow draws


def _same(a: str, b: str) -> bool:
    """The same draw: logs written before the expert axis lack ``expert=1``, and before jaxpar.acts a
    dot-product draw printed its drawn (inert) attention block instead of the default."""

    def norm(x: str) -> str:
        x = x.replace(", expert=1)", ")")
        return re.sub(r"attention_block=\d+", "", x) if "attention='dot_product'" in x else x

    return norm(a) == norm(b)


def evaluate(log: str, seed: int) -> None:
    import test_memory_random as T

    from jaxpar.analysis import temporaries as TE
    from jaxpar.analysis.estimate import estimated_argument_bytes

    rows = re.findall(r"case (\d+): (.*?)\n    temp ([\d.]+) MiB est ([\d.]+)", pathlib.Path(log).read_text())
    out = []
    for case, desc, temp, _ in rows:
        rng = random.Random(seed * 1000 + int(case))
        for _ in range(T.TRIES):  # the draw that the log compiled (later redraws may follow a compile error)
            name, model, lay = T._draw(rng)
            if lay.devices <= T.DEVICES and _same(f"{name} {model} {lay}", desc):
                break
        else:
            raise SystemExit(f"case {case}: no draw of seed {seed} gives {desc!r}")
        cfg = T._config(name, model, lay)
        compiled = float(temp) * 2**20
        est = TE.estimated_temp_bytes(cfg.model, lay)
        args = estimated_argument_bytes(cfg.model, lay, "jaxpar", cfg.optim)
        out.append((compiled / est, (args + compiled) / (args + est), case, desc))
    bad = [o for o in out if abs(o[0] - 1) > T.TEMP_BOUND or abs(o[1] - 1) > T.PEAK_BOUND]
    print(
        f"{log} seed {seed}: {len(out)} layouts, compiled/est temp {min(o[0] for o in out):.3f}-"
        f"{max(o[0] for o in out):.3f}, peak {min(o[1] for o in out):.3f}-{max(o[1] for o in out):.3f}; "
        f"outside the bounds: {len(bad)}"
    )
    for o in bad:
        print(f"    temp {o[0]:.3f} peak {o[1]:.3f} case {o[2]}: {o[3]}")


if __name__ == "__main__":
    args = sys.argv[1:]
    for log, seed in zip(args[::2], args[1::2]):
        evaluate(log, int(seed))
