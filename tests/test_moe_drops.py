"""The dropped-choice metric of capacity dropping (``moe_dropped``, ``moe_dropped_choices``): the
exact count of one layer against numpy's count of the same routing; a step's count summed over its
layers and microbatches, the same on a sharded layout as on one device; 0 when dropless."""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import load_config
from jaxpar.models import moe
from tests.helpers import FP32_SMALL, ROOT, run_steps


def _numpy_dropped(experts: np.ndarray, seq: int, num_experts: int, cap: int) -> int:
    """GShard's priority by hand: per sequence, every token's first choice (in position order), then
    every second choice, ...; a choice is dropped once its expert has taken ``cap`` of them."""
    rows, k = experts.shape
    dropped = 0
    for start in range(0, rows, seq):
        taken = [0] * num_experts
        for slot in range(k):
            for t in range(start, start + seq):
                e = int(experts[t, slot])
                if taken[e] >= cap:
                    dropped += 1
                else:
                    taken[e] += 1
    return dropped


def test_layer_count_equals_numpy_count_of_the_same_routing():
    b, s, h, f, num_experts, k = 3, 16, 8, 4, 4, 2
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (b, s, h))
    p = {
        "router": jax.random.normal(keys[1], (h, num_experts)),
        "w_gate": jax.random.normal(keys[2], (num_experts, h, f)),
        "w_up": jax.random.normal(keys[3], (num_experts, h, f)),
        "w_down": jax.random.normal(keys[4], (num_experts, f, h)),
    }
    settings = moe.MoeSettings(num_experts, k, capacity_factor=0.5)
    cap = moe.capacity(s, settings)
    assert cap == math.ceil(0.5 * s * k / num_experts) == 4
    _, experts, _ = moe.route(moe.router_logits(x.reshape(b * s, h), p["router"]), settings)
    want = _numpy_dropped(np.asarray(experts), s, num_experts, cap)
    assert want > 0  # a capacity of 4 of 32 choices per expert and sequence must drop here

    def out(probe):
        s_probe = dataclasses.replace(settings, probe=probe)
        return jnp.sum(moe.moe_mlp(x, p, s_probe, jnp.float32, lambda a: a, lambda a: a))

    counts = jax.grad(out)(jnp.zeros((2,), jnp.float32))
    np.testing.assert_array_equal(counts, [want, b * s * k])
    # the probe leaves the layer's output as it is
    assert float(out(jnp.zeros((2,)))) == float(out(None))


SLOW = os.environ.get("JAXPAR_SLOW") == "1"
TINY = str(ROOT / "configs" / "tiny_mixtral.py")
SMALL = [*FP32_SMALL, "--config.model.num_layers=2", "--config.train.seq_len=32", "--config.train.global_batch=8"]


_RUNS: dict[tuple[str, ...], dict] = {}


def _first_step(*overrides: str) -> dict:
    if overrides not in _RUNS:
        _RUNS[overrides] = run_steps(load_config(TINY, [*SMALL, *overrides]), 1)[0][0]
    return _RUNS[overrides]


CAPACITY = ("--config.model.moe_capacity_factor=0.5",)
ONE = ("--config.mesh.data=1", "--config.mesh.expert=1")


@pytest.mark.skipif(
    not SLOW, reason="JAXPAR_SLOW=1: a training step's compile (the layer's count is checked by default)"
)
def test_step_reports_the_share_of_routed_choices_dropped():
    one = _first_step(*CAPACITY, *ONE)
    routed = 2 * 8 * 32 * 2  # layers x sequences x tokens x top-k
    assert 0 < one["moe_dropped_choices"] < routed
    assert one["moe_dropped"] == np.float32(one["moe_dropped_choices"]) / np.float32(routed)
    dropless = _first_step(*ONE)
    assert dropless["moe_dropped"] == dropless["moe_dropped_choices"] == 0.0


@pytest.mark.skipif(not SLOW, reason="JAXPAR_SLOW=1: a second layout's compile (~15 s)")
def test_sharded_step_counts_the_same_choices():
    """data=2 x expert=2 with 2 microbatches: the same routing, counted over shards and microbatches."""
    sharded = _first_step(
        *CAPACITY, "--config.mesh.data=2", "--config.mesh.expert=2", "--config.parallel.microbatches=2"
    )
    assert sharded["moe_dropped_choices"] == _first_step(*CAPACITY, *ONE)["moe_dropped_choices"]
