"""The parameter inventory the estimates count with (nothing allocated).

The model's parameter tensors with their logical dims and pipeline placement (:func:`param_tensors`,
from the model interface with ``jax.eval_shape``), and the elements of each a device holds under the
jaxpar sharding rules (:func:`shard_elements`, :func:`stage_tensors`), for
:mod:`jaxpar.analysis.estimate` and :mod:`jaxpar.analysis.traffic`. The layout is
:class:`jaxpar.layout.ParallelLayout`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from jaxpar.axes import EXPERT_RULES, TENSOR_RULES
from jaxpar.config import ConfigDict
from jaxpar.layout import RECOMPUTE, ParallelLayout  # noqa: F401 - RECOMPUTE re-exported

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TENSOR_DIMS = frozenset(TENSOR_RULES)  # logical dims split over `tensor` (heads, kv_heads, mlp, vocab)
EXPERT_DIMS = frozenset(EXPERT_RULES)  # logical dims split over `expert` (the MoE experts)


# --------------------------------------------------------------------------- parameters


@dataclasses.dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor: logical dims as (name, size) and where it lives (layer | first | last stage)."""

    name: str
    dims: tuple[tuple[str, int], ...]
    place: str

    # cached: the planner asks these for every tensor of every layout it searches
    @functools.cached_property
    def size(self) -> int:
        return math.prod(n for _, n in self.dims)

    @functools.cached_property
    def tensor_split(self) -> bool:
        """Whether a dim is split over ``tensor`` (heads, kv_heads, mlp or vocab)."""
        return any(name in TENSOR_DIMS for name, _ in self.dims)

    @functools.cached_property
    def expert_split(self) -> bool:
        """Whether a dim is split over ``expert`` (an MoE expert weight)."""
        return any(name in EXPERT_DIMS for name, _ in self.dims)

    @functools.cached_property
    def zero_candidates(self) -> tuple[int, ...]:
        """Sizes of the dims ZeRO may shard over ``data`` (those the tensor and expert rules do not map)."""
        return tuple(n for name, n in self.dims if name not in TENSOR_DIMS and name not in EXPERT_DIMS)


def param_tensors(model: ConfigDict) -> tuple[ParamTensor, ...]:
    """Every parameter tensor of the model, per layer or per model, with logical dim names.

    Derived from the model interface with ``jax.eval_shape(init)`` (nothing allocated, so a 175B
    config costs milliseconds) and the logical axes. A leaf of the stacked subtree is one ``layer``
    tensor (its ``layers`` dim dropped), named by its path inside the subtree (``attn_wq``); every
    other leaf takes its top-level entry's role (``embedding``, ``positions`` on the first pipeline
    stage; ``final_norm_scale``, ``output`` on the last). Cached per model config (the planner
    calls it for every layout).
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


def stacked_layers(model: ConfigDict) -> int:
    """Layers in the scanned stack: all but ``deepseek_v3``'s dense first layers (a per-model entry)."""
    return model.num_layers - model.get("first_dense_layers", 0)


def count_params(model: ConfigDict) -> int:
    """Exact parameter count (the size of ``jax.eval_shape(init)``)."""
    return sum(t.size * (stacked_layers(model) if t.place == "layer" else 1) for t in param_tensors(model))


def shard_elements(tensor: ParamTensor, tensor_size: int, data: int, zero_shard: bool, expert: int = 1) -> float:
    """Elements of ``tensor`` held per device under the jaxpar sharding rules.

    Tensor parallelism splits the logical dims heads, kv_heads, mlp and vocab over ``tensor``
    (norms and position tables are replicated); expert parallelism splits an expert weight's
    ``experts`` dim over ``expert`` (``expert`` = mesh.expert). ZeRO (``zero_shard``) shards the
    largest other dim that its group divides, the first on ties, and never the stacked layer dim;
    if none divides, the tensor stays replicated. The group is ``data`` (the caller's data x
    context) for an expert weight and ``data x expert`` for every other tensor
    (:func:`jaxpar.axes.data_group`). As :func:`jaxpar.sharding.zero_dim` on the real dims.
    """
    elements = float(tensor.size)
    if tensor.tensor_split:
        elements /= tensor_size
    if tensor.expert_split:
        elements /= expert
    elif expert > 1:
        data *= expert
    if zero_shard and data > 1 and any(n % data == 0 for n in tensor.zero_candidates):
        elements /= data
    return elements


def stage_tensors(
    model: ConfigDict, layout: ParallelLayout, pipeline_stage: str, shared_on_every_stage: bool = False
) -> list[tuple[ParamTensor, int]]:
    """(tensor, copies) held by the first or last pipeline stage (one stage holds all when p = 1).

    Each rank holds L/p layers (v chunks when interleaved; uneven stages: the most any stage holds). Megatron places the embedding and
    learned positions on the first stage, final norm and output layer on the last (with tied
    embeddings and p > 1 the last keeps its own copy of the table). ``shared_on_every_stage``:
    jaxpar's pipeline (stage form, :mod:`jaxpar.parallel.pipeline.forms`) holds on every stage the
    layers, the final norm, the positions and one V x h table (the ``ends`` slot when untied, else
    the shared table).
    """
    tensors, p = param_tensors(model), layout.pipeline
    layers = stacked_layers(model) if p == 1 else layout.stored_layers(model.num_layers)
    out = [(t, layers if t.place == "layer" else 1) for t in tensors]
    if shared_on_every_stage:  # one ends slot of (vocab, h): counted as the embedding, no output
        # (zb-v: no ends slot, the embedding and the output layer both on every stage)
        return [(t, c) for t, c in out if p == 1 or t.name != "output" or layout.pipeline_schedule == "zb-v"]
    out = [(t, c) for t, c in out if t.place == "layer" or p == 1 or t.place == pipeline_stage]
    if pipeline_stage == "last" and p > 1 and model.tie_embeddings:
        out += [(t, 1) for t in tensors if t.name == "embedding"]
    return out


def held_elements(
    model: ConfigDict,
    layout: ParallelLayout,
    pipeline_stage: str,
    zero_shard: bool,
    every_stage: bool = False,
    experts: bool | None = None,
) -> float:
    """Parameter elements one device of pipeline stage ``pipeline_stage`` holds (:func:`stage_tensors`), each
    split over ``tensor`` (and an expert weight over ``expert``) and, with ``zero_shard``, over its
    ZeRO group: ``data x context``, times ``expert`` for all but the experts' weights. ``experts``:
    count only the experts' weights (True) or only the other tensors (False)."""
    held = stage_tensors(model, layout, pipeline_stage, every_stage)
    if experts is not None:  # only the experts' weights (True) or only the rest (False)
        held = [(t, c) for t, c in held if t.expert_split == experts]
    # ZeRO shards over the data (x expert) x context group (jaxpar.axes.data_group)
    group = layout.data * layout.context
    return sum(c * shard_elements(t, layout.tensor, group, zero_shard, layout.expert) for t, c in held)
