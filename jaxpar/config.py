"""Configuration: the schema with its field domains, loading, command-line overrides.

One place per concern: each field's domain (type, range, allowed values) is checked here,
once; the rules that tie fields together and the batch arithmetic live in
:mod:`jaxpar.layout` (:meth:`ParallelLayout.validate`), which :func:`validate` calls, so the
rest of the code can trust a validated config. :func:`validate` is where a config becomes its
:class:`~jaxpar.layout.ParallelLayout`, once per run; the code below is handed that layout. Configs are ml_collections ``ConfigDict`` objects made of small
sub-configs (``mesh``, ``parallel``, ``model``, ``optim``, ``train``, ``data``,
``checkpoint``); code receives the sub-config it needs, never the whole tree. The layout's fields
are ``mesh.*`` and ``parallel.*``, named as :class:`~jaxpar.layout.ParallelLayout` names them; a key
from before they moved there (:data:`MOVED_KEYS`) is a one-line error naming the new key.

Errors are :class:`ConfigError`: one line that names the field and the fix. The CLI turns
them into exit code 2 without a traceback.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import importlib.util
import inspect
import math
import os
import pathlib
import stat
from typing import Any

import ml_collections

from jaxpar import acts, files, isolated
from jaxpar.acts import flatten
from jaxpar.axes import MESH_AXES
from jaxpar.errors import ConfigError, require
from jaxpar.layout import ParallelLayout
from jaxpar.models.registry import check_name
from jaxpar.optim.fields import check_fields

ConfigDict = ml_collections.ConfigDict

DTYPES = ("float32", "bfloat16", "float16")
DATA_SOURCES = ("stdlib", "synthetic", "bin", "megatron")
SCHEDULE_TYPES = ("cosine", "linear", "constant", "inverse_sqrt", "sqrt")
FILE_SOURCES = ("bin", "megatron")  # the data sources that read data.path
MAX_DEVICES = 1 << 20  # more accelerators than any cluster has: a larger mesh is a typo, not a plan
MAX_PARAMS = 10**13  # parameters: beyond any model a cluster of MAX_DEVICES trains
MAX_DIM = 1 << 24  # one model dimension (vocabulary, width, heads, layers, sequence length)
ROPE_SCALINGS = ("none", "llama3")  # model.rope_scaling


# Keys that moved into the `parallel` group (the layout's own names); setting one is an error naming the new key.
MOVED_KEYS = {  # rename_keys: keep
    "model.remat": "parallel.recompute",  # rename_keys: keep
    "train.microbatches": "parallel.microbatches",  # rename_keys: keep
    "pipeline.schedule": "parallel.pipeline_schedule",  # rename_keys: keep
    "pipeline.virtual_stages": "parallel.virtual_stages",  # rename_keys: keep
    "pipeline.layers_per_stage": "parallel.layers_per_stage",  # rename_keys: keep
    "pipeline.first_stage_layers": "parallel.first_stage_layers",  # rename_keys: keep
    "pipeline.last_stage_layers": "parallel.last_stage_layers",  # rename_keys: keep
}
REMOVED_SECTIONS = ("pipeline",)  # sections whose fields all moved (to `parallel`)


def moved_key_error(key: str, value: Any, origin: str) -> str | None:
    """The one-line error for an old ``key`` (:data:`MOVED_KEYS`, or a field of a removed section) set
    to ``value`` from ``origin`` (a config file, ``--config.<key>``, or ``jaxpar port``'s ``--set <key>``:
    the fix then names the same flag); None for a current key."""
    section = key.partition(".")[0]
    new = MOVED_KEYS.get(key)
    if new is None and section not in REMOVED_SECTIONS:
        return None
    if new is None:
        return (
            f"{origin}: the {section} section is gone (its fields moved to parallel: "
            f"{', '.join(v for k, v in MOVED_KEYS.items() if k.startswith(section + '.'))}); "
            f"'{key}' is not one of them: see jaxpar/config.py for the fields"
        )
    for flag in ("--config.", "--set "):
        if origin.startswith(flag):
            return f"{key} moved to {new}: use {flag}{new}={value}"
    return f"{origin}: {key} moved to {new}: set c.{new} = {value!r} (or --config.{new}={value})"


def default_config() -> ConfigDict:
    """The full schema with defaults. Every config file starts from this."""
    c = ConfigDict()

    c.mesh = ConfigDict({axis.value: 1 for axis in MESH_AXES})  # jaxpar.axes.MeshAxis: one size per axis

    # The layout (jaxpar.layout.ParallelLayout): the mesh axis sizes above and these fields, under the
    # layout's own names. The layout also carries, from other sections, train.seq_len and
    # train.global_batch (the training problem; the layout derives microbatch_size = global_batch /
    # (microbatches * data * expert)) and model.attention / model.attention_block (a kernel choice of
    # the model, which the layout carries to price it).
    c.parallel = ConfigDict()
    c.parallel.zero_stage = 0  # 0 = DP, 1 = optimizer, 2 = + grads, 3 = + params, over `data`
    c.parallel.sequence_parallel = False  # shard norms/residuals over seq on `tensor`
    c.parallel.recompute = "none"  # none | full | selective (keep weight-matmul outputs, recompute attention core)
    c.parallel.microbatches = 1  # gradient accumulation (or pipeline) microbatches per optimizer step
    # gpipe | 1f1b | interleaved | zb-h1 | zb-v (zb: backward split into B and W); acts when mesh.pipeline > 1
    c.parallel.pipeline_schedule = "1f1b"
    c.parallel.virtual_stages = 1  # model chunks per pipeline rank (interleaved: >= 2, zb-v: 2)
    c.parallel.layers_per_stage = ""  # uneven stages: layers of each stage, e.g. "1,2,1" (empty: even)
    c.parallel.first_stage_layers = 0  # layers of the first stage, the rest split evenly (0: not set)
    c.parallel.last_stage_layers = 0  # layers of the last stage (0: not set)
    c.parallel.context_exchange = "ring"  # mesh.context > 1: ring (ppermute K/V) | all_gather (gather K/V)
    c.parallel.grad_reduce_dtype = "float32"  # gradient reduction over `data` (ZeRO 0-2); ZeRO-3
    # gathers parameters and reduce-scatters their gradients in model.compute_dtype (FSDP-style)
    c.parallel.max_replicated_fraction = 0.05  # ZeRO-3 guard: share of param bytes replicated
    c.parallel.cross_node_tensor = False  # allow tensor x context groups that span nodes (slow links)

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
    # RoPE frequency scaling: none | llama3 (Llama 3.1's: jaxpar.models.llama.rope_frequencies); the four
    # fields below act only with llama3, their defaults are Llama 3.1's
    c.model.rope_scaling = "none"
    c.model.rope_scaling_factor = 8.0  # the lowest frequencies are divided by it
    c.model.rope_low_freq_factor = 1.0  # wavelengths above rope_original_max_seq_len / this are scaled
    c.model.rope_high_freq_factor = 4.0  # wavelengths below rope_original_max_seq_len / this are kept
    c.model.rope_original_max_seq_len = 8192  # the context length the unscaled model was trained at
    c.model.norm_eps = 1e-5
    c.model.tie_embeddings = False
    c.model.mlp_activation = "swiglu"  # swiglu | gelu (classic GPT)
    c.model.norm = "rmsnorm"  # rmsnorm | layernorm (classic GPT)
    c.model.position = "rope"  # rope | learned (classic GPT)
    # auto: cudnn on an NVIDIA GPU whose kernel takes the shapes, else blockwise (and always with
    # mesh.context > 1) | dot_product (s x s scores, the reference) | blockwise (flash, any backend) | cudnn
    c.model.attention = "auto"
    c.model.attention_block = 512  # blockwise: query and key/value block length
    c.model.attention_mask = "causal"  # causal | block_causal (also never across documents: torchtitan's)
    c.model.eos_token_id = -1  # block_causal: the token ending each packed document (-1: unset, refused)
    c.model.compute_dtype = "bfloat16"
    c.model.param_dtype = "float32"  # master parameters
    c.model.init_std = 0.02
    c.model.dropout = 0.0  # hidden dropout (embedding output, attention and MLP branches); 0: off (jaxpar.ops.dropout)
    c.model.attention_dropout = 0.0  # dropout on the softmax probabilities; 0: off
    c.model.qk_norm = False  # RMSNorm of each query and key head before RoPE (Qwen3; Dehghani et al. 2023)
    # mixture of experts (jaxpar.models.moe): every layer's MLP is num_experts SwiGLU experts of mlp_dim
    c.model.num_experts = 0  # 0: a dense MLP in every layer
    c.model.experts_per_token = 2  # top-k experts each token runs through
    c.model.router_score = "softmax"  # softmax (Mixtral, Qwen3-MoE) | sigmoid (DeepSeek-V3)
    c.model.router_norm_topk = True  # renormalise the top-k weights to sum 1
    c.model.moe_aux_loss_coeff = 0.0  # Switch load-balancing loss weight (Megatron --moe-aux-loss-coeff)
    c.model.moe_z_loss_coeff = 0.0  # router z-loss weight (Megatron --moe-z-loss-coeff)
    c.model.shared_expert_dim = 0  # width of a shared expert every token runs through; 0: none
    c.model.moe_dispatch = "grouped"  # grouped (ragged_dot over the routed tokens) | dense (every expert, every token)
    c.model.moe_capacity_factor = 0.0  # 0: dropless; else per-expert capacity per sequence (token dropping)
    # DeepSeek-V3 (model.name=deepseek_v3 only; jaxpar.models.deepseek): MLA, DeepSeekMoE routing
    c.model.q_lora_rank = 0  # query latent width; 0: a full-rank query projection
    c.model.kv_lora_rank = 0  # key/value latent width (MLA); 0: no MLA
    c.model.qk_nope_head_dim = 0  # per-head query/key dims without RoPE
    c.model.qk_rope_head_dim = 0  # per-head query/key dims with RoPE (one shared rotary key)
    c.model.v_head_dim = 0  # per-head value dims
    c.model.first_dense_layers = 0  # the first layers have a dense MLP of mlp_dim (first_k_dense_replace)
    c.model.moe_mlp_dim = 0  # expert width of deepseek_v3 (moe_intermediate_size)
    c.model.router_groups = 1  # group-limited routing: experts in this many groups (n_group)
    c.model.router_group_topk = 1  # only the best this many groups are eligible (topk_group)
    c.model.router_scale = 1.0  # combine weights times this (routed_scaling_factor)
    c.model.router_bias_rate = 0.0  # aux-loss-free balancing: bias += rate * sign(mean load - load) per step

    c.optim = ConfigDict()
    c.optim.name = "adamw"  # adamw | lion | sgd | adafactor | muon | path/to/file.py:fn (jaxpar.optim.registry)
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
    c.optim.momentum = -1.0  # sgd momentum, muon's beta, adafactor's momentum (0: none); -1: 0.9 / 0.95 / none
    c.optim.nesterov = False  # sgd, muon

    c.train = ConfigDict()
    c.train.steps = 300
    c.train.global_batch = 16  # sequences per optimizer step
    c.train.seq_len = 256
    c.train.seed = 0
    c.train.workdir = "runs/default"
    c.train.log_every = 10
    c.train.eval_every = 0  # 0: evaluate only at start and end
    c.train.eval_batches = 8  # 0: no validation (nothing evaluated at start or end; eval_every must be 0)
    c.train.resume = "auto"  # auto | never (refused over checkpoints) | restart (delete them, start over) | a step
    c.train.init_from = ""  # HF LLaMA weights (dir, .safetensors, .index.json, torch file) when nothing resumes
    c.train.warmup_steps_excluded = 3  # first steps excluded from steady-state throughput (the first always is)
    c.train.spike_factor = 5.0  # skip an update whose loss exceeds this x the running median (0: off)
    c.train.max_bad_steps = 3  # consecutive skipped steps before rolling back to the last checkpoint
    c.train.inject_bad_steps = ""  # fault drills: comma-separated batch numbers (from 1) whose loss is made NaN
    c.train.profile_steps = ""  # "a,b": jax.profiler trace of steps a..b (from 1) into <workdir>/profile
    # fp16 loss scaling (jaxpar.train.loss_scale); acts only with model.compute_dtype=float16
    c.train.loss_scale = ConfigDict()
    c.train.loss_scale.static = 0.0  # > 0: this fixed scale; 0: dynamic, from 2**initial_scale_power
    c.train.loss_scale.initial_scale_power = 16
    c.train.loss_scale.window = 1000  # good steps before the scale doubles
    c.train.loss_scale.hysteresis = 2  # overflowing steps before the scale halves
    c.train.loss_scale.min_scale = 1.0
    c.train.loss_scale.consecutive_hysteresis = False  # deepspeed rule: every good step refills the hysteresis
    c.train.loss_scale.rule = "deepspeed"  # deepspeed | megatron: when the scale grows (jaxpar.train.loss_scale)

    c.data = ConfigDict()
    c.data.source = "stdlib"  # stdlib | synthetic | bin | megatron
    c.data.path = ""  # .bin token file or Megatron prefix (without .bin/.idx)
    c.data.token_dtype = "uint16"  # for source=bin
    c.data.val_fraction = 0.05  # share of files (stdlib) or tokens (bin) held out

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
    return load_config_and_layout(path, overrides)[0]


def load_config_and_layout(
    path: str | None, overrides: list[str] | tuple[str, ...] = ()
) -> tuple[ConfigDict, ParallelLayout]:
    """:func:`load_config` and the layout :func:`validate` built: what a run (``jaxpar train``,
    ``inspect``) hands down instead of deriving it from the config again."""
    cfg = default_config() if path is None else _load_file(path)
    apply_overrides(cfg, overrides)
    return cfg, validate(cfg)


CONFIG_TIMEOUT_S = 30  # default of JAXPAR_CONFIG_TIMEOUT: how long a config file may take to load


# The values of config files this process ran, by (real path, argument, SHA-256 of the file's bytes):
# a file is run once per process for the same bytes (a fresh interpreter per run costs ~0.1-0.3 s once
# JAX has started). Only what the file itself holds is in the key: a module it imports is not.
_VALUES: dict[tuple[str, str, str], dict[str, Any]] = {}
_CACHED_BYTES = 1 << 20  # files larger than this are run every time (the child's reader refuses them anyway)


def _cache_key(spec: str) -> tuple[str, str, str] | None:
    """The file's key in :data:`_VALUES`, or None where only the child should look at it (not a
    regular file, too large, unreadable): opened without blocking, so a FIFO cannot hang the caller."""
    path_str, _, arg = spec.partition(":")
    try:
        fd = os.open(path_str, os.O_RDONLY | os.O_NONBLOCK)
    except (OSError, ValueError):
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _CACHED_BYTES:
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(_CACHED_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    return os.path.realpath(path_str), arg, hashlib.sha256(data).hexdigest()


def _load_file(spec: str) -> ConfigDict:
    """The config file ``spec`` run in a child process (:mod:`jaxpar.isolated`): a file that loops, starts
    a thread or ends the interpreter cannot hang or end the caller; only its values come back (and are
    kept for the same bytes: :data:`_VALUES`)."""
    path_str = spec.partition(":")[0]
    limit = os.environ.get("JAXPAR_CONFIG_TIMEOUT", str(CONFIG_TIMEOUT_S))
    if not (limit.isascii() and limit.isdigit() and int(limit) >= 1):
        raise ConfigError(f"JAXPAR_CONFIG_TIMEOUT={limit!r}: use a whole number of seconds of at least 1")
    key = _cache_key(spec)
    if key is not None and key in _VALUES:
        return merge_into_defaults(copy.deepcopy(_VALUES[key]), source=path_str)
    values = isolated.call(
        __name__,
        "config_file_values",
        [spec],
        int(limit),
        f"--config: '{path_str[:200]}'",
        "a config file only builds its ConfigDict (no loops, threads or waiting); "
        "raise JAXPAR_CONFIG_TIMEOUT if it needs longer",
    )
    if key is not None:
        _VALUES[key] = copy.deepcopy(values)
    return merge_into_defaults(values, source=path_str)


def config_file_values(spec: str) -> dict[str, Any]:
    """The flat ``{"section.field": value}`` of the config file ``spec``, run in this process (the child
    :func:`_load_file` starts): plain values, sent back as JSON."""
    return flatten(_run_file(spec).to_dict())


def _run_file(spec: str) -> ConfigDict:
    path_str, _, arg = spec.partition(":")
    path = pathlib.Path(path_str)
    fix = "pass a path such as configs/tiny.py"
    if not _exists(path):
        raise ConfigError(f"--config: file '{path_str[:200]}' not found; {fix}")
    files.check(path, "config file", "--config", fix)  # a FIFO, device or folder: one line, no hang
    module_spec = importlib.util.spec_from_file_location(f"jaxpar_config_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"--config: '{path_str}' is not a Python file; pass a .py file defining get_config()")
    source = files.read_bytes(path, "config file", "--config", fix)
    module = importlib.util.module_from_spec(module_spec)
    try:
        exec(compile(source, str(path), "exec"), module.__dict__)  # the bytes read above, not a second open
    except BaseException as e:  # a broken config file is bad input, not a crash (SystemExit included)
        if isinstance(e, KeyboardInterrupt):
            raise
        raise ConfigError(f"--config: '{path_str}' failed to load ({_first_line(e)})") from e
    get_config = getattr(module, "get_config", None)
    if not callable(get_config):
        raise ConfigError(f"--config: '{path_str}' defines no get_config(); add one returning a ConfigDict")
    args = (arg,) if arg else ()
    try:
        inspect.signature(get_config).bind(*args)
    except (TypeError, ValueError):
        want = "get_config(arg)" if arg else "get_config()"
        raise ConfigError(
            f"--config: '{path_str}': get_config does not accept the call {want}; "
            + ("drop ':" + arg + "' from --config" if arg else "give its argument as --config FILE:ARG")
        ) from None
    try:
        cfg = get_config(*args)
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        raise ConfigError(f"--config: '{path_str}': get_config() raised {_first_line(e)}; fix the config file") from e
    if not isinstance(cfg, (ConfigDict, dict)):
        raise ConfigError(
            f"--config: '{path_str}': get_config() returned {type(cfg).__name__}, not a ConfigDict; "
            "return jaxpar.config.default_config() with your changes"
        )
    return merge_into_defaults(cfg, source=path_str)


def _exists(path: pathlib.Path) -> bool:
    """``path.exists()``, False for a name the OS refuses (too long, a NUL byte) instead of raising."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def _first_line(error: BaseException) -> str:
    first = (str(error).strip().splitlines() or [""])[0][:200]
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def merge_into_defaults(cfg: ConfigDict | dict, source: str = "config") -> ConfigDict:
    """Overlay a (possibly partial) config on the defaults, rejecting unknown keys."""
    base = default_config()
    try:
        flat = flatten(cfg.to_dict() if isinstance(cfg, ConfigDict) else cfg)
    except RecursionError:
        raise ConfigError(f"{source}: the config nests too deeply; use section.field keys") from None
    for key, value in flat.items():
        _set(base, key, value, origin=source)
    for section in REMOVED_SECTIONS:  # an empty section flattens to no key
        if section in cfg:
            raise ConfigError(
                f"{source}: the {section} section is gone (its fields moved to parallel); drop c.{section} and set "
                "the parallel.* fields: see jaxpar/config.py"
            )
    return base


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
    moved = moved_key_error(key, value, origin)
    if moved is not None:
        raise ConfigError(moved)
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
                f"--config.{key}: '{raw}' is not a valid {kind.__name__}; give e.g. --config.{key}={current!r}"
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
