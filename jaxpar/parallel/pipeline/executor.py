"""The pipeline executors: one scan over the schedule's ticks inside the step's shard_map.

See :mod:`jaxpar.parallel.pipeline` ("Execution") for 1F1B / interleaved, GPipe and how ZeRO combines.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

import jaxpar.parallel.pipeline.stash as stash_lib
import jaxpar.parallel.pipeline.ticks as ticks
from jaxpar.compat import vary, varying_axes
from jaxpar.errors import ConfigError
from jaxpar.layout import ParallelLayout
from jaxpar.models.base import Model, ShardContext, bind_tokens
from jaxpar.ops import dropout
from jaxpar.parallel.pipeline.forms import STACKED, bind_stage_layers
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
from jaxpar.parallel.pipeline.split_executor import split_loss_and_grads


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
    """The backward of :func:`~jaxpar.parallel.pipeline.ticks.run_stage` layer by layer, for full
    rematerialisation: a forward scan keeps each layer's input, then a reverse scan recomputes one
    layer under ``jax.vjp`` and adds its weight gradient into rows ``row + l`` of ``acc[STACKED]`` in place, so no stacked gradient of
    the stage's layers exists beside the accumulator (ZeRO-2: each reduce-scattered first, ``dims``).
    Returns (scaled loss, input gradient, acc). ``layer0``: as in
    :func:`~jaxpar.parallel.pipeline.ticks.run_stage`."""
    inputs, targets, positions, ctx = bind_tokens(tokens, ctx)

    one = model.layer_step(positions, ctx)  # one stored layer, gathered under ZeRO-3

    def block(x, layer, j):  # with dropout, layer j of the chunk keys its masks by its model-form index
        return one(x, layer, layer0 + j if dropout.active(ctx) else None, j)

    embed, head = ticks.stage_ends(model, ctx, inputs, targets, first, last, scale)

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
            dw = ticks.scatter_grad(
                dw, dim - 1 if dim >= 0 else -1, dtype, ctx.data_axis
            )  # one layer: its dims shift by one
            return a.at[row + j].add(vary(dw, varying_axes(a)), mode="promise_in_bounds")

        return (vary(d_x, varying_axes(g)), jax.tree.map(add, acc_blocks, d_layer, dims_blocks)), None

    acc_shared, acc_blocks = ticks.split_params(acc)
    dims_shared, dims_blocks = ticks.split_params(dims)
    (g, acc_blocks), _ = jax.lax.scan(layer_backward, (g, acc_blocks), jnp.arange(n - 1, -1, -1))
    d_embed, d_x = embed_vjp(g)
    d_shared = ticks.scatter_shared(
        jax.tree.map(jnp.add, d_head, d_embed), dims_shared, dtype, first | last, ctx.data_axis
    )
    acc_shared = jax.tree.map(lambda a, g: a + vary(g, varying_axes(a)), acc_shared, d_shared)
    return loss, d_x, {**acc_shared, STACKED: acc_blocks}


# --------------------------------------------------------------------------- executors


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
    d = jax.lax.axis_index(ticks.AXIS)
    shared, blocks = ticks.split_params(params)
    act, act_axes, loss_axes = ticks.boundary_types(model, shared, blocks, batch, ctx, v, scale)
    zeros_act = functools.partial(ticks.zeros, act.shape, act.dtype, act_axes)
    # Full rematerialisation trades compute for memory: there the backward also runs the microbatch's
    # sequences one at a time (the same flops; the working set of one sequence) and layer by layer;
    # not with ZeRO-2/3, where each pass would gather or scatter every layer again (b times the traffic).
    by_layer = ctx.recompute == "full"
    splits = act.shape[0] if by_layer and not (ctx.zero3 or scatter) else 1
    dims, dtype = scatter or (jax.tree.map(lambda _: -1, params), jnp.float32)

    def stage_fn(chunk):
        """A non-last virtual stage's output as a function of (shared, its layers, input, tokens):
        the function whose residuals the stash keeps (:mod:`~jaxpar.parallel.pipeline.stash`)."""
        first, layer0 = (chunk == 0) & (d == 0), ticks.layer0_of(chunk, p, v, blocks, ctx)

        def fn(sh, ch, x, tok):
            return ticks.run_stage(model, sh, ch, x, tok, first, None, ctx, scale, layer0)[0]

        return fn

    keep = prog.stash_slots > 0  # no recomputation: the backward reads the forward's residuals
    if keep:  # the kept residuals' types, traced once for the slot buffers (nothing is emitted)
        # typed as inside a tick: the chunk and the microbatch's tokens vary over pipeline there
        c0, tok = ticks.tick_typed(jnp.int32(0)), ticks.tick_typed(batch[0])
        plan = stash_lib.split(stage_fn(c0), (shared, ticks.chunk_layers(blocks, c0, v), zeros_act(), tok), (2, 3))
        kept_zeros = [functools.partial(ticks.zeros, a.shape, a.dtype, varying_axes(a)) for a in plan.kept_avals]
    else:
        kept_zeros = []

    def run(row, bufs, acc, loss):
        act_buf, grad_buf, (stash_bufs,) = bufs
        kind, mb, chunk = row["kind"], row["microbatch"], row["chunk"]
        act_slot, grad_slot, stash_slot = row["act_read"], row["grad_read"], row["stash_read"]

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
                args = (shared, ticks.chunk_layers(blocks, chunk, v), act_in(), tokens)
                y, kept = stash_lib.forward(stage_fn(chunk), args, plan)
                return y, zeros_act(), kept, acc, loss
            y, _ = ticks.run_stage(
                model,
                shared,
                ticks.chunk_layers(blocks, chunk, v),
                act_in(),
                tokens,
                first,
                None,
                ctx,
                scale,
                ticks.layer0_of(chunk, p, v, blocks, ctx),
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
                        ticks.chunk_layers(blocks, chunk, v),
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
                        ticks.layer0_of(chunk, p, v, blocks, ctx),
                    )
                else:

                    def f(sh, ch, x):
                        return ticks.run_stage(
                            model,
                            sh,
                            ch,
                            x,
                            part(tokens),
                            first,
                            last,
                            ctx,
                            scale,
                            ticks.layer0_of(chunk, p, v, blocks, ctx),
                        )

                    def recompute(x_in, g_y):  # the stage's forward again, under jax.vjp
                        (y, stage_loss), vjp = jax.vjp(f, shared, ticks.chunk_layers(blocks, chunk, v), x_in)
                        g_y = jnp.where(last, jnp.zeros_like(y), g_y)
                        return *vjp((vary(g_y, varying_axes(y)), jnp.ones_like(stage_loss))), stage_loss

                    def kept(x_in, g_y):  # a non-last stage's pullback from its stashed residuals
                        args = (shared, ticks.chunk_layers(blocks, chunk, v), x_in, tokens)
                        in_branch = stash_lib.split(stage_fn(chunk), args, (2, 3))
                        saved = [jax.lax.dynamic_index_in_dim(buf, stash_slot, 0, False) for buf in stash_bufs]
                        d_shared, d_chunk, d_x, _ = stash_lib.pullback(args, saved, in_branch)(g_y)
                        return d_shared, d_chunk, d_x, jnp.zeros((), jnp.float32)

                    if keep:  # the last virtual stage ran no forward tick: it computes both now
                        d_shared, d_chunk, d_x, stage_loss = ticks.cond(
                            last,
                            ticks.scoped(ticks.SCOPE_LAST, recompute),
                            ticks.scoped(ticks.SCOPE_KEPT, kept),
                            x_in,
                            g_y,
                        )
                    else:
                        d_shared, d_chunk, d_x, stage_loss = recompute(x_in, g_y)
                    acc_shared, acc_blocks = ticks.split_params(acc)
                    dims_shared, dims_blocks = ticks.split_params(dims)

                    def add(a, g, dim):  # into this chunk's rows of the stage's stacked layers
                        old = jax.lax.dynamic_slice_in_dim(a, chunk * size, size, 0)
                        return jax.lax.dynamic_update_slice_in_dim(
                            a, old + ticks.scatter_grad(g, dim, dtype, ctx.data_axis), chunk * size, 0
                        )

                    d_shared = ticks.scatter_shared(d_shared, dims_shared, dtype, first | last, ctx.data_axis)
                    acc = {
                        **jax.tree.map(lambda a, g: a + vary(g, varying_axes(a)), acc_shared, d_shared),
                        STACKED: jax.tree.map(add, acc_blocks, d_chunk, dims_blocks),
                    }
                d_in = jax.lax.dynamic_update_slice_in_dim(d_in, vary(d_x, varying_axes(d_in)), j * rows, 0)
                out = (acc, loss + stage_loss, d_in)
                return jax.tree.map(lambda new, old: vary(new, varying_axes(old)), out, carry), None

            (acc, loss, d_in), _ = jax.lax.scan(one, (acc, loss, zeros_act()), jnp.arange(splits))
            return zeros_act(), d_in, [z() for z in kept_zeros], acc, loss

        send_f, send_b, kept, acc, loss = ticks.switch(
            kind,
            [idle, ticks.scoped(ticks.SCOPE_FORWARD, forward), ticks.scoped(ticks.SCOPE_BACKWARD, backward)],
            acc,
            loss,
        )
        return send_f, send_b, [kept], acc, loss

    bufs = (
        ticks.zeros((prog.act_slots, *act.shape), act.dtype, act_axes),
        ticks.zeros((prog.grad_slots, *act.shape), act.dtype, act_axes),
        [
            [
                ticks.zeros((prog.stash_slots, *a.shape), a.dtype, varying_axes(a))
                for a in (plan.kept_avals if keep else [])
            ]
        ],
    )
    acc = ticks.accumulator(params, dims, ctx.data_axis)
    return ticks.scan_table(run, prog, bufs, ("stash_write",), acc, ticks.zeros((), jnp.float32, loss_axes))


def _gpipe_loss_and_grads(
    model: Model, params: dict, batch: jax.Array, ctx: ShardContext, table: ScheduleTable, prog: Program, scale: float
) -> tuple[jax.Array, dict]:
    """GPipe: the forward ticks as a differentiated scan; JAX's transpose runs the backward ticks."""
    p, m = table.stages, table.microbatches
    d = jax.lax.axis_index(ticks.AXIS)
    forward_ticks = m + p - 1

    def forward(params):
        shared, blocks = ticks.split_params(params)
        act, act_axes, loss_axes = ticks.boundary_types(model, shared, blocks, batch, ctx, 1, scale)

        def tick(carry, xs):
            x, loss = carry
            t, pattern = xs
            mb = t - d
            tokens = jax.lax.dynamic_index_in_dim(batch, jnp.clip(mb, 0, m - 1), 0, keepdims=False)

            def work(x):
                return ticks.run_stage(
                    model,
                    shared,
                    blocks,
                    x,
                    tokens,
                    d == 0,
                    d == p - 1,
                    ctx,
                    scale,
                    ticks.layer0_of(0, p, 1, blocks, ctx),
                )

            def skip(x):
                return x, jnp.zeros((), jnp.float32)

            y, stage_loss = ticks.cond((mb >= 0) & (mb < m), ticks.scoped(ticks.SCOPE_WORK, work), skip, x)
            return (ticks.send(y, pattern, prog.pairs["fwd"], "fwd"), loss + stage_loss), None

        init = (ticks.zeros(act.shape, act.dtype, act_axes), ticks.zeros((), jnp.float32, loss_axes))
        xs = (jnp.arange(forward_ticks), jnp.asarray(prog.pattern["fwd"][:forward_ticks]))
        (_, loss), _ = jax.lax.scan(tick, init, xs)
        return loss

    loss, grads = jax.value_and_grad(forward)(params)
    return ticks.reduce_shared(loss, grads)


def eval_loss_sum(
    model: Model, params: dict, tokens: jax.Array, ctx: ShardContext, prog: Program, v_shape: bool = False
) -> jax.Array:
    """Summed loss of ``tokens`` (m, b, s+1) through the pipeline, forward only, on the forward
    table ``prog`` (:func:`~jaxpar.parallel.pipeline.schedule.build_eval_schedule`): every stage
    works on its own microbatch at each tick, activations move as in training; the last virtual
    stage adds its microbatch's loss, summed over stages at the end."""
    table_p = prog.per_stage["kind"].shape[1]
    v = int(prog.per_stage["chunk"].max()) + 1
    d = jax.lax.axis_index(ticks.AXIS)
    shared, blocks = ticks.split_params(params)
    act, act_axes, loss_axes = ticks.boundary_types(model, shared, blocks, tokens, ctx, v, 1.0)

    def tick(carry, xs):
        act_buf, loss = carry
        row = {name: column[d] for name, column in xs["per_stage"].items()}
        chunk = row["chunk"]
        first, last = ticks.ends_of(chunk, table_p, v, v_shape)
        mb = jax.lax.dynamic_index_in_dim(tokens, row["microbatch"], 0, keepdims=False)

        def idle(loss):
            return ticks.zeros(act.shape, act.dtype, act_axes), loss

        def forward(loss):
            x = jax.lax.dynamic_index_in_dim(act_buf, row["act_read"], 0, False)
            layer0 = ticks.layer0_of(chunk, table_p, v, blocks, ctx, v_shape)
            y, stage_loss = ticks.run_stage(
                model, shared, ticks.chunk_layers(blocks, chunk, v), x, mb, first, last, ctx, 1.0, layer0
            )
            return y, loss + stage_loss

        y, loss = ticks.switch(row["kind"], [idle, ticks.scoped(ticks.SCOPE_FORWARD, forward)], loss)
        act_buf = ticks.store(act_buf, ticks.send(y, xs["fwd"], prog.pairs["fwd"], "fwd"), row["act_write"])
        if v_shape:  # chunk 1's lane, and at the V's tip the next virtual stage is on this device
            act_buf = ticks.store(act_buf, ticks.send(y, xs["fwdv"], prog.pairs["fwdv"], "fwdv"), row["act_write_v"])
            act_buf = ticks.store(act_buf, vary(y, varying_axes(act_buf)), row["act_self"])
        return (act_buf, loss), None

    xs = jax.tree.map(jnp.asarray, {"per_stage": prog.per_stage, **prog.pattern})
    carry = (ticks.zeros((prog.act_slots, *act.shape), act.dtype, act_axes), ticks.zeros((), jnp.float32, loss_axes))
    (_, loss), _ = jax.lax.scan(tick, carry, xs)
    return jax.lax.psum(loss, ticks.AXIS)


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
        running ``model``'s stages, whose layers stack in :data:`STACKED` (the subtree the stages split)."""
        if model.layer_stacks() != {STACKED: 0}:
            raise ConfigError(
                f"model.name={model.cfg.name}: its layers stack in {sorted(model.layer_stacks())}, and the pipeline "
                f"splits one stacked subtree, {STACKED!r}; use --config.mesh.pipeline=1"
            )
        table = build_schedule(layout.pipeline_schedule, layout.pipeline, layout.microbatches, layout.virtual_stages)
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
            return split_loss_and_grads(self.model, params, batch, ctx, self.table, self.program, scale, scatter)
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
