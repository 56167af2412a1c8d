"""The pipeline executors: one scan over the schedule's ticks inside the step's shard_map.

See :mod:`jaxpar.parallel.pipeline` ("Execution") for 1F1B / interleaved, GPipe and how ZeRO combines.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import jaxpar.parallel.pipeline.stash as stash_lib
import jaxpar.parallel.pipeline.weight_split as weight_split
from jaxpar.axes import MeshAxis
from jaxpar.compat import vary, varying_axes
from jaxpar.layout import ParallelLayout
from jaxpar.models.base import Model, ShardContext
from jaxpar.ops import dropout
from jaxpar.ops.context_parallel import split_tokens
from jaxpar.parallel.pipeline.forms import ENDS, bind_stage_layers
from jaxpar.parallel.pipeline.schedule import (
    Program,
    ScheduleTable,
    build_eval_schedule,
    build_schedule,
    compile_program,
    keeps_activations,
    splits_backward,
    v_shaped,
)

AXIS = MeshAxis.PIPELINE


# --------------------------------------------------------------------------- typing helpers


def _branches_agree(branches: list[Callable], *args: Any) -> list[Callable]:
    """Wrap branches of a cond/switch so their outputs vary over the same mesh axes."""
    shapes = [jax.eval_shape(f, *args) for f in branches]
    target = jax.tree.map(lambda *s: frozenset().union(*map(varying_axes, s)), *shapes)

    def wrap(f):
        return lambda *a: jax.tree.map(vary, f(*a), target)

    return [wrap(f) for f in branches]


def _switch(index: jax.Array, branches: list[Callable], *args: Any) -> Any:
    return jax.lax.switch(index, _branches_agree(branches, *args), *args)


def _cond(pred: jax.Array, true_fn: Callable, false_fn: Callable, *args: Any) -> Any:
    return jax.lax.switch(pred.astype(jnp.int32), _branches_agree([false_fn, true_fn], *args), *args)


# Named scopes on the schedule's branches: they appear in the op_name metadata of every collective
# inside (transposes included), so the compiled-HLO report can count each collective exactly per
# stage from the schedule table (jaxpar.analysis.compiled.pipeline_fraction) instead of bounding it.
SCOPE_FORWARD, SCOPE_BACKWARD, SCOPE_WORK = "pp_forward", "pp_backward", "pp_work"
SCOPE_FIRST, SCOPE_LAST, SCOPE_SEND = "pp_first", "pp_last", "pp_send"
SCOPE_ENDS = "pp_ends"  # the first or the last virtual stage
SCOPE_WEIGHT = "pp_weight"  # a split backward's weight-gradient tick
SCOPE_KEPT = "pp_kept"  # a backward from stashed residuals: every virtual stage but the last


def _scoped(name: str, f: Callable) -> Callable:
    def run(*args: Any) -> Any:
        with jax.named_scope(name):
            return f(*args)

    return run


def _send(x: jax.Array, pattern: jax.Array, pairs: tuple, direction: str) -> jax.Array:
    """ppermute ``x`` over ``pipeline`` with this tick's pairs (pattern 0: nothing is sent)."""
    branches = [jnp.zeros_like] + [
        _scoped(f"{SCOPE_SEND}_{direction}_{k}", functools.partial(jax.lax.ppermute, axis_name=AXIS, perm=list(p)))
        for k, p in enumerate(pairs)
        if k
    ]
    return jax.lax.switch(pattern, branches, x) if len(branches) > 1 else jnp.zeros_like(x)


# --------------------------------------------------------------------------- the stage


def _split(params: dict) -> tuple[dict, dict]:
    """(embedding / final norm / head parameters, stacked block parameters)."""
    return {k: val for k, val in params.items() if k != "blocks"}, params["blocks"]


def _scatter(g: jax.Array, dim: int, dtype: Any, group: str | tuple[str, ...]) -> jax.Array:
    """ZeRO-2 inside the pipeline: reduce-scatter a gradient over ``data`` on ``dim`` in ``dtype``,
    back in fp32 for the accumulator (``dim`` -1: the parameter is not sharded, keep it)."""
    if dim < 0:
        return g
    return jax.lax.psum_scatter(g.astype(dtype), group, scatter_dimension=dim, tiled=True).astype(jnp.float32)


def _scatter_shared(grads: dict, dims: dict, dtype: Any, owner: jax.Array, group: str | tuple[str, ...]) -> dict:
    """ZeRO-2: reduce-scatter the embedding / head / final-norm gradients only where a stage computed
    them (``owner``: the first or last virtual stage; its data peers take the same branch); the
    other stages' are zero and move nothing."""
    if all(dim < 0 for dim in jax.tree.leaves(dims)):
        return grads
    n = jax.lax.axis_size(group)

    def scatter(g):
        return jax.tree.map(lambda x, dim: _scatter(x, dim, dtype, group), g, dims)

    def skip(g):
        return jax.tree.map(
            lambda x, dim: jnp.zeros(tuple(k // n if i == dim else k for i, k in enumerate(x.shape)), jnp.float32),
            g,
            dims,
        )

    return _cond(owner, _scoped(SCOPE_ENDS, scatter), skip, grads)


def _view(model: Model, shared: dict, ctx: ShardContext) -> dict:
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


def _chunk(blocks: dict, chunk: jax.Array, virtual_stages: int) -> dict:
    """Chunk ``chunk`` of this device's stacked layers (all of them when v = 1)."""
    if virtual_stages == 1:
        return blocks
    size = jax.tree.leaves(blocks)[0].shape[0] // virtual_stages
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, chunk * size, size, 0), blocks)


def _virtual(chunk: jax.Array | int, stages: int, v_shape: bool = False) -> jax.Array:
    """This device's virtual stage for ``chunk``: ``chunk * p + d``, or zb-v's V order (chunk 0 is
    stage d, chunk 1 stage 2p-1-d; :func:`~jaxpar.parallel.pipeline.schedule.virtual_stage`)."""
    d = jax.lax.axis_index(AXIS)
    return jnp.where(chunk == 0, d, 2 * stages - 1 - d) if v_shape else chunk * stages + d


def _ends(chunk: jax.Array | int, stages: int, virtual_stages: int, v_shape: bool = False) -> tuple:
    """(first, last): whether ``chunk`` is the first / the last virtual stage on this device."""
    k = _virtual(chunk, stages, v_shape)
    return k == 0, k == stages * virtual_stages - 1


def _layer0(
    chunk: jax.Array | int, stages: int, virtual_stages: int, blocks: dict, ctx: ShardContext, v_shape: bool = False
) -> jax.Array | int:
    """Model-form index of the first layer of this device's chunk ``chunk`` (its virtual stage
    :func:`_virtual` times the chunk's layers; :func:`~jaxpar.parallel.pipeline.forms.layer_order`):
    keys dropout masks (0, nothing traced, without dropout)."""
    if not dropout.active(ctx):
        return 0
    if ctx.first_layer is not None:  # uneven stages (virtual_stages = 1)
        return ctx.first_layer
    size = jax.tree.leaves(blocks)[0].shape[0] // virtual_stages
    return _virtual(chunk, stages, v_shape) * size


def _stage(
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
    the chunk's first layer (dropout masks; :func:`_layer0`)."""
    tokens, ctx = dropout.bind(tokens, ctx)  # the row column of dropout, if any
    inputs, targets, positions = split_tokens(tokens, ctx.context_axis)
    x = _cond(
        first, _scoped(SCOPE_FIRST, lambda x: model.embed(_view(model, shared, ctx), inputs, ctx)), lambda x: x, x_in
    )
    y = model.run_blocks(x, chunk, positions, dropout.at_layer(ctx, layer0))

    def loss(y):
        return model.head_loss(_view(model, shared, ctx), y, targets, ctx) * scale

    return y, None if last is None else _cond(last, _scoped(SCOPE_LAST, loss), lambda y: jnp.zeros((), jnp.float32), y)


def _stage_backward_by_layer(
    model: Model,
    shared: dict,
    chunk: dict,
    x_in: jax.Array,
    tokens: jax.Array,
    first: jax.Array,
    last: jax.Array,
    g_y: jax.Array,
    acc: dict,
    row: jax.Array,
    ctx: ShardContext,
    scale: float,
    dims: dict,
    dtype: Any,
    layer0: jax.Array | int = 0,
) -> tuple[jax.Array, jax.Array, dict]:
    """The backward of :func:`_stage` layer by layer, for full rematerialisation: a forward scan keeps
    each layer's input, then a reverse scan recomputes one layer under ``jax.vjp`` and adds its
    weight gradient into rows ``row + l`` of ``acc["blocks"]`` in place, so no stacked gradient of
    the stage's layers exists beside the accumulator (ZeRO-2: each reduce-scattered first, ``dims``).
    Returns (scaled loss, input gradient, acc). ``layer0``: as in :func:`_stage`."""
    tokens, ctx = dropout.bind(tokens, ctx)
    inputs, targets, positions = split_tokens(tokens, ctx.context_axis)

    one = model.layer_step(positions, ctx)  # one stored layer, gathered under ZeRO-3

    def block(x, layer, j):  # with dropout, layer j of the chunk keys its masks by its model-form index
        return one(x, layer, layer0 + j if dropout.active(ctx) else None, j)

    def embed(sh, x):
        return _cond(
            first, _scoped(SCOPE_FIRST, lambda x: model.embed(_view(model, sh, ctx), inputs, ctx)), lambda x: x, x
        )

    def head(sh, y):
        def loss(y):
            return model.head_loss(_view(model, sh, ctx), y, targets, ctx) * scale

        return _cond(last, _scoped(SCOPE_LAST, loss), lambda y: jnp.zeros((), jnp.float32), y)

    x0, embed_vjp = jax.vjp(embed, shared, x_in)
    n = jax.tree.leaves(chunk)[0].shape[0]
    y, xs = jax.lax.scan(lambda x, lj: (block(x, *lj), x), x0, (chunk, jnp.arange(n, dtype=jnp.int32)))
    loss, head_vjp = jax.vjp(head, shared, y)
    d_head, d_y = head_vjp(jnp.ones_like(loss))
    g = vary(d_y + jnp.where(last, jnp.zeros_like(g_y), g_y), varying_axes(y))

    def layer_backward(carry, j):
        g, acc_blocks = carry
        layer = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, j, 0, keepdims=False), chunk)
        x = jax.lax.dynamic_index_in_dim(xs, j, 0, keepdims=False)
        _, vjp = jax.vjp(lambda x, layer: block(x, layer, j), x, layer)
        d_x, d_layer = vjp(g)

        def add(a, dw, dim):  # a scatter-add: in place, no copy of the old row beside the new one
            dw = _scatter(dw, dim - 1 if dim >= 0 else -1, dtype, ctx.data_axis)  # one layer: its dims shift by one
            return a.at[row + j].add(vary(dw, varying_axes(a)), mode="promise_in_bounds")

        return (vary(d_x, varying_axes(g)), jax.tree.map(add, acc_blocks, d_layer, dims_blocks)), None

    acc_shared, acc_blocks = _split(acc)
    dims_shared, dims_blocks = _split(dims)
    (g, acc_blocks), _ = jax.lax.scan(layer_backward, (g, acc_blocks), jnp.arange(n - 1, -1, -1))
    d_embed, d_x = embed_vjp(g)
    d_shared = _scatter_shared(jax.tree.map(jnp.add, d_head, d_embed), dims_shared, dtype, first | last, ctx.data_axis)
    acc_shared = jax.tree.map(lambda a, g: a + vary(g, varying_axes(a)), acc_shared, d_shared)
    return loss, d_x, {**acc_shared, "blocks": acc_blocks}


def _boundary_types(
    model: Model, shared: dict, blocks: dict, batch: jax.Array, ctx: ShardContext, v: int, scale: float
) -> tuple[jax.ShapeDtypeStruct, frozenset, frozenset]:
    """(activation shape/dtype, its varying axes, the loss's varying axes), traced abstractly."""
    tokens, bound = dropout.bind(batch[0], ctx)
    emb = jax.eval_shape(
        lambda: model.embed(_view(model, shared, bound), split_tokens(tokens, ctx.context_axis)[0], bound)
    )
    axes = varying_axes(emb) | {AXIS}  # blocks vary over pipeline: so does every stage's output
    true, x = jnp.bool_(True), _zeros(emb.shape, emb.dtype, axes)
    y, loss = jax.eval_shape(lambda: _stage(model, shared, _chunk(blocks, 0, v), x, batch[0], true, true, ctx, scale))
    return emb, axes | varying_axes(y), varying_axes(loss)


def _tick_typed(x: jax.Array) -> jax.Array:
    """``x`` varying over ``pipeline`` as a value read by stage index inside a tick is: what a
    stash's types are traced from, so that its slots have the types its ticks write."""
    return vary(x, varying_axes(x) | {AXIS})


def _zeros(shape: tuple, dtype: Any, axes: frozenset) -> jax.Array:
    return vary(jnp.zeros(shape, dtype), axes)


def _reduce_shared(loss: jax.Array, grads: dict) -> tuple[jax.Array, dict]:
    """Sum the loss (last stage) and the gradients of parameters every stage holds (final norm,
    positions, a tied embedding) over stages; ``ends`` slots are each their own stage's."""
    shared, blocks = _split(grads)
    summed = {k: g if k == ENDS else jax.lax.psum(g, AXIS) for k, g in shared.items()}
    return jax.lax.psum(loss, AXIS), {**summed, "blocks": blocks}


# --------------------------------------------------------------------------- executors


def _store(buf: jax.Array, x: jax.Array, slot: jax.Array) -> jax.Array:
    """Write ``x`` into ``buf[slot]``; ``slot == len(buf)`` (the program's "nothing arrived") is out
    of bounds and dropped, so the slot buffers need no trash slot (an in-place scatter: a select
    against the old slot would keep a copy of it alive through the tick)."""
    return buf.at[slot].set(x, mode="drop")


def _explicit_loss_and_grads(
    model: Model,
    params: dict,
    batch: jax.Array,
    ctx: ShardContext,
    table: ScheduleTable,
    prog: Program,
    scale: float,
    scatter: tuple[dict, Any] | None,
) -> tuple[jax.Array, dict]:
    """1F1B / interleaved: one scan over the table's ticks, explicit ``jax.vjp`` per backward.
    ``scatter`` (ZeRO-2): (dims tree like ``params``, reduce dtype); each backward tick
    reduce-scatters its gradients over ``data`` into an accumulator sharded like the optimizer."""
    p, v = table.stages, table.virtual_stages
    d = jax.lax.axis_index(AXIS)
    shared, blocks = _split(params)
    act, act_axes, loss_axes = _boundary_types(model, shared, blocks, batch, ctx, v, scale)
    zeros_act = functools.partial(_zeros, act.shape, act.dtype, act_axes)
    # Full rematerialisation trades compute for memory: there the backward also runs the microbatch's
    # sequences one at a time (the same flops; the working set of one sequence) and layer by layer;
    # not with ZeRO-2/3, where each pass would gather or scatter every layer again (b times the traffic).
    by_layer = ctx.remat == "full"
    splits = act.shape[0] if by_layer and not (ctx.zero3 or scatter) else 1
    dims, dtype = scatter or (jax.tree.map(lambda _: -1, params), jnp.float32)
    n_data = jax.lax.axis_size(ctx.data_axis)

    def acc_zeros(a, dim):  # ZeRO-2: sharded like the optimizer state
        shape = tuple(size // n_data if k == dim else size for k, size in enumerate(a.shape))
        return _zeros(shape, jnp.float32, varying_axes(a))

    def stage_fn(chunk):
        """A non-last virtual stage's output as a function of (shared, its layers, input, tokens):
        the function whose residuals the stash keeps (:mod:`~jaxpar.parallel.pipeline.stash`)."""
        first, layer0 = (chunk == 0) & (d == 0), _layer0(chunk, p, v, blocks, ctx)

        def fn(sh, ch, x, tok):
            return _stage(model, sh, ch, x, tok, first, None, ctx, scale, layer0)[0]

        return fn

    keep = prog.stash_slots > 0  # no recomputation: the backward reads the forward's residuals
    if keep:  # the kept residuals' types, traced once for the slot buffers (nothing is emitted)
        # typed as inside a tick: the chunk and the microbatch's tokens vary over pipeline there
        c0, tok = _tick_typed(jnp.int32(0)), _tick_typed(batch[0])
        plan = stash_lib.split(stage_fn(c0), (shared, _chunk(blocks, c0, v), zeros_act(), tok), (2, 3))
        kept_zeros = [functools.partial(_zeros, a.shape, a.dtype, varying_axes(a)) for a in plan.kept_avals]
    else:
        kept_zeros = []

    def run(kind, mb, chunk, act_buf, grad_buf, stash_bufs, act_slot, grad_slot, stash_slot, acc, loss):
        # the stage input and output gradient are read from their slots inside the branches: read
        # before the switch they would be copies alive through the whole tick
        def act_in(start=0, n=act.shape[0]):
            return jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_index_in_dim(act_buf, act_slot, 0, False), start, n, 0)

        def grad_in(start=0, n=act.shape[0]):
            return jax.lax.dynamic_slice_in_dim(
                jax.lax.dynamic_index_in_dim(grad_buf, grad_slot, 0, False), start, n, 0
            )

        first, last = (chunk == 0) & (d == 0), (chunk == v - 1) & (d == p - 1)
        tokens = jax.lax.dynamic_index_in_dim(batch, mb, 0, keepdims=False)

        def idle(acc, loss):
            return zeros_act(), zeros_act(), [z() for z in kept_zeros], acc, loss

        def forward(acc, loss):
            if keep:
                args = (shared, _chunk(blocks, chunk, v), act_in(), tokens)
                y, kept = stash_lib.forward(stage_fn(chunk), args, plan)
                return y, zeros_act(), kept, acc, loss
            y, _ = _stage(
                model,
                shared,
                _chunk(blocks, chunk, v),
                act_in(),
                tokens,
                first,
                None,
                ctx,
                scale,
                _layer0(chunk, p, v, blocks, ctx),
            )
            return y, zeros_act(), [z() for z in kept_zeros], acc, loss

        def backward(acc, loss):
            rows = act.shape[0] // splits
            size = jax.tree.leaves(blocks)[0].shape[0] // v

            def one(carry, j):  # rows [j * rows, (j + 1) * rows) of the microbatch
                acc, loss, d_in = carry

                def part(a):
                    return jax.lax.dynamic_slice_in_dim(a, j * rows, rows, 0)

                x_in, g_y = act_in(j * rows, rows), grad_in(j * rows, rows)
                if by_layer:
                    stage_loss, d_x, acc = _stage_backward_by_layer(
                        model,
                        shared,
                        _chunk(blocks, chunk, v),
                        x_in,
                        part(tokens),
                        first,
                        last,
                        g_y,
                        acc,
                        chunk * size,
                        ctx,
                        scale,
                        dims,
                        dtype,
                        _layer0(chunk, p, v, blocks, ctx),
                    )
                else:

                    def f(sh, ch, x):
                        return _stage(
                            model, sh, ch, x, part(tokens), first, last, ctx, scale, _layer0(chunk, p, v, blocks, ctx)
                        )

                    def recompute(x_in, g_y):  # the stage's forward again, under jax.vjp
                        (y, stage_loss), vjp = jax.vjp(f, shared, _chunk(blocks, chunk, v), x_in)
                        g_y = jnp.where(last, jnp.zeros_like(y), g_y)
                        return *vjp((vary(g_y, varying_axes(y)), jnp.ones_like(stage_loss))), stage_loss

                    def kept(x_in, g_y):  # a non-last stage's pullback from its stashed residuals
                        args = (shared, _chunk(blocks, chunk, v), x_in, tokens)
                        in_branch = stash_lib.split(stage_fn(chunk), args, (2, 3))
                        saved = [jax.lax.dynamic_index_in_dim(buf, stash_slot, 0, False) for buf in stash_bufs]
                        d_shared, d_chunk, d_x, _ = stash_lib.pullback(args, saved, in_branch)(g_y)
                        return d_shared, d_chunk, d_x, jnp.zeros((), jnp.float32)

                    if keep:  # the last virtual stage ran no forward tick: it computes both now
                        d_shared, d_chunk, d_x, stage_loss = _cond(
                            last, _scoped(SCOPE_LAST, recompute), _scoped(SCOPE_KEPT, kept), x_in, g_y
                        )
                    else:
                        d_shared, d_chunk, d_x, stage_loss = recompute(x_in, g_y)
                    acc_shared, acc_blocks = _split(acc)
                    dims_shared, dims_blocks = _split(dims)

                    def add(a, g, dim):  # into this chunk's rows of the stage's stacked layers
                        old = jax.lax.dynamic_slice_in_dim(a, chunk * size, size, 0)
                        return jax.lax.dynamic_update_slice_in_dim(
                            a, old + _scatter(g, dim, dtype, ctx.data_axis), chunk * size, 0
                        )

                    d_shared = _scatter_shared(d_shared, dims_shared, dtype, first | last, ctx.data_axis)
                    acc = {
                        **jax.tree.map(lambda a, g: a + vary(g, varying_axes(a)), acc_shared, d_shared),
                        "blocks": jax.tree.map(add, acc_blocks, d_chunk, dims_blocks),
                    }
                d_in = jax.lax.dynamic_update_slice_in_dim(d_in, vary(d_x, varying_axes(d_in)), j * rows, 0)
                out = (acc, loss + stage_loss, d_in)
                return jax.tree.map(lambda new, old: vary(new, varying_axes(old)), out, carry), None

            (acc, loss, d_in), _ = jax.lax.scan(one, (acc, loss, zeros_act()), jnp.arange(splits))
            return zeros_act(), d_in, [z() for z in kept_zeros], acc, loss

        return _switch(kind, [idle, _scoped(SCOPE_FORWARD, forward), _scoped(SCOPE_BACKWARD, backward)], acc, loss)

    def tick(carry, xs):
        act_buf, grad_buf, stash_bufs, acc, loss = carry
        row = {name: column[d] for name, column in xs["per_stage"].items()}
        send_f, send_b, kept, acc, loss = run(
            row["kind"],
            row["microbatch"],
            row["chunk"],
            act_buf,
            grad_buf,
            stash_bufs,
            row["act_read"],
            row["grad_read"],
            row["stash_read"],
            acc,
            loss,
        )
        recv_f = _send(send_f, xs["fwd"], prog.pairs["fwd"], "fwd")
        recv_b = _send(send_b, xs["bwd"], prog.pairs["bwd"], "bwd")
        act_buf = _store(act_buf, recv_f, row["act_write"])
        grad_buf = _store(grad_buf, recv_b, row["grad_write"])
        stash_bufs = [_store(buf, vary(x, varying_axes(buf)), row["stash_write"]) for buf, x in zip(stash_bufs, kept)]
        return (act_buf, grad_buf, stash_bufs, acc, loss), None

    xs = {"per_stage": prog.per_stage, **prog.pattern}
    carry = (
        _zeros((prog.act_slots, *act.shape), act.dtype, act_axes),
        _zeros((prog.grad_slots, *act.shape), act.dtype, act_axes),
        [_zeros((prog.stash_slots, *a.shape), a.dtype, varying_axes(a)) for a in (plan.kept_avals if keep else [])],
        jax.tree.map(acc_zeros, params, dims),
        _zeros((), jnp.float32, loss_axes),
    )
    (_, _, _, grads, loss), _ = jax.lax.scan(tick, carry, jax.tree.map(jnp.asarray, xs))
    return _reduce_shared(loss, grads)


# --------------------------------------------------------------------------- split backward (zb-h1)


def _split_parts(
    model: Model,
    chunk: jax.Array,
    p: int,
    v: int,
    blocks: dict,
    tokens: jax.Array,
    ctx: ShardContext,
    scale: float,
    v_shape: bool,
):
    """The stage of a split-backward schedule as three differentiable parts: ``embed(shared, x)``
    (the embedding on the first virtual stage, else identity), ``layer(layer, x, j)`` (the chunk's
    layer j) and ``head(shared, y)`` (the scaled loss on the last virtual stage, else 0)."""
    first, last = _ends(chunk, p, v, v_shape)
    tokens, ctx = dropout.bind(tokens, ctx)
    inputs, targets, positions = split_tokens(tokens, ctx.context_axis)
    one, layer0 = model.layer_step(positions, ctx), _layer0(chunk, p, v, blocks, ctx, v_shape)

    def embed(sh, x):
        return _cond(
            first, _scoped(SCOPE_FIRST, lambda x: model.embed(_view(model, sh, ctx), inputs, ctx)), lambda x: x, x
        )

    def layer(lay, x, j):
        return one(x, lay, layer0 + j) if dropout.active(ctx) else one(x, lay)

    def head(sh, y):
        def loss(y):
            return model.head_loss(_view(model, sh, ctx), y, targets, ctx) * scale

        return _cond(last, _scoped(SCOPE_LAST, loss), lambda y: jnp.zeros((), jnp.float32), y)

    return embed, layer, head


def _layer_pullback(layer_fn: Callable, lay: dict, x: jax.Array, j: jax.Array, kept: list, g: jax.Array):
    """(flat residuals, weight-split plan, flat arguments) of one layer's pullback rebuilt from its
    kept residuals: what B and W both run a part of (:mod:`~jaxpar.parallel.pipeline.weight_split`)."""
    fn = functools.partial(lambda j, lay, x: layer_fn(lay, x, j), j)
    plan = stash_lib.split(fn, (lay, x), (1,))
    leaves = jax.tree.leaves(stash_lib.pullback((lay, x), kept, plan))
    n_params = len(jax.tree.leaves(lay))

    def pull(leaves, g):
        return jax.tree.leaves(jax.tree.unflatten(plan.treedef, leaves)(g))

    ws = weight_split.split(pull, (leaves, g), [False] * n_params + [True], available=len(leaves))
    return leaves, ws


def _split_loss_and_grads(
    model: Model,
    params: dict,
    batch: jax.Array,
    ctx: ShardContext,
    table: ScheduleTable,
    prog: Program,
    scale: float,
    scatter: tuple[dict, Any] | None,
) -> tuple[jax.Array, dict]:
    """ZB-H1 / ZB-V: one scan over the table's ticks; F keeps each layer's residuals, B computes the
    input gradient and keeps the frontier, W the weight gradients (embedding and head gradients in
    B)."""
    p, v, v_shape = table.stages, table.virtual_stages, v_shaped(table.schedule)
    shared, blocks = _split(params)
    act, act_axes, loss_axes = _boundary_types(model, shared, blocks, batch, ctx, v, scale)
    dims, dtype = scatter or (jax.tree.map(lambda _: -1, params), jnp.float32)
    dims_shared, dims_blocks = _split(dims)
    n = jax.tree.leaves(blocks)[0].shape[0] // v
    n_data = jax.lax.axis_size(ctx.data_axis)

    def zeros_act():
        return _zeros(act.shape, act.dtype, act_axes)

    def layer_of(ch, j):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, j, 0, keepdims=False), ch)

    # the kept residuals' and the frontier's types, traced once (nothing is emitted)
    box: dict[str, Any] = {}

    def trace(c, x, tok):
        embed, layer, head = _split_parts(model, c, p, v, blocks, tok, ctx, scale, v_shape)
        ch, j = _chunk(blocks, c, v), jnp.int32(0)
        box["embed"] = stash_lib.split(embed, (shared, x), (1,))
        box["layer"] = stash_lib.split(
            functools.partial(lambda j, lay, x: layer(lay, x, j), j), (layer_of(ch, j), x), (1,)
        )
        box["head"] = stash_lib.split(head, (shared, x), (1,))
        kept = [jnp.zeros(a.shape, a.dtype) for a in box["layer"].kept_avals]
        _, ws = _layer_pullback(layer, layer_of(ch, j), x, j, kept, x)
        box["front"] = ws.frontier_avals
        return jnp.zeros(())

    jax.eval_shape(trace, _tick_typed(jnp.int32(0)), zeros_act(), _tick_typed(batch[0]))
    kept_avals = (
        [("embed", a) for a in box["embed"].kept_avals]
        + [("layer", a) for a in box["layer"].kept_avals]
        + [("head", a) for a in box["head"].kept_avals]
    )

    def stacked(part, a):  # a layer's residual or frontier value, stacked over the chunk's layers
        return (n, *a.shape) if part == "layer" else a.shape

    def kept_zeros():
        return [_zeros(stacked(part, a), a.dtype, varying_axes(a)) for part, a in kept_avals]

    def front_zeros():
        return [_zeros((n, *a.shape), a.dtype, varying_axes(a)) for a in box["front"]]

    def groups(values):  # kept values as (embed, layer, head) lists
        counts = [len(box[k].kept_avals) for k in ("embed", "layer", "head")]
        return values[: counts[0]], values[counts[0] : counts[0] + counts[1]], values[counts[0] + counts[1] :]

    def acc_zeros(a, dim):
        shape = tuple(size // n_data if k == dim else size for k, size in enumerate(a.shape))
        return _zeros(shape, jnp.float32, varying_axes(a))

    def run(row, bufs, acc, loss):
        act_buf, grad_buf, stash_bufs, front_bufs = bufs
        chunk, mb = row["chunk"], row["microbatch"]
        tokens = jax.lax.dynamic_index_in_dim(batch, mb, 0, keepdims=False)
        embed, layer, head = _split_parts(model, chunk, p, v, blocks, tokens, ctx, scale, v_shape)
        ch = _chunk(blocks, chunk, v)
        first, last = _ends(chunk, p, v, v_shape)

        def read(bufs, slot):
            return [jax.lax.dynamic_index_in_dim(b, slot, 0, False) for b in bufs]

        def idle(acc, loss):
            return zeros_act(), zeros_act(), kept_zeros(), front_zeros(), acc, loss

        def forward(acc, loss):
            x_in = jax.lax.dynamic_index_in_dim(act_buf, row["act_read"], 0, False)
            x0, e_kept = stash_lib.forward(embed, (shared, x_in), box["embed"])

            def body(x, lj):
                lay, j = lj
                fn = functools.partial(lambda j, lay, x: layer(lay, x, j), j)
                return stash_lib.forward(fn, (lay, x), box["layer"])

            y, l_kept = jax.lax.scan(body, x0, (ch, jnp.arange(n, dtype=jnp.int32)))
            stage_loss, h_kept = stash_lib.forward(head, (shared, y), box["head"])
            return y, zeros_act(), [*e_kept, *l_kept, *h_kept], front_zeros(), acc, loss + stage_loss

        def backward(acc, loss):
            e_kept, l_kept, h_kept = groups(read(stash_bufs, row["stash_read"]))
            x = zeros_act()  # a placeholder of the right type: the pullbacks read only kept values
            h_plan = stash_lib.split(head, (shared, x), (1,))
            d_head, d_y = stash_lib.pullback((shared, x), h_kept, h_plan)(_zeros((), jnp.float32, loss_axes) + 1)
            g_in = jax.lax.dynamic_index_in_dim(grad_buf, row["grad_read"], 0, False)
            g = vary(d_y + jnp.where(last, jnp.zeros_like(g_in), g_in), act_axes)

            def body(g, xs):
                lay, j, kept = xs
                leaves, ws = _layer_pullback(layer, lay, x, j, kept, g)
                (d_x,), front = weight_split.run_input_grad(ws, [*leaves, g])
                return vary(d_x, act_axes), front

            idx = jnp.arange(n, dtype=jnp.int32)
            g, front = jax.lax.scan(body, g, (ch, idx, l_kept), reverse=True)
            e_plan = stash_lib.split(embed, (shared, x), (1,))
            d_embed, d_x = stash_lib.pullback((shared, x), e_kept, e_plan)(g)
            d_shared = _scatter_shared(
                jax.tree.map(jnp.add, d_head, d_embed), dims_shared, dtype, first | last, ctx.data_axis
            )
            acc = {
                **jax.tree.map(lambda a, g: a + vary(g, varying_axes(a)), _split(acc)[0], d_shared),
                "blocks": acc["blocks"],
            }
            return zeros_act(), d_x, kept_zeros(), front, acc, loss

        def weight(acc, loss):
            _, l_kept, _ = groups(read(stash_bufs, row["stash_read"]))
            front = read(front_bufs, row["front_read"])
            x, row0 = zeros_act(), chunk * n

            def body(acc_blocks, xs):
                lay, j, kept, fr = xs
                leaves, ws = _layer_pullback(layer, lay, x, j, kept, x)
                d_lay = jax.tree.unflatten(jax.tree.structure(lay), weight_split.run_weight_grad(ws, leaves, fr))

                def add(a, dw, dim):
                    dw = _scatter(dw, dim - 1 if dim >= 0 else -1, dtype, ctx.data_axis)
                    return a.at[row0 + j].add(vary(dw, varying_axes(a)), mode="promise_in_bounds")

                return jax.tree.map(add, acc_blocks, d_lay, dims_blocks), None

            idx = jnp.arange(n, dtype=jnp.int32)
            acc_blocks, _ = jax.lax.scan(body, acc["blocks"], (ch, idx, l_kept, front))
            return zeros_act(), zeros_act(), kept_zeros(), front_zeros(), {**acc, "blocks": acc_blocks}, loss

        branches = [
            idle,
            _scoped(SCOPE_FORWARD, forward),
            _scoped(SCOPE_BACKWARD, backward),
            _scoped(SCOPE_WEIGHT, weight),
        ]
        return _switch(row["kind"], branches, acc, loss)

    def tick(carry, xs):
        bufs, acc, loss = carry
        act_buf, grad_buf, stash_bufs, front_bufs = bufs
        row = {name: column[jax.lax.axis_index(AXIS)] for name, column in xs["per_stage"].items()}
        send_f, send_b, kept, front, acc, loss = run(row, bufs, acc, loss)
        act_buf = _store(act_buf, _send(send_f, xs["fwd"], prog.pairs["fwd"], "fwd"), row["act_write"])
        grad_buf = _store(grad_buf, _send(send_b, xs["bwd"], prog.pairs["bwd"], "bwd"), row["grad_write"])
        if v_shape:  # chunk 1's lanes, and at the V's tip the next virtual stage is on this device
            act_buf = _store(act_buf, _send(send_f, xs["fwdv"], prog.pairs["fwdv"], "fwdv"), row["act_write_v"])
            grad_buf = _store(grad_buf, _send(send_b, xs["bwdv"], prog.pairs["bwdv"], "bwdv"), row["grad_write_v"])
            act_buf = _store(act_buf, vary(send_f, varying_axes(act_buf)), row["act_self"])
            grad_buf = _store(grad_buf, vary(send_b, varying_axes(grad_buf)), row["grad_self"])
        stash_bufs = [_store(b, vary(x, varying_axes(b)), row["stash_write"]) for b, x in zip(stash_bufs, kept)]
        front_bufs = [_store(b, vary(x, varying_axes(b)), row["front_write"]) for b, x in zip(front_bufs, front)]
        return ((act_buf, grad_buf, stash_bufs, front_bufs), acc, loss), None

    bufs = (
        _zeros((prog.act_slots, *act.shape), act.dtype, act_axes),
        _zeros((prog.grad_slots, *act.shape), act.dtype, act_axes),
        [_zeros((prog.stash_slots, *stacked(part, a)), a.dtype, varying_axes(a)) for part, a in kept_avals],
        [_zeros((prog.front_slots, n, *a.shape), a.dtype, varying_axes(a)) for a in box["front"]],
    )
    carry = (bufs, jax.tree.map(acc_zeros, params, dims), _zeros((), jnp.float32, loss_axes))
    xs = {"per_stage": prog.per_stage, **prog.pattern}
    (_, grads, loss), _ = jax.lax.scan(tick, carry, jax.tree.map(jnp.asarray, xs))
    return _reduce_shared(loss, grads)


def _gpipe_loss_and_grads(
    model: Model, params: dict, batch: jax.Array, ctx: ShardContext, table: ScheduleTable, prog: Program, scale: float
) -> tuple[jax.Array, dict]:
    """GPipe: the forward ticks as a differentiated scan; JAX's transpose runs the backward ticks."""
    p, m = table.stages, table.microbatches
    d = jax.lax.axis_index(AXIS)
    forward_ticks = m + p - 1

    def forward(params):
        shared, blocks = _split(params)
        act, act_axes, loss_axes = _boundary_types(model, shared, blocks, batch, ctx, 1, scale)

        def tick(carry, xs):
            x, loss = carry
            t, pattern = xs
            mb = t - d
            tokens = jax.lax.dynamic_index_in_dim(batch, jnp.clip(mb, 0, m - 1), 0, keepdims=False)

            def work(x):
                return _stage(
                    model, shared, blocks, x, tokens, d == 0, d == p - 1, ctx, scale, _layer0(0, p, 1, blocks, ctx)
                )

            def skip(x):
                return x, jnp.zeros((), jnp.float32)

            y, stage_loss = _cond((mb >= 0) & (mb < m), _scoped(SCOPE_WORK, work), skip, x)
            return (_send(y, pattern, prog.pairs["fwd"], "fwd"), loss + stage_loss), None

        init = (_zeros(act.shape, act.dtype, act_axes), _zeros((), jnp.float32, loss_axes))
        xs = (jnp.arange(forward_ticks), jnp.asarray(prog.pattern["fwd"][:forward_ticks]))
        (_, loss), _ = jax.lax.scan(tick, init, xs)
        return loss

    loss, grads = jax.value_and_grad(forward)(params)
    return _reduce_shared(loss, grads)


def eval_loss_sum(
    model: Model, params: dict, tokens: jax.Array, ctx: ShardContext, prog: Program, v_shape: bool = False
) -> jax.Array:
    """Summed loss of ``tokens`` (m, b, s+1) through the pipeline, forward only, on the forward
    table ``prog`` (:func:`~jaxpar.parallel.pipeline.schedule.build_eval_schedule`): every stage
    works on its own microbatch at each tick, activations move as in training; the last virtual
    stage adds its microbatch's loss, summed over stages at the end."""
    table_p = prog.per_stage["kind"].shape[1]
    v = int(prog.per_stage["chunk"].max()) + 1
    d = jax.lax.axis_index(AXIS)
    shared, blocks = _split(params)
    act, act_axes, loss_axes = _boundary_types(model, shared, blocks, tokens, ctx, v, 1.0)

    def tick(carry, xs):
        act_buf, loss = carry
        row = {name: column[d] for name, column in xs["per_stage"].items()}
        chunk = row["chunk"]
        first, last = _ends(chunk, table_p, v, v_shape)
        mb = jax.lax.dynamic_index_in_dim(tokens, row["microbatch"], 0, keepdims=False)

        def idle(loss):
            return _zeros(act.shape, act.dtype, act_axes), loss

        def forward(loss):
            x = jax.lax.dynamic_index_in_dim(act_buf, row["act_read"], 0, False)
            layer0 = _layer0(chunk, table_p, v, blocks, ctx, v_shape)
            y, stage_loss = _stage(model, shared, _chunk(blocks, chunk, v), x, mb, first, last, ctx, 1.0, layer0)
            return y, loss + stage_loss

        y, loss = _switch(row["kind"], [idle, _scoped(SCOPE_FORWARD, forward)], loss)
        act_buf = _store(act_buf, _send(y, xs["fwd"], prog.pairs["fwd"], "fwd"), row["act_write"])
        if v_shape:  # chunk 1's lane, and at the V's tip the next virtual stage is on this device
            act_buf = _store(act_buf, _send(y, xs["fwdv"], prog.pairs["fwdv"], "fwdv"), row["act_write_v"])
            act_buf = _store(act_buf, vary(y, varying_axes(act_buf)), row["act_self"])
        return (act_buf, loss), None

    xs = jax.tree.map(jnp.asarray, {"per_stage": prog.per_stage, **prog.pattern})
    carry = (_zeros((prog.act_slots, *act.shape), act.dtype, act_axes), _zeros((), jnp.float32, loss_axes))
    (_, loss), _ = jax.lax.scan(tick, carry, xs)
    return jax.lax.psum(loss, AXIS)


def eval_microbatches(rows: int, stages: int, microbatches: int) -> int:
    """Microbatches of an evaluation batch of ``rows`` sequences per data shard: the training
    count, or the largest divisor of ``rows`` not above it (at least ``stages`` when ``rows``
    allows, so every stage has work at once)."""
    return max(k for k in range(1, rows + 1) if rows % k == 0 and k <= max(microbatches, min(stages, rows)))


@dataclasses.dataclass(frozen=True, eq=False)
class Pipeline:
    """A layout's pipeline: the schedule table, its lowered program, the model whose stages it
    runs (:class:`~jaxpar.models.base.Model`), and the executors."""

    table: ScheduleTable
    program: Program
    model: Model
    stage_layers: tuple[int, ...] = ()  # uneven stages: layers of each (ParallelLayout.stage_layers)

    @classmethod
    def from_layout(cls, layout: ParallelLayout, model: Model) -> Pipeline:
        """The pipeline of a validated layout (the rules: :meth:`jaxpar.layout.ParallelLayout.validate`)
        running ``model``'s stages."""
        table = build_schedule(layout.schedule, layout.pipeline, layout.microbatches, layout.virtual_stages)
        return cls(table, compile_program(table, stash=keeps_activations(layout)), model, layout.stage_layers)

    def loss_and_grads(
        self, params: dict, batch: jax.Array, ctx: ShardContext, scale: float, scatter: tuple[dict, Any] | None = None
    ) -> tuple[jax.Array, dict]:
        """Inside the shard_map: the scaled loss summed over stages and microbatches, and the local
        gradients (block gradients of this stage's layers; embedding / head gradients summed over
        stages). ``params`` must vary over ``pipeline`` (and over ``data`` unless ZeRO-sharded).
        ``scatter`` (ZeRO-2, 1F1B / interleaved): (zero dim per parameter, -1 for none; reduce
        dtype): those gradients come back reduce-scattered over ``data``."""
        ctx = bind_stage_layers(ctx, self.stage_layers)
        if self.table.schedule == "gpipe":
            return _gpipe_loss_and_grads(self.model, params, batch, ctx, self.table, self.program, scale)
        if splits_backward(self.table.schedule):
            return _split_loss_and_grads(self.model, params, batch, ctx, self.table, self.program, scale, scatter)
        return _explicit_loss_and_grads(self.model, params, batch, ctx, self.table, self.program, scale, scatter)

    def eval_loss_sum(self, params: dict, tokens: jax.Array, ctx: ShardContext) -> jax.Array:
        """Inside the shard_map: the summed loss of ``tokens`` (b, s+1) on this data shard, the
        rows split into :func:`eval_microbatches` that flow through the stages at once."""
        ctx = bind_stage_layers(ctx, self.stage_layers)
        p, v = self.table.stages, self.table.virtual_stages
        m = eval_microbatches(tokens.shape[0], p, self.table.microbatches)
        v_shape = v_shaped(self.table.schedule)
        prog = compile_program(build_eval_schedule(p, m, v, v_shape))
        return eval_loss_sum(self.model, params, tokens.reshape(m, -1, *tokens.shape[1:]), ctx, prog, v_shape)
