"""Checkpoints: exact resume, restore onto other layouts, damaged checkpoints, SIGTERM."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxpar.checkpoint import Checkpointer
from jaxpar.config import ConfigError, validate
from jaxpar.mesh import make_mesh
from jaxpar.train.loop import Trainer
from jaxpar.train.state import Setup
from tests.helpers import ROOT, TINY, tiny_config


def _trainer(workdir, steps, *extra):
    cfg = tiny_config(
        "--config.mesh.data=4",
        "--config.mesh.tensor=2",
        f"--config.train.steps={steps}",
        f"--config.train.workdir={workdir}",
        "--config.checkpoint.every=3",
        *extra,
    )
    return Trainer(cfg, validate(cfg), echo=lambda _: None, progress=False)


def _losses(workdir):
    rows = [json.loads(x) for x in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_resume_is_bitwise_identical(tmp_path):
    straight = _trainer(tmp_path / "a", 6)
    straight.run()
    first = _trainer(tmp_path / "b", 6)  # the same run, preempted after step 4
    step_fn = first.train_step

    def preempt_after_four():
        row = step_fn()
        if first.step == 4:
            first.stop_signal = signal.SIGTERM
        return row

    first.train_step = preempt_after_four
    assert first.run() == {"preempted": True, "step": 4}
    resumed = _trainer(tmp_path / "b", 6)
    resumed.run()
    assert _losses(tmp_path / "b") == _losses(tmp_path / "a")  # same per-step losses, bit for bit
    for a, b in zip(jax.tree.leaves(jax.device_get(straight.params)), jax.tree.leaves(jax.device_get(resumed.params))):
        np.testing.assert_array_equal(a, b)
    assert Checkpointer(str(tmp_path / "b"), 3, 3).steps() == [3, 4, 6]


def _setup(overrides, n):
    cfg = tiny_config(*overrides)
    layout = validate(cfg)
    return Setup(cfg, layout, make_mesh(layout, jax.devices()[:n]))


def test_restore_onto_other_layouts(tmp_path):
    source = _setup(["--config.mesh.data=8", "--config.mesh.tensor=1", "--config.parallel.zero_stage=3"], 8)
    params, opt = source.init(7)
    ckpt = Checkpointer(str(tmp_path), 1, 2)
    ckpt.save(1, params, opt, {"step": 1}, source.cfg)
    ckpt.wait()
    want = jax.device_get({"params": params, "opt_state": opt})
    targets = [
        (["--config.mesh.data=4", "--config.mesh.tensor=2", "--config.parallel.zero_stage=1"], 8),
        (
            [
                "--config.mesh.data=2",
                "--config.mesh.tensor=2",
                "--config.mesh.pipeline=2",
                "--config.parallel.zero_stage=1",
                "--config.parallel.microbatches=2",
            ],
            8,
        ),
        (["--config.mesh.data=2", "--config.mesh.tensor=2", "--config.parallel.zero_stage=3"], 4),
        (
            [
                "--config.mesh.data=2",
                "--config.mesh.tensor=2",
                "--config.mesh.pipeline=2",
                "--config.parallel.zero_stage=3",
                "--config.parallel.microbatches=2",
            ],
            8,
        ),
        (["--config.mesh.data=1", "--config.mesh.tensor=1"], 1),
    ]
    for overrides, n in targets:
        target = _setup(overrides, n)
        p, o, _ = target.abstract_state(model_form=True)
        step, state, meta = Checkpointer(str(tmp_path), 1, 2).restore({"params": p, "opt_state": o})
        assert step == 1 and meta["data"] == {"step": 1}
        got = jax.device_get(state)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)
        wq = state["params"]["blocks"]["attn"]["wq"]
        assert wq.sharding.spec == target.train_form.param_specs["blocks"]["attn"]["wq"]  # landed in the new layout


def test_damaged_checkpoint_falls_back_then_fails(tmp_path):
    setup = _setup(["--config.mesh.data=8", "--config.mesh.tensor=1"], 8)
    params, opt = setup.init(0)
    messages = []
    ckpt = Checkpointer(str(tmp_path), 1, 3, echo=messages.append)
    for step in (1, 2):
        ckpt.save(step, params, opt, {"step": step}, setup.cfg)
    ckpt.wait()
    newest = pathlib.Path(ckpt.directory) / "2" / "state"
    for f in newest.rglob("*"):
        if f.is_file() and f.stat().st_size > 0 and "zarr" not in f.name:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # truncate every data file
    p, o, _ = setup.abstract_state()
    step, _, _ = ckpt.restore({"params": p, "opt_state": o})
    assert step == 1 and len(messages) == 2 and "checkpoint 2" in messages[0] and "\n" not in messages[0]
    assert messages[1].startswith("removed damaged checkpoint(s) [2]") and ckpt.steps() == [1]
    wrong = _setup(["--config.mesh.data=8", "--config.mesh.tensor=1", "--config.model.embed_dim=64"], 8)
    p, o, _ = wrong.abstract_state()
    with pytest.raises(ConfigError, match="no usable checkpoint"):
        ckpt.restore({"params": p, "opt_state": o})


def test_sigterm_checkpoints_and_exits_zero(tmp_path):
    workdir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "jaxpar",
        "train",
        "--config",
        TINY,
        "--no-progress",
        "--config.train.steps=1000",
        "--config.train.global_batch=8",
        "--config.train.seq_len=64",
        f"--config.train.workdir={workdir}",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = workdir / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and '"loss"' in metrics.read_text()):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert "SIGTERM: checkpoint of step" in out
    step = int(out.split("SIGTERM: checkpoint of step ")[1].split()[0])
    assert Checkpointer(str(workdir), 0, 3).steps() == [step]


def test_interleaved_pipeline_checkpoints_in_model_layer_order(tmp_path):
    """Interleaved stages store layers permuted; checkpoints hold the model's order, so they
    restore onto a layout without pipeline (and back) with identical values."""
    from jaxpar.parallel import pipeline

    pp = _setup(
        [
            "--config.mesh.data=2",
            "--config.mesh.tensor=2",
            "--config.mesh.pipeline=2",
            "--config.parallel.pipeline_schedule=interleaved",
            "--config.parallel.virtual_stages=2",
            "--config.parallel.microbatches=2",
        ],
        8,
    )
    params, opt = pp.init(3)
    model_order = pipeline.to_model_form(jax.device_get(params), 2, 2)
    ckpt = Checkpointer(str(tmp_path), 1, 2)
    ckpt.save(1, *pp.to_model_order(params, opt), {"step": 1}, pp.cfg)
    ckpt.wait()
    flat = _setup(["--config.mesh.data=4", "--config.mesh.tensor=2"], 8)
    p, o, _ = flat.abstract_state(model_form=True)
    _, state, _ = ckpt.restore({"params": p, "opt_state": o})
    for a, b in zip(jax.tree.leaves(jax.device_get(state["params"])), jax.tree.leaves(model_order), strict=True):
        np.testing.assert_array_equal(a, b)
    p, o, _ = pp.abstract_state(model_form=True)
    _, state, _ = ckpt.restore({"params": p, "opt_state": o})
    back, _ = pp.from_model_order(state["params"], state["opt_state"])
    for a, b in zip(jax.tree.leaves(jax.device_get(back)), jax.tree.leaves(jax.device_get(params)), strict=True):
        np.testing.assert_array_equal(a, b)
    ckpt.close()
