"""Each field's domain (type, range, finiteness, allowed values), checked once; :func:`validate`
then hands the rules that tie fields together to :meth:`jaxpar.layout.ParallelLayout.validate` and
returns the run's layout."""

from __future__ import annotations

import math
import os

from jaxpar import acts
from jaxpar.acts import flatten
from jaxpar.axes import MESH_AXES
from jaxpar.config.schema import (
    DATA_SOURCES,
    DTYPES,
    FILE_SOURCES,
    MAX_DEVICES,
    MAX_DIM,
    MAX_PARAMS,
    ROPE_SCALINGS,
    SCHEDULE_TYPES,
    ConfigDict,
    default_config,
)
from jaxpar.errors import require
from jaxpar.layout import ParallelLayout
from jaxpar.models.registry import check_name
from jaxpar.optim.fields import check_fields

PATH_FIELDS = ("train.workdir", "train.init_from", "data.path", "optim.name")  # fields that may hold a path


ATTENTION_MASKS = ("causal", "block_causal")  # model.attention_mask


def validate(cfg: ConfigDict, num_devices: int | None = None) -> ParallelLayout:
    """Check every field's domain, then the layout's cross-field rules; return the layout.

    Field domains (type, range, allowed values) are checked here, once; rules that tie fields
    together (divisibility, batch arithmetic, pipeline schedules) live in
    :meth:`jaxpar.layout.ParallelLayout.validate`. ``num_devices``, when given, must equal the
    product of the mesh sizes.
    """
    p, mo, o, t, d = cfg.parallel, cfg.model, cfg.optim, cfg.train, cfg.data
    for key, value in flatten(cfg.to_dict()).items():
        require(
            not (isinstance(value, str) and "\x00" in value),
            f"config.{key}: the value holds a NUL byte, which no path or name may; retype it",
        )
    for key in PATH_FIELDS:  # "~" is the shell's: unexpanded, it would make a folder named "~"
        section, field = key.split(".")
        value = cfg[section][field]
        require(
            not value.startswith("~"),
            f"config.{key}={value[:200]!r}: jaxpar does not expand '~' (only an unquoted shell word is); "
            "give the full path",
        )
    for axis in MESH_AXES:
        require(
            1 <= cfg.mesh[axis.value] <= MAX_DEVICES,
            f"mesh.{axis.value}={cfg.mesh[axis.value]}: use a size in [1, {MAX_DEVICES}]",
        )
    devices = math.prod(cfg.mesh[axis.value] for axis in MESH_AXES)
    require(
        devices <= MAX_DEVICES,
        f"mesh: {devices} devices in all is more than any cluster has (at most {MAX_DEVICES}); check the mesh sizes",
    )
    require(
        p.grad_reduce_dtype in ("float32", "bfloat16"),
        f"parallel.grad_reduce_dtype='{p.grad_reduce_dtype}': use float32 or bfloat16",
    )
    require(
        0.0 <= p.max_replicated_fraction <= 1.0,
        f"parallel.max_replicated_fraction={p.max_replicated_fraction}: use a value in [0, 1]",
    )
    _validate_model(mo)
    _validate_optim(o)
    _validate_train(t)
    require(d.source in DATA_SOURCES, f"data.source='{d.source}': use one of {', '.join(DATA_SOURCES)}")
    require(d.token_dtype in ("uint16", "uint32"), f"data.token_dtype='{d.token_dtype}': use uint16 or uint32")
    if d.source in FILE_SOURCES:
        require(bool(d.path.strip()), f"data.path is empty but data.source='{d.source}'; set --config.data.path=")
    require(0 < d.val_fraction < 1, f"data.val_fraction={d.val_fraction}: use a value in (0, 1)")
    require(cfg.checkpoint.every >= 0, f"checkpoint.every={cfg.checkpoint.every}: must be >= 0")
    require(cfg.checkpoint.keep >= 1, f"checkpoint.keep={cfg.checkpoint.keep}: must be >= 1")
    acts.check(cfg, default_config())
    return ParallelLayout.from_config(cfg).validate(mo, t.global_batch, num_devices)


def _validate_model(mo: ConfigDict) -> None:
    for name in (
        "vocab_size",
        "embed_dim",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "mlp_dim",
        "max_seq_len",
    ):
        require(1 <= mo[name] <= MAX_DIM, f"model.{name}={mo[name]}: use a value in [1, {MAX_DIM}]")
    require(
        mo.num_heads % mo.num_kv_heads == 0,
        f"model.num_heads={mo.num_heads} is not a multiple of model.num_kv_heads={mo.num_kv_heads}; "
        "pick kv heads that divide the heads",
    )
    for name in ("compute_dtype", "param_dtype"):
        require(mo[name] in DTYPES, f"model.{name}='{mo[name]}': use one of {', '.join(DTYPES)}")
    require(mo.mlp_activation in ("swiglu", "gelu"), f"model.mlp_activation='{mo.mlp_activation}': use swiglu or gelu")
    require(mo.norm in ("rmsnorm", "layernorm"), f"model.norm='{mo.norm}': use rmsnorm or layernorm")
    require(mo.position in ("rope", "learned"), f"model.position='{mo.position}': use rope or learned")
    check_name(mo.name)
    if mo.position == "rope":  # RoPE rotates pairs of dims
        require(
            mo.head_dim % 2 == 0,
            f"model.head_dim={mo.head_dim}: RoPE needs an even head dim; use e.g. {mo.head_dim + 1}",
        )
        _positive_finite("model.rope_theta", mo.rope_theta)
    require(
        mo.rope_scaling in ROPE_SCALINGS,
        f"model.rope_scaling='{mo.rope_scaling}': use none (plain RoPE) or llama3 (Llama 3.1's scaled RoPE)",
    )
    if mo.position == "rope" and mo.rope_scaling == "llama3":
        validate_rope_scaling(mo)
    _positive_finite("model.norm_eps", mo.norm_eps)
    _positive_finite("model.init_std", mo.init_std)
    for name in ("dropout", "attention_dropout"):  # a drop probability (Srivastava et al. 2014): in [0, 1)
        require(
            math.isfinite(mo[name]) and 0 <= mo[name] < 1,
            f"model.{name}={mo[name]}: use a drop probability in [0, 1), e.g. 0.1 (0: no dropout)",
        )
    require(
        mo.attention_mask in ATTENTION_MASKS,
        f"model.attention_mask='{mo.attention_mask}': use causal or block_causal (attention also stops at "
        "documents, which model.eos_token_id ends)",
    )
    if mo.attention_mask == "block_causal":
        require(
            0 <= mo.eos_token_id < mo.vocab_size,
            f"model.eos_token_id={mo.eos_token_id}: model.attention_mask=block_causal needs the token id that "
            f"ends each document (in [0, model.vocab_size={mo.vocab_size})); set model.eos_token_id to your "
            "tokenizer's EOS id",
        )
    _validate_moe(mo)
    count = _rough_param_count(mo)
    require(
        count <= MAX_PARAMS,
        f"model: {count:.3g} parameters is beyond any cluster (at most {MAX_PARAMS:.0e}); check the model sizes",
    )


def validate_rope_scaling(mo: ConfigDict) -> None:
    """Llama 3.1's RoPE scaling fields (:func:`jaxpar.models.llama.rope_frequencies`): a factor >= 1 (1:
    no scaling), 0 < low frequency factor < high frequency factor (the band between the two wavelengths
    is interpolated), an original context of whole positions."""
    require(
        math.isfinite(mo.rope_scaling_factor) and mo.rope_scaling_factor >= 1,
        f"model.rope_scaling_factor={mo.rope_scaling_factor}: use a finite factor >= 1 (Llama 3.1: 8; 1: no scaling)",
    )
    _positive_finite("model.rope_low_freq_factor", mo.rope_low_freq_factor)
    require(
        math.isfinite(mo.rope_high_freq_factor) and mo.rope_high_freq_factor > mo.rope_low_freq_factor,
        f"model.rope_high_freq_factor={mo.rope_high_freq_factor}: use a finite value above "
        f"model.rope_low_freq_factor={mo.rope_low_freq_factor} (Llama 3.1: 4 and 1)",
    )
    require(
        1 <= mo.rope_original_max_seq_len <= MAX_DIM,
        f"model.rope_original_max_seq_len={mo.rope_original_max_seq_len}: use a value in [1, {MAX_DIM}] "
        "(Llama 3.1: 8192)",
    )


def _validate_moe(mo: ConfigDict) -> None:
    """The MoE fields' domains (with ``num_experts=0`` the others have no effect: :mod:`jaxpar.acts`)."""
    require(0 <= mo.num_experts <= MAX_DIM, f"model.num_experts={mo.num_experts}: use 0 (dense) or a count >= 2")
    require(mo.num_experts != 1, "model.num_experts=1 is a dense MLP with a router; use 0 (dense) or >= 2 experts")
    _validate_deepseek(mo)
    if not mo.num_experts:
        return
    require(
        0 <= mo.shared_expert_dim <= MAX_DIM,
        f"model.shared_expert_dim={mo.shared_expert_dim}: use 0 (none) or a width in [1, {MAX_DIM}]",
    )
    require(
        1 <= mo.experts_per_token <= mo.num_experts,
        f"model.experts_per_token={mo.experts_per_token}: use 1 to model.num_experts={mo.num_experts}",
    )
    require(
        mo.moe_dispatch in ("grouped", "dense"),
        f"model.moe_dispatch='{mo.moe_dispatch}': use grouped (the routed tokens only) or dense (every expert "
        "on every token, the reference)",
    )
    require(
        mo.router_score in ("softmax", "sigmoid"),
        f"model.router_score='{mo.router_score}': use softmax (Mixtral, Qwen3-MoE) or sigmoid (DeepSeek-V3)",
    )
    require(mo.mlp_activation == "swiglu", f"model.mlp_activation='{mo.mlp_activation}': the MoE experts are SwiGLU")
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_capacity_factor"):
        require(
            math.isfinite(mo[name]) and mo[name] >= 0, f"model.{name}={mo[name]}: use a finite weight >= 0 (0: off)"
        )


def _validate_deepseek(mo: ConfigDict) -> None:
    """The domains of the MLA and DeepSeekMoE fields (set elsewhere they are refused by
    :mod:`jaxpar.acts`: only ``deepseek_v3`` reads them)."""
    if mo.name != "deepseek_v3":
        return
    for field in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_mlp_dim"):
        require(1 <= mo[field] <= MAX_DIM, f"model.{field}={mo[field]}: model.name=deepseek_v3 needs a width >= 1")
    require(0 <= mo.q_lora_rank <= MAX_DIM, f"model.q_lora_rank={mo.q_lora_rank}: use 0 (full rank) or a width")
    require(mo.qk_rope_head_dim % 2 == 0, f"model.qk_rope_head_dim={mo.qk_rope_head_dim}: RoPE needs an even dim")
    qk = mo.qk_nope_head_dim + mo.qk_rope_head_dim
    require(
        mo.v_head_dim <= qk,
        f"model.v_head_dim={mo.v_head_dim}: use at most qk_nope_head_dim + qk_rope_head_dim = {qk}",
    )
    E = max(mo.num_experts, 1)
    require(
        mo.router_groups >= 1 and E % mo.router_groups == 0 and (mo.router_groups == 1 or E // mo.router_groups >= 2),
        f"model.router_groups={mo.router_groups}: use a divisor of model.num_experts={E} leaving >= 2 experts a group",
    )
    require(
        1 <= mo.router_group_topk <= mo.router_groups,
        f"model.router_group_topk={mo.router_group_topk}: use 1 to model.router_groups={mo.router_groups}",
    )
    require(
        mo.router_group_topk * (E // mo.router_groups) >= mo.experts_per_token,
        f"model.router_group_topk={mo.router_group_topk}: the eligible groups hold fewer than "
        f"model.experts_per_token={mo.experts_per_token} experts; raise it",
    )
    for name in ("router_scale", "router_bias_rate"):
        require(math.isfinite(mo[name]) and mo[name] >= 0, f"model.{name}={mo[name]}: use a finite value >= 0")
    require(mo.router_scale > 0, f"model.router_scale={mo.router_scale}: use a value > 0 (DeepSeek-V3: 2.5)")
    for name in ("dropout", "attention_dropout"):
        require(
            not mo.get(name, 0.0), f"model.{name}={mo.get(name)}: model.name=deepseek_v3 trains without dropout; set 0"
        )


def _rough_param_count(mo: ConfigDict) -> int:
    """Parameters of a decoder of these sizes, to within norms and biases: enough to refuse what no
    cluster could hold without importing the model (the exact count: ``jaxpar.models.inventory``)."""
    attention = mo.embed_dim * mo.head_dim * (2 * mo.num_heads + 2 * mo.num_kv_heads)
    mlp = 3 * mo.embed_dim * ((mo.moe_mlp_dim or mo.mlp_dim) * max(mo.num_experts, 1) + mo.shared_expert_dim)
    return mo.num_layers * (attention + mlp) + 2 * mo.vocab_size * mo.embed_dim


def _validate_optim(o: ConfigDict) -> None:
    _positive_finite("optim.lr", o.lr)
    require(o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps}: must be >= 0")
    require(
        o.schedule in SCHEDULE_TYPES,
        f"optim.schedule='{o.schedule}': use one of {', '.join(SCHEDULE_TYPES)}",
    )
    require(o.warmup_type in ("linear", "log"), f"optim.warmup_type='{o.warmup_type}': use linear or log")
    require(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio={o.min_lr_ratio}: use a value in [0, 1]")
    require(o.clip_norm >= 0, f"optim.clip_norm={o.clip_norm}: must be >= 0 (0 disables)")
    check_fields(o, default_config().optim)  # a known optimizer; no field it would ignore
    for name in ("b1", "b2"):  # Adam's moment decay rates (Kingma & Ba 2015): in [0, 1)
        require(0 <= o[name] < 1, f"optim.{name}={o[name]}: use a value in [0, 1), e.g. 0.9")
    require(math.isfinite(o.eps) and o.eps >= 0, f"optim.eps={o.eps}: use a finite value >= 0, e.g. 1e-8")
    require(
        math.isfinite(o.weight_decay) and o.weight_decay >= 0,
        f"optim.weight_decay={o.weight_decay}: use a finite value >= 0",
    )


def _validate_train(t: ConfigDict) -> None:
    require(t.steps >= 0, f"train.steps={t.steps}: must be >= 0")
    require(t.global_batch <= MAX_DIM, f"train.global_batch={t.global_batch}: use at most {MAX_DIM} sequences")
    require(0 <= t.seed < 2**32, f"train.seed={t.seed}: use an integer in [0, 2**32)")
    require(bool(t.workdir.strip()), "train.workdir is empty; give a folder for checkpoints and metrics")
    require(
        not os.path.exists(t.workdir) or os.path.isdir(t.workdir),
        f"train.workdir='{t.workdir}' is a file, not a folder; pick another path",
    )
    for name in ("log_every", "eval_every", "warmup_steps_excluded"):
        require(t[name] >= 0, f"train.{name}={t[name]}: must be >= 0")
    require(t.eval_batches >= 0, f"train.eval_batches={t.eval_batches}: must be >= 0 (0: no validation)")
    require(
        t.eval_batches >= 1 or t.eval_every == 0,
        f"train.eval_every={t.eval_every} with train.eval_batches=0: there is nothing to evaluate; set "
        "train.eval_batches >= 1, or train.eval_every=0 to train without validation",
    )
    require(
        _profile_steps_ok(t.profile_steps),
        f"train.profile_steps='{t.profile_steps}': give the first and last step to trace as a,b with "
        "1 <= a <= b, e.g. --config.train.profile_steps=5,7 (empty: no trace)",
    )
    resume = str(t.resume)
    require(
        resume in ("auto", "never", "restart") or _is_count(resume),
        f"train.resume='{resume}': use auto, never, restart (delete the workdir's checkpoints and start over) or a "
        "step number",
    )
    require(
        not t.init_from or os.path.exists(t.init_from),
        f"train.init_from='{t.init_from}': no such file or directory; give an HF checkpoint directory, a "
        ".safetensors / .index.json file or a torch state dict",
    )
    require(
        t.spike_factor == 0 or 1 < t.spike_factor < math.inf,
        f"train.spike_factor={t.spike_factor}: use 0 (off) or a finite value > 1",
    )
    require(t.max_bad_steps >= 1, f"train.max_bad_steps={t.max_bad_steps}: must be >= 1")
    _validate_loss_scale(t.loss_scale)
    require(
        all(_is_count(x.strip()) for x in t.inject_bad_steps.split(",")) if t.inject_bad_steps else True,
        f"train.inject_bad_steps='{t.inject_bad_steps}': give comma-separated step numbers, e.g. 3,4",
    )


def _validate_loss_scale(ls: ConfigDict) -> None:
    require(
        math.isfinite(ls.static) and ls.static >= 0,
        f"train.loss_scale.static={ls.static}: use 0 (dynamic) or a finite fixed scale > 0",
    )
    require(
        0 <= ls.initial_scale_power <= 64,
        f"train.loss_scale.initial_scale_power={ls.initial_scale_power}: use a power of two in [0, 64] "
        "(DeepSpeed: 16, Megatron: 32)",
    )
    require(ls.window >= 1, f"train.loss_scale.window={ls.window}: use >= 1 good steps (DeepSpeed, Megatron: 1000)")
    require(ls.hysteresis >= 1, f"train.loss_scale.hysteresis={ls.hysteresis}: use >= 1 overflows (default 2)")
    require(
        math.isfinite(ls.min_scale) and 0 < ls.min_scale <= 2.0**ls.initial_scale_power,
        f"train.loss_scale.min_scale={ls.min_scale}: use a value > 0 and at most "
        f"2**train.loss_scale.initial_scale_power={2.0**ls.initial_scale_power:g}",
    )
    require(
        ls.rule in ("deepspeed", "megatron"),
        f"train.loss_scale.rule='{ls.rule}': use deepspeed or megatron (when the scale grows and halves)",
    )


def _is_count(text: str) -> bool:
    """ASCII digits only (``str.isdigit`` also takes '²', which ``int`` refuses)."""
    return text.isascii() and text.isdigit()


def _positive_finite(name: str, value: float) -> None:
    require(math.isfinite(value) and value > 0, f"{name}={value}: use a finite value > 0")


def _profile_steps_ok(text: str) -> bool:
    if not text:
        return True
    parts = [x.strip() for x in text.split(",")]
    return len(parts) == 2 and all(_is_count(x) for x in parts) and 1 <= int(parts[0]) <= int(parts[1])
