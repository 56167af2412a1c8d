"""Compiled temporaries of many layouts, kept, so that the planner's estimate can be held against them
again without compiling (the compiled bytes do not depend on the estimate).

    # compile: the random draws of tests/test_memory_random.py (JAXPAR_SLOW=1 draws) for a seed,
    # or the fixed grid of tests/test_memory_estimate.py (default + slow), one JSON line per layout
    python experiments/memory_grid.py compile --seed 7 --cases 40 -o runs/memory/seed7.jsonl
    python experiments/memory_grid.py compile --grid -o runs/memory/grid.jsonl
    # hold the current estimate against every kept line: ratios compiled / estimate, the layouts
    # outside the bounds (peak 10%, temporaries 15%: the tests' bounds)
    python experiments/memory_grid.py check runs/memory/*.jsonl

``compile --live`` also dumps each compile's buffer assignment and keeps the largest live set of its
temporaries (:mod:`live_set`) beside the allocation: the estimate counts live arrays, and where XLA's
heap packing leaves holes the allocation is larger; ``check`` prints both ratios for such rows.

fp32 compute and reductions, AOT on 8 simulated CPU devices with ``AOT_COMPILER_OPTIONS``: what
``plan --aot`` and the tests compile.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import random
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT), str(ROOT / "experiments")]
MIB = 2**20
# what the compiled step is built from: a row compiled before one of these changed may hold another program
STEP_CODE = ("jaxpar/train", "jaxpar/parallel", "jaxpar/models", "jaxpar/ops", "jaxpar/layout.py", "jaxpar/config")


def _config(name: str, model: dict, layout):
    from jaxpar.analysis.aot import layout_config
    from jaxpar.config import load_config

    cfg = load_config(str(ROOT / "configs" / ("llama_1b.py" if name == "1b" else "tiny.py")))
    for key, value in model.items():
        cfg.model[key] = value
    cfg = layout_config(cfg, layout)
    cfg.model.compute_dtype = cfg.parallel.grad_reduce_dtype = "float32"
    return cfg


def _draws(seed: int, cases: int, only: list[int] | None = None):
    """(label, candidates) per case of the random test's draws for ``seed``: the layouts in the order the
    test draws them; the first that builds and compiles is the case's (a refusal is drawn again, as the
    test does)."""
    os.environ["JAXPAR_SLOW"] = "1"
    import test_memory_random as T

    for case in only or range(cases):
        rng = random.Random(seed * 1000 + case)

        def candidates(rng=rng):
            for _ in range(T.TRIES):
                name, model, layout = T._draw(rng)
                if layout.devices <= T.DEVICES:
                    yield name, model, layout

        yield f"seed {seed} case {case}", candidates()


def _grid():
    os.environ["JAXPAR_SLOW"] = "1"
    import test_memory_estimate as E

    for label, layout in E.GRID.items():
        yield label, iter([("1b" if label.startswith("1b_") else "tiny", {}, layout)])


def _commit() -> str:
    """The worktree's commit (``+`` when the step's code differs from it): what compiled the row."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "diff", "--quiet", "HEAD", "--", *STEP_CODE]).returncode != 0
    return head + ("+" if dirty else "")


def compile_all(items, out: pathlib.Path, dump: pathlib.Path | None = None) -> None:
    """Compile the first buildable draw of each item and append its row to ``out``; with ``dump`` (the
    directory ``XLA_FLAGS=--xla_dump_to`` names) also the largest live set of its temporaries."""
    import shutil

    import jax

    from jaxpar.analysis.compiled import AOT_COMPILER_OPTIONS, analyze_layout
    from jaxpar.config import ConfigError

    stamp = {"commit": _commit(), "jax": jax.__version__}
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        for label, candidates in items:
            t0 = time.perf_counter()
            for name, model, layout in candidates:
                try:
                    cfg = _config(name, model, layout)
                    mem = analyze_layout(cfg, compiler_options=AOT_COMPILER_OPTIONS).memory
                except ConfigError:  # jaxpar cannot run this draw: the next one (the test draws again)
                    continue
                break
            else:
                print(f"{label}: no buildable draw", flush=True)
                continue
            row = {
                "label": label,
                "model_name": name,
                "model": model,
                "layout": dataclasses.asdict(layout),
                "temp_bytes": mem.temp_bytes,
                "argument_bytes": mem.argument_bytes,
                **stamp,
            }
            if dump is not None:  # every module this draw compiled is there; the step is the largest
                from live_set import live_peak_bytes

                allocation, live = live_peak_bytes(dump)
                if allocation == mem.temp_bytes:  # the dump is the step's program
                    row["live_temp_bytes"] = live
                shutil.rmtree(dump, ignore_errors=True)
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(
                f"{label}: temp {mem.temp_bytes / MIB:.2f} MiB, ratio {mem.temp_ratio:.3f}, peak {mem.peak_ratio:.3f} "
                f"({time.perf_counter() - t0:.1f} s)",
                flush=True,
            )


def _stale(row: dict, jax_version: str, cache: dict[str, bool]) -> str:
    """Why ``row``'s compiled bytes may not be the current step's ("" when they are): compiled by another jax,
    or at a commit whose step code (:data:`STEP_CODE`) differs from this worktree's, or unstamped."""
    commit = row.get("commit", "")
    if not commit:
        return "no commit recorded"
    if row.get("jax") != jax_version:
        return f"compiled by jax {row.get('jax')}"
    if commit.endswith("+"):
        return "compiled from uncommitted step code"
    if commit not in cache:
        diff = ["git", "-C", str(ROOT), "diff", "--quiet", commit, "--", *STEP_CODE]
        cache[commit] = subprocess.run(diff, capture_output=True).returncode != 0
    return f"the step's code changed since {commit[:7]}" if cache[commit] else ""


def check(paths: list[str], show: int, stale_ok: bool = False) -> int:
    """Hold the estimate against every kept row; a row whose program may have changed since it was compiled
    (:func:`_stale`) is counted apart, not held against the estimate (``stale_ok``: held anyway)."""
    import jax

    from jaxpar.analysis import temporaries as T
    from jaxpar.analysis.estimate import estimated_argument_bytes
    from jaxpar.config import validate
    from jaxpar.layout import ParallelLayout

    bad_total = rows_total = stale_total = 0
    commits: dict[str, bool] = {}
    for path in paths:
        rows = [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]
        out, stale = [], {}
        for r in rows:
            why = _stale(r, jax.__version__, commits)
            if why and not stale_ok:
                stale[why] = stale.get(why, 0) + 1
                continue
            # the layout the compile ran: the config's validated one, as analyze_layout holds it (the stage
            # split, fields inert on this layout reset), not the row's draw; from_dict reads older rows, which
            # name pipeline_schedule schedule
            cfg = _config(r["model_name"], r["model"], ParallelLayout.from_dict(r["layout"]))
            layout = validate(cfg)
            est = T.estimated_temp_bytes(cfg.model, layout)
            args = estimated_argument_bytes(cfg.model, layout, "jaxpar", cfg.optim)
            temp = r["temp_bytes"] / est
            peak = (r["argument_bytes"] + r["temp_bytes"]) / (args + est)
            live = r["live_temp_bytes"] / est if "live_temp_bytes" in r else None
            out.append((temp, peak, r | {"layout": layout, "live": live}))
        bad = [o for o in out if abs(o[0] - 1) > 0.15 or abs(o[1] - 1) > 0.10]
        bad_total, rows_total = bad_total + len(bad), rows_total + len(out)
        stale_total += sum(stale.values())
        span = (
            f"compiled/est temp {min(o[0] for o in out):.3f}-{max(o[0] for o in out):.3f}, "
            f"peak {min(o[1] for o in out):.3f}-{max(o[1] for o in out):.3f}; "
            if out
            else ""
        )
        print(f"{path}: {len(out)} layouts, {span}outside the bounds: {len(bad)}")
        for why, n in stale.items():
            print(f"    {n} rows not held ({why}): compile them again, or --stale to hold them anyway")
        for temp, peak, r in sorted(bad, key=lambda o: o[0])[:show]:
            lay = {k: v for k, v in vars(r["layout"]).items() if v != getattr(ParallelLayout, k, None)}
            live = "" if r["live"] is None else f" (largest live set / est {r['live']:.3f})"
            print(f"    temp {temp:.3f} peak {peak:.3f}{live} {r['label']}: {r['model_name']} {r['model']} {lay}")
        lives = [o[2]["live"] for o in out if o[2]["live"] is not None]
        if lives:
            print(f"    largest live set / est: {min(lives):.3f}-{max(lives):.3f} over {len(lives)} rows")
    print(
        f"all: {rows_total - bad_total} of {rows_total} within the bounds"
        + (f"; {stale_total} stale rows not held" if stale_total else "")
    )
    return bad_total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile")
    c.add_argument("--seed", type=int)
    c.add_argument("--cases", type=int, default=40)
    c.add_argument("--case", type=int, action="append", help="only these cases of the seed (repeatable)")
    c.add_argument("--grid", action="store_true")
    c.add_argument("-o", "--out", required=True)
    c.add_argument("--live", action="store_true", help="also keep each step's largest live set (XLA dumps)")
    k = sub.add_parser("check")
    k.add_argument("paths", nargs="+")
    k.add_argument("--show", type=int, default=50)
    k.add_argument("--stale", action="store_true", help="hold rows compiled from other step code too")
    a = ap.parse_args()
    if a.cmd == "compile":
        from jaxpar.distributed import ensure_host_devices

        dump = None
        if a.live:  # XLA reads its flags once: one directory, emptied after each draw
            import tempfile

            dump = pathlib.Path(tempfile.mkdtemp(prefix="memory_grid_dump_"))
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()
        ensure_host_devices(8)
        items = _grid() if a.grid else _draws(a.seed, a.cases, a.case)
        compile_all(items, pathlib.Path(a.out), dump)
    else:
        check(a.paths, a.show, a.stale)


if __name__ == "__main__":
    main()
