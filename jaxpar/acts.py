"""When each config field acts: one declaration per conditional field, checked by the config schema.

A field whose effect depends on another's value (``parallel.pipeline_schedule`` does nothing without
pipeline stages) is declared here with that condition; :func:`check` refuses it set away from its
default where the condition is false, naming both fields, so no accepted value is silently inert.
Undeclared fields act whenever set; the optimizer fields follow
:func:`jaxpar.optim.fields.optimizer_fields`, listed here too so :func:`table` covers the schema.
``docs/config_fields.md`` is :func:`markdown` written out. Configs derived from a valid one go
through :func:`reset_inert`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jaxpar.errors import ConfigError
from jaxpar.optim.fields import COMMON_FIELDS, optimizer_fields


@dataclasses.dataclass(frozen=True)
class Condition:
    """``field`` acts only when ``holds(cfg)``; ``when`` says so in words, ``names`` the fields it reads."""

    when: str
    names: tuple[str, ...]
    holds: Callable[[Any], bool]


def _blockwise(c: Any) -> bool:
    # auto runs blockwise wherever cuDNN does not apply (jaxpar.ops.attention.resolve_attention)
    return c.model.attention in ("blockwise", "auto")


def _llama3_rope(c: Any) -> bool:
    return c.model.position == "rope" and c.model.rope_scaling == "llama3"


def _dynamic_loss_scale(c: Any) -> bool:
    return c.model.compute_dtype == "float16" and c.train.loss_scale.static == 0


CONDITIONS: dict[str, Condition] = {
    "parallel.sequence_parallel": Condition("mesh.tensor > 1", ("mesh.tensor",), lambda c: c.mesh.tensor > 1),
    "parallel.context_exchange": Condition("mesh.context > 1", ("mesh.context",), lambda c: c.mesh.context > 1),
    "parallel.cross_node_tensor": Condition(
        "mesh.tensor * mesh.context > 1",
        ("mesh.tensor", "mesh.context"),
        lambda c: c.mesh.tensor * c.mesh.context > 1,
    ),
    "parallel.max_replicated_fraction": Condition(
        "parallel.zero_stage = 3", ("parallel.zero_stage",), lambda c: c.parallel.zero_stage == 3
    ),
    "model.rope_theta": Condition("model.position = rope", ("model.position",), lambda c: c.model.position == "rope"),
    "model.rope_scaling": Condition("model.position = rope", ("model.position",), lambda c: c.model.position == "rope"),
    # they read model.rope_scaling, itself declared: their condition includes its (model.position = rope)
    **{
        f"model.{name}": Condition(
            "model.position = rope and model.rope_scaling = llama3",
            ("model.position", "model.rope_scaling"),
            _llama3_rope,
        )
        for name in (
            "rope_scaling_factor",
            "rope_low_freq_factor",
            "rope_high_freq_factor",
            "rope_original_max_seq_len",
        )
    },
    "model.attention_block": Condition("model.attention is blockwise or auto", ("model.attention",), _blockwise),
    "model.eos_token_id": Condition(
        "model.attention_mask = block_causal",
        ("model.attention_mask",),
        lambda c: c.model.attention_mask == "block_causal",
    ),
    "optim.min_lr_ratio": Condition(
        "optim.schedule is not constant", ("optim.schedule",), lambda c: c.optim.schedule != "constant"
    ),
    "optim.decay_steps": Condition(
        "optim.schedule is not constant", ("optim.schedule",), lambda c: c.optim.schedule != "constant"
    ),
    "optim.decay_start_step": Condition(
        "optim.schedule is not constant", ("optim.schedule",), lambda c: c.optim.schedule != "constant"
    ),
    "optim.warmup_type": Condition(
        "optim.warmup_steps > 0", ("optim.warmup_steps",), lambda c: c.optim.warmup_steps > 0
    ),
    "optim.warmup_init_lr": Condition(
        "optim.warmup_steps > 0", ("optim.warmup_steps",), lambda c: c.optim.warmup_steps > 0
    ),
    "data.path": Condition(
        "data.source is bin or megatron", ("data.source",), lambda c: c.data.source in ("bin", "megatron")
    ),
    "data.token_dtype": Condition("data.source = bin", ("data.source",), lambda c: c.data.source == "bin"),
    # the held-out share also decides what trains, with or without evaluation
    "data.val_fraction": Condition(
        "data.source is not synthetic", ("data.source",), lambda c: c.data.source != "synthetic"
    ),
    **{
        f"model.{name}": Condition("model.num_experts > 0", ("model.num_experts",), lambda c: c.model.num_experts > 0)
        for name in (
            "experts_per_token",
            "router_score",
            "router_norm_topk",
            "moe_aux_loss_coeff",
            "moe_z_loss_coeff",
            "moe_capacity_factor",
            "shared_expert_dim",
            "moe_dispatch",
        )
    },
    "train.loss_scale.static": Condition(
        "model.compute_dtype = float16", ("model.compute_dtype",), lambda c: c.model.compute_dtype == "float16"
    ),
    # the dynamic scale's fields: with fp16 and no fixed scale
    **{
        f"train.loss_scale.{name}": Condition(
            "model.compute_dtype = float16 and train.loss_scale.static = 0",
            ("model.compute_dtype", "train.loss_scale.static"),
            _dynamic_loss_scale,
        )
        for name in ("initial_scale_power", "window", "hysteresis", "min_scale", "rule")
    },
    "train.loss_scale.consecutive_hysteresis": Condition(
        "model.compute_dtype = float16 and train.loss_scale.static = 0 and train.loss_scale.rule = deepspeed",
        ("model.compute_dtype", "train.loss_scale.static", "train.loss_scale.rule"),
        lambda c: _dynamic_loss_scale(c) and c.train.loss_scale.rule == "deepspeed",
    ),
    # MLA and DeepSeekMoE routing: read by the deepseek_v3 family only (jaxpar.models.deepseek)
    **{
        f"model.{name}": Condition("model.name = deepseek_v3", ("model.name",), lambda c: c.model.name == "deepseek_v3")
        for name in (
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "first_dense_layers",
            "moe_mlp_dim",
            "router_groups",
            "router_group_topk",
            "router_scale",
            "router_bias_rate",
        )
    },
    "parallel.pipeline_schedule": Condition("mesh.pipeline > 1", ("mesh.pipeline",), lambda c: c.mesh.pipeline > 1),
    "parallel.virtual_stages": Condition("mesh.pipeline > 1", ("mesh.pipeline",), lambda c: c.mesh.pipeline > 1),
    **{
        f"parallel.{name}": Condition("mesh.pipeline > 1", ("mesh.pipeline",), lambda c: c.mesh.pipeline > 1)
        for name in ("layers_per_stage", "first_stage_layers", "last_stage_layers")
    },
}


def _value(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def check(cfg: Any, defaults: Any) -> None:
    """Refuse, in one line naming both fields, a declared field set away from its default where its
    condition does not hold."""
    for field, cond in CONDITIONS.items():
        value = _value(cfg, field)
        if value == _value(defaults, field) or cond.holds(cfg):
            continue
        here = ", ".join(f"{name}={_value(cfg, name)!r}" for name in cond.names)
        raise ConfigError(
            f"{field}={value!r} has no effect here: it acts only when {cond.when} ({here}); "
            f"remove it or change {' / '.join(cond.names)}"
        )


def reset_inert(cfg: Any, defaults: Any) -> list[str]:
    """Set every declared field whose condition does not hold in ``cfg`` back to its default, in
    place; returns the fields reset, in :data:`CONDITIONS` order. For configs derived from a valid
    one (a checkpoint read on one device, a planned layout), which train the same with such fields
    at their defaults. A condition that reads a declared field also requires that field's own
    condition (the RoPE scaling factors read ``model.rope_scaling``, which needs ``model.position =
    rope``), so one pass settles them all."""
    reset = []
    for field, cond in CONDITIONS.items():
        default = _value(defaults, field)
        if cond.holds(cfg) or _value(cfg, field) == default:
            continue
        *path, leaf = field.split(".")
        node = cfg
        for part in path:
            node = node[part]
        node[leaf] = default
        reset.append(field)
    return reset


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A config tree as ``{"section.field": value}`` (the schema's dotted names)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if not isinstance(k, str):
            raise ConfigError(f"config key {prefix}{k!r}: keys must be strings (section.field names)")
        if isinstance(v, Mapping) or hasattr(v, "to_dict"):  # a dict or a ConfigDict
            out.update(flatten(dict(v), f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def table(defaults: Any) -> list[tuple[str, str, str]]:
    """Every config field as (field, default, when it acts)."""
    rows = []
    for field, default in flatten(defaults.to_dict()).items():
        section, _, leaf = field.partition(".")
        if field in CONDITIONS:
            when = CONDITIONS[field].when
        elif section == "optim" and leaf not in COMMON_FIELDS:
            names = sorted(name for name, fields in optimizer_fields().items() if leaf in fields)
            when = f"optim.name is {' or '.join(names)} (or a custom factory, which reads what it likes)"
        else:
            when = "always"
        rows.append((field, repr(default), when))
    return rows


def markdown(defaults: Any) -> str:
    """:func:`table` as the page ``docs/config_fields.md``."""
    lines = [
        "# Config fields and when they act",
        "",
        "Generated from `jaxpar/acts.py` (`tests/test_acts.py` checks that it is current):",
        "",
        "    python3 -c 'from jaxpar import acts, config; print(acts.markdown(config.default_config()), end=\"\")' \\",
        "      > docs/config_fields.md",
        "",
        "A field set away from its default where it does not act is refused with one line naming the field",
        "that decides (exit code 2).",
        "",
        "| field | default | acts when |",
        "|---|---|---|",
    ]
    lines += [f"| `{field}` | `{default}` | {when} |" for field, default, when in table(defaults)]
    return "\n".join(lines) + "\n"
