"""The planner's estimates held against compiled train steps, layout by layout.

For a grid of layouts of ``configs/tiny.py`` and ``configs/llama_1b.py`` on 8 simulated CPU devices
(DP, ZeRO-1/2/3, TP, SP, and 1F1B / interleaved / GPipe pipelines) it compiles the step from
abstract arrays (nothing is allocated) and prints compiled / estimated for the per-device argument
memory, the temporaries (:mod:`jaxpar.analysis.temporaries`; pipelines: the busiest stage), the peak
(arguments + temporaries, GiB per device beside the ratio) and the ring bytes on each mesh axis
(pipeline layouts: the busiest stage on each axis, counted exactly from the schedule). On CPU the
compile and the estimates are in fp32 (plan --aot's dtypes). The tests (tests/test_plan_aot.py,
tests/test_memory_estimate.py) hold the same numbers to 5% (arguments), 15% (temporaries), 10% (peak,
bytes); this prints them all.

    python experiments/plan_vs_compiled.py          # ~1 min on 2 cores
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEQ = 256


def _lay(
    data: int,
    tensor: int,
    pipeline: int,
    virtual: int,
    zero: int,
    m: int,
    b: int,
    seq: int,
    recompute: str = "none",
    sp: bool = False,
    schedule: str = "1f1b",
):
    """A layout (no context axis) from its fields in the order these tables list them."""
    from jaxpar.analysis.estimate import ParallelLayout

    return ParallelLayout(
        data=data,
        tensor=tensor,
        pipeline=pipeline,
        virtual_stages=virtual,
        zero_stage=zero,
        microbatches=m,
        microbatch_size=b,
        seq_len=seq,
        recompute=recompute,
        sequence_parallel=sp,
        pipeline_schedule=schedule,
    )


def layouts():
    tiny = [
        _lay(8 // t, t, 1, 1, z, 2, 16 // (2 * (8 // t)), SEQ, r, sp)
        for t, z, r, sp in (
            (1, 0, "none", False),
            (1, 1, "full", False),
            (1, 2, "none", False),
            (1, 3, "none", False),
            (2, 0, "full", False),
            (2, 3, "selective", False),
            (2, 1, "full", True),
        )
    ]
    tiny += [
        _lay(2, 2, 2, 1, 1, 4, 2, SEQ, "full"),
        _lay(2, 2, 2, 2, 0, 2, 4, SEQ, "full", True, "interleaved"),
        _lay(2, 1, 4, 1, 1, 4, 2, SEQ, "none", False, "gpipe"),
    ]
    big = [
        _lay(8, 1, 1, 1, 3, 2, 1, SEQ, "none"),
        _lay(4, 2, 1, 1, 1, 1, 1, SEQ, "selective"),
        _lay(2, 4, 1, 1, 0, 1, 1, SEQ, "none", True),
        _lay(2, 2, 2, 1, 1, 2, 1, SEQ, "selective", True),
        _lay(1, 2, 4, 2, 0, 4, 1, SEQ, "full", False, "interleaved"),
    ]
    return [("tiny", lay) for lay in tiny] + [("llama_1b", lay) for lay in big]


def main() -> int:
    from jaxpar.distributed import ensure_host_devices

    ensure_host_devices(8)
    from jaxpar.analysis import aot, plan
    from jaxpar.config import load_config

    print(
        f"{'model':<9} {'layout':<78} {'args':>7} {'temp':>7} {'peak':>7} {'peak GiB c/e':>15} {'data':>7} "
        f"{'tensor':>7} {'pipeline':>8}"
    )
    for model, layout in layouts():
        cfg = load_config(str(ROOT / "configs" / f"{model}.py"))
        r = aot.aot_compare(cfg, layout, "jaxpar")
        if r.skipped:
            print(f"{model:<9} {plan.describe(layout):<78} skipped: {r.skipped}")
            continue

        def fmt(values):
            return " ".join(f"{'-' if x is None else f'{x:.4f}':>7}" for x in values)

        peak = f"{r.peak_bytes / 2**30:.3f}/{r.estimated_peak_bytes / 2**30:.3f}"
        print(
            f"{model:<9} {plan.describe(layout):<78} {fmt([r.argument_ratio, r.temp_ratio, r.peak_ratio])} "
            f"{peak:>15} {fmt([r.ratio(axis) for axis in ('data', 'tensor', 'pipeline')])}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
