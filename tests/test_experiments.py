"""The accelerator benchmark script runs end to end (its --quick CPU shape) and reports its figures."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from tests.helpers import child_env

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_bench_train_quick_reports_step_time_tokens_and_mfu():
    env = child_env()
    out = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "bench_train.py"), "--quick", "--steps", "6", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["platform"] == "cpu" and summary["devices"] == 8 and summary["zero_stage"] == 3
    assert summary["global_batch"] == 64 and summary["steady_steps"] == 3
    # mean throughput over the steady steps vs the median step: equal up to step-time jitter
    assert summary["step_time_s"] > 0
    assert 0.5 < summary["tokens_per_s"] * summary["step_time_s"] / (summary["global_batch"] * 128) < 2
    assert 0 < summary["mfu"] < 1 and summary["params"] > 0


def test_bench_train_bad_flag_is_one_line_exit_2():
    out = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "bench_train.py"), "--quick", "--config.model.num_heads=3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "num_heads" in out.stderr


_CENSUS_HLO = """HloModule m, entry_computation_layout={(f32[8,16]{1,0})->f32[8,16]{1,0}}

%fused_add (p0: f32[8,16], p1: f32[16,8]) -> f32[8,16] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[16,8]{1,0} parameter(1)
  %t = f32[8,16]{1,0} transpose(%p1), dimensions={1,0}
  ROOT %a = f32[8,16]{1,0} add(%p0, %t)
}

%sum (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (c: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %c = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %v = f32[8,16]{1,0} get-tuple-element(%c), index=1
  %r = f32[8,16]{1,0} all-reduce(%v), channel_id=1, replica_groups={{0,1}}, to_apply=%sum
  %w = f32[16,8]{1,0} copy(%v)
  %f = f32[8,16]{1,0} fusion(%r, %w), kind=kLoop, calls=%fused_add
  ROOT %o = (s32[], f32[8,16]{1,0}) tuple(%i, %f)
}

%cond (c: (s32[], f32[8,16])) -> pred[] {
  %c = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[8,16]) -> f32[8,16] {
  %a = f32[8,16]{1,0} parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], f32[8,16]{1,0}) tuple(%z, %a)
  %wl = (s32[], f32[8,16]{1,0}) while(%t), condition=%cond, body=%body
  ROOT %out = f32[8,16]{1,0} get-tuple-element(%wl), index=1
}
"""


def test_hlo_census_counts_ops_per_step_through_loops_and_fusions():
    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        import hlo_census
    finally:
        sys.path.pop(0)
    c = hlo_census.census(_CENSUS_HLO)
    loop_bytes = 3 * 8 * 16 * 4  # 3 trips of one f32[8,16]
    assert c["top"]["all-reduce"] == [3, loop_bytes] and c["top"]["copy"] == [3, loop_bytes]
    assert c["top"]["fusion (kLoop)"] == [3, loop_bytes]
    assert c["top"]["while"] == [1, 8 * 16 * 4 + 4]  # the loop state: s32 counter + f32[8,16]
    assert c["fused"] == {"transpose": [3, loop_bytes]}  # inside the fusion; the reducer is not counted
    assert "add" not in c["top"] and "compare" in c["top"]  # the reducer's add is not a step op


def test_sweep_load_note_reads_the_load_before_the_sweep():
    from jaxpar.analysis.sweep.report import _load_note

    assert _load_note({"host_cores": 2, "load_average_before": (0.3, 0.2, 0.1)}).startswith(
        "the host was otherwise idle"
    )
    assert _load_note({"host_cores": 2, "load_average_before": (4.2, 3.0, 2.0)}) == (
        "other jobs were running when the sweep started (1-minute load 4.2 on 2 cores)"
    )
