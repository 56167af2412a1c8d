"""The layout and the parameter inventory the estimates count with (nothing allocated).

:class:`Layout` (mesh sizes plus the choices that change memory and time), the model's parameter
tensors with their logical dims and pipeline placement (:func:`param_tensors`, derived from the
model interface with ``jax.eval_shape``), and how many
elements of each a device holds under the jaxpar sharding rules (:func:`shard_elements`,
:func:`stage_tensors`). Used by :mod:`jaxpar.analysis.estimate` and :mod:`jaxpar.analysis.traffic`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from jaxpar.config import SCHEDULES, ConfigDict, ConfigError
from jaxpar.sharding import TENSOR_RULES

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RECOMPUTE = ("none", "selective", "full")
TENSOR_DIMS = frozenset(TENSOR_RULES)  # logical dims split over `tensor` (heads, kv_heads, mlp, vocab)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A parallel layout: mesh sizes plus the schedule choices that change memory and time."""

    data: int = 1
    tensor: int = 1
    pipeline: int = 1
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedule)
    zero_stage: int = 0
    microbatches: int = 1  # m: microbatches per optimizer step (accumulation or pipeline)
    microbatch_size: int = 1  # b: sequences per data shard per microbatch
    seq_len: int = 2048
    recompute: str = "none"  # none | selective (attention core) | full (keep layer inputs)
    sequence_parallel: bool = False
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved

    @classmethod
    def from_config(cls, cfg: ConfigDict) -> Layout:
        """The layout a (validated) train config runs."""
        m, t = cfg.mesh, cfg.train
        return cls(m.data, m.tensor, m.pipeline, cfg.pipeline.virtual_stages if m.pipeline > 1 else 1,
                   cfg.parallel.zero_stage, t.microbatches, t.global_batch // (t.microbatches * m.data), t.seq_len,
                   cfg.model.remat, cfg.parallel.sequence_parallel, cfg.pipeline.schedule)

    @property
    def devices(self) -> int:
        return self.data * self.tensor * self.pipeline

    @property
    def global_batch(self) -> int:
        return self.microbatch_size * self.microbatches * self.data

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def check(self, model: ConfigDict) -> None:
        """Raise a one-line :class:`ConfigError` if the layout cannot run this model."""
        for n in ("data", "tensor", "pipeline", "virtual_stages", "microbatches", "microbatch_size", "seq_len"):
            _require(getattr(self, n) >= 1, f"{n}={getattr(self, n)} must be >= 1")
        for n in ("num_heads", "num_kv_heads", "mlp_dim", "vocab_size"):
            _require(model[n] % self.tensor == 0, f"tensor={self.tensor} does not divide model.{n}={model[n]}")
        stages = self.pipeline * self.virtual_stages
        _require(model.num_layers % stages == 0, f"pipeline*virtual={stages} does not divide {model.num_layers} layers")
        _require(self.zero_stage in (0, 1, 2, 3), f"zero={self.zero_stage}; use 0, 1, 2 or 3")
        _require(self.recompute in RECOMPUTE, f"recompute='{self.recompute}'; use {', '.join(RECOMPUTE)}")
        _require(self.schedule in SCHEDULES, f"schedule='{self.schedule}'; use {', '.join(SCHEDULES)}")
        _require(self.virtual_stages == 1 or self.schedule == "interleaved", "virtual > 1 needs schedule=interleaved")
        _require(
            not self.sequence_parallel or self.seq_len % self.tensor == 0, "sequence parallel needs seq % tensor == 0"
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"devices": self.devices, "global_batch": self.global_batch}


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(f"layout: {message}")


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


def param_tensors(model: ConfigDict) -> tuple[ParamTensor, ...]:
    """Every parameter tensor of the model, per layer or per model, with logical dim names.

    Derived from the model interface (:mod:`jaxpar.models`), not written by hand: the shapes of
    ``jax.eval_shape(init)`` (abstract: nothing allocated, so 70B / 175B configs cost milliseconds)
    and the logical axes. A leaf of the stacked (scanned) subtree is one ``layer`` tensor (its
    leading ``layers`` dim dropped), named by its path inside the subtree (``attn_wq``,
    ``attn_norm_bias``); every other leaf takes its top-level entry's role (``embedding``,
    ``positions`` on the first pipeline stage; ``final_norm_scale``, ``output`` on the last).
    Cached per model config: the planner calls this for every layout it searches.
    """
    return _param_tensors(tuple(sorted(dict(model).items())))


@functools.lru_cache(maxsize=64)
def _param_tensors(items: tuple) -> tuple[ParamTensor, ...]:
    import jax

    from jaxpar.models import get_model
    from jaxpar.models.base import ROLE_STAGE

    m = get_model(ConfigDict(dict(items)))
    abstract, logical = m.abstract_params(), m.logical_axes()
    flat_names = jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, tuple))
    out = []
    for (path, leaf), names in zip(jax.tree_util.tree_leaves_with_path(abstract), flat_names):
        keys = tuple(str(k.key) for k in path)
        dims = tuple(zip(names, leaf.shape))
        if keys[0] == m.stacked:
            out.append(ParamTensor("_".join(keys[1:]), dims[1:], "layer"))
        else:
            role = m.roles[keys[0]]
            out.append(ParamTensor("_".join((role, *keys[1:])), dims, ROLE_STAGE[role]))
    return tuple(out)


def count_params(model: ConfigDict) -> int:
    """Exact parameter count (the size of ``jax.eval_shape(init)``)."""
    return sum(t.size * (model.num_layers if t.place == "layer" else 1) for t in param_tensors(model))


def shard_elements(tensor: ParamTensor, tensor_size: int, data: int, zero_shard: bool) -> float:
    """Elements of ``tensor`` held per device under the jaxpar sharding rules.

    Tensor parallel splits the logical dims heads, kv_heads, mlp and vocab over ``tensor``; norm
    scales/biases and position tables have none, so they are replicated over tensor. ZeRO
    (``zero_shard``) shards over ``data`` the largest dimension that the tensor rules do not map (a
    heads/kv_heads/mlp/vocab dim is never a ZeRO candidate, even at tensor=1) and whose size is
    divisible by ``data``; ties go to the first such dim. If none divides, the tensor stays
    replicated over data. The stacked layer (scan) dimension is never sharded by ZeRO (it is not
    among ``tensor.dims``). As :func:`jaxpar.sharding.zero_dim`, on the parameter's real dims.
    """
    elements = float(tensor.size)
    if any(name in TENSOR_DIMS for name, _ in tensor.dims):
        elements /= tensor_size
    if zero_shard and data > 1 and any(n % data == 0 for name, n in tensor.dims if name not in TENSOR_DIMS):
        elements /= data
    return elements


def stage_tensors(
    model: ConfigDict, layout: Layout, stage: str, shared_on_every_stage: bool = False
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


def _held_elements(model: ConfigDict, layout: Layout, stage: str, zero_shard: bool, every_stage: bool = False) -> float:
    held = stage_tensors(model, layout, stage, every_stage)
    return sum(c * shard_elements(t, layout.tensor, layout.data, zero_shard) for t, c in held)
