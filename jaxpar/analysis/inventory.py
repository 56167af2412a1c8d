"""The layout and the parameter inventory the estimates count with (no JAX, no allocation).

The layout is :class:`jaxpar.layout.ParallelLayout`; here: the model's parameter
tensors with their logical dims and pipeline placement (:func:`param_tensors`), and how many
elements of each a device holds under the jaxpar sharding rules (:func:`shard_elements`,
:func:`stage_tensors`). Used by :mod:`jaxpar.analysis.estimate` and :mod:`jaxpar.analysis.traffic`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from jaxpar.config import ConfigDict
from jaxpar.layout import RECOMPUTE, ParallelLayout  # noqa: F401 - RECOMPUTE re-exported

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TENSOR_DIMS = frozenset({"heads", "kv_heads", "mlp", "vocab"})  # logical dims split over `tensor`


# --------------------------------------------------------------------------- parameters


@dataclasses.dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor: logical dims as (name, size) and where it lives (layer | first | last stage)."""

    name: str
    dims: tuple[tuple[str, int], ...]
    place: str

    @property
    def size(self) -> int:
        return math.prod(n for _, n in self.dims)


_SHAPE_FIELDS = ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                 "max_seq_len", "tie_embeddings", "mlp_activation", "norm", "position")  # fmt: skip


def param_tensors(model: ConfigDict) -> tuple[ParamTensor, ...]:
    """Every parameter tensor of our block, per layer or per model, with logical dim names.

    LLaMA block: q (embed, heads*hd), k/v (embed, kv_heads*hd), o (heads*hd, embed), SwiGLU gate/up
    (embed, mlp) and down (mlp, embed), two RMSNorm scales (embed); final norm; embedding (vocab,
    embed); untied output (embed, vocab). Classic GPT switches: ``gelu`` drops the gate, ``layernorm``
    adds a bias to every norm, ``learned`` adds a (max_seq_len, embed) position table. Linear layers
    have no biases (as in param_count_estimate). Cached per shape: the planner calls this a lot.
    """
    return _param_tensors(tuple(model[k] for k in _SHAPE_FIELDS))


@functools.lru_cache(maxsize=256)
def _param_tensors(shape: tuple) -> tuple[ParamTensor, ...]:
    m = dict(zip(_SHAPE_FIELDS, shape))
    h, hd, f, vocab = ("embed", m["embed_dim"]), m["head_dim"], ("mlp", m["mlp_dim"]), ("vocab", m["vocab_size"])
    q, kv = ("heads", m["num_heads"] * hd), ("kv_heads", m["num_kv_heads"] * hd)
    norm = [("scale", (h,))] + ([("bias", (h,))] if m["norm"] == "layernorm" else [])
    shapes = {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "up": (h, f), "down": (f, h)}
    if m["mlp_activation"] == "swiglu":
        shapes["gate"] = (h, f)
    out = [ParamTensor(name, dims, "layer") for name, dims in shapes.items()]
    out += [ParamTensor(f"{n}_{k}", d, "layer") for n in ("attn_norm", "mlp_norm") for k, d in norm]
    out.append(ParamTensor("embedding", (vocab, h), "first"))
    if m["position"] == "learned":
        out.append(ParamTensor("positions", (("pos", m["max_seq_len"]), h), "first"))
    out += [ParamTensor(f"final_norm_{k}", d, "last") for k, d in norm]
    if not m["tie_embeddings"]:
        out.append(ParamTensor("output", (h, vocab), "last"))
    return tuple(out)


def count_params(model: ConfigDict) -> int:
    """Exact parameter count (equals jaxpar.config.param_count_estimate)."""
    return sum(t.size * (model.num_layers if t.place == "layer" else 1) for t in param_tensors(model))


def shard_elements(tensor: ParamTensor, tensor_size: int, data: int, zero_shard: bool) -> float:
    """Elements of ``tensor`` held per device under the jaxpar sharding rules.

    Tensor parallel splits the logical dims heads, kv_heads, mlp and vocab over ``tensor``; norm
    scales/biases and position tables have none, so they are replicated over tensor. ZeRO
    (``zero_shard``) shards over ``data`` the largest dimension that the tensor rules do not map (a
    heads/kv_heads/mlp/vocab dim is never a ZeRO candidate, even at tensor=1) and whose size is
    divisible by ``data``; ties go to the first such dim. If none divides, the tensor stays
    replicated over data. The stacked layer (scan) dimension is never sharded by ZeRO.
    """
    elements = float(tensor.size)
    if any(name in TENSOR_DIMS for name, _ in tensor.dims):
        elements /= tensor_size
    if zero_shard and data > 1 and any(n % data == 0 for name, n in tensor.dims if name not in TENSOR_DIMS):
        elements /= data
    return elements


def stage_tensors(
    model: ConfigDict, layout: ParallelLayout, stage: str, shared_on_every_stage: bool = False
) -> list[tuple[ParamTensor, int]]:
    """(tensor, copies) held by the first or last pipeline stage (one stage holds all when p = 1).

    Each rank holds L/p layers (v chunks of L/(p*v) when interleaved). Megatron places the
    embedding and learned positions on the first stage, final norm and output layer on the last;
    with tied embeddings and p > 1 the last stage keeps its own copy of the table.
    ``shared_on_every_stage``: jaxpar's pipeline (``jaxpar/parallel/pipeline/forms.py``, stage form) holds on
    every stage what SPMD makes every device hold: the layers, the final norm and positions
    (replicated over ``pipeline``, gradients summed over it) and one V x h table: with an untied
    output layer the ``ends`` slot (embedding on the first stage, output layer on the last), with
    tied embeddings the shared table.
    """
    tensors, p = param_tensors(model), layout.pipeline
    out = [(t, model.num_layers // p if t.place == "layer" else 1) for t in tensors]
    if shared_on_every_stage:  # one ends slot of (vocab, h): counted as the embedding, no output
        return [(t, c) for t, c in out if p == 1 or t.name != "output"]
    out = [(t, c) for t, c in out if t.place == "layer" or p == 1 or t.place == stage]
    if stage == "last" and p > 1 and model.tie_embeddings:
        out += [(t, 1) for t in tensors if t.name == "embedding"]
    return out


def _held_elements(model: ConfigDict, layout: ParallelLayout, stage: str, zero_shard: bool, every_stage: bool = False) -> float:
    held = stage_tensors(model, layout, stage, every_stage)
    return sum(c * shard_elements(t, layout.tensor, layout.data, zero_shard) for t, c in held)
