"""The accelerator benchmark script runs end to end (its --quick CPU shape) and reports its figures."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_bench_train_quick_reports_step_time_tokens_and_mfu():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_train.py"), "--quick", "--steps", "6",
                          "--json"], capture_output=True, text=True, env=env, timeout=300, check=True)
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["platform"] == "cpu" and summary["devices"] == 8 and summary["zero_stage"] == 3
    assert summary["global_batch"] == 64 and summary["steady_steps"] == 3
    # mean throughput over the steady steps vs the median step: equal up to step-time jitter
    assert summary["step_time_s"] > 0
    assert 0.5 < summary["tokens_per_s"] * summary["step_time_s"] / (summary["global_batch"] * 128) < 2
    assert 0 < summary["mfu"] < 1 and summary["params"] > 0


def test_bench_train_bad_flag_is_one_line_exit_2():
    out = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_train.py"), "--quick",
                          "--config.model.num_heads=3"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "num_heads" in out.stderr
