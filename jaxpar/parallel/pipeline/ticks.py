"""What every pipeline executor's ticks share: typed branches, sends, a stage's parts, slot buffers, the
gradient accumulator and the tick loop itself (:func:`scan_table`).

See :mod:`jaxpar.parallel.pipeline` ("Execution"); the executors are in
:mod:`~jaxpar.parallel.pipeline.executor` and :mod:`~jaxpar.parallel.pipeline.split_executor`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.axes import MeshAxis
from jaxpar.compat import trace_once, vary, varying_axes
from jaxpar.models.base import Model, ShardContext, bind_tokens
from jaxpar.ops import dropout
from jaxpar.ops.context_parallel import split_tokens
from jaxpar.parallel.pipeline.forms import ENDS, STACKED

AXIS = MeshAxis.PIPELINE


# --------------------------------------------------------------------------- typing helpers


def branches_agree(branches: list[Callable], *args: Any) -> list[Callable]:
    """Wrap branches of a cond/switch so their outputs vary over the same mesh axes (each branch traced
    once: :func:`~jaxpar.compat.trace_once`)."""
    shapes, replays = zip(*(trace_once(f, *args) for f in branches), strict=True)
    target = jax.tree.map(lambda *s: frozenset().union(*map(varying_axes, s)), *shapes)

    def wrap(f):
        return lambda *a: jax.tree.map(vary, f(*a), target)

    return [wrap(f) for f in replays]


def switch(index: jax.Array, branches: list[Callable], *args: Any) -> Any:
    return jax.lax.switch(index, branches_agree(branches, *args), *args)


def cond(pred: jax.Array, true_fn: Callable, false_fn: Callable, *args: Any) -> Any:
    return jax.lax.switch(pred.astype(jnp.int32), branches_agree([false_fn, true_fn], *args), *args)


# Named scopes on the schedule's branches: they appear in the op_name metadata of every collective
# inside (transposes included), so the compiled-HLO report can count each collective exactly per
# stage from the schedule table (jaxpar.analysis.compiled.pipeline_fraction) instead of bounding it.
SCOPE_FORWARD, SCOPE_BACKWARD, SCOPE_WORK = "pp_forward", "pp_backward", "pp_work"
SCOPE_FIRST, SCOPE_LAST, SCOPE_SEND = "pp_first", "pp_last", "pp_send"
SCOPE_ENDS = "pp_ends"  # the first or the last virtual stage
SCOPE_WEIGHT = "pp_weight"  # a split backward's weight-gradient tick
SCOPE_KEPT = "pp_kept"  # a backward from stashed residuals: every virtual stage but the last


def scoped(name: str, f: Callable) -> Callable:
    def run(*args: Any) -> Any:
        with jax.named_scope(name):
            return f(*args)

    return run


def send(x: jax.Array, pattern: jax.Array, pairs: tuple, direction: str) -> jax.Array:
    """ppermute ``x`` over ``pipeline`` with this tick's pairs (pattern 0: nothing is sent)."""
    branches = [jnp.zeros_like] + [
        scoped(f"{SCOPE_SEND}_{direction}_{k}", functools.partial(jax.lax.ppermute, axis_name=AXIS, perm=list(p)))
        for k, p in enumerate(pairs)
        if k
    ]
    return jax.lax.switch(pattern, branches, x) if len(branches) > 1 else jnp.zeros_like(x)


# --------------------------------------------------------------------------- the stage


def split_params(params: dict) -> tuple[dict, dict]:
    """(embedding / final norm / head parameters, stacked block parameters)."""
    return {k: val for k, val in params.items() if k != STACKED}, params[STACKED]


def scatter_grad(g: jax.Array, dim: int, dtype: Any, group: str | tuple[str, ...]) -> jax.Array:
    """ZeRO-2 inside the pipeline: reduce-scatter a gradient over ``data`` on ``dim`` in ``dtype``,
    back in fp32 for the accumulator (``dim`` -1: the parameter is not sharded, keep it)."""
    if dim < 0:
        return g
    return jax.lax.psum_scatter(g.astype(dtype), group, scatter_dimension=dim, tiled=True).astype(jnp.float32)


def scatter_shared(grads: dict, dims: dict, dtype: Any, owner: jax.Array, group: str | tuple[str, ...]) -> dict:
    """ZeRO-2: reduce-scatter the embedding / head / final-norm gradients only where a stage computed
    them (``owner``: the first or last virtual stage; its data peers take the same branch); the
    other stages' are zero and move nothing."""
    if all(dim < 0 for dim in jax.tree.leaves(dims)):
        return grads
    n = jax.lax.axis_size(group)

    def scatter(g):
        return jax.tree.map(lambda x, dim: scatter_grad(x, dim, dtype, group), g, dims)

    def skip(g):
        return jax.tree.map(
            lambda x, dim: jnp.zeros(tuple(k // n if i == dim else k for i, k in enumerate(x.shape)), jnp.float32),
            g,
            dims,
        )

    return cond(owner, scoped(SCOPE_ENDS, scatter), skip, grads)


def shared_view(model: Model, shared: dict, ctx: ShardContext) -> dict:
    """The model's view of a stage's non-block parameters: this stage's slot of ``ends`` (the
    embedding on the first stage, the transposed output layer on the last) serves as ``embed``,
    which the model's head uses as ``[vocab, embed]`` output layer when there is no ``lm_head``
    (as for tied embeddings). With ZeRO-3 the shards are gathered over ``data`` here
    (:meth:`~jaxpar.models.base.Model.gather_shared`), inside the first / last stage's branch, so
    only those stages gather them."""
    shared = model.gather_shared(shared, ctx)
    if ENDS not in shared:
        return shared
    return {**{k: val for k, val in shared.items() if k != ENDS}, "embed": shared[ENDS][0]}


def chunk_layers(blocks: dict, chunk: jax.Array, virtual_stages: int) -> dict:
    """Chunk ``chunk`` of this device's stacked layers (all of them when v = 1)."""
    if virtual_stages == 1:
        return blocks
    size = jax.tree.leaves(blocks)[0].shape[0] // virtual_stages
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, chunk * size, size, 0), blocks)


def virtual_index(chunk: jax.Array | int, stages: int, v_shape: bool = False) -> jax.Array:
    """This device's virtual stage for ``chunk``: ``chunk * p + d``, or zb-v's V order (chunk 0 is
    stage d, chunk 1 stage 2p-1-d; :func:`~jaxpar.parallel.pipeline.schedule.virtual_stage`)."""
    d = jax.lax.axis_index(AXIS)
    return jnp.where(chunk == 0, d, 2 * stages - 1 - d) if v_shape else chunk * stages + d


def ends_of(chunk: jax.Array | int, stages: int, virtual_stages: int, v_shape: bool = False) -> tuple:
    """(first, last): whether ``chunk`` is the first / the last virtual stage on this device."""
    k = virtual_index(chunk, stages, v_shape)
    return k == 0, k == stages * virtual_stages - 1


def layer0_of(
    chunk: jax.Array | int, stages: int, virtual_stages: int, blocks: dict, ctx: ShardContext, v_shape: bool = False
) -> jax.Array | int:
    """Model-form index of the first layer of this device's chunk ``chunk`` (its virtual stage
    :func:`virtual_index` times the chunk's layers; :func:`~jaxpar.parallel.pipeline.forms.layer_order`):
    keys dropout masks (0, nothing traced, without dropout)."""
    if not dropout.active(ctx):
        return 0
    if ctx.first_layer is not None:  # uneven stages (virtual_stages = 1)
        return ctx.first_layer
    size = jax.tree.leaves(blocks)[0].shape[0] // virtual_stages
    return virtual_index(chunk, stages, v_shape) * size


def run_stage(
    model: Model,
    shared: dict,
    chunk: dict,
    x_in: jax.Array,
    tokens: jax.Array,
    first: jax.Array,
    last: jax.Array | None,
    ctx: ShardContext,
    scale: float,
    layer0: jax.Array | int = 0,
) -> tuple[jax.Array, jax.Array | None]:
    """One virtual stage on one microbatch: (embedding if ``first``) -> its blocks -> (scaled loss
    if ``last``, else 0). ``last=None``: forward only, no loss. ``layer0``: the model-form index of
    the chunk's first layer (dropout masks; :func:`layer0_of`)."""
    inputs, targets, positions, ctx = bind_tokens(tokens, ctx)  # dropout's row column, the document ids
    x = cond(
        first,
        scoped(SCOPE_FIRST, lambda x: model.embed(shared_view(model, shared, ctx), inputs, ctx)),
        lambda x: x,
        x_in,
    )
    y = model.run_blocks(x, chunk, positions, dropout.at_layer(ctx, layer0))

    def loss(y):
        return model.head_loss(shared_view(model, shared, ctx), y, targets, ctx) * scale

    return y, None if last is None else cond(last, scoped(SCOPE_LAST, loss), lambda y: jnp.zeros((), jnp.float32), y)


def stage_ends(
    model: Model,
    ctx: ShardContext,
    inputs: jax.Array,
    targets: jax.Array,
    first: jax.Array,
    last: jax.Array,
    scale: float,
) -> tuple[Callable, Callable]:
    """A virtual stage's two ends as differentiable functions of the shared parameters:
    ``embed(shared, x)`` (the embedding of ``inputs`` on the first virtual stage, else ``x``) and
    ``head(shared, y)`` (the loss against ``targets`` times ``scale`` on the last, else 0)."""

    def embed(sh, x):
        return cond(
            first,
            scoped(SCOPE_FIRST, lambda x: model.embed(shared_view(model, sh, ctx), inputs, ctx)),
            lambda x: x,
            x,
        )

    def head(sh, y):
        def loss(y):
            return model.head_loss(shared_view(model, sh, ctx), y, targets, ctx) * scale

        return cond(last, scoped(SCOPE_LAST, loss), lambda y: jnp.zeros((), jnp.float32), y)

    return embed, head


def boundary_types(
    model: Model, shared: dict, blocks: dict, batch: jax.Array, ctx: ShardContext, v: int, scale: float
) -> tuple[jax.ShapeDtypeStruct, frozenset, frozenset]:
    """(activation shape/dtype, its varying axes, the loss's varying axes), traced abstractly."""
    tokens, bound = dropout.bind(batch[0], ctx)
    emb = jax.eval_shape(
        lambda: model.embed(shared_view(model, shared, bound), split_tokens(tokens, ctx.context_axis)[0], bound)
    )
    axes = varying_axes(emb) | {AXIS}  # blocks vary over pipeline: so does every stage's output
    true, x = jnp.bool_(True), zeros(emb.shape, emb.dtype, axes)
    y, loss = jax.eval_shape(
        lambda: run_stage(model, shared, chunk_layers(blocks, 0, v), x, batch[0], true, true, ctx, scale)
    )
    return emb, axes | varying_axes(y), varying_axes(loss)


def tick_typed(x: jax.Array) -> jax.Array:
    """``x`` varying over ``pipeline`` as a value read by stage index inside a tick is: what a
    stash's types are traced from, so that its slots have the types its ticks write."""
    return vary(x, varying_axes(x) | {AXIS})


def zeros(shape: tuple, dtype: Any, axes: frozenset) -> jax.Array:
    return vary(jnp.zeros(shape, dtype), axes)


def reduce_shared(loss: jax.Array, grads: dict) -> tuple[jax.Array, dict]:
    """Sum the loss (last stage) and the gradients of parameters every stage holds (final norm,
    positions, a tied embedding) over stages; ``ends`` slots are each their own stage's."""
    shared, blocks = split_params(grads)
    summed = {k: g if k == ENDS else jax.lax.psum(g, AXIS) for k, g in shared.items()}
    return jax.lax.psum(loss, AXIS), {**summed, STACKED: blocks}


def accumulator(params: dict, dims: dict, data_axis: Any) -> dict:
    """fp32 zeros shaped like ``params`` that a step's gradients are added into; a leaf split along dim
    ``dims[leaf]`` (ZeRO-2's reduce-scatter; -1: none) is sharded over ``data_axis`` like the optimizer state."""
    n = jax.lax.axis_size(data_axis)

    def like(a, dim):
        shape = tuple(size // n if k == dim else size for k, size in enumerate(a.shape))
        return zeros(shape, jnp.float32, varying_axes(a))

    return jax.tree.map(like, params, dims)


def scan_table(
    run: Callable,
    prog: Any,
    bufs: tuple[jax.Array, jax.Array, list[list[jax.Array]]],
    writes: tuple[str, ...],
    acc: dict,
    loss: jax.Array,
    v_shape: bool = False,
) -> tuple[jax.Array, dict]:
    """The tick loop of every explicit-backward executor: one ``lax.scan`` over the program's ticks.

    Each device takes its row of the table (``prog.per_stage``) and runs it: ``run(row, bufs, acc, loss)``
    returns (the stage output to send forward, the input gradient to send back, one list of values per group
    of kept slots, acc, loss). The output and the gradient travel over ``pipeline`` by the tick's pattern
    into the slots the row names (V-shaped: also over the lanes of the device's second chunk, and to itself
    at the V's tip); group k's values go into its buffers at the row's ``writes[k]`` column. ``bufs`` = (the
    activation slots, the gradient slots, the groups' buffers). Returns :func:`reduce_shared` of the loss
    and the accumulated gradients."""
    d = jax.lax.axis_index(AXIS)

    def tick(carry, xs):
        (act_buf, grad_buf, groups), acc, loss = carry
        row = {name: column[d] for name, column in xs["per_stage"].items()}
        send_f, send_b, kept, acc, loss = run(row, (act_buf, grad_buf, groups), acc, loss)
        recv_f = send(send_f, xs["fwd"], prog.pairs["fwd"], "fwd")
        recv_b = send(send_b, xs["bwd"], prog.pairs["bwd"], "bwd")
        act_buf = store(act_buf, recv_f, row["act_write"])
        grad_buf = store(grad_buf, recv_b, row["grad_write"])
        if v_shape:  # chunk 1's lanes, and at the V's tip the next virtual stage is on this device
            act_buf = store(act_buf, send(send_f, xs["fwdv"], prog.pairs["fwdv"], "fwdv"), row["act_write_v"])
            grad_buf = store(grad_buf, send(send_b, xs["bwdv"], prog.pairs["bwdv"], "bwdv"), row["grad_write_v"])
            act_buf = store(act_buf, vary(send_f, varying_axes(act_buf)), row["act_self"])
            grad_buf = store(grad_buf, vary(send_b, varying_axes(grad_buf)), row["grad_self"])
        groups = [
            [store(b, vary(x, varying_axes(b)), row[write]) for b, x in zip(group, values)]
            for group, values, write in zip(groups, kept, writes, strict=True)
        ]
        return ((act_buf, grad_buf, groups), acc, loss), None

    xs = {"per_stage": prog.per_stage, **prog.pattern}
    (_, acc, loss), _ = jax.lax.scan(tick, (bufs, acc, loss), jax.tree.map(jnp.asarray, xs))
    return reduce_shared(loss, acc)


def store(buf: jax.Array, x: jax.Array, slot: jax.Array) -> jax.Array:
    """Write ``x`` into ``buf[slot]``; ``slot == len(buf)`` (the program's "nothing arrived") is out
    of bounds and dropped, so the slot buffers need no trash slot (an in-place scatter: a select
    against the old slot would keep a copy of it alive through the tick)."""
    return buf.at[slot].set(x, mode="drop")
