"""The step loop never makes the host wait: the only per-step device-to-host transfer is the read of
step n's metrics, after step n+1 is dispatched; the spike threshold is computed on the device, bit for
bit the host rule; steady-state figures never include the compiling step."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config import validate
from jaxpar.metrics import MetricsLog
from jaxpar.train.guard import WINDOW, BadStepGuard, SpikeThreshold
from jaxpar.train.loop import Trainer
from tests.helpers import tiny_config

STEPS, CHECKPOINT_EVERY, BAD = 7, 4, 2  # steps 4 (checkpoint) and 7 (last) sync; batch 2 is made NaN


def _array_impl():
    return type(jax.numpy.zeros(()))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run whose every host read of a jax.Array and every step dispatch is logged, in order.

    Every way of getting a jax.Array's values onto the host (``jax.device_get``, ``np.asarray``,
    ``float()``, ``.item()``, printing) goes through ``ArrayImpl._value``; a read is one that finds no
    host copy yet. ``jax.transfer_guard_device_to_host("disallow")`` wraps each dispatch too, but on
    CPU it never fires (the buffers are host memory already), so the log is what the test checks."""
    cfg = tiny_config(
        "--config.mesh.data=4",
        "--config.mesh.tensor=2",
        f"--config.train.steps={STEPS}",
        f"--config.train.workdir={tmp_path_factory.mktemp('loop')}",
        "--config.train.eval_batches=1",
        f"--config.checkpoint.every={CHECKPOINT_EVERY}",
        f"--config.train.inject_bad_steps={BAD}",
    )
    messages: list[str] = []
    trainer = Trainer(cfg, validate(cfg), echo=messages.append, progress=False)
    events: list[tuple] = []
    step_fn = trainer.setup.train_step

    def dispatch(*args, **kwargs):
        with jax.transfer_guard_device_to_host("disallow"):
            out = step_fn(*args, **kwargs)
        events.append(("dispatch", out[2]))  # keeps the metrics alive: their ids stay theirs
        return out

    impl = _array_impl()
    value = impl._value

    def logged(self):
        if self._npy_value is None:
            events.append(("read", self))
        return value.fget(self)

    trainer.setup.train_step = dispatch
    impl._value = property(logged)
    try:
        trainer.run()
    finally:
        impl._value = value
    return trainer, events, messages


def test_only_per_step_transfer_is_the_delayed_metrics_read(run):
    _, events, _ = run
    dispatches = [i for i, e in enumerate(events) if e[0] == "dispatch"]
    assert len(dispatches) == STEPS
    owner = {id(leaf): step for step, i in enumerate(dispatches, 1) for leaf in jax.tree.leaves(events[i][1])}
    reads: dict[int, list[int]] = {}  # step -> event indices of its metric reads
    others = []  # event indices of reads of anything else during the loop
    for i, e in enumerate(events[dispatches[0] :], dispatches[0]):
        if e[0] == "read":
            if id(e[1]) in owner:
                reads.setdefault(owner[id(e[1])], []).append(i)
            else:
                others.append(i)
    assert sorted(reads) == list(range(1, STEPS + 1))
    assert all(len(r) == len(owner) // STEPS for r in reads.values())  # each metric read once
    for step in range(1, STEPS + 1):
        after = dispatches[step] if step < STEPS else len(events)  # the next dispatch
        if step % CHECKPOINT_EVERY and step < STEPS:
            assert dispatches[step] < min(reads[step]), (
                f"step {step}: metrics read before step {step + 1} was dispatched"
            )
        else:  # a sync step: read before the next dispatch (the checkpoint needs to know the step was good)
            assert max(reads[step]) < after
    # anything else read during the loop (the checkpoint's state) is read while no step is in flight
    sync_windows = [
        (max(reads[s]), dispatches[s] if s < STEPS else len(events))
        for s in range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY)
    ]
    stray = [i for i in others if i < max(reads[STEPS]) and not any(a < i < b for a, b in sync_windows)]
    assert not stray, [events[i][1].shape for i in stray]


def test_delayed_read_reports_the_bad_step_under_its_own_number(run):
    trainer, _, messages = run
    rows = [r for r in map(json.loads, open(trainer.log.path).read().splitlines()) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["skipped"] for r in rows] == [float(s == BAD) for s in range(1, STEPS + 1)]
    assert [r["bad_steps_total"] for r in rows] == [float(s >= BAD) for s in range(1, STEPS + 1)]
    assert any(m.startswith(f"step {BAD}: update skipped (loss nan") for m in messages), messages
    assert f"step {BAD}: loss is nan" in messages
    assert trainer.checkpoints.steps() == [CHECKPOINT_EVERY, STEPS]
    assert trainer.batches.state()["step"] == STEPS  # no batch drawn beyond the last step
    assert all(r["step_time_s"] > 0 for r in rows)


def test_device_threshold_is_the_host_rule_bit_for_bit():
    mesh = jax.make_mesh((8,), ("data",))
    replicated = NamedSharding(mesh, P())
    rng = np.random.default_rng(0)
    for factor in (5.0, 1.3, 0.0):
        device, host = SpikeThreshold(factor, replicated), BadStepGuard(factor)
        thresholds = []
        for step in range(WINDOW + 40):  # past a full window, odd and even counts
            inject = step == 3
            guard = np.asarray(device.guard(inject=inject))
            assert np.isnan(guard[1]) if inject else guard[1] == 0
            assert np.float32(guard[0]) == np.float32(host.max_loss()), (factor, step)
            thresholds.append(guard[0])
            loss, skipped = np.float32(rng.uniform(1, 3)), int(rng.random() < 0.2)
            device.dispatched(
                {"loss": jax.device_put(loss, replicated), "skipped": jax.device_put(np.int32(skipped), replicated)}
            )
            host.observe(float(loss), bool(skipped))
        finite = np.isfinite(thresholds)
        assert finite.any() == (factor != 0) and not finite[: BadStepGuard.MIN_HISTORY].any()
    count = int(device.count)
    device.dispatched(
        {"loss": jax.device_put(np.float32(2), replicated), "skipped": jax.device_put(np.int32(0), replicated)}
    )
    device.discard()  # a thrown-away step (rollback): its metrics are not folded in
    device.guard()
    assert int(device.count) == count


def test_steady_state_leaves_out_the_compiling_step(tmp_path):
    for warmup in (0, 3):
        log = MetricsLog(str(tmp_path), 1.0, 1.0, 1, warmup, write=False)
        log.record(5, 9.0, 10, {})  # the first step after a resume: it compiled
        assert log.steady_state() == {}
        for step in (6, 7):
            log.record(step, 0.5, 10, {})
        steady = log.steady_state()
        assert steady["steps"] == 2 and steady["median_step_time_s"] == 0.5 and steady["tokens_per_s"] == 20.0
