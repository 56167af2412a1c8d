"""The stage form of the parameters: the layer order of (virtual) stages and the ``ends`` table.

See :mod:`jaxpar.parallel.pipeline` ("Layers on stages", "Embedding and output layer on their stages").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.axes import MeshAxis
from jaxpar.config import ConfigDict
from jaxpar.models.base import Model, ShardContext

ENDS = "ends"  # stage-form parameter: embedding on the first stage, output layer on the last
# the stacked layer subtree the stages split (Pipeline.from_layout refuses a family that names another)
STACKED = Model.stacked


# --------------------------------------------------------------------------- layer order


def layer_order(num_layers: int, stages: int, virtual_stages: int = 1, v_shape: bool = False) -> np.ndarray:
    """``order[j]``: the model layer stored at position j of the pipeline-sharded ``layers`` dim.

    Device d's block of L/p positions holds its chunks d, d+p, ..., d+(v-1)p in that order (with
    ``v_shape``, zb-v's two chunks: virtual stages d and 2p-1-d), each L/(p*v) consecutive layers;
    the identity when v = 1.
    """
    p, v = stages, virtual_stages
    per_chunk = num_layers // (p * v)

    def stage(c: int, d: int) -> int:
        return (d if c == 0 else 2 * p - 1 - d) if v_shape else c * p + d

    return np.array([stage(c, d) * per_chunk + j for d in range(p) for c in range(v) for j in range(per_chunk)])


def uneven(stage_layers: tuple[int, ...]) -> bool:
    """Whether ``stage_layers`` (:attr:`jaxpar.layout.ParallelLayout.stage_layers`) differ by stage."""
    return len(set(stage_layers)) > 1


def stored_order(
    num_layers: int, stages: int, virtual_stages: int = 1, stage_layers: tuple[int, ...] = (), v_shape: bool = False
) -> np.ndarray:
    """``order[j]``: the model layer stored at row j of the pipeline-sharded ``layers`` dim, or
    ``num_layers`` for a padding row. Uneven stages (``stage_layers``, v = 1) each store
    ``max(stage_layers)`` rows: stage d's layers first, then padding that is never computed
    (:attr:`jaxpar.models.base.ShardContext.layers`). Otherwise :func:`layer_order`."""
    if not uneven(stage_layers):
        return layer_order(num_layers, stages, virtual_stages, v_shape)
    rows, start = max(stage_layers), np.cumsum([0, *stage_layers])
    return np.array([start[d] + j if j < n else num_layers for d, n in enumerate(stage_layers) for j in range(rows)])


def _permute_blocks(params: dict, index: np.ndarray) -> dict:
    if np.array_equal(index, np.arange(len(index))):
        return params

    def take(a):  # a row index past the end: a padding row, filled with zeros
        return jnp.take(a, index, axis=0, mode="fill", fill_value=0)

    return {**params, STACKED: jax.tree.map(take, params[STACKED])}


def model_index(
    num_layers: int, stages: int, virtual_stages: int = 1, stage_layers: tuple[int, ...] = (), v_shape: bool = False
) -> np.ndarray:
    """``index[i]``: the stored row of model layer i (the inverse of :func:`stored_order`)."""
    order = stored_order(num_layers, stages, virtual_stages, stage_layers, v_shape)
    index = np.empty(num_layers, dtype=np.int64)
    real = order < num_layers
    index[order[real]] = np.nonzero(real)[0]
    return index


def bind_stage_layers(ctx: ShardContext, stage_layers: tuple[int, ...]) -> ShardContext:
    """Inside the shard_map: ``ctx`` with this stage's layer count and first model-form layer
    (uneven stages; ``ctx`` unchanged otherwise)."""
    if not uneven(stage_layers):
        return ctx
    d = jax.lax.axis_index(MeshAxis.PIPELINE)
    start = np.cumsum([0, *stage_layers[:-1]])
    return dataclasses.replace(
        ctx, layers=jnp.asarray(stage_layers, jnp.int32)[d], first_layer=jnp.asarray(start, jnp.int32)[d]
    )


def has_ends(model_cfg: ConfigDict, stages: int, v_shape: bool = False) -> bool:
    """Whether the stage form places the embedding and output layer in ``ends`` (untied, p > 1;
    not with ``v_shape``, where both run on device 0 and stay replicated over ``pipeline``)."""
    return stages > 1 and not model_cfg.tie_embeddings and not v_shape


def to_stage_form(
    params: dict, stages: int, virtual_stages: int = 1, stage_layers: tuple[int, ...] = (), v_shape: bool = False
) -> dict:
    """Model form -> stage form: block parameters in the stored (pipeline) layer order, and with an
    untied output layer, ``embed`` [V, h] and ``lm_head`` [h, V] packed into one ``ends`` [p, V, h]
    split over ``pipeline``: slot 0 the embedding, slot p-1 the transposed output layer, the slots
    between zeros (they stay zero: their gradient is zero). Each device then holds one V x h table
    instead of two, as Megatron keeps the embedding on the first stage and the head on the last.
    Uneven ``stage_layers``: each stage's rows padded with zeros (:func:`stored_order`)."""
    n = jax.tree.leaves(params[STACKED])[0].shape[0]
    out = _permute_blocks(params, stored_order(n, stages, virtual_stages, stage_layers, v_shape))
    if stages > 1 and "lm_head" in out and not v_shape:
        embed, head = out["embed"], out["lm_head"]
        middle = [jnp.zeros_like(embed)] * (stages - 2)
        out = {k: val for k, val in out.items() if k not in ("embed", "lm_head")}
        out[ENDS] = jnp.stack([embed, *middle, jnp.transpose(head).astype(embed.dtype)])
    return out


def to_model_form(
    params: dict, stages: int, virtual_stages: int = 1, stage_layers: tuple[int, ...] = (), v_shape: bool = False
) -> dict:
    """Stage form -> model form; inverse of :func:`to_stage_form` (padding rows dropped)."""
    n = sum(stage_layers) if uneven(stage_layers) else jax.tree.leaves(params[STACKED])[0].shape[0]
    out = _permute_blocks(params, model_index(n, stages, virtual_stages, stage_layers, v_shape))
    if ENDS in out:
        ends = out[ENDS]
        out = {k: val for k, val in out.items() if k != ENDS}
        out["embed"], out["lm_head"] = ends[0], jnp.transpose(ends[-1])
    return out


def stage_form_logical_axes(logical: dict, stages: int, v_shape: bool = False) -> dict:
    """Logical dim names of the stage form (``ends``: stages x vocab x embed)."""
    if stages <= 1 or "lm_head" not in logical or v_shape:
        return logical
    out = {k: val for k, val in logical.items() if k not in ("embed", "lm_head")}
    return {**out, ENDS: ("stages", *logical["embed"])}
