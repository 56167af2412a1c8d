"""Context parallelism (``mesh.context``) computes the same training step as one device.

fp32, 8 simulated devices, relative error below 1e-5 on the loss, the gradient norm and the
parameters after three steps (so the gradients of every step are checked through the update), the
causal mask included (the sequence is split in 2c load-balanced chunks). The reference is one
device with the ``dot_product`` attention that builds the whole score matrix.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.ops import attention as attn
from jaxpar.ops import context_parallel as cp
from jaxpar.parallel import pipeline
from tests.helpers import max_rel_error, run_steps, tiny_config

STEPS = 3
SLOW = os.environ.get("JAXPAR_SLOW") == "1"
# Blocks of 16 over seq 64: several blocks per chunk at c=2, one (clamped) at c=8.
BLOCKWISE = ["--config.model.attention=blockwise", "--config.model.attention_block=16", "--config.mesh.tensor=1"]


def _layout(context: int, data: int = 1, tensor: int = 1, exchange: str = "ring", zero: int = 0, *extra: str):
    return [
        *BLOCKWISE,
        f"--config.mesh.context={context}",
        f"--config.mesh.data={data}",
        f"--config.mesh.tensor={tensor}",
        f"--config.parallel.context_exchange={exchange}",
        f"--config.parallel.zero_stage={zero}",
        *extra,
    ]


# (name, overrides): the grid. The default suite runs one layout per feature; JAXPAR_SLOW=1 all.
LAYOUTS = [
    ("c4_d2_allgather_z3", _layout(4, 2, 1, "all_gather", 3)),
    ("c2_d2_t2_ring_z3_sp", _layout(2, 2, 2, "ring", 3, "--config.parallel.sequence_parallel=true")),
    (
        "c2_d2_p2_allgather_1f1b",
        _layout(2, 2, 1, "all_gather", 1, "--config.mesh.pipeline=2", "--config.parallel.microbatches=2"),
    ),
]
SLOW_LAYOUTS = [
    ("c2_d4_ring_z1", _layout(2, 4, 1, "ring", 1)),  # the ring trains by default with tensor=2 + SP (session 28)
    ("c8_ring_z3", _layout(8, 1, 1, "ring", 3)),
    ("c2_d2_t2_allgather_z1", _layout(2, 2, 2, "all_gather", 1)),
    ("c2_d4_allgather_z3", _layout(2, 4, 1, "all_gather", 3)),
    ("c4_d2_ring_z1", _layout(4, 2, 1, "ring", 1)),
    ("c8_allgather_z1", _layout(8, 1, 1, "all_gather", 1)),
    ("c4_ring_d2_z3_full_remat", _layout(4, 2, 1, "ring", 3, "--config.parallel.recompute=full")),
    ("c2_d2_t2_ring_z1", _layout(2, 2, 2, "ring", 1)),
    ("c2_d2_t2_allgather_z3", _layout(2, 2, 2, "all_gather", 3)),
    (
        "c2_d4_ring_learned_pos_sp",
        _layout(2, 2, 2, "ring", 0, "--config.model.position=learned", "--config.parallel.sequence_parallel=true"),
    ),
]


@pytest.fixture(scope="module")
def reference():
    history, params, _ = run_steps(tiny_config("--config.mesh.data=1", "--config.mesh.tensor=1"), STEPS)
    return history, params


@pytest.fixture(scope="module")
def reference_learned():
    history, params, _ = run_steps(
        tiny_config("--config.mesh.data=1", "--config.mesh.tensor=1", "--config.model.position=learned"), STEPS
    )
    return history, params


def _check(name, overrides, ref):
    ref_history, ref_params = ref
    history, params, setup = run_steps(tiny_config(*overrides), STEPS)
    assert setup.layout.devices == 8
    for got, want in zip(history, ref_history, strict=True):
        assert abs(got["loss"] - want["loss"]) / want["loss"] < 1e-5, (name, got, want)
        assert abs(got["grad_norm"] - want["grad_norm"]) / want["grad_norm"] < 1e-5, (name, got, want)
    if setup.layout.pipeline > 1:
        params = pipeline.to_model_form(params, setup.layout.pipeline, setup.layout.virtual_stages)
    assert max_rel_error(params, ref_params) < 1e-5, name
    assert setup.train_step._cache_size() == 1


@pytest.mark.parametrize("name, overrides", LAYOUTS, ids=[n for n, _ in LAYOUTS])
def test_context_layout_matches_single_device(reference, name, overrides):
    _check(name, overrides, reference)


@pytest.mark.skipif(not SLOW, reason="JAXPAR_SLOW=1: the rest of the context grid")
@pytest.mark.parametrize("name, overrides", SLOW_LAYOUTS, ids=[n for n, _ in SLOW_LAYOUTS])
def test_context_layout_matches_single_device_slow(reference, reference_learned, name, overrides):
    _check(name, overrides, reference_learned if "learned" in name else reference)


def test_load_balanced_chunks():
    """Rank i holds chunks i and 2c-1-i: every position exactly once, and equal causal work per rank."""
    c, n_local = 4, 6
    pos = cp.all_positions(c, n_local)
    assert sorted(pos.tolist()) == list(range(c * n_local))
    per_rank = pos.reshape(c, n_local)
    assert per_rank[1].tolist() == [3, 4, 5, 18, 19, 20]
    keys_seen = (per_rank + 1).sum(axis=1)  # a causal query at position p sees p + 1 keys
    assert len(set(keys_seen.tolist())) == 1
    for rank in range(c):
        assert np.array_equal(np.asarray(cp.chunk_positions(rank, c, n_local)), per_rank[rank])


@pytest.mark.parametrize("seq", [50] + ([48] if SLOW else []))  # not a multiple of the block (16), and one
def test_blockwise_model_matches_dot_product(seq):
    """One device, whole model: ``blockwise`` gives dot_product's loss and gradients (fp32, 1e-5)."""
    from jaxpar.models import get_model

    cfg = tiny_config("--config.mesh.tensor=1", f"--config.train.seq_len={seq}")
    model = get_model(cfg.model)
    params = model.init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, seq + 1), 0, cfg.model.vocab_size)

    def loss_and_grads(attention):
        ctx = model.shard_context(attention=attention, attention_block=16)
        return jax.jit(jax.value_and_grad(lambda p: model.loss_sum(p, tokens, ctx)))(params)

    (loss_ref, g_ref), (loss, g) = loss_and_grads("dot_product"), loss_and_grads("blockwise")
    assert abs(float(loss) - float(loss_ref)) / abs(float(loss_ref)) < 1e-5
    assert max_rel_error(g, g_ref) < 1e-5


def test_ring_attention_gradients_match_dot_product():
    """The ring's hand-written backward pass (K/V and their gradients around the ring) against autodiff
    of the whole score matrix, on 4 context ranks, GQA, fp32."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]), ("context",))
    b, s, n, kv, d = 2, 32, 4, 2, 8
    q, k, v = (jax.random.normal(jax.random.key(i), (b, s, h, d)) for i, h in enumerate((n, kv, kv)))
    order = cp.all_positions(4, s // 4)  # the load-balanced layout of the sequence over the ranks

    def ring(q, k, v):
        pos = cp.rank_positions("context", q.shape[1])
        return cp.ring_attention(q, k, v, pos, "context", block_q=4, block_kv=4)

    sharded = jax.jit(jax.shard_map(ring, mesh=mesh, in_specs=(P(None, "context"),) * 3, out_specs=P(None, "context")))
    weights = jax.random.normal(jax.random.key(9), (b, s, n, d))

    def loss_ring(q, k, v):
        return jnp.sum(sharded(q[:, order], k[:, order], v[:, order]) * weights[:, order])

    def loss_ref(q, k, v):
        return jnp.sum(attn.dot_product_attention(q, k, v) * weights)

    got, want = jax.grad(loss_ring, (0, 1, 2))(q, k, v), jax.grad(loss_ref, (0, 1, 2))(q, k, v)
    assert abs(float(loss_ring(q, k, v)) - float(loss_ref(q, k, v))) < 1e-4
    for g, w in zip(got, want, strict=True):
        assert float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w))) < 1e-5


def test_long_sequence_memory_is_linear_and_falls_with_context():
    """Compiled temporaries per device, tiny model, fp32, one sequence per data shard: blockwise grows
    at most 2.2x from seq 4096 to 8192 (the score matrix of dot_product grows ~4x: 3.04 -> 11.7 GiB,
    experiments/long_context.py), and context=4 holds at most 0.3x of context=1's at seq 8192."""
    from experiments.long_context import LAYOUTS, compiled_memory, config

    blockwise = {seq: compiled_memory(config(seq, LAYOUTS["d8 blockwise"]))["temp_bytes"] for seq in (4096, 8192)}
    ring4 = compiled_memory(config(8192, LAYOUTS["d2 c4 ring"]))["temp_bytes"]
    assert blockwise[8192] / blockwise[4096] <= 2.2, blockwise
    assert ring4 / blockwise[8192] <= 0.3, (ring4, blockwise)
    assert blockwise[8192] < 1 << 30  # dot_product at 8192: 11.7 GiB per device
