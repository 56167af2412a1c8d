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
    build_schedule,
    compile_program,
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


def _layer0(
    chunk: jax.Array | int, stages: int, virtual_stages: int, blocks: dict, ctx: ShardContext
) -> jax.Array | int:
    """Model-form index of the first layer of this device's chunk ``chunk`` (virtual stage
    ``chunk * p + d``; :func:`~jaxpar.parallel.pipeline.forms.layer_order`): keys dropout masks
    (0, nothing traced, without dropout)."""
    if not dropout.active(ctx):
        return 0
    if ctx.first_layer is not None:  # uneven stages (virtual_stages = 1)
        return ctx.first_layer
    size = jax.tree.leaves(blocks)[0].shape[0] // virtual_stages
    return (chunk * stages + jax.lax.axis_index(AXIS)) * size


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

    def run(kind, mb, chunk, act_buf, grad_buf, act_slot, grad_slot, acc, loss):
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
            return zeros_act(), zeros_act(), acc, loss

        def forward(acc, loss):
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
            return y, zeros_act(), acc, loss

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

                    (y, stage_loss), vjp = jax.vjp(f, shared, _chunk(blocks, chunk, v), x_in)
                    g_y = jnp.where(last, jnp.zeros_like(y), g_y)
                    d_shared, d_chunk, d_x = vjp((vary(g_y, varying_axes(y)), jnp.ones_like(stage_loss)))
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
            return zeros_act(), d_in, acc, loss

        return _switch(kind, [idle, _scoped(SCOPE_FORWARD, forward), _scoped(SCOPE_BACKWARD, backward)], acc, loss)

    def tick(carry, xs):
        act_buf, grad_buf, acc, loss = carry
        row = {name: column[d] for name, column in xs["per_stage"].items()}
        send_f, send_b, acc, loss = run(
            row["kind"],
            row["microbatch"],
            row["chunk"],
            act_buf,
            grad_buf,
            row["act_read"],
            row["grad_read"],
            acc,
            loss,
        )
        recv_f = _send(send_f, xs["fwd"], prog.pairs["fwd"], "fwd")
        recv_b = _send(send_b, xs["bwd"], prog.pairs["bwd"], "bwd")
        act_buf = _store(act_buf, recv_f, row["act_write"])
        grad_buf = _store(grad_buf, recv_b, row["grad_write"])
        return (act_buf, grad_buf, acc, loss), None

    xs = {"per_stage": prog.per_stage, **prog.pattern}
    carry = (
        _zeros((prog.act_slots, *act.shape), act.dtype, act_axes),
        _zeros((prog.grad_slots, *act.shape), act.dtype, act_axes),
        jax.tree.map(acc_zeros, params, dims),
        _zeros((), jnp.float32, loss_axes),
    )
    (_, _, grads, loss), _ = jax.lax.scan(tick, carry, jax.tree.map(jnp.asarray, xs))
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
    model: Model, params: dict, tokens: jax.Array, ctx: ShardContext, stages: int, virtual_stages: int
) -> jax.Array:
    """Summed loss of ``tokens`` (b, s+1) through the pipeline, forward only: the microbatch walks
    the p*v virtual stages in order (one stage busy at a time); the loss is summed over stages."""
    p, v = stages, virtual_stages
    d = jax.lax.axis_index(AXIS)
    shared, blocks = _split(params)
    inputs, targets, positions = split_tokens(tokens, ctx.context_axis)
    x = model.embed(_view(model, shared, ctx), inputs, ctx)
    x = vary(x, varying_axes(x) | {AXIS})
    ring = [(j, (j + 1) % p) for j in range(p)]

    def run(x, k):
        return _cond(
            d == k % p, lambda x: model.run_blocks(x, _chunk(blocks, k // p, v), positions, ctx), lambda x: x, x
        )

    def step(x, k):
        return jax.lax.ppermute(run(x, k), AXIS, ring), None

    x, _ = jax.lax.scan(step, x, jnp.arange(p * v - 1))
    x = run(x, p * v - 1)  # the last virtual stage is on the last device, which holds the head

    def loss(x):
        return model.head_loss(_view(model, shared, ctx), x, targets, ctx)

    return jax.lax.psum(_cond(d == p - 1, loss, lambda x: jnp.zeros((), jnp.float32), x), AXIS)


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
        return cls(table, compile_program(table), model, layout.stage_layers)

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
        return _explicit_loss_and_grads(self.model, params, batch, ctx, self.table, self.program, scale, scatter)

    def eval_loss_sum(self, params: dict, tokens: jax.Array, ctx: ShardContext) -> jax.Array:
        ctx = bind_stage_layers(ctx, self.stage_layers)
        return eval_loss_sum(self.model, params, tokens, ctx, self.table.stages, self.table.virtual_stages)
