"""Every layout computes the same training step as one device (fp32, relative error < 1e-5)."""

import os

import jax
import numpy as np
import pytest

from tests.helpers import max_rel_error, run_steps, tiny_config

STEPS = 3
# Run with JAXPAR_SLOW=1 only: their strategies train in the default run at other sizes (zero2_d4_m2,
# d4_t2_zero3_sp, tp2_sp, d2_t2_zero3, zero1_d8): the default suite's 15-minute budget.
SLOW = pytest.mark.skipif(os.environ.get("JAXPAR_SLOW") != "1", reason="JAXPAR_SLOW=1: covered at other sizes")
# (name, overrides): issue 2's layouts plus every strategy of the seed and the hybrids.
LAYOUTS = [
    pytest.param("data4_tensor2", ["--config.mesh.data=4", "--config.mesh.tensor=2"], marks=SLOW),
    ("dp8", ["--config.mesh.data=8", "--config.mesh.tensor=1"]),
    ("zero1_d8", ["--config.mesh.data=8", "--config.mesh.tensor=1", "--config.parallel.zero_stage=1"]),
    ("zero2_d8", ["--config.mesh.data=8", "--config.mesh.tensor=1", "--config.parallel.zero_stage=2"]),
    (
        "zero2_d4_m2",
        [
            "--config.mesh.data=4",
            "--config.mesh.tensor=1",
            "--config.parallel.zero_stage=2",
            "--config.parallel.microbatches=2",
        ],
    ),
    ("zero3_d8", ["--config.mesh.data=8", "--config.mesh.tensor=1", "--config.parallel.zero_stage=3"]),
    pytest.param("tp2", ["--config.mesh.data=1", "--config.mesh.tensor=2"], marks=SLOW),
    ("tp2_sp", ["--config.mesh.data=1", "--config.mesh.tensor=2", "--config.parallel.sequence_parallel=true"]),
    pytest.param(
        "d2_t2_zero1", ["--config.mesh.data=2", "--config.mesh.tensor=2", "--config.parallel.zero_stage=1"], marks=SLOW
    ),
    ("d2_t2_zero3", ["--config.mesh.data=2", "--config.mesh.tensor=2", "--config.parallel.zero_stage=3"]),
    pytest.param(
        "d4_t2_zero2_m2",
        [
            "--config.mesh.data=4",
            "--config.mesh.tensor=2",
            "--config.parallel.zero_stage=2",
            "--config.parallel.microbatches=2",
            "--config.parallel.sequence_parallel=true",
        ],
        marks=SLOW,
    ),
    # aborted XLA:CPU (rendezvous mismatch) before the head's collectives were ordered after the layer scan
    (
        "d4_t2_zero3_sp",
        [
            "--config.mesh.data=4",
            "--config.mesh.tensor=2",
            "--config.parallel.zero_stage=3",
            "--config.parallel.sequence_parallel=true",
            "--config.parallel.recompute=none",
        ],
    ),
]


@pytest.fixture(scope="module")
def reference():
    history, params, setup = run_steps(tiny_config("--config.mesh.data=1", "--config.mesh.tensor=1"), STEPS)
    assert setup.train_step._cache_size() == 1
    return history, params


@pytest.mark.parametrize("name, overrides", LAYOUTS, ids=[getattr(p, "values", p)[0] for p in LAYOUTS])
def test_layout_matches_single_device(reference, name, overrides):
    ref_history, ref_params = reference
    history, params, setup = run_steps(tiny_config(*overrides), STEPS)
    for got, want in zip(history, ref_history):
        assert abs(got["loss"] - want["loss"]) / want["loss"] < 1e-5, (name, got, want)
        assert abs(got["grad_norm"] - want["grad_norm"]) / want["grad_norm"] < 1e-5, (name, got, want)
    assert max_rel_error(params, ref_params) < 1e-5
    # Three steps, one compilation: the second step does not recompile.
    assert setup.train_step._cache_size() == 1


@SLOW
def test_tensor8_where_shapes_allow():
    wide = ["--config.model.num_heads=8", "--config.model.num_kv_heads=8", "--config.model.head_dim=16"]
    _, ref_params, _ = run_steps(tiny_config("--config.mesh.data=1", "--config.mesh.tensor=1", *wide), 1)
    history, params, _ = run_steps(tiny_config("--config.mesh.data=1", "--config.mesh.tensor=8", *wide), 1)
    assert np.isfinite(history[0]["loss"])
    assert max_rel_error(params, ref_params) < 1e-5


def test_params_are_sharded_not_replicated():
    """ZeRO-3 x TP: each device holds 1/8 of a block weight, not a full copy."""
    _, _, setup = run_steps(
        tiny_config("--config.mesh.data=4", "--config.mesh.tensor=2", "--config.parallel.zero_stage=3"), 0
    )
    params, _ = setup.init(0)
    wq = params["blocks"]["attn"]["wq"]
    shard = wq.addressable_shards[0].data
    assert shard.size * 8 == wq.size
    assert {s.data.shape for s in wq.addressable_shards} == {shard.shape}
    del params
    jax.clear_caches()
