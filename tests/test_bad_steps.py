"""Bad steps: NaN/Inf or spiking losses skip the update (state unchanged), are counted, and a run of
them rolls back to the last checkpoint and skips the offending data."""

import json

import jax
import numpy as np

from jaxpar.config import validate
from jaxpar.train.loop import BadStepGuard, Trainer
from tests.helpers import run_steps, tiny_config


def _rows(trainer):
    return [json.loads(x) for x in open(trainer.log.path).read().splitlines()]


def test_skipped_update_leaves_state_bitwise_unchanged():
    _, _, setup = run_steps(tiny_config("--config.mesh.data=4", "--config.mesh.tensor=2"), 0)
    params, opt = setup.init(0)
    rows = np.random.default_rng(0).integers(0, 256, size=(8, 65))
    before = jax.device_get((params, opt))
    for kwargs in ({"max_loss": 0.0}, {"loss_offset": float("nan")}, {"loss_offset": float("inf")}):
        params, opt, metrics = setup.train_step(params, opt, setup.feed.make_batch(rows), **kwargs)
        assert int(metrics["skipped"]) == 1, kwargs
        for a, b in zip(jax.tree.leaves(jax.device_get((params, opt))), jax.tree.leaves(before), strict=True):
            np.testing.assert_array_equal(a, b)
    params, opt, metrics = setup.train_step(params, opt, setup.feed.make_batch(rows))
    assert int(metrics["skipped"]) == 0 and int(opt["count"]) == 1


def test_spike_threshold_follows_running_median():
    guard = BadStepGuard(spike_factor=4.0)
    assert guard.max_loss() == float("inf")  # not enough history yet
    for loss in [2.0] * 9 + [3.0]:
        guard.observe(loss, skipped=False)
    assert guard.max_loss() == 8.0
    guard.observe(50.0, skipped=True)
    guard.observe(60.0, skipped=True)
    assert (guard.consecutive, guard.total, guard.max_loss()) == (2, 2, 8.0)  # skipped losses not in history
    guard.observe(2.0, skipped=False)
    assert guard.consecutive == 0 and guard.total == 2


def test_injected_nan_batches_are_skipped_and_counted(tmp_path):
    cfg = tiny_config(
        "--config.mesh.data=4",
        "--config.mesh.tensor=2",
        "--config.train.steps=6",
        f"--config.train.workdir={tmp_path}",
        "--config.train.inject_bad_steps=3,4",
    )
    trainer = Trainer(cfg, validate(cfg), echo=lambda _: None, progress=False)
    trainer.run()
    steps = [r for r in _rows(trainer) if "loss" in r]
    assert [r["skipped"] for r in steps] == [0, 0, 1, 1, 0, 0]
    assert [r["bad_steps_total"] for r in steps] == [0, 0, 1, 2, 2, 2]
    assert np.isfinite(steps[-1]["loss"]) and int(trainer.opt_state["count"]) == 4  # 6 steps, 2 skipped


def test_consecutive_bad_steps_roll_back_and_skip_the_data(tmp_path):
    cfg = tiny_config(
        "--config.mesh.data=4",
        "--config.mesh.tensor=2",
        "--config.train.steps=6",
        f"--config.train.workdir={tmp_path}",
        "--config.checkpoint.every=2",
        "--config.train.max_bad_steps=2",
        "--config.train.inject_bad_steps=4,5",
    )
    messages = []
    trainer = Trainer(cfg, validate(cfg), echo=messages.append, progress=False)
    trainer.run()
    events = [r for r in _rows(trainer) if "rollback_to" in r]
    assert len(events) == 1 and events[0]["step"] == 5 and events[0]["rollback_to"] == 2
    assert events[0]["data_position"]["step"] == 5  # batches 4 and 5 are not seen again
    assert any("rolled back to the checkpoint of step 2" in m for m in messages)
    assert trainer.step == 6 and int(trainer.opt_state["count"]) == 6  # steps 3..6 redone on new data
    assert trainer.batches.state()["step"] == 9  # 6 good + 2 bad batches + 1 replacing step 3's redo
