"""Fuzz: generated bad values for every config field, through a config file and through
``--config.x=v`` overrides; each must be refused in one line naming the field.

The oracle is the table below (independent of jaxpar/config/): for every field, values outside
its domain. A new field without an entry fails :func:`test_every_field_has_bad_values`.
"""

from __future__ import annotations

import math

import pytest

from jaxpar.config import ConfigError, default_config, flatten, load_config, merge_into_defaults, validate
from tests import fuzzkit

NAN, INF = math.nan, math.inf
SIZE = [0, -1, 2**40]  # a dimension or mesh size: positive and no larger than any machine
# Fields whose domain other agents own (model.name; the optimizer schedule fields): only type errors here.
OTHERS = ("model.name", "optim.decay_steps", "optim.warmup_init_lr", "optim.schedule_offset", "optim.decay_start_step")
BAD: dict[str, list] = {
    "mesh.data": SIZE,
    "mesh.tensor": SIZE,
    "mesh.pipeline": SIZE,
    "mesh.context": [*SIZE, 3],
    "mesh.expert": [*SIZE, 2],  # 2: the tiny model is dense
    "parallel.zero_stage": [-1, 4],
    "parallel.sequence_parallel": [],
    "parallel.cross_node_tensor": [],
    "parallel.grad_reduce_dtype": ["float16", ""],
    "parallel.context_exchange": ["ulysses", ""],
    "parallel.max_replicated_fraction": [-0.1, 1.5, NAN],
    "model.vocab_size": SIZE,
    "model.embed_dim": SIZE,
    "model.num_layers": SIZE,
    "model.num_heads": SIZE,
    "model.num_kv_heads": [*SIZE, 3],
    "model.head_dim": [*SIZE, 31],
    "model.mlp_dim": SIZE,
    "model.max_seq_len": [0, -3, 2**40],
    "model.rope_theta": [0.0, -1.0, NAN, INF],
    "model.rope_scaling": ["yarn", "", "Llama3"],
    "model.rope_scaling_factor": [0.5, 0.0, -8.0, NAN, INF],
    "model.rope_low_freq_factor": [0.0, -1.0, NAN, INF],
    "model.rope_high_freq_factor": [0.0, 1.0, -4.0, NAN, INF],
    "model.rope_original_max_seq_len": SIZE,
    "model.norm_eps": [0.0, -1e-5, NAN, INF],
    "model.tie_embeddings": [],
    "model.mlp_activation": ["relu"],
    "model.norm": ["batchnorm"],
    "model.position": ["alibi"],
    "parallel.recompute": ["sometimes"],
    "model.attention": ["flash", ""],
    "model.attention_block": [0, -16],
    "model.attention_mask": ["document", ""],
    "model.eos_token_id": [5, -2],  # with the default causal mask it acts nowhere
    "model.compute_dtype": ["int8"],
    "model.param_dtype": ["float64"],
    "model.init_std": [0.0, -0.02, NAN, INF],
    "model.dropout": [-0.1, 1.0, 1.5, NAN, INF, -INF],
    "model.attention_dropout": [-1e-9, 1.0, 2.0, NAN, INF],
    "model.qk_norm": [],
    "model.num_experts": [-1, 1, 2**40],
    "model.experts_per_token": [0, 9],
    "model.router_score": ["relu", ""],
    "model.router_norm_topk": [],
    "model.moe_aux_loss_coeff": [-0.1, NAN, INF],
    "model.moe_z_loss_coeff": [-1.0, NAN],
    "model.moe_capacity_factor": [-1.25, NAN, INF],
    "model.shared_expert_dim": [-1, 2**40],
    "model.moe_dispatch": ["alltoall", ""],
    # deepseek_v3's fields: refused by the acts table on other families, by their domains on it
    **{f"model.{name}": [-1, 2**40] for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim")},
    "model.qk_rope_head_dim": [-2, 3],
    "model.moe_mlp_dim": [-1, 2**40],
    "model.first_dense_layers": [-1],
    "model.router_groups": [0, -1],
    "model.router_group_topk": [0, -1],
    "model.router_scale": [-1.0, NAN, INF],
    "model.router_bias_rate": [-0.1, NAN],
    "optim.name": ["rmsprop", "no/such/file.py:make"],
    "optim.momentum": [0.5, NAN],
    "optim.nesterov": [True],
    "optim.lr": [0.0, -1.0, NAN, INF],
    "optim.min_lr_ratio": [-0.1, 1.5, NAN],
    "optim.warmup_steps": [-1],
    "optim.schedule": ["bogus"],
    "optim.warmup_type": ["bogus"],
    "optim.b1": [-0.1, 1.0, NAN, INF],
    "optim.b2": [-0.1, 1.0, 1.5, NAN],
    "optim.eps": [-1.0, NAN, INF],
    "optim.weight_decay": [-0.1, NAN, INF],
    "optim.decoupled_weight_decay": [],
    "optim.clip_norm": [-1.0, NAN],
    "train.steps": [-1],
    "train.global_batch": [0, -8],
    "parallel.microbatches": [0, -1, 3],
    "train.seq_len": [0, 1, 100000],
    "train.seed": [-1, 2**40],
    "train.workdir": ["", "   ", "@FILE"],
    "train.log_every": [-1],
    "train.eval_every": [-1],
    "train.eval_batches": [-1],
    "train.resume": ["latest", "-1", "\u00b2"],
    "train.init_from": ["/nonexistent/weights"],
    "train.warmup_steps_excluded": [-1],
    "train.spike_factor": [0.5, 1.0, -1.0, NAN, INF],
    "train.max_bad_steps": [0],
    "train.profile_steps": ["5", "3,2", "0,1", "a,b", "1,2,3"],
    "train.inject_bad_steps": ["a", "1,,x", "-1", "\u00b2"],
    "train.loss_scale.static": [-1.0, NAN, INF],
    "train.loss_scale.initial_scale_power": [-1, 65],
    "train.loss_scale.window": [0, -1],
    "train.loss_scale.hysteresis": [0, -1],
    "train.loss_scale.min_scale": [0.0, -1.0, NAN, 2.0**20],  # above 2**initial_scale_power (16)
    "train.loss_scale.consecutive_hysteresis": [],
    "train.loss_scale.rule": ["torch", ""],
    "data.source": ["web"],
    "data.path": ["/tmp/tokens.bin"],
    "data.token_dtype": ["int8"],
    "data.val_fraction": [0.0, 1.0, NAN, -0.5],
    "parallel.pipeline_schedule": ["zigzag"],
    "parallel.virtual_stages": [0, -1],
    "parallel.layers_per_stage": ["a", "1,,2", "-1,2", "1;2"],
    "parallel.first_stage_layers": [-1],
    "parallel.last_stage_layers": [-1],
    "checkpoint.every": [-1],
    "checkpoint.keep": [0, -1],
}
FIELDS = flatten(default_config().to_dict())


def _wrong_types(default) -> list:
    """Values of another type than the field's default (ints are fine for float fields)."""
    if isinstance(default, bool):
        return [1, "true", None, [True]]
    if isinstance(default, int):
        return ["7", 1.5, None, True, [1]]
    if isinstance(default, float):
        return ["x", None, True, [1.0]]
    return [None, [default], {"a": 1}, 1.5]


def _text(value) -> str:
    return {NAN: "nan", INF: "inf"}.get(value, str(value)) if isinstance(value, float) else str(value)


def _cases(tmp_path) -> list[tuple[str, object]]:
    afile = tmp_path / "a_file"
    afile.write_text("not a folder")
    return [(key, str(afile) if v == "@FILE" else v) for key, values in BAD.items() for v in values]


def test_every_field_has_bad_values():
    assert sorted(BAD) == sorted(k for k in FIELDS if k not in OTHERS)


def _refused_naming(family: str, key: str, value, fn) -> None:
    try:
        message = fuzzkit.expect_refused(family, fn)
    except AssertionError as e:
        raise AssertionError(f"{key}={value!r}: {str(e)[:300]}") from None
    section, field = key.split(".")[0], key.split(".")[-1]  # train.loss_scale.window: train, window
    assert field in message or section in message, f"{key}={value!r}: the message does not name it: {message}"


def test_out_of_domain_values_in_a_config_file_are_refused(tmp_path):
    for key, value in _cases(tmp_path):
        _refused_naming(
            "config: out-of-domain value (file)",
            key,
            value,
            lambda k=key, v=value: validate(merge_into_defaults({k: v}, source="cfg.py")),
        )


def test_out_of_domain_values_as_overrides_are_refused(tmp_path):
    for key, value in _cases(tmp_path):
        _refused_naming(
            "config: out-of-domain value (override)",
            key,
            value,
            lambda k=key, v=value: load_config(None, [f"--config.{k}={_text(v)}"]),
        )


def test_values_of_the_wrong_type_are_refused():
    for key, default in FIELDS.items():
        for value in _wrong_types(default):
            if key == "train.resume" and isinstance(value, float):
                continue  # a number is a step number there; 1.5 is refused by the domain check instead
            fuzzkit.expect_refused("config: wrong type (file)", lambda k=key, v=value: merge_into_defaults({k: v}))
        if not isinstance(default, str):
            fuzzkit.expect_refused(
                "config: wrong type (override)",
                lambda k=key, d=default: load_config(None, [f"--config.{k}=not-a-{type(d).__name__}"]),
            )


@pytest.mark.parametrize(
    "override, word",
    [
        ("--config.mesh.data=100000000000000000000", "mesh"),  # 10^20: no cluster
        ("--config.train.steps=99999999999999999999999999999999999999999999999", None),  # accepted? must be bounded
        ("--config.model.embed_dim=" + "9" * 5000, "embed_dim"),  # past Python's int-string limit
    ],
)
def test_absurd_numbers(override, word):
    message, cfg = fuzzkit.expect_refused_or_ok("config: absurd number", load_config, None, [override])
    if word is None:  # a huge step count is a long run, not an error: it must at least load as that count
        assert message is None and cfg.train.steps > 10**40
    else:
        assert message is not None and word in message


def test_pathological_keys_and_nesting():
    deep: dict = {}
    node = deep
    for _ in range(5000):
        node["x"] = {}
        node = node["x"]
    for tree in ({"model": None}, {"model": {"embed_dim": {"a": 1}}}, {1: 2}, {"": 1}, {"model.": 1}, deep):
        fuzzkit.expect_refused("config: pathological structure", merge_into_defaults, tree)
    with pytest.raises(ConfigError):
        load_config(None, ["--config.model.embed_dim"])
