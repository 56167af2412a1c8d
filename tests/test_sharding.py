"""The rules table and the ZeRO-3 guard against silent under-sharding."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.config import ConfigError, validate
from jaxpar.mesh import make_mesh
from jaxpar.train.state import Setup
from tests.helpers import tiny_config


def _setup(n, *overrides):
    cfg = tiny_config(*overrides)
    layout = validate(cfg)
    return Setup(cfg, layout, make_mesh(layout, jax.devices()[:n]))


def test_megatron_rules_and_zero_dims():
    s = _setup(8, "--config.mesh.data=4", "--config.mesh.tensor=2", "--config.parallel.zero_stage=3")
    lay = s.train_form.placements
    assert lay["blocks"]["attn"]["wq"].compute == P(None, None, "tensor", None)  # column-parallel QKV
    assert lay["blocks"]["attn"]["wo"].compute == P(None, "tensor", None, None)  # row-parallel output
    assert lay["blocks"]["mlp"]["w_down"].compute == P(None, "tensor", None)
    assert lay["embed"].compute == P("tensor", None)  # vocabulary-parallel
    # ZeRO-3 splits the largest dim the tensor rules leave alone (never `layers`) over data.
    assert lay["blocks"]["attn"]["wq"].storage == P(None, "data", "tensor", None)
    assert lay["blocks"]["mlp"]["w_up"].storage == P(None, "data", "tensor")
    assert lay["embed"].storage == P("tensor", "data")
    assert not lay["blocks"]["attn_norm"]["scale"].weight_decay and lay["embed"].weight_decay
    assert s.replicated_fraction == 0.0


def test_zero3_guard_refuses_silent_replication():
    # data=3 divides no model dim left to ZeRO: nearly every byte would stay replicated.
    with pytest.raises(ConfigError, match=r"ZeRO-3 leaves 100.0% of parameter bytes replicated over data"):
        _setup(
            3,
            "--config.mesh.data=3",
            "--config.mesh.tensor=1",
            "--config.parallel.zero_stage=3",
            "--config.train.global_batch=3",
        )
    allowed = _setup(
        3,
        "--config.mesh.data=3",
        "--config.mesh.tensor=1",
        "--config.parallel.zero_stage=3",
        "--config.train.global_batch=3",
        "--config.parallel.max_replicated_fraction=1.0",
    )
    assert allowed.replicated_fraction == 1.0
    # ZeRO-1/2 keep parameters replicated by design: no guard.
    _setup(
        3,
        "--config.mesh.data=3",
        "--config.mesh.tensor=1",
        "--config.parallel.zero_stage=2",
        "--config.train.global_batch=3",
    )
