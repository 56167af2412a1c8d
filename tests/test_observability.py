"""Run observability: TensorBoard events equal to metrics.jsonl, config.json reloads, profile traces."""

import json
import os

import numpy as np
import pytest

from jaxpar.config import ConfigError, flatten, merge_into_defaults, validate
from jaxpar.metrics import read_event_scalars, read_metrics
from jaxpar.train.loop import LOSS_UNIT, Trainer, profile_range
from tests.helpers import tiny_config

STEPS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One short data=8 run with a trace of steps 2-4 (3 steps)."""
    workdir = tmp_path_factory.mktemp("obs") / "run"
    cfg = tiny_config(
        "--config.mesh.data=8",
        "--config.mesh.tensor=1",
        f"--config.train.steps={STEPS}",
        f"--config.train.workdir={workdir}",
        "--config.train.eval_batches=1",
        "--config.train.profile_steps=2,4",
    )
    lines = []
    Trainer(cfg, validate(cfg), echo=lines.append, progress=False).run()
    return cfg, workdir, lines


def test_tensorboard_events_hold_the_losses_of_metrics_jsonl(run):
    _, workdir, _ = run
    rows = [r for r in read_metrics(str(workdir / "metrics.jsonl")) if "loss" in r]
    scalars = read_event_scalars(str(workdir))
    assert [s for s, _ in scalars["train/loss"]] == [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # event files store float32: the jsonl losses (float32 values printed as float64) round-trip exactly
    assert [v for _, v in scalars["train/loss"]] == [float(np.float32(r["loss"])) for r in rows]
    for tag in ("train/grad_norm", "train/step_time_s", "train/tokens_per_s", "train/mfu", "val/bits_per_byte"):
        assert tag in scalars, tag
    evals = [r["val_bits"] for r in read_metrics(str(workdir / "metrics.jsonl")) if "val_bits" in r]
    assert [v for _, v in scalars["val/bits_per_byte"]] == [float(np.float32(v)) for v in evals]


def test_config_json_reloads_into_the_same_config(run):
    cfg, workdir, _ = run
    saved = json.loads((workdir / "config.json").read_text())
    reloaded = merge_into_defaults(saved, source="config.json")
    assert flatten(reloaded.to_dict()) == flatten(cfg.to_dict())
    assert reloaded.train.profile_steps == "2,4" and reloaded.mesh.data == 8
    assert (workdir / "command.txt").read_text().strip()


def test_profile_steps_write_a_trace(run):
    _, workdir, lines = run
    traces = [
        os.path.join(d, f)
        for d, _, files in os.walk(workdir / "profile")
        for f in files
        if f.endswith((".xplane.pb", ".trace.json.gz"))
    ]
    assert traces and all(os.path.getsize(t) > 0 for t in traces)
    assert any("profile of steps 2-4" in line for line in lines)


def test_eval_batches_zero_trains_without_validation(run, tmp_path):
    """``train.eval_batches=0``: no validation at start or end, nothing logged for it, and the same
    per-step losses as the run with validation (evaluating never touches the training state)."""
    cfg, workdir, _ = run
    lines = []
    quiet = tiny_config(
        "--config.mesh.data=8",
        "--config.mesh.tensor=1",
        f"--config.train.steps={STEPS}",
        f"--config.train.workdir={tmp_path / 'run'}",
        "--config.train.eval_batches=0",
    )
    result = Trainer(quiet, validate(quiet), echo=lines.append, progress=False).run()
    assert "validation: off (train.eval_batches=0)" in lines and not any("validation at step" in x for x in lines)
    assert result["val_start"] is None and result["val_end"] is None
    rows = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert not [r for r in rows if "val_bits" in r]
    with_val = [r["loss"] for r in read_metrics(str(workdir / "metrics.jsonl")) if "loss" in r]
    assert [r["loss"] for r in rows if "loss" in r] == with_val


@pytest.mark.parametrize("bad", ["3", "4,2", "0,1", "a,b", "1,2,3"])
def test_profile_steps_rejects_bad_ranges(bad):
    with pytest.raises(ConfigError, match="train.profile_steps"):
        tiny_config(f"--config.train.profile_steps={bad}")


def test_profile_range_and_loss_unit():
    assert profile_range(tiny_config("--config.train.profile_steps=5,7").train) == (5, 7)
    assert profile_range(tiny_config().train) is None
    assert LOSS_UNIT == "nats/token"
