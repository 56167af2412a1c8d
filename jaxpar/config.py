"""Configuration: defaults, loading, command-line overrides, validation, batch arithmetic.

One place per concern: every derived quantity (device count, per-device microbatch,
tokens per step) and every cross-field check lives here, so the rest of the code can
trust a validated config. Configs are ml_collections ``ConfigDict`` objects made of small
sub-configs (``mesh``, ``parallel``, ``model``, ``optim``, ``train``, ``data``,
``pipeline``, ``checkpoint``); code receives the sub-config it needs, never the whole tree.

Errors are :class:`ConfigError`: one line that names the field and the fix. The CLI turns
them into exit code 2 without a traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
import pathlib
from typing import Any

import ml_collections

from jaxpar.axes import MESH_AXES

ConfigDict = ml_collections.ConfigDict

REMAT_POLICIES = ("none", "full", "selective")
DTYPES = ("float32", "bfloat16", "float16")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
DATA_SOURCES = ("stdlib", "synthetic", "bin", "megatron")
SCHEDULE_TYPES = ("cosine", "linear", "constant", "inverse_sqrt", "sqrt")


class ConfigError(ValueError):
    """A user-facing configuration error: one line naming the field and the fix."""


def default_config() -> ConfigDict:
    """The full schema with defaults. Every config file starts from this."""
    c = ConfigDict()

    c.mesh = ConfigDict({axis.value: 1 for axis in MESH_AXES})  # jaxpar.axes.MeshAxis: one size per axis

    c.parallel = ConfigDict()
    c.parallel.zero_stage = 0  # 0 = DP, 1 = optimizer, 2 = + grads, 3 = + params, over `data`
    c.parallel.sequence_parallel = False  # shard norms/residuals over seq on `tensor`
    c.parallel.grad_reduce_dtype = "float32"  # gradient reduction over `data` (ZeRO 0-2); ZeRO-3
    # gathers parameters and reduce-scatters their gradients in model.compute_dtype (FSDP-style)
    c.parallel.max_replicated_fraction = 0.05  # ZeRO-3 guard: share of param bytes replicated

    c.model = ConfigDict()
    c.model.name = "llama"
    c.model.vocab_size = 256
    c.model.embed_dim = 128
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.num_kv_heads = 4
    c.model.head_dim = 32
    c.model.mlp_dim = 384
    c.model.max_seq_len = 256
    c.model.rope_theta = 10000.0
    c.model.norm_eps = 1e-5
    c.model.tie_embeddings = False
    c.model.mlp_activation = "swiglu"  # swiglu | gelu (classic GPT)
    c.model.norm = "rmsnorm"  # rmsnorm | layernorm (classic GPT)
    c.model.position = "rope"  # rope | learned (classic GPT)
    c.model.remat = "none"  # none | full | selective (keep weight-matmul outputs, recompute attention core)
    c.model.compute_dtype = "bfloat16"
    c.model.param_dtype = "float32"  # master parameters
    c.model.init_std = 0.02

    c.optim = ConfigDict()
    c.optim.name = "adamw"
    c.optim.lr = 3e-3  # peak learning rate
    c.optim.min_lr_ratio = 0.1  # end of cosine decay, as a fraction of lr
    c.optim.warmup_steps = 20
    c.optim.decay_steps = -1  # -1: decay over train.steps
    c.optim.schedule = "cosine"  # decay after warmup: cosine | linear | constant | inverse_sqrt
    c.optim.warmup_type = "linear"  # linear | log (DeepSpeed's default warmup)
    c.optim.warmup_init_lr = 0.0  # absolute learning rate at the start of warmup
    c.optim.schedule_offset = 0  # evaluate the curve at max(k - offset, 0) (DeepSpeed ports: 1)
    c.optim.decay_start_step = -1  # where decay progress is 0; -1: at the end of warmup
    c.optim.b1 = 0.9
    c.optim.b2 = 0.95
    c.optim.eps = 1e-8
    c.optim.weight_decay = 0.1  # not applied to norms (1-D params)
    c.optim.decoupled_weight_decay = True  # AdamW; False = L2 added to the gradient (Adam)
    c.optim.clip_norm = 1.0  # global-norm clipping; 0 disables

    c.train = ConfigDict()
    c.train.steps = 300
    c.train.global_batch = 16  # sequences per optimizer step
    c.train.microbatches = 1  # gradient accumulation (or pipeline) microbatches
    c.train.seq_len = 256
    c.train.seed = 0
    c.train.workdir = "runs/default"
    c.train.log_every = 10
    c.train.eval_every = 0  # 0: evaluate only at start and end
    c.train.eval_batches = 8
    c.train.resume = "auto"  # auto | never | a step number
    c.train.init_from = ""  # HF LLaMA weights (dir, .safetensors, .index.json, torch file) when nothing resumes
    c.train.warmup_steps_excluded = 3  # steps excluded from steady-state throughput
    c.train.spike_factor = 5.0  # skip an update whose loss exceeds this x the running median (0: off)
    c.train.max_bad_steps = 3  # consecutive skipped steps before rolling back to the last checkpoint
    c.train.inject_bad_steps = ""  # fault drills: comma-separated batch numbers (from 1) whose loss is made NaN
    c.train.profile_steps = ""  # "a,b": jax.profiler trace of steps a..b (from 1) into <workdir>/profile

    c.data = ConfigDict()
    c.data.source = "stdlib"  # stdlib | synthetic | bin | megatron
    c.data.path = ""  # .bin token file or Megatron prefix (without .bin/.idx)
    c.data.token_dtype = "uint16"  # for source=bin
    c.data.val_fraction = 0.05  # share of files (stdlib) or tokens (bin) held out

    c.pipeline = ConfigDict()
    c.pipeline.schedule = "1f1b"  # gpipe | 1f1b | interleaved
    c.pipeline.virtual_stages = 1

    c.checkpoint = ConfigDict()
    c.checkpoint.every = 0  # 0: never
    c.checkpoint.keep = 3
    return c


# --------------------------------------------------------------------------- loading


def load_config(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> ConfigDict:
    """Load ``get_config()`` from a config file, apply ``--config.x.y=v`` overrides, validate.

    ``path`` may carry an argument after a colon (``configs/x.py:arg``), passed to
    ``get_config(arg)`` as ml_collections does.
    """
    cfg = default_config() if path is None else _load_file(path)
    apply_overrides(cfg, overrides)
    validate(cfg)
    return cfg


def _load_file(spec: str) -> ConfigDict:
    path_str, _, arg = spec.partition(":")
    path = pathlib.Path(path_str)
    if not path.is_file():
        raise ConfigError(f"--config: file '{path_str}' not found; pass a path such as configs/tiny.py")
    module_spec = importlib.util.spec_from_file_location(f"jaxpar_config_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # a broken config file is bad input, not a crash
        raise ConfigError(f"--config: '{path_str}' failed to load ({type(e).__name__}: {e})") from e
    if not hasattr(module, "get_config"):
        raise ConfigError(f"--config: '{path_str}' defines no get_config(); add one returning a ConfigDict")
    cfg = module.get_config(arg) if arg else module.get_config()
    return merge_into_defaults(cfg, source=path_str)


def merge_into_defaults(cfg: ConfigDict | dict, source: str = "config") -> ConfigDict:
    """Overlay a (possibly partial) config on the defaults, rejecting unknown keys."""
    base = default_config()
    flat = flatten(cfg.to_dict() if isinstance(cfg, ConfigDict) else cfg)
    for key, value in flat.items():
        _set(base, key, value, origin=source)
    return base


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, (dict, ConfigDict)):
            out.update(flatten(dict(v), key + "."))
        else:
            out[key] = v
    return out


def apply_overrides(cfg: ConfigDict, overrides: list[str] | tuple[str, ...]) -> None:
    """Apply ``--config.a.b=value`` strings, typed by the existing field."""
    for item in overrides:
        text = item[2:] if item.startswith("--") else item
        if not text.startswith("config.") or "=" not in text:
            raise ConfigError(f"override '{item}': expected --config.<section>.<field>=<value>")
        key, _, raw = text[len("config.") :].partition("=")
        _set(cfg, key, raw, origin=f"--config.{key}", parse=True)


def _known_keys() -> list[str]:
    return sorted(flatten(default_config().to_dict()))


def _set(cfg: ConfigDict, key: str, value: Any, origin: str, parse: bool = False) -> None:
    parts = key.split(".")
    node = cfg
    for part in parts[:-1]:
        if part not in node or not isinstance(node[part], ConfigDict):
            raise ConfigError(_unknown(key, origin))
        node = node[part]
    leaf = parts[-1]
    if leaf not in node or isinstance(node[leaf], ConfigDict):
        raise ConfigError(_unknown(key, origin))
    current = node[leaf]
    node[leaf] = _coerce(value, current, key, parse)


def _unknown(key: str, origin: str) -> str:
    close = difflib.get_close_matches(key, _known_keys(), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else "; see jaxpar/config.py for the fields"
    return f"{origin}: unknown config key '{key}'{hint}"


def _coerce(value: Any, current: Any, key: str, parse: bool) -> Any:
    kind = type(current)
    if parse and isinstance(value, str):
        raw = value.strip()
        try:
            if kind is bool:
                low = raw.lower()
                if low in ("true", "1", "yes"):
                    return True
                if low in ("false", "0", "no"):
                    return False
                raise ValueError
            if kind is int:
                return int(raw)
            if kind is float:
                return float(raw)
        except ValueError:
            raise ConfigError(
                f"--config.{key}: '{raw}' is not a valid {kind.__name__}; give e.g. "
                f"--config.{key}={current!r}"
            ) from None
        return raw
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is str and isinstance(value, (int, float)) and key == "train.resume":
        return str(value)
    if type(value) is not kind:
        raise ConfigError(f"config.{key}: expected {kind.__name__}, got {value!r}; fix the value in the config")
    return value


# --------------------------------------------------------------------------- validation


@dataclasses.dataclass(frozen=True)
class Derived:
    """Quantities derived from a validated config (batch arithmetic lives only here)."""

    num_devices: int
    per_device_microbatch: int  # sequences per data shard per microbatch
    microbatch_sequences: int  # global sequences per microbatch
    tokens_per_step: int
    layers_per_stage: int


def derive(cfg: ConfigDict) -> Derived:
    """Batch arithmetic: global_batch = per_device_microbatch * microbatches * data."""
    m, t = cfg.mesh, cfg.train
    num_devices = m.data * m.tensor * m.pipeline
    per_device = t.global_batch // (t.microbatches * m.data)
    return Derived(
        num_devices=num_devices,
        per_device_microbatch=per_device,
        microbatch_sequences=t.global_batch // t.microbatches,
        tokens_per_step=t.global_batch * t.seq_len,
        layers_per_stage=cfg.model.num_layers // (m.pipeline * cfg.pipeline.virtual_stages),
    )


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg: ConfigDict, num_devices: int | None = None) -> Derived:
    """Check every field and cross-field constraint; return the derived quantities.

    ``num_devices``, when given, must equal data * tensor * pipeline.
    """
    m, p, mo, o, t, d = cfg.mesh, cfg.parallel, cfg.model, cfg.optim, cfg.train, cfg.data
    for axis in MESH_AXES:
        _require(m[axis] >= 1, f"mesh.{axis}={m[axis]}: a mesh axis size must be >= 1")
    product = m.data * m.tensor * m.pipeline
    if num_devices is not None:
        _require(
            product == num_devices,
            f"mesh: data*tensor*pipeline = {m.data}*{m.tensor}*{m.pipeline} = {product} but "
            f"{num_devices} devices are available; change --config.mesh.data (or tensor/pipeline) "
            f"so the product is {num_devices}",
        )
    _require(p.zero_stage in (0, 1, 2, 3), f"parallel.zero_stage={p.zero_stage}: use 0, 1, 2 or 3")
    _require(
        p.grad_reduce_dtype in ("float32", "bfloat16"),
        f"parallel.grad_reduce_dtype='{p.grad_reduce_dtype}': use float32 or bfloat16",
    )
    _require(
        0.0 <= p.max_replicated_fraction <= 1.0,
        f"parallel.max_replicated_fraction={p.max_replicated_fraction}: use a value in [0, 1]",
    )
    for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"):
        _require(mo[name] >= 1, f"model.{name}={mo[name]}: must be >= 1")
    _require(
        mo.num_heads % mo.num_kv_heads == 0,
        f"model.num_heads={mo.num_heads} is not a multiple of model.num_kv_heads={mo.num_kv_heads}; "
        "pick kv heads that divide the heads",
    )
    for name in ("num_heads", "num_kv_heads", "mlp_dim", "vocab_size"):
        _require(
            mo[name] % m.tensor == 0,
            f"model.{name}={mo[name]} is not divisible by mesh.tensor={m.tensor}; "
            f"choose a tensor size that divides {mo[name]}",
        )
    stages = m.pipeline * cfg.pipeline.virtual_stages
    _require(cfg.pipeline.virtual_stages >= 1, "pipeline.virtual_stages must be >= 1")
    _require(
        mo.num_layers % stages == 0,
        f"model.num_layers={mo.num_layers} is not divisible by mesh.pipeline*pipeline.virtual_stages="
        f"{stages}; choose a pipeline size that divides the layers",
    )
    _require(mo.remat in REMAT_POLICIES, f"model.remat='{mo.remat}': use one of {', '.join(REMAT_POLICIES)}")
    for name in ("compute_dtype", "param_dtype"):
        _require(mo[name] in DTYPES, f"model.{name}='{mo[name]}': use one of {', '.join(DTYPES)}")
    _require(mo.mlp_activation in ("swiglu", "gelu"), f"model.mlp_activation='{mo.mlp_activation}': use swiglu or gelu")
    _require(mo.norm in ("rmsnorm", "layernorm"), f"model.norm='{mo.norm}': use rmsnorm or layernorm")
    _require(mo.position in ("rope", "learned"), f"model.position='{mo.position}': use rope or learned")
    _require(
        t.seq_len <= mo.max_seq_len,
        f"train.seq_len={t.seq_len} exceeds model.max_seq_len={mo.max_seq_len}; lower train.seq_len",
    )
    _require(t.steps >= 0, f"train.steps={t.steps}: must be >= 0")
    _require(t.global_batch >= 1, f"train.global_batch={t.global_batch}: must be >= 1")
    _require(t.microbatches >= 1, f"train.microbatches={t.microbatches}: must be >= 1")
    _require(t.seq_len >= 2, f"train.seq_len={t.seq_len}: must be >= 2")
    per_step = t.microbatches * m.data
    _require(
        t.global_batch % per_step == 0,
        f"train.global_batch={t.global_batch} is not divisible by train.microbatches*mesh.data="
        f"{t.microbatches}*{m.data}={per_step}; use a multiple of {per_step}",
    )
    if p.sequence_parallel:
        _require(
            t.seq_len % m.tensor == 0,
            f"train.seq_len={t.seq_len} is not divisible by mesh.tensor={m.tensor} (sequence parallel); "
            "use a multiple of the tensor size",
        )
    _require(o.lr > 0, f"optim.lr={o.lr}: must be > 0")
    _require(o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps}: must be >= 0")
    _require(
        o.schedule in SCHEDULE_TYPES,
        f"optim.schedule='{o.schedule}': use one of {', '.join(SCHEDULE_TYPES)}",
    )
    _require(o.warmup_type in ("linear", "log"), f"optim.warmup_type='{o.warmup_type}': use linear or log")
    _require(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio={o.min_lr_ratio}: use a value in [0, 1]")
    _require(o.clip_norm >= 0, f"optim.clip_norm={o.clip_norm}: must be >= 0 (0 disables)")
    _require(o.name == "adamw", f"optim.name='{o.name}': only adamw is supported")
    _require(d.source in DATA_SOURCES, f"data.source='{d.source}': use one of {', '.join(DATA_SOURCES)}")
    _require(d.token_dtype in ("uint16", "uint32"), f"data.token_dtype='{d.token_dtype}': use uint16 or uint32")
    if d.source in ("bin", "megatron"):
        _require(bool(d.path), f"data.path is empty but data.source='{d.source}'; set --config.data.path=")
    _require(0 < d.val_fraction < 1, f"data.val_fraction={d.val_fraction}: use a value in (0, 1)")
    _require(cfg.pipeline.schedule in SCHEDULES, f"pipeline.schedule='{cfg.pipeline.schedule}': use one of {', '.join(SCHEDULES)}")
    resume = str(t.resume)
    _require(
        resume in ("auto", "never") or resume.isdigit(),
        f"train.resume='{resume}': use auto, never or a step number",
    )
    _require(
        not t.init_from or os.path.exists(t.init_from),
        f"train.init_from='{t.init_from}': no such file or directory; give an HF checkpoint directory, a "
        ".safetensors / .index.json file or a torch state dict",
    )
    _require(t.spike_factor == 0 or t.spike_factor > 1, f"train.spike_factor={t.spike_factor}: use 0 (off) or > 1")
    _require(t.max_bad_steps >= 1, f"train.max_bad_steps={t.max_bad_steps}: must be >= 1")
    _require(
        all(x.strip().isdigit() for x in t.inject_bad_steps.split(",")) if t.inject_bad_steps else True,
        f"train.inject_bad_steps='{t.inject_bad_steps}': give comma-separated step numbers, e.g. 3,4",
    )
    _require(_profile_steps_ok(t.profile_steps),
             f"train.profile_steps='{t.profile_steps}': give the first and last step to trace as a,b with "
             "1 <= a <= b, e.g. --config.train.profile_steps=5,7 (empty: no trace)")
    _require(cfg.checkpoint.every >= 0, f"checkpoint.every={cfg.checkpoint.every}: must be >= 0")
    _require(cfg.checkpoint.keep >= 1, f"checkpoint.keep={cfg.checkpoint.keep}: must be >= 1")
    return derive(cfg)


def _profile_steps_ok(text: str) -> bool:
    if not text:
        return True
    parts = [x.strip() for x in text.split(",")]
    return len(parts) == 2 and all(x.isdigit() for x in parts) and 1 <= int(parts[0]) <= int(parts[1])


def param_count_estimate(model: ConfigDict) -> int:
    """Parameter count of the model config (exact for our LLaMA/GPT blocks)."""
    h, f, v = model.embed_dim, model.mlp_dim, model.vocab_size
    q = model.num_heads * model.head_dim
    kv = model.num_kv_heads * model.head_dim
    attn = h * q + 2 * h * kv + q * h
    mlp = (3 if model.mlp_activation == "swiglu" else 2) * h * f
    norms = 2 * h * (2 if model.norm == "layernorm" else 1)
    per_layer = attn + mlp + norms
    embed = v * h * (1 if model.tie_embeddings else 2)
    final_norm = h * (2 if model.norm == "layernorm" else 1)
    positions = model.max_seq_len * h if model.position == "learned" else 0
    return model.num_layers * per_layer + embed + final_norm + positions
