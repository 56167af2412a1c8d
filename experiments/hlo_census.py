"""Where a compiled train step spends its work: an op census of the optimized HLO, per step.

For each input (a jaxpar config, compiled ahead of time on simulated CPU devices, or an optimized
HLO text file such as MaxText's ``--xla_dump_to`` dump), every instruction outside fused and
reducer computations is counted as many times as it runs per step (while bodies x trip count,
:func:`jaxpar.analysis.hlo.executions`), with the bytes it writes; fusions are split by kind, and
the data-movement ops hidden inside fusions (copy, transpose, convert, dynamic-(update-)slice,
concatenate, pad) are counted too. The columns put the inputs side by side, so "moves fewer bytes
but runs slower" can be traced to ops (more collectives, more copies, a transpose per layer).

    python experiments/hlo_census.py configs/maxtext_tiny.py:dp8 configs/maxtext_tiny.py:fsdp8 \\
        --hlo mt_fsdp8=/tmp/maxtext-hlo/fsdp8/module_0123.jit_train_step.cpu_after_optimizations.txt
    python experiments/hlo_census.py configs/maxtext_tiny.py:fsdp8 --json out.json

MaxText's HLO: ``MT_DUMP_HLO=1 ../shared/peers/maxtext/run_layout.sh fsdp8 ici_fsdp_parallelism=8``
(any MaxText run with ``--xla_dump_to`` and ``--xla_dump_hlo_as_text``); pass the
``*after_optimizations.txt`` file of its train step.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
MOVES = (
    "copy",
    "transpose",
    "convert",
    "dynamic-slice",
    "dynamic-update-slice",
    "concatenate",
    "pad",
    "broadcast",
    "select",
    "scatter",
    "gather",
)
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")
_KIND = re.compile(r"\bkind=(k\w+)")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_APPLY = re.compile(r"\bto_apply=%?([\w.\-]+)")


def census(text: str) -> dict[str, dict[str, float]]:
    """``{"top": {op: [runs, bytes]}, "fused": {op: [runs, bytes]}}`` per step of the module's entry."""
    from jaxpar.analysis.hlo import executions, fused_computations, parse_hlo, shape_bytes

    entry, comps = parse_hlo(text)
    runs = executions(entry, comps, warnings=[])
    fused = fused_computations(comps)
    applied = {c for instrs in comps.values() for ins in instrs for c in _APPLY.findall(ins.attrs)}
    top: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    inside: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])

    def add(table, key, n, ins):
        table[key][0] += n
        try:
            table[key][1] += n * shape_bytes(ins.type_text)
        except ValueError:
            pass

    def walk_fused(comp: str, n: int, seen: tuple[str, ...] = ()) -> None:
        for ins in comps.get(comp, []):
            if ins.opcode in MOVES or ins.opcode in ("dot", "convolution"):
                add(inside, ins.opcode, n, ins)
            for callee in _CALLS.findall(ins.attrs):  # nested fusions
                if callee not in seen:
                    walk_fused(callee, n, (*seen, callee))

    for comp, instrs in comps.items():
        n = runs.get(comp, 0)
        if not n or comp in fused or comp in applied:
            continue
        for ins in instrs:
            if ins.opcode in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast") or ins.opcode.endswith(
                "-done"
            ):
                continue
            key = ins.opcode.removesuffix("-start")
            if key == "fusion":
                kind = _KIND.search(ins.attrs)
                key = f"fusion ({kind.group(1) if kind else '?'})"
                for callee in _CALLS.findall(ins.attrs):
                    walk_fused(callee, n, (callee,))
            add(top, key, n, ins)
    return {"top": {k: v for k, v in top.items()}, "fused": {k: v for k, v in inside.items()}}


def jaxpar_hlo(config: str) -> str:
    """Optimized HLO text of a jaxpar config's train step (AOT on simulated CPU devices)."""
    from jaxpar.analysis.compiled import mesh_for
    from jaxpar.config import load_config_and_layout
    from jaxpar.train.state import Setup

    cfg, layout = load_config_and_layout(config)
    return Setup(cfg, layout, mesh_for(layout)).lower_train_step().compile().as_text()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", help="jaxpar configs (path[:preset]) to compile")
    parser.add_argument(
        "--hlo",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="an optimized HLO text file (e.g. MaxText's dump), repeatable",
    )
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--json", default=None, help="also write the census as JSON here")
    args = parser.parse_args(argv)
    from jaxpar.distributed import ensure_host_devices

    ensure_host_devices(args.devices)
    columns: dict[str, dict] = {}
    for config in args.configs:
        name = config.rsplit("/", 1)[-1].replace(".py", "")
        columns[name] = census(jaxpar_hlo(config if "/" in config or config.endswith(".py") else str(ROOT / config)))
    for spec in args.hlo:
        name, _, path = spec.partition("=")
        columns[name] = census(pathlib.Path(path).read_text())
    if not columns:
        parser.error("give at least one config or --hlo NAME=FILE")
    for part, title in (("top", "ops per step (outside fusions)"), ("fused", "ops inside fusions, per step")):
        keys = sorted(
            {k for c in columns.values() for k in c[part]},
            key=lambda k: (k not in COLLECTIVES, -max(c[part].get(k, [0, 0])[1] for c in columns.values())),
        )
        print(f"\n{title}: count / MB written")
        print(f"{'op':<26}" + "".join(f"{n[:24]:>26}" for n in columns))
        for k in keys:
            cells = [c[part].get(k) for c in columns.values()]
            print(
                f"{k:<26}"
                + "".join(f"{'-':>26}" if v is None else f"{int(v[0]):>12} {v[1] / 1e6:>12.2f}" for v in cells)
            )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(columns, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
