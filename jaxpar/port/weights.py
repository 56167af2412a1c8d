"""Hugging Face LLaMA-family checkpoints <-> jaxpar parameters, loaded shard by shard onto a mesh.

The tensor names and layouts come from the model family's HF map
(:attr:`jaxpar.models.base.Model.hf`; for ``llama``: :data:`jaxpar.models.llama.HF_LLAMA`); this
module reads and writes the files. For the ``llama`` family:

Names and layouts (HF ``nn.Linear`` weights are ``(out, in)``; jaxpar stacks the layers on a
leading ``L`` dim; ``n``/``kv`` heads of size ``d``, width ``h``, MLP ``f``, vocabulary ``V``):

* ``model.embed_tokens.weight`` (V, h) -> ``embed`` (V, h); ``lm_head.weight`` (V, h) -> ``lm_head``
  (h, V), absent when tied; ``model.norm.weight`` (h,) -> ``final_norm.scale``;
* per layer ``model.layers.{i}.``: ``self_attn.q_proj.weight`` (n*d, h) -> ``blocks.attn.wq``
  (L, h, n, d); ``k_proj``/``v_proj`` (kv*d, h) -> ``wk``/``wv`` (L, h, kv, d); ``o_proj`` (h, n*d)
  -> ``wo`` (L, n, d, h); ``mlp.gate_proj``/``up_proj`` (f, h) -> ``blocks.mlp.w_gate``/``w_up``
  (L, h, f); ``down_proj`` (h, f) -> ``w_down`` (L, f, h); ``input_layernorm.weight`` /
  ``post_attention_layernorm.weight`` (h,) -> ``blocks.attn_norm.scale`` / ``blocks.mlp_norm.scale``.

**RoPE layout.** jaxpar's RoPE rotates the halves ``(i, i + d/2)`` of each head (HF's
``rotate_half``). HF LLaMA checkpoints are already in that layout: HF's conversion script permuted
the rows of Meta's ``wq``/``wk``, whose RoPE rotates adjacent pairs ``(2i, 2i + 1)``. Meta's original
``consolidated.00.pth`` therefore needs the same permutation per head: HF row ``j*d/2 + i`` is Meta
row ``2i + j`` (:func:`from_meta_interleaved`; :func:`to_meta_interleaved` is its inverse). Pass
``meta_interleaved=True`` for HF-named files in Meta's layout; files with Meta's own names
(``tok_embeddings``, ``layers.{i}.attention.wq``, ``feed_forward.w1``...) are renamed and permuted
automatically (a single model-parallel shard only; the config must then be given by hand).

:func:`load_hf` reads with ``jax.make_array_from_callback``: each device's callback reads from the
file only the slice it is asked for (``safe_open(...).get_slice``, or an mmap'ed torch tensor), layer
by layer for the stacked dim, so no host ever holds more than one tensor's needed slice at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxpar import files, write_guard
from jaxpar.config import ConfigDict, ConfigError, default_config, validate_rope_scaling
from jaxpar.models import get_model
from jaxpar.models.base import HFMap

PathLike = str | os.PathLike
ReadHook = Callable[[str, tuple[int, ...]], None]
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|^rope\.freqs)$")  # derived buffers, not parameters
_META_NAMES = (  # Meta consolidated name -> HF name
    (r"^tok_embeddings\.", "model.embed_tokens."),
    (r"^norm\.", "model.norm."),
    (r"^output\.", "lm_head."),
    (r"^layers\.(\d+)\.attention\.w([qkvo])\.", r"model.layers.\1.self_attn.\2_proj."),
    (r"^layers\.(\d+)\.feed_forward\.w1\.", r"model.layers.\1.mlp.gate_proj."),
    (r"^layers\.(\d+)\.feed_forward\.w2\.", r"model.layers.\1.mlp.down_proj."),
    (r"^layers\.(\d+)\.feed_forward\.w3\.", r"model.layers.\1.mlp.up_proj."),
    (r"^layers\.(\d+)\.attention_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^layers\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
)


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
    hf = dict(config) if isinstance(config, Mapping) else _read_json(config, what)
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
    _hf_map(model_cfg)
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
WEIGHTS_FIX = "point train.init_from at a downloaded HF checkpoint (its regular files)"


def _read_json(path: PathLike, what: str = "HF checkpoint") -> dict:
    p = pathlib.Path(path)
    p = p / "config.json" if p.is_dir() else p
    if not os.path.lexists(p):
        raise ConfigError(f"{p}: no such file; pass the checkpoint directory holding config.json")
    return _json_object(p, "HF config.json", what)


def _json_object(p: pathlib.Path, kind: str, what: str = "HF checkpoint") -> dict:
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


def _hf_map(m: ConfigDict) -> HFMap:
    """The family's HF map, after checking that the configured settings fit the format."""
    hf = type(get_model(m)).hf
    if hf is None:
        raise ConfigError(f"model.name='{m.name}' has no HF checkpoint format; use model.name=llama for HF weights")
    for field, want in hf.requires:
        if m[field] != want:
            raise ConfigError(f"model.{field}='{m[field]}': {hf.label} checkpoints need model.{field}='{want}'")
    return hf


def check_hf_model(path: PathLike, model_cfg: ConfigDict) -> None:
    """Compare the configured model with the ``config.json`` next to HF weights (if there is one),
    field by field as the family's HF map lists them (:attr:`jaxpar.models.base.HFMap.config_fields`);
    the first difference is a one-line :class:`ConfigError` naming the override that fixes it."""
    hf_map = _hf_map(model_cfg)
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    config_json = os.path.join(directory, "config.json")
    if not os.path.exists(config_json):
        return
    hf = model_config_from_hf(config_json, "train.init_from")
    for field, key in hf_map.config_fields:
        want, have = hf[field], model_cfg[field]
        if want != have:
            raise ConfigError(
                f"train.init_from: {config_json} has {key} giving model.{field}={want!r} but the config has "
                f"{have!r}; set --config.model.{field}={want}"
            )


def load_checked(path: PathLike, model_cfg: ConfigDict, shardings: Any = None) -> dict:
    """:func:`check_hf_model` then :func:`load_hf`: the model-form parameters of ``train.init_from``."""
    check_hf_model(path, model_cfg)
    return load_hf(path, model_cfg, shardings)


# --------------------------------------------------------------------------- layouts


def _meta_perm(d: int) -> np.ndarray:
    """``perm[r]``: the Meta (interleaved) row holding HF (rotate-half) row ``r`` within one head."""
    return np.arange(d).reshape(d // 2, 2).T.reshape(-1)


def from_meta_interleaved(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Meta's interleaved-RoPE ``wq``/``wk`` rows ``(heads*d, in)`` -> HF's rotate-half layout."""
    w = np.asarray(w)
    d = w.shape[0] // num_heads
    return w.reshape(num_heads, d, *w.shape[1:])[:, _meta_perm(d)].reshape(w.shape)


def to_meta_interleaved(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of :func:`from_meta_interleaved`: HF rotate-half rows -> Meta's interleaved rows."""
    w = np.asarray(w)
    d = w.shape[0] // num_heads
    return w.reshape(num_heads, d, *w.shape[1:])[:, np.argsort(_meta_perm(d))].reshape(w.shape)


@dataclasses.dataclass(frozen=True)
class _Leaf:
    path: tuple[str, ...]
    hf: str  # name, with {i} for stacked leaves and {e} for expert-stacked ones
    kind: str
    what: str  # the HF shape in model_cfg terms, for error messages
    shape: tuple[int, ...]  # jaxpar shape (with L for stacked leaves, then E for expert-stacked ones)
    dtype: Any
    stacked: bool
    rope: bool
    first: int = 0  # the HF layer index of this stack's layer 0 (deepseek_v3: the dense layers come first)

    @property
    def experts(self) -> bool:
        """One HF tensor per expert: the jaxpar array's dim after ``layers`` stacks them."""
        return "{e}" in self.hf

    @property
    def hf_shape(self) -> tuple[int, ...]:
        s = self.shape[int(self.stacked) + int(self.experts) :]
        if self.kind == "transpose":
            return s[::-1]
        if self.kind == "heads_in":  # (h, n, d) -> (n*d, h)
            return (s[1] * s[2], s[0])
        if self.kind == "heads_out":  # (n, d, h) -> (h, n*d)
            return (s[2], s[0] * s[1])
        return s

    def name(self, layer: int | None = None, expert: int | None = None) -> str:
        return self.hf.format(i=None if layer is None else layer + self.first, e=expert) if self.stacked else self.hf

    def names(self) -> list[str]:
        """Every HF name of this leaf, layer-major then expert."""
        if not self.stacked:
            return [self.hf]
        experts = range(self.shape[1]) if self.experts else [None]
        return [self.name(i, e) for i in range(self.shape[0]) for e in experts]


def _leaves(model_cfg: ConfigDict) -> tuple[list[_Leaf], Any]:
    """The leaves of jaxpar's parameter tree (in tree order) with their HF names, and the treedef."""
    hf = _hf_map(model_cfg)
    model = get_model(model_cfg)
    abstract = model.abstract_params()
    table = {t.path: t for t in hf.tensors}
    stacks = model.layer_stacks()
    leaves = []
    for keys, a in jax.tree_util.tree_leaves_with_path(abstract):
        path = tuple(k.key for k in keys)
        if path not in table:
            raise ConfigError(f"parameter {'.'.join(path)} has no {hf.label} counterpart")
        t = table[path]
        stacked = path[0] in stacks
        leaves.append(
            _Leaf(path, t.name, t.kind, t.what, tuple(a.shape), a.dtype, stacked, t.rope, stacks.get(path[0], 0))
        )
    return leaves, jax.tree.structure(abstract)


# --------------------------------------------------------------------------- sources


class _Source:
    """Named tensors of a checkpoint whose slices are read without loading whole tensors."""

    def __init__(self, path: PathLike):
        kind, found = _find_files(pathlib.Path(path))
        self.tensors: dict[str, Any] = {}  # HF name -> (file handle or torch tensor, stored name)
        for f in found:
            if kind == "safetensors":
                _check_safetensors(f)
                try:
                    handle = safe_open(str(f), framework="numpy")
                    names = list(handle.keys())
                except Exception as e:  # noqa: BLE001 - truncated or garbage bytes are bad input
                    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
                    raise ConfigError(f"{f}: not a readable safetensors file ({first}); download it again") from None
                self.tensors.update({k: (handle, k) for k in names})
            else:
                files.check(f, "weights", "train.init_from", WEIGHTS_FIX)
                self.tensors.update({k: (t, k) for k, t in _torch_load(f).items()})
        self.meta_names = "tok_embeddings.weight" in self.tensors
        if self.meta_names:
            self.tensors = {_rename_meta(k): v for k, v in self.tensors.items()}

    def shape(self, name: str) -> tuple[int, ...]:
        obj, key = self.tensors[name]
        return tuple(obj.shape) if not hasattr(obj, "get_slice") else tuple(obj.get_slice(key).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype's name (``F32``, ``BF16``, ``I32`` for safetensors; ``torch.float32``, ...)."""
        obj, key = self.tensors[name]
        return str(obj.get_slice(key).get_dtype()) if hasattr(obj, "get_slice") else str(obj.dtype)

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        obj, key = self.tensors[name]
        if hasattr(obj, "get_slice"):
            return obj.get_slice(key)[index]
        import torch

        t = obj[index]
        return t.view(torch.int16).numpy().view(jnp.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()


def _check_safetensors(path: pathlib.Path) -> None:
    """A regular file whose header length (its first 8 bytes) is within the format's limit: what
    ``safe_open`` reads first (a FIFO would block it, a huge length would be allocated)."""
    head = files.read_head(path, "weights", "train.init_from", WEIGHTS_FIX, 8)
    size = int.from_bytes(head, "little") if len(head) == 8 else None
    cap = files.CAPS["safetensors header"]
    if size is not None and size > cap:
        raise ConfigError(
            f"train.init_from: '{path}' declares a safetensors header of {files.size_text(size)}, more than the format "
            f"allows ({files.size_text(cap)}); download it again"
        )


def _rename_meta(name: str) -> str:
    for pattern, repl in _META_NAMES:
        if re.match(pattern, name):
            return re.sub(pattern, repl, name)
    return name


def _find_files(p: pathlib.Path) -> tuple[str, list[pathlib.Path]]:
    """(``safetensors`` | ``torch``, files) for a checkpoint directory, file or index file."""
    if p.is_dir():
        for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            if os.path.lexists(p / index):
                return _find_files(p / index)
        if found := sorted(p.glob("*.safetensors")):
            return "safetensors", found
        meta = sorted(p.glob("consolidated.*.pth"))
        if len(meta) > 1:
            raise ConfigError(f"{p}: {len(meta)} model-parallel Meta shards; merge them into one file first")
        if found := [f for f in (p / "pytorch_model.bin", *meta) if os.path.lexists(f)]:
            return "torch", found
        raise ConfigError(f"{p}: no *.safetensors, pytorch_model.bin or consolidated.00.pth found")
    if not os.path.lexists(p):
        raise ConfigError(f"{p}: no such checkpoint file or directory")
    index = p.name.endswith(".index.json")
    files.check(p, "weights index" if index else "weights", "train.init_from", ORIGINAL if index else WEIGHTS_FIX)
    if p.name.endswith(".index.json"):
        weight_map = _json_object(p, "weights index", "train.init_from").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ConfigError(
                f"{p}: no 'weight_map' of tensor name -> file name; replace it with the checkpoint's original"
            )
        shards = [p.parent / f for f in sorted(set(weight_map.values()))]
        absent = [f for f in shards if not os.path.lexists(f)]
        if absent:
            raise ConfigError(
                f"{p} names shard '{absent[0].name}' which is missing"
                + (f" (and {len(absent) - 1} more)" if len(absent) > 1 else "")
                + "; download every shard of the checkpoint"
            )
        return ("safetensors" if "safetensors" in p.name else "torch"), shards
    return ("safetensors" if p.suffix == ".safetensors" else "torch"), [p]


def _torch_load(path: pathlib.Path) -> dict:
    """A torch state dict, tensors only (``weights_only=True``: never unpickles arbitrary objects)."""
    try:
        import torch
    except ImportError:
        raise ConfigError(
            f"{path}: reading a torch state-dict file needs PyTorch (pip install torch), "
            "or convert the checkpoint to safetensors"
        ) from None
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # legacy (non-zip) format: no mmap
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a bad or unsafe file is bad input
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"{path}: torch.load(weights_only=True) cannot read it ({type(e).__name__}: {first})") from e
    for wrapper in ("state_dict", "model", "module"):
        if isinstance(state, dict) and set(state) == {wrapper}:
            state = state[wrapper]
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


# --------------------------------------------------------------------------- load


# float dtypes as safetensors (F32, ...) and torch (FLOAT32, ...) name them, upper case
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64", "FLOAT16", "BFLOAT16", "FLOAT32", "FLOAT64", "HALF", "FLOAT", "DOUBLE")


def _finite(name: str, block: np.ndarray) -> np.ndarray:
    """``block`` unchanged, or a ConfigError when it holds NaN or Inf (training from it would diverge at step 0)."""
    if not np.isfinite(np.asarray(block, np.float32)).all():
        raise ConfigError(f"tensor '{name}' holds NaN or Inf values; the checkpoint is damaged, download it again")
    return block


def _check(src: _Source, leaves: list[_Leaf], model_cfg: ConfigDict) -> None:
    """Every expected tensor present, nothing unexpected, every shape right; else ConfigError."""
    expected = {name: leaf for leaf in leaves for name in leaf.names()}
    present = {n for n in src.tensors if not _IGNORED.search(n)}
    if model_cfg.tie_embeddings:
        present.discard("lm_head.weight")  # some tied checkpoints store the copy; HF ignores it too
    hint = "; check that model_cfg matches the checkpoint's config.json"
    missing = [n for n in expected if n not in present]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        leaf = expected[missing[0]]
        raise ConfigError(
            f"checkpoint lacks tensor '{missing[0]}' (expected {leaf.what} = {leaf.hf_shape}){more}{hint}"
        )
    unexpected = sorted(present - set(expected))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ConfigError(
            f"checkpoint has unexpected tensor '{unexpected[0]}' {src.shape(unexpected[0])}{more} "
            f"that model_cfg (num_layers={model_cfg.num_layers}, "
            f"tie_embeddings={model_cfg.tie_embeddings}) has no place for{hint}"
        )
    for name, leaf in expected.items():
        stored = src.dtype(name)
        if stored.upper().removeprefix("TORCH.") not in FLOAT_DTYPES:
            raise ConfigError(
                f"tensor '{name}' is stored as {stored}, not a float dtype; weights must be float "
                "(F32, BF16, F16, F64): is this a quantized or corrupted checkpoint?"
            )
        if src.shape(name) != leaf.hf_shape:
            raise ConfigError(
                f"tensor '{name}' has shape {src.shape(name)} but model_cfg expects {leaf.what} = {leaf.hf_shape}{hint}"
            )


def _read_heads(
    read: Callable, axis: int, sn: slice, sd: slice, d: int, other: slice, perm: np.ndarray | None
) -> np.ndarray:
    """Heads ``sn`` x head dims ``sd`` of an HF tensor whose dim ``axis`` is ``heads*d``; that dim
    comes back split in two. ``perm`` (Meta layout) maps each HF row of a head to the stored row."""

    def at(rows: slice) -> tuple[slice, slice]:
        return (rows, other) if axis == 0 else (other, rows)

    if sd.stop - sd.start == d:  # whole heads: one contiguous read
        block = read(at(slice(sn.start * d, sn.stop * d)))
        shape = list(block.shape)
        shape[axis : axis + 1] = [sn.stop - sn.start, d]
        block = block.reshape(shape)
        return block if perm is None else np.take(block, perm, axis=axis + 1)
    want = np.arange(sd.start, sd.stop) if perm is None else perm[sd]
    lo, hi = int(want.min()), int(want.max()) + 1
    heads = [np.take(read(at(slice(n * d + lo, n * d + hi))), want - lo, axis=axis) for n in range(sn.start, sn.stop)]
    return np.stack(heads, axis=axis)


def _read_one(
    src: _Source, name: str, leaf: _Leaf, idx: tuple[slice, ...], meta: bool, on_read: ReadHook | None
) -> np.ndarray:
    """The slice ``idx`` (jaxpar layout, one layer) of HF tensor ``name``."""

    def read(hf_idx: tuple[slice, ...]) -> np.ndarray:
        block = src.read(name, hf_idx)
        if on_read is not None:
            on_read(name, tuple(block.shape))
        return block

    if leaf.kind == "copy":
        return read(idx)
    if leaf.kind == "transpose":
        return read(idx[::-1]).T
    d = leaf.shape[-1] if leaf.kind == "heads_in" else leaf.shape[-2]
    if leaf.kind == "heads_in":  # (h, n, d) <- (n*d, h)
        perm = _meta_perm(d) if meta and leaf.rope else None
        return _read_heads(read, 0, idx[1], idx[2], d, idx[0], perm).transpose(2, 0, 1)
    return _read_heads(read, 1, idx[0], idx[1], d, idx[2], None).transpose(1, 2, 0)  # (n, d, h) <- (h, n*d)


def _read_leaf(src: _Source, leaf: _Leaf, meta: bool, on_read: ReadHook | None, index: tuple) -> np.ndarray:
    """``make_array_from_callback``'s callback: the block ``index`` of ``leaf``, read slice by slice."""
    idx = tuple(slice(*s.indices(n)) for s, n in zip(index, leaf.shape))
    with np.errstate(over="ignore"):  # a value past param_dtype's range becomes inf, which _finite refuses
        return _read_block(src, leaf, meta, on_read, idx)


def _read_block(src: _Source, leaf: _Leaf, meta: bool, on_read: ReadHook | None, idx: tuple) -> np.ndarray:
    if not leaf.stacked:
        return _finite(
            leaf.hf, np.ascontiguousarray(_read_one(src, leaf.hf, leaf, idx, meta, on_read), dtype=leaf.dtype)
        )

    def one(name: str, rest: tuple) -> np.ndarray:
        return _finite(name, np.asarray(_read_one(src, name, leaf, rest, meta, on_read), leaf.dtype))

    layers = range(idx[0].start, idx[0].stop)
    if not leaf.experts:
        return np.stack([one(leaf.name(i), idx[1:]) for i in layers])
    experts = range(idx[1].start, idx[1].stop)
    return np.stack([np.stack([one(leaf.name(i, e), idx[2:]) for e in experts]) for i in layers])


def load_hf(
    path: PathLike,
    model_cfg: ConfigDict,
    shardings: Any = None,
    *,
    meta_interleaved: bool = False,
    on_read: ReadHook | None = None,
) -> dict:
    """Load an HF LLaMA checkpoint into jaxpar's parameter tree, cast to ``model.param_dtype``.

    ``path``: a checkpoint directory, a ``.safetensors`` file, a ``*.index.json`` or a torch
    state-dict file (``torch.load(weights_only=True)``; needs PyTorch). ``shardings``: a tree of
    ``jax.sharding.Sharding`` like the model-form parameters (``Setup.model_form.param_shardings``);
    each device's shard is read straight from the file. ``None``: full host numpy arrays. ``meta_interleaved``: q/k rows are
    in Meta's interleaved-RoPE layout (see the module docstring). ``on_read(name, shape)`` is called
    for every block read from the file. Missing, unexpected or wrongly shaped tensors raise
    :class:`ConfigError` naming the tensor.
    """
    leaves, treedef = _leaves(model_cfg)
    src = _Source(path)
    _check(src, leaves, model_cfg)
    meta = meta_interleaved or src.meta_names
    if shardings is None:
        out = [_read_leaf(src, leaf, meta, on_read, tuple(slice(None) for _ in leaf.shape)) for leaf in leaves]
    else:
        flat, tree = jax.tree.flatten(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        if tree != treedef:
            raise ValueError(f"shardings {tree} does not match the parameter tree {treedef}")
        out = [
            jax.make_array_from_callback(leaf.shape, s, functools.partial(_read_leaf, src, leaf, meta, on_read))
            for leaf, s in zip(leaves, flat)
        ]
    return jax.tree.unflatten(treedef, out)


# --------------------------------------------------------------------------- export


def _to_hf(leaf: _Leaf, a: np.ndarray) -> np.ndarray:
    """One (layer of a) jaxpar array in HF layout."""
    if leaf.kind == "transpose":
        a = a.T
    elif leaf.kind == "heads_in":
        a = a.transpose(1, 2, 0).reshape(leaf.hf_shape)
    elif leaf.kind == "heads_out":
        a = a.transpose(2, 0, 1).reshape(leaf.hf_shape)
    return np.ascontiguousarray(a)


def _hf_items(params: dict, model_cfg: ConfigDict) -> list[tuple[str, _Leaf, Callable[[], np.ndarray]]]:
    """``(HF name, leaf, thunk)`` in HF order; each thunk fetches one (layer's) tensor to host."""
    leaves, treedef = _leaves(model_cfg)
    by_path = {leaf.path: (leaf, v) for leaf, v in zip(leaves, treedef.flatten_up_to(params))}
    ordered = [by_path[t.path] for t in _hf_map(model_cfg).tensors if t.path in by_path]

    def thunk(leaf: _Leaf, value: Any, *index: int) -> Callable[[], np.ndarray]:
        return lambda: _to_hf(leaf, np.asarray(value[index] if index else value))

    items = [(leaf.hf, leaf, thunk(leaf, v)) for leaf, v in ordered if leaf.path == ("embed",)]
    for i in range(model_cfg.num_layers):
        for leaf, v in ordered:
            j = i - leaf.first  # this HF layer's index in the leaf's stack
            if not leaf.stacked or not 0 <= j < leaf.shape[0]:
                continue
            if leaf.experts:
                items += [(leaf.name(j, e), leaf, thunk(leaf, v, j, e)) for e in range(leaf.shape[1])]
            else:
                items += [(leaf.name(j), leaf, thunk(leaf, v, j))]
    items += [(leaf.hf, leaf, thunk(leaf, v)) for leaf, v in ordered if leaf.path[0] in ("final_norm", "lm_head")]
    return items


def hf_tensors(params: dict, model_cfg: ConfigDict) -> dict[str, np.ndarray]:
    """All of ``params`` (or a gradient tree like it) as HF-named host arrays in HF layout."""
    return {name: fetch() for name, _, fetch in _hf_items(params, model_cfg)}


def save_hf(
    params: dict, model_cfg: ConfigDict, out_dir: PathLike, *, max_shard_bytes: int = 5 * 2**30, overwrite: bool = False
) -> pathlib.Path:
    """Write ``params`` as an HF LLaMA checkpoint: safetensors (sharded with an index past
    ``max_shard_bytes``) and ``config.json``, in a temporary directory renamed into place
    (:func:`jaxpar.write_guard.replace_folder`: ``overwrite`` replaces only an earlier export).

    Tensors keep their dtype, so jaxpar -> HF -> jaxpar is bitwise exact. Parameters are fetched
    one layer's tensor at a time (single process: every shard must be addressable).
    """
    out = pathlib.Path(out_dir)
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists; pass overwrite=True to replace it")
    shards: list[list] = [[]]
    size = 0
    for name, leaf, fetch in _hf_items(params, model_cfg):
        nbytes = int(np.prod(leaf.hf_shape)) * np.dtype(leaf.dtype).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, fetch))
        size += nbytes

    def fill(tmp: pathlib.Path) -> None:
        weight_map, total = {}, 0
        for k, shard in enumerate(shards):
            fname = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            arrays = {name: fetch() for name, fetch in shard}
            with write_guard.naming(out / fname):
                save_file(arrays, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(arrays, fname))
            total += sum(a.nbytes for a in arrays.values())
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(hf_config_from_model(model_cfg), indent=2) + "\n")

    write_guard.replace_folder(out, write_guard.EXPORT, fill, flag="export -o", overwrite=overwrite)
    return out
