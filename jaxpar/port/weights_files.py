"""The files of an HF or Meta checkpoint (safetensors, torch state dicts, sharded with an index) as
named tensors whose slices are read without loading whole tensors."""

from __future__ import annotations

import os
import pathlib
import re
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from jaxpar import files
from jaxpar.config import ConfigError
from jaxpar.port.weights_config import ORIGINAL, PathLike, json_object

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
WEIGHTS_FIX = "point train.init_from at a downloaded HF checkpoint (its regular files)"


# --------------------------------------------------------------------------- sources


class Source:
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
        weight_map = json_object(p, "weights index", "train.init_from").get("weight_map")
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
