"""HF ``config.json`` <-> a jaxpar ``model`` sub-config (LLaMA, Mistral, Mixtral, Qwen3, Qwen3-MoE,
DeepSeek-V3), and the JSON reading the checkpoint files share."""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Mapping
from typing import Any

from jaxpar import files
from jaxpar.config import ConfigDict, ConfigError, default_config, validate_rope_scaling
from jaxpar.models import get_model
from jaxpar.models.base import HFMap

PathLike = str | os.PathLike


# --------------------------------------------------------------------------- config


def model_config_from_hf(config: Mapping[str, Any] | PathLike, what: str = "HF checkpoint") -> ConfigDict:
    """A jaxpar ``model`` sub-config from an HF ``config.json`` (a dict, the file or its directory).

    Rejects what jaxpar's LLaMA does not compute (RoPE scaling other than Llama 3.1's, biases,
    activations other than SiLU) with a one-line :class:`ConfigError`; Llama 3.1's ``rope_scaling``
    (rope_type ``llama3``) sets ``model.rope_scaling`` and its four fields. Mistral's ``sliding_window`` caps ``max_seq_len``
    (no window ever applies to shorter sequences, so the model is then exactly LLaMA's). The
    checkpoint's ``torch_dtype`` is not copied: parameters stay in ``param_dtype`` (fp32 masters).
    Dropout: ``attention_dropout`` (HF LLaMA / Mistral, on the softmax probabilities) maps to
    ``model.attention_dropout``, ``hidden_dropout`` (where a config carries one) to
    ``model.dropout``; absent, 0. (GPT-2's ``resid_pdrop`` / ``attn_pdrop`` / ``embd_pdrop`` never
    reach here: only LLaMA-family configs are read.)
    """
    hf = dict(config) if isinstance(config, Mapping) else read_json(config, what)
    try:
        return _model_config(hf)
    except (TypeError, ValueError, AttributeError, OverflowError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(
            f"config.json: a value has the wrong type ({type(e).__name__}: {e}); replace it with the "
            "checkpoint's original"
        ) from None


def _model_config(hf: dict) -> ConfigDict:
    where = "config.json"
    model_type = hf.get("model_type", "llama")
    if model_type not in ("llama", "mistral", "mixtral", "qwen3", "qwen3_moe", "deepseek_v3"):
        raise ConfigError(
            f"{where}: model_type='{model_type}' is not supported; use a LLaMA, Mistral, Mixtral, Qwen3, "
            "Qwen3-MoE or DeepSeek-V3 model"
        )
    if hf.get("use_sliding_window"):
        raise ConfigError(f"{where}: use_sliding_window=true is not supported; jaxpar attends to the whole sequence")
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act='{act}' is not supported; jaxpar's SwiGLU MLP needs silu")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ConfigError(f"{where}: {key}=true is not supported; jaxpar's LLaMA has no biases")
    rope_key, rope = _rope_parameters(hf, where)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in hf:
            raise ConfigError(f"{where}: '{key}' is missing; is this an HF LLaMA config.json?")
    heads = int(hf["num_attention_heads"])
    m = default_config().model
    m.name = "llama"
    m.vocab_size = int(hf["vocab_size"])
    m.embed_dim = int(hf["hidden_size"])
    m.num_layers = int(hf["num_hidden_layers"])
    m.num_heads = heads
    m.num_kv_heads = int(hf.get("num_key_value_heads") or heads)
    m.head_dim = int(hf.get("head_dim") or m.embed_dim // heads)
    m.mlp_dim = int(hf["intermediate_size"])
    m.max_seq_len = int(hf.get("max_position_embeddings", m.max_seq_len))
    if hf.get("sliding_window"):
        m.max_seq_len = min(m.max_seq_len, int(hf["sliding_window"]))
    m.rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if rope.get("rope_type", rope.get("type")) == "llama3":
        _llama3_rope(rope_key, rope, hf, m, where)
    m.norm_eps = float(hf.get("rms_norm_eps", 1e-6))
    m.tie_embeddings = bool(hf.get("tie_word_embeddings", False))
    m.init_std = float(hf.get("initializer_range", m.init_std))
    for key, field in (("attention_dropout", "attention_dropout"), ("hidden_dropout", "dropout")):
        rate = float(hf.get(key) or 0.0)
        if not (math.isfinite(rate) and 0 <= rate < 1):
            raise ConfigError(
                f"{where}: {key}={json.dumps(hf.get(key))} is not a drop probability; use a value in "
                "[0, 1) (0: no dropout)"
            )
        m[field] = rate
    m.mlp_activation, m.norm, m.position = "swiglu", "rmsnorm", "rope"
    if model_type in ("qwen3", "qwen3_moe"):
        m.name, m.qk_norm = model_type, True
    if model_type in ("mixtral", "qwen3_moe"):
        _moe_fields(hf, m, model_type, where)
    if model_type == "deepseek_v3":
        _deepseek_fields(hf, m, where)
    return m


# model.* field <- DeepSeek-V3 config.json key (int fields; the routing floats and flags below)
_DEEPSEEK_KEYS = (
    ("kv_lora_rank", "kv_lora_rank"),
    ("qk_nope_head_dim", "qk_nope_head_dim"),
    ("qk_rope_head_dim", "qk_rope_head_dim"),
    ("v_head_dim", "v_head_dim"),
    ("moe_mlp_dim", "moe_intermediate_size"),
    ("num_experts", "n_routed_experts"),
    ("experts_per_token", "num_experts_per_tok"),
    ("first_dense_layers", "first_k_dense_replace"),
    ("router_groups", "n_group"),
    ("router_group_topk", "topk_group"),
)


def _deepseek_fields(hf: dict, m: ConfigDict, where: str) -> None:
    """MLA and DeepSeekMoE fields of a DeepSeek-V3 ``config.json`` (:mod:`jaxpar.models.deepseek`)."""
    for field, key in _DEEPSEEK_KEYS:
        if hf.get(key) is None:
            raise ConfigError(f"{where}: '{key}' is missing; is this an HF deepseek_v3 config.json?")
        m[field] = int(hf[key])
    if not hf.get("rope_interleave", True):
        raise ConfigError(f"{where}: rope_interleave=false is not supported; DeepSeek-V3 checkpoints interleave")
    if int(hf.get("num_nextn_predict_layers") or 0):
        raise ConfigError(
            f"{where}: num_nextn_predict_layers={hf['num_nextn_predict_layers']}: the multi-token-prediction "
            "module is not supported; set it to 0 and drop its layer's tensors"
        )
    if hf.get("topk_method", "noaux_tc") != "noaux_tc" or hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"{where}: topk_method / scoring_func other than noaux_tc / sigmoid is not supported")
    m.name, m.router_score = "deepseek_v3", "sigmoid"
    m.q_lora_rank = int(hf.get("q_lora_rank") or 0)
    m.num_kv_heads, m.head_dim = m.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim
    m.shared_expert_dim = int(hf.get("n_shared_experts") or 0) * m.moe_mlp_dim
    m.router_norm_topk = bool(hf.get("norm_topk_prob", True))
    m.router_scale = float(hf.get("routed_scaling_factor", 1.0))


# model.* field -> key of a llama3 rope_scaling / rope_parameters dict (transformers' names)
_LLAMA3_ROPE_KEYS = (
    ("rope_scaling_factor", "factor"),
    ("rope_low_freq_factor", "low_freq_factor"),
    ("rope_high_freq_factor", "high_freq_factor"),
    ("rope_original_max_seq_len", "original_max_position_embeddings"),
)


def _rope_parameters(hf: dict, where: str) -> tuple[str, dict]:
    """``(key, dict)``: the RoPE parameters of a ``config.json`` as transformers 5 reads them
    (``convert_rope_params_to_dict``): ``rope_scaling`` (transformers 4's key) when given, else
    ``rope_parameters`` (transformers 5's), else none (``("", {})``); ``rope_theta`` is read from that
    dict, else from the top level. Plain RoPE and Llama 3.1's scaled RoPE (rope_type ``llama3``) are
    supported; any other scaling, under either key, is a one-line :class:`ConfigError`."""
    found = []
    for key in ("rope_scaling", "rope_parameters"):
        value = hf.get(key)
        if not value:
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {key}={json.dumps(value)} is not an object; replace it with the original")
        kind = value.get("rope_type", value.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise ConfigError(
                f"{where}: {key}={json.dumps(value)} is not supported; only plain RoPE and Llama 3.1's scaled "
                "RoPE (rope_type llama3) are"
            )
        found.append((key, dict(value)))
    return found[0] if found else ("", {})


def _llama3_rope(key: str, scaling: dict, hf: dict, m: ConfigDict, where: str) -> None:
    """Llama 3.1's scaled RoPE from ``hf[key]`` (rope_type llama3) into ``model.rope_scaling`` and its fields,
    checked as the config checks them (one line naming the key)."""
    m.rope_scaling = "llama3"
    for field, name in _LLAMA3_ROPE_KEYS:
        if name not in scaling:
            if name == "original_max_position_embeddings":  # transformers' fallback (standardize_rope_params)
                m[field] = int(hf.get("max_position_embeddings", m.max_seq_len))
                continue
            raise ConfigError(f"{where}: {key} has rope_type llama3 but no '{name}'; add it from the checkpoint")
        value = scaling[name]
        integral = field != "rope_original_max_seq_len" or (isinstance(value, (int, float)) and value == int(value))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not integral:
            raise ConfigError(
                f"{where}: {key}.{name}={json.dumps(value)} is not a"
                + (" number" if field != "rope_original_max_seq_len" else " whole number")
                + "; replace it with the checkpoint's original"
            )
        m[field] = int(value) if field == "rope_original_max_seq_len" else float(value)
    try:
        validate_rope_scaling(m)
    except ConfigError as e:
        raise ConfigError(f"{where}: {key}: {e}") from None


def _moe_fields(hf: dict, m: ConfigDict, model_type: str, where: str) -> None:
    """The MoE fields of a Mixtral or Qwen3-MoE ``config.json``. The load-balancing loss is a
    training choice, read only where ``output_router_logits`` turns it on: HF's
    ``router_aux_loss_coef`` weighs ``E * sum_e count_e / T * P_e``, ``k`` times jaxpar's Switch
    loss (:mod:`jaxpar.models.moe`), so the coefficient is multiplied by ``k`` for the same objective."""
    # Mixtral names the count num_local_experts; Qwen3-MoE num_experts (transformers 5 saves it as
    # num_local_experts too)
    count = "num_experts" if model_type == "qwen3_moe" and "num_experts" in hf else "num_local_experts"
    for key in (count, "num_experts_per_tok", *(("moe_intermediate_size",) if model_type == "qwen3_moe" else ())):
        if key not in hf:
            raise ConfigError(f"{where}: '{key}' is missing; is this an HF {model_type} config.json?")
    m.num_experts = int(hf[count])
    m.experts_per_token = int(hf["num_experts_per_tok"])
    if model_type == "mixtral":
        m.name = "mixtral"
    else:  # every layer sparse: the dense intermediate_size is then unused
        if int(hf.get("decoder_sparse_step", 1)) != 1 or hf.get("mlp_only_layers"):
            raise ConfigError(
                f"{where}: decoder_sparse_step={hf.get('decoder_sparse_step')} / mlp_only_layers="
                f"{hf.get('mlp_only_layers')}: dense layers between MoE layers are not supported; every "
                "layer must be MoE (decoder_sparse_step=1, mlp_only_layers=[])"
            )
        m.mlp_dim = int(hf["moe_intermediate_size"])
        m.router_norm_topk = bool(hf.get("norm_topk_prob", False))
    if hf.get("output_router_logits"):
        m.moe_aux_loss_coeff = float(hf.get("router_aux_loss_coef", 0.0)) * m.experts_per_token


def hf_config_from_model(model_cfg: ConfigDict) -> dict[str, Any]:
    """The HF ``config.json`` of ``model_cfg``'s family (LLaMA, Mixtral, Qwen3, Qwen3-MoE), the
    inverse of :func:`model_config_from_hf`."""
    family_hf_map(model_cfg)
    m = model_cfg
    family = {
        "mixtral": ("MixtralForCausalLM", "mixtral"),
        "qwen3": ("Qwen3ForCausalLM", "qwen3"),
        "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
        "deepseek_v3": ("DeepseekV3ForCausalLM", "deepseek_v3"),
    }.get(m.name, ("LlamaForCausalLM", "llama"))
    experts = {}
    if m.name == "deepseek_v3":
        experts = {hf_key: m[field] for field, hf_key in _DEEPSEEK_KEYS} | {
            "q_lora_rank": m.q_lora_rank or None,
            "n_shared_experts": m.shared_expert_dim // m.moe_mlp_dim,
            "norm_topk_prob": m.router_norm_topk,
            "routed_scaling_factor": m.router_scale,
            "rope_interleave": True,
            "num_nextn_predict_layers": 0,
        }
    elif m.num_experts:
        aux = {
            "output_router_logits": bool(m.moe_aux_loss_coeff),
            "router_aux_loss_coef": m.moe_aux_loss_coeff / m.experts_per_token,
            "num_experts_per_tok": m.experts_per_token,
        }
        if m.name == "mixtral":
            experts = aux | {"num_local_experts": m.num_experts, "sliding_window": None}
        else:
            experts = aux | {
                "num_experts": m.num_experts,
                "moe_intermediate_size": m.mlp_dim,
                "norm_topk_prob": m.router_norm_topk,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            }
    if m.name in ("qwen3", "qwen3_moe"):
        experts |= {"use_sliding_window": False, "sliding_window": None}
    return experts | {
        "architectures": [family[0]],
        "model_type": family[1],
        "hidden_act": "silu",
        "hidden_size": m.embed_dim,
        "intermediate_size": m.mlp_dim,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        **_hf_rope(m),
        "tie_word_embeddings": m.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": m.init_std,
        "torch_dtype": m.param_dtype,
        # HF LLaMA has attention dropout only (model.dropout has no config.json field there)
        "attention_dropout": m.attention_dropout,
    }


def _hf_rope(m: ConfigDict) -> dict[str, Any]:
    """``rope_parameters`` (transformers 5) and ``rope_scaling`` (transformers 4) of ``config.json``."""
    if m.get("rope_scaling", "none") == "none":
        return {"rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta}, "rope_scaling": None}
    scaling = {"rope_type": "llama3"} | {
        key: int(m[field]) if field == "rope_original_max_seq_len" else float(m[field])
        for field, key in _LLAMA3_ROPE_KEYS
    }
    return {"rope_parameters": scaling | {"rope_theta": m.rope_theta}, "rope_scaling": scaling}


ORIGINAL = "replace it with the checkpoint's original"  # the fix of a damaged checkpoint file


def read_json(path: PathLike, what: str = "HF checkpoint") -> dict:
    p = pathlib.Path(path)
    p = p / "config.json" if p.is_dir() else p
    if not os.path.lexists(p):
        raise ConfigError(f"{p}: no such file; pass the checkpoint directory holding config.json")
    return json_object(p, "HF config.json", what)


def json_object(p: pathlib.Path, kind: str, what: str = "HF checkpoint") -> dict:
    """The JSON object in file ``p`` (a ``kind`` of :data:`jaxpar.files.CAPS`); ConfigError (one line) for a
    file that is not a regular one, too large, unreadable bytes, bad JSON or another type."""
    data = files.read_bytes(p, kind, what, ORIGINAL)
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, OSError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise ConfigError(
            f"{p}: not a readable JSON file ({type(e).__name__}: {first}); replace it with the checkpoint's original"
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(
            f"{p}: holds a JSON {type(value).__name__}, not an object; replace it with the checkpoint's original"
        )
    return value


def family_hf_map(m: ConfigDict) -> HFMap:
    """The family's HF map, after checking that the configured settings fit the format."""
    hf = type(get_model(m)).hf
    if hf is None:
        raise ConfigError(f"model.name='{m.name}' has no HF checkpoint format; use model.name=llama for HF weights")
    for field, want in hf.requires:
        if m[field] != want:
            raise ConfigError(f"model.{field}='{m[field]}': {hf.label} checkpoints need model.{field}='{want}'")
    return hf
