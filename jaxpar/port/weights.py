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
import os
import pathlib
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from safetensors.numpy import save_file

from jaxpar import write_guard
from jaxpar.config import ConfigDict, ConfigError
from jaxpar.models import get_model
from jaxpar.port.weights_config import PathLike as PathLike
from jaxpar.port.weights_config import family_hf_map
from jaxpar.port.weights_config import hf_config_from_model as hf_config_from_model
from jaxpar.port.weights_config import model_config_from_hf as model_config_from_hf
from jaxpar.port.weights_files import Source

ReadHook = Callable[[str, tuple[int, ...]], None]
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|^rope\.freqs)$")  # derived buffers, not parameters


def check_hf_model(path: PathLike, model_cfg: ConfigDict) -> None:
    """Compare the configured model with the ``config.json`` next to HF weights (if there is one),
    field by field as the family's HF map lists them (:attr:`jaxpar.models.base.HFMap.config_fields`);
    the first difference is a one-line :class:`ConfigError` naming the override that fixes it."""
    hf_map = family_hf_map(model_cfg)
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
    hf = family_hf_map(model_cfg)
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


# --------------------------------------------------------------------------- load


# float dtypes as safetensors (F32, ...) and torch (FLOAT32, ...) name them, upper case
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64", "FLOAT16", "BFLOAT16", "FLOAT32", "FLOAT64", "HALF", "FLOAT", "DOUBLE")


def _finite(name: str, block: np.ndarray) -> np.ndarray:
    """``block`` unchanged, or a ConfigError when it holds NaN or Inf (training from it would diverge at step 0)."""
    if not np.isfinite(np.asarray(block, np.float32)).all():
        raise ConfigError(f"tensor '{name}' holds NaN or Inf values; the checkpoint is damaged, download it again")
    return block


def _check(src: Source, leaves: list[_Leaf], model_cfg: ConfigDict) -> None:
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
    src: Source, name: str, leaf: _Leaf, idx: tuple[slice, ...], meta: bool, on_read: ReadHook | None
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


def _read_leaf(src: Source, leaf: _Leaf, meta: bool, on_read: ReadHook | None, index: tuple) -> np.ndarray:
    """``make_array_from_callback``'s callback: the block ``index`` of ``leaf``, read slice by slice."""
    idx = tuple(slice(*s.indices(n)) for s, n in zip(index, leaf.shape))
    with np.errstate(over="ignore"):  # a value past param_dtype's range becomes inf, which _finite refuses
        return _read_block(src, leaf, meta, on_read, idx)


def _read_block(src: Source, leaf: _Leaf, meta: bool, on_read: ReadHook | None, idx: tuple) -> np.ndarray:
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
    src = Source(path)
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
    ordered = [by_path[t.path] for t in family_hf_map(model_cfg).tensors if t.path in by_path]

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
