"""Every conditional config field (``jaxpar/acts.py``): refused in one line where it cannot act,
accepted where it can, and there it changes what runs (the lowered train step, or the data read);
``docs/config_fields.md`` is the table as generated."""

from __future__ import annotations

import os
import pathlib

import jax
import numpy as np
import pytest

from jaxpar import acts
from jaxpar.config import ConfigError, apply_overrides, default_config, validate
from jaxpar.data import load_bin, stdlib_files
from jaxpar.layout import ParallelLayout
from tests.helpers import ROOT, make_setup, tiny_config

D8 = ["--config.mesh.data=8", "--config.mesh.tensor=1"]  # no tensor, context or pipeline axis
BLOCKWISE = ["--config.model.attention=blockwise"]
FP16 = ["--config.model.compute_dtype=float16"]
DEEPSEEK = [
    "--config.model.name=deepseek_v3",
    "--config.model.num_experts=4",
    "--config.model.router_score=sigmoid",
    *(f"--config.model.{f}=16" for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")),
    "--config.model.moe_mlp_dim=32",
]
# field -> (a value away from the default, overrides where it cannot act, overrides where it acts)
CASES: dict[str, tuple[str, list[str], list[str]]] = {
    "parallel.sequence_parallel": ("True", D8, []),
    "parallel.context_exchange": (
        "all_gather",
        [],
        ["--config.mesh.data=2", "--config.mesh.context=2", *BLOCKWISE],
    ),
    "parallel.cross_node_tensor": ("True", D8, []),
    "parallel.max_replicated_fraction": ("0.5", [], ["--config.parallel.zero_stage=3"]),
    "model.rope_theta": ("500000.0", ["--config.model.position=learned"], []),
    "model.rope_scaling": ("llama3", ["--config.model.position=learned"], []),
    **{
        f"model.{name}": (value, [], ["--config.model.rope_scaling=llama3"])
        for name, value in (
            ("rope_scaling_factor", "16.0"),
            ("rope_low_freq_factor", "2.0"),
            ("rope_high_freq_factor", "8.0"),
            ("rope_original_max_seq_len", "4096"),
        )
    },
    "model.attention_block": ("16", ["--config.model.attention=dot_product"], BLOCKWISE),
    "model.eos_token_id": ("5", [], ["--config.model.attention_mask=block_causal"]),
    "optim.min_lr_ratio": ("0.5", ["--config.optim.schedule=constant"], []),
    "optim.decay_steps": ("50", ["--config.optim.schedule=constant"], []),
    "optim.decay_start_step": ("5", ["--config.optim.schedule=constant"], []),
    "optim.warmup_type": ("log", ["--config.optim.warmup_steps=0"], []),
    "optim.warmup_init_lr": ("1e-5", ["--config.optim.warmup_steps=0"], []),
    "data.path": ("x.bin", [], ["--config.data.source=bin"]),
    "data.token_dtype": ("uint32", [], ["--config.data.source=bin", "--config.data.path=x.bin"]),
    "data.val_fraction": ("0.5", ["--config.data.source=synthetic"], []),
    **{
        f"model.{name}": (value, [], ["--config.model.num_experts=4"])
        for name, value in (
            ("experts_per_token", "1"),
            ("router_score", "sigmoid"),
            ("router_norm_topk", "False"),
            ("moe_aux_loss_coeff", "0.01"),
            ("moe_z_loss_coeff", "0.001"),
            ("moe_capacity_factor", "1.25"),
            ("shared_expert_dim", "64"),
            ("moe_dispatch", "dense"),
        )
    },
    "train.loss_scale.static": ("128", [], FP16),
    **{
        f"train.loss_scale.{name}": (value, [], FP16)
        for name, value in (
            ("initial_scale_power", "12"),
            ("window", "10"),
            ("hysteresis", "3"),
            ("min_scale", "2.0"),
            ("rule", "megatron"),
            ("consecutive_hysteresis", "True"),
        )
    },
    **{
        f"model.{name}": (value, [], [*DEEPSEEK, *extra])
        for name, value, extra in (
            ("q_lora_rank", "16", []),
            ("kv_lora_rank", "8", []),
            ("qk_nope_head_dim", "8", []),
            ("qk_rope_head_dim", "8", []),
            ("v_head_dim", "8", []),
            ("first_dense_layers", "1", []),
            ("moe_mlp_dim", "16", []),
            ("router_groups", "2", []),
            ("router_group_topk", "2", ["--config.model.router_groups=2"]),
            ("router_scale", "2.5", []),
            ("router_bias_rate", "0.001", []),
        )
    },
    "parallel.pipeline_schedule": (
        "gpipe",
        [],
        ["--config.mesh.pipeline=2", "--config.mesh.data=2", "--config.parallel.microbatches=2"],
    ),
    **{
        f"parallel.{name}": (
            value,
            [],
            ["--config.mesh.pipeline=2", "--config.mesh.data=2", "--config.parallel.microbatches=2"],
        )
        for name, value in (("layers_per_stage", "1,3"), ("first_stage_layers", "1"), ("last_stage_layers", "3"))
    },
    "parallel.virtual_stages": (
        "2",
        [],
        [
            "--config.mesh.pipeline=2",
            "--config.mesh.data=2",
            "--config.parallel.pipeline_schedule=interleaved",
            "--config.parallel.microbatches=2",
        ],
    ),
}
SLOW = os.environ.get("JAXPAR_SLOW") == "1"


def test_every_condition_has_a_case():
    assert sorted(CASES) == sorted(acts.CONDITIONS)


@pytest.mark.parametrize("field", sorted(CASES))
def test_refused_where_it_cannot_act_and_accepted_where_it_can(field):
    value, inert, active = CASES[field]
    cond = acts.CONDITIONS[field]
    with pytest.raises(ConfigError) as refused:
        validate(tiny_config(*inert, f"--config.{field}={value}"))
    message = str(refused.value)
    assert message.startswith(f"{field}=") and " has no effect here: " in message
    assert f"it acts only when {cond.when} (" in message and "\n" not in message
    assert all(name in message for name in cond.names)
    validate(tiny_config(*active, f"--config.{field}={value}"))  # accepted where it acts
    validate(tiny_config(*inert))  # and the default stays accepted where it does not


def test_a_condition_reading_a_declared_field_includes_its_condition():
    """What lets :func:`acts.reset_inert` settle every field in one pass (its docstring)."""
    for field, cond in acts.CONDITIONS.items():
        for name in cond.names:
            if name in acts.CONDITIONS:
                assert set(acts.CONDITIONS[name].names) <= set(cond.names), (field, name)
                assert acts.CONDITIONS[name].when in cond.when, (field, name)


def _lowered(*overrides: str) -> str:
    return make_setup(tiny_config(*overrides)).lower_train_step().as_text()


# where it acts, each changes the lowered step (a few in the default suite, all under JAXPAR_SLOW=1)
IN_THE_STEP = [
    "parallel.sequence_parallel",
    "model.rope_theta",
    "model.rope_scaling",
    "model.rope_scaling_factor",
    "model.rope_low_freq_factor",
    "model.rope_high_freq_factor",
    "model.rope_original_max_seq_len",
    "optim.min_lr_ratio",
    "optim.warmup_type",
    "parallel.context_exchange",
    "model.attention_block",
    "optim.decay_steps",
    "optim.decay_start_step",
    "optim.warmup_init_lr",
    "parallel.pipeline_schedule",
    "parallel.layers_per_stage",
    "parallel.first_stage_layers",
    "parallel.last_stage_layers",
    "model.experts_per_token",
    "model.router_score",
    "model.router_norm_topk",
    "model.moe_aux_loss_coeff",
    "model.moe_z_loss_coeff",
    "model.moe_capacity_factor",
    "model.shared_expert_dim",
    "model.moe_dispatch",
    "train.loss_scale.static",
    "train.loss_scale.window",
    "train.loss_scale.hysteresis",
    "train.loss_scale.min_scale",
    "train.loss_scale.rule",
    "train.loss_scale.consecutive_hysteresis",
]  # parallel.virtual_stages: the interleaved schedule needs it >= 2, so it has no step without it to compare;
# model.eos_token_id: block_causal needs one (tests/test_documents.py shows the mask in the model's loss)
DEFAULT_STEP = {"parallel.sequence_parallel", "optim.min_lr_ratio", "model.attention_block"}


@pytest.mark.parametrize(
    "field",
    [
        f if f in DEFAULT_STEP else pytest.param(f, marks=pytest.mark.skipif(not SLOW, reason="JAXPAR_SLOW=1"))
        for f in IN_THE_STEP
    ],
)
def test_where_it_acts_it_changes_the_lowered_step(field):
    value, _, active = CASES[field]
    active = [*active, "--config.optim.warmup_steps=4", "--config.train.steps=20"]
    assert _lowered(*active, f"--config.{field}={value}") != _lowered(*active)


def test_data_fields_change_what_is_read(tmp_path):
    assert stdlib_files(0.05) != stdlib_files(0.5)
    path = tmp_path / "tokens.bin"
    np.arange(4096, dtype=np.uint16).tofile(path)
    as16 = load_bin(str(path), "uint16", 0.05, 1 << 16)
    as32 = load_bin(str(path), "uint32", 0.05, 1 << 32)
    assert len(as16["train"]) != len(as32["train"])


# dims that data=8 does not divide: ZeRO-3 must replicate most parameters
ODD_DIMS = ["--config.model.embed_dim=36", "--config.model.head_dim=10", "--config.model.mlp_dim=100"]


def test_max_replicated_fraction_decides_the_zero3_guard():
    for fraction, passes in (("1.0", True), ("0.0", False)):
        cfg = tiny_config(
            *D8,
            *ODD_DIMS,
            "--config.parallel.zero_stage=3",
            f"--config.parallel.max_replicated_fraction={fraction}",
        )
        try:
            make_setup(cfg)
        except ConfigError as e:
            assert not passes and "max_replicated_fraction" in str(e), str(e)
        else:
            assert passes


def test_the_docs_table_is_current():
    written = pathlib.Path(ROOT / "docs" / "config_fields.md").read_text()
    assert written == acts.markdown(default_config())
    assert written.count("\n| `") == len(acts.table(default_config()))


@pytest.mark.parametrize("field", sorted(CASES))
def test_reset_inert_puts_back_each_field_that_cannot_act(field):
    value, inert, active = CASES[field]
    defaults = default_config()
    cfg = tiny_config(*inert)
    apply_overrides(cfg, [f"--config.{field}={value}"])  # typed, not validated: validate refuses it
    assert acts.reset_inert(cfg, defaults) == [field]
    assert acts._value(cfg, field) == acts._value(defaults, field)
    validate(cfg)
    kept = tiny_config(*active, f"--config.{field}={value}")
    before = acts._value(kept, field)
    assert acts.reset_inert(kept, defaults) == [] and acts._value(kept, field) == before  # where it acts it stays


def test_derived_configs_drop_what_becomes_inert():
    from jaxpar.analysis.aot import layout_config
    from jaxpar.train.state import one_device_checkpoint_state

    # one device: no pipeline, tensor, context or ZeRO-3 left for these fields to act on
    cfg = tiny_config(
        "--config.mesh.data=1",
        "--config.mesh.tensor=2",
        "--config.mesh.pipeline=2",
        "--config.mesh.context=2",
        *BLOCKWISE,
        "--config.parallel.microbatches=2",
        "--config.parallel.pipeline_schedule=gpipe",
        "--config.parallel.sequence_parallel=True",
        "--config.parallel.context_exchange=all_gather",
        "--config.parallel.zero_stage=0",
    )
    validate(cfg)
    params, _ = one_device_checkpoint_state(cfg)
    assert jax.tree.leaves(params)
    # a planned layout without the source's tensor axis or ZeRO-3 (plan --aot, compare --aot, sweep)
    src = tiny_config(*D8, "--config.parallel.zero_stage=3", "--config.parallel.max_replicated_fraction=0.5")
    validate(src)
    out = layout_config(src, ParallelLayout(8, 1, zero_stage=1, seq_len=src.train.seq_len, pipeline_schedule="gpipe"))
    assert out.parallel.max_replicated_fraction == default_config().parallel.max_replicated_fraction
    assert out.parallel.pipeline_schedule == default_config().parallel.pipeline_schedule
