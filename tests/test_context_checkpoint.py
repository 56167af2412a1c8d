"""Checkpoints of a context-parallel run read outside their layout: ``jaxpar export`` and the
drill's final-state comparison place them on one device (``one_device_checkpoint_state``), which
must reset every mesh axis, ``context`` included."""

from __future__ import annotations

import jax
import numpy as np

from jaxpar.port import weights
from tests.helpers import FP32_SMALL, TINY, tiny_config


def test_export_and_drill_compare_read_a_context_parallel_checkpoint(tmp_path, capsys):
    from jaxpar import drill
    from jaxpar.cli import main
    from jaxpar.config import validate
    from jaxpar.train.loop import Trainer

    overrides = [
        f"--config.train.workdir={tmp_path / 'run'}",
        "--config.data.source=synthetic",
        "--config.checkpoint.every=1",
        "--config.train.steps=1",
        "--config.mesh.data=2",
        "--config.mesh.tensor=2",
        "--config.mesh.context=2",
        "--config.model.attention=blockwise",
    ]
    cfg = tiny_config(*overrides)
    trainer = Trainer(cfg, validate(cfg), echo=lambda _: None, progress=False)
    trainer.initialize()
    trainer.train_step()
    trainer.save()
    trainer.close()  # what run() closes: the TensorBoard writer too, left to atexit otherwise
    assert trainer.log.tensorboard.writer.all_writers is None
    trainer.close()  # a second close does nothing
    want, _ = trainer.setup.to_model_order(trainer.params, trainer.opt_state)
    out = tmp_path / "hf"
    assert main(["export", "--config", TINY, "-o", str(out), *FP32_SMALL, *overrides]) == 0, capsys.readouterr().err
    got = weights.load_hf(out, cfg.model)
    for a, b in zip(jax.tree.leaves(jax.device_get(want)), jax.tree.leaves(got), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert drill._same_final_state(cfg, tmp_path / "run", tmp_path / "run")
