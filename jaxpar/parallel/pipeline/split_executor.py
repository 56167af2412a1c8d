"""The zero-bubble executor (zb-h1, zb-v): F keeps each layer's residuals, B the input gradient, W the
weight gradient, as separate actions of one scan over the schedule's ticks.

See :mod:`jaxpar.parallel.pipeline` ("Execution") and :mod:`~jaxpar.parallel.pipeline.weight_split`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import jaxpar.parallel.pipeline.stash as stash_lib
import jaxpar.parallel.pipeline.ticks as ticks
import jaxpar.parallel.pipeline.weight_split as weight_split
from jaxpar.compat import vary, varying_axes
from jaxpar.models.base import Model, ShardContext, bind_tokens
from jaxpar.ops import dropout
from jaxpar.parallel.pipeline.forms import STACKED
from jaxpar.parallel.pipeline.schedule import Program, ScheduleTable, v_shaped


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
    first, last = ticks.ends_of(chunk, p, v, v_shape)
    inputs, targets, positions, ctx = bind_tokens(tokens, ctx)
    one, layer0 = model.layer_step(positions, ctx), ticks.layer0_of(chunk, p, v, blocks, ctx, v_shape)
    embed, head = ticks.stage_ends(model, ctx, inputs, targets, first, last, scale)

    def layer(layer_params, x, j):
        return one(x, layer_params, layer0 + j) if dropout.active(ctx) else one(x, layer_params)

    return embed, layer, head


def _layer_pullback(
    layer_fn: Callable,
    layer_params: dict,
    x: jax.Array,
    j: jax.Array,
    kept: list,
    g: jax.Array,
    known: tuple[stash_lib.Split, weight_split.Split | None] | None = None,
) -> tuple[list, weight_split.Split]:
    """(flat residuals, weight-split plan) of one layer's pullback rebuilt from its kept residuals:
    what B and W both run a part of (:mod:`~jaxpar.parallel.pipeline.weight_split`). ``known``: the
    residual split and weight-split plan of the setup trace (:func:`split_loss_and_grads`); the
    plan is reused when its constants are plain values, traced again otherwise."""
    fn = functools.partial(lambda j, layer_params, x: layer_fn(layer_params, x, j), j)
    plan = stash_lib.split(fn, (layer_params, x), (1,), kept=known[0].kept if known else None)
    leaves = jax.tree.leaves(stash_lib.pullback((layer_params, x), kept, plan))
    if known and known[1] is not None:
        return leaves, known[1]
    n_params = len(jax.tree.leaves(layer_params))

    def pull(leaves, g):
        return jax.tree.leaves(jax.tree.unflatten(plan.treedef, leaves)(g))

    ws = weight_split.split(pull, (leaves, g), [False] * n_params + [True], available=len(leaves))
    return leaves, ws


def split_loss_and_grads(
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
    shared, blocks = ticks.split_params(params)
    act, act_axes, loss_axes = ticks.boundary_types(model, shared, blocks, batch, ctx, v, scale)
    dims, dtype = scatter or (jax.tree.map(lambda _: -1, params), jnp.float32)
    dims_shared, dims_blocks = ticks.split_params(dims)
    n = jax.tree.leaves(blocks)[0].shape[0] // v

    def zeros_act():
        return ticks.zeros(act.shape, act.dtype, act_axes)

    def layer_of(ch, j):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, j, 0, keepdims=False), ch)

    # the kept residuals' and the frontier's types, traced once (nothing is emitted)
    box: dict[str, Any] = {}

    def trace(c, x, tok):
        embed, layer, head = _split_parts(model, c, p, v, blocks, tok, ctx, scale, v_shape)
        ch, j = ticks.chunk_layers(blocks, c, v), jnp.int32(0)
        box["embed"] = stash_lib.split(embed, (shared, x), (1,))
        box["layer"] = stash_lib.split(
            functools.partial(lambda j, layer_params, x: layer(layer_params, x, j), j), (layer_of(ch, j), x), (1,)
        )
        box["head"] = stash_lib.split(head, (shared, x), (1,))
        kept = [ticks.zeros(a.shape, a.dtype, varying_axes(a)) for a in box["layer"].kept_avals]
        _, ws = _layer_pullback(layer, layer_of(ch, j), x, j, kept, x, (box["layer"], None))
        box["front"] = ws.frontier_avals
        # B and W run parts of this plan: traced once, unless its constants are values of this trace
        box["ws"] = None if any(isinstance(val, jax.core.Tracer) for val in ws.bound.values()) else ws
        leaf_reads = ws.weight_reads()[: len(box["layer"].kept)]  # the residual leaves, then the cotangent
        reads = [r for r, k in zip(leaf_reads, box["layer"].kept, strict=True) if k]
        box["places"] = stash_lib.pack(box["front"], box["layer"].kept_avals, [not r for r in reads])
        return jnp.zeros(())

    jax.eval_shape(trace, ticks.tick_typed(jnp.int32(0)), zeros_act(), ticks.tick_typed(batch[0]))
    # B writes the frontier into the layer residuals only B read (the same stash slot, kept until W):
    # a microbatch's slot holds its F state, then its W state, and no frontier buffer beside it takes
    # stage p-1's W delay on top of stage 0's in-flight stashes; what does not fit waits in front slots
    places, known = box["places"], (box["layer"], box["ws"])
    rest = [a for a, place in zip(box["front"], places, strict=True) if place is None]
    kept_avals = (
        [("embed", a) for a in box["embed"].kept_avals]
        + [("layer", a) for a in box["layer"].kept_avals]
        + [("head", a) for a in box["head"].kept_avals]
    )

    def stacked(part, a):  # a layer's residual or frontier value, stacked over the chunk's layers
        return (n, *a.shape) if part == "layer" else a.shape

    def kept_zeros():
        return [ticks.zeros(stacked(part, a), a.dtype, varying_axes(a)) for part, a in kept_avals]

    def front_zeros():
        return [ticks.zeros((n, *a.shape), a.dtype, varying_axes(a)) for a in rest]

    def groups(values):  # kept values as (embed, layer, head) lists
        counts = [len(box[k].kept_avals) for k in ("embed", "layer", "head")]
        return values[: counts[0]], values[counts[0] : counts[0] + counts[1]], values[counts[0] + counts[1] :]

    def run(row, bufs, acc, loss):
        act_buf, grad_buf, (stash_bufs, front_bufs) = bufs
        chunk, mb = row["chunk"], row["microbatch"]
        tokens = jax.lax.dynamic_index_in_dim(batch, mb, 0, keepdims=False)
        embed, layer, head = _split_parts(model, chunk, p, v, blocks, tokens, ctx, scale, v_shape)
        ch = ticks.chunk_layers(blocks, chunk, v)
        first, last = ticks.ends_of(chunk, p, v, v_shape)

        def read(bufs, slot):
            return [jax.lax.dynamic_index_in_dim(b, slot, 0, False) for b in bufs]

        def idle(acc, loss):
            return zeros_act(), zeros_act(), kept_zeros(), front_zeros(), acc, loss

        def forward(acc, loss):
            x_in = jax.lax.dynamic_index_in_dim(act_buf, row["act_read"], 0, False)
            x0, e_kept = stash_lib.forward(embed, (shared, x_in), box["embed"])

            def body(x, lj):
                layer_params, j = lj
                fn = functools.partial(lambda j, layer_params, x: layer(layer_params, x, j), j)
                return stash_lib.forward(fn, (layer_params, x), box["layer"])

            y, l_kept = jax.lax.scan(body, x0, (ch, jnp.arange(n, dtype=jnp.int32)))
            stage_loss, h_kept = stash_lib.forward(head, (shared, y), box["head"])
            return y, zeros_act(), [*e_kept, *l_kept, *h_kept], front_zeros(), acc, loss + stage_loss

        def backward(acc, loss):
            e_kept, l_kept, h_kept = groups(read(stash_bufs, row["stash_read"]))
            x = zeros_act()  # a placeholder of the right type: the pullbacks read only kept values
            h_plan = stash_lib.split(head, (shared, x), (1,), kept=box["head"].kept)
            d_head, d_y = stash_lib.pullback((shared, x), h_kept, h_plan)(ticks.zeros((), jnp.float32, loss_axes) + 1)
            g_in = jax.lax.dynamic_index_in_dim(grad_buf, row["grad_read"], 0, False)
            g = vary(d_y + jnp.where(last, jnp.zeros_like(g_in), g_in), act_axes)

            def body(g, xs):
                layer_params, j, kept = xs
                leaves, ws = _layer_pullback(layer, layer_params, x, j, kept, g, known)
                (d_x,), front = weight_split.run_input_grad(ws, [*leaves, g])
                return vary(d_x, act_axes), front

            idx = jnp.arange(n, dtype=jnp.int32)
            g, front = jax.lax.scan(body, g, (ch, idx, l_kept), reverse=True)
            e_plan = stash_lib.split(embed, (shared, x), (1,), kept=box["embed"].kept)
            d_embed, d_x = stash_lib.pullback((shared, x), e_kept, e_plan)(g)
            d_shared = ticks.scatter_shared(
                jax.tree.map(jnp.add, d_head, d_embed), dims_shared, dtype, first | last, ctx.data_axis
            )
            acc = {
                **jax.tree.map(lambda a, g: a + vary(g, varying_axes(a)), ticks.split_params(acc)[0], d_shared),
                STACKED: acc[STACKED],
            }
            l_kept = stash_lib.put(l_kept, front, places)
            rest = [f for f, place in zip(front, places, strict=True) if place is None]
            return zeros_act(), d_x, [*e_kept, *l_kept, *h_kept], rest, acc, loss

        def weight(acc, loss):
            _, l_kept, _ = groups(read(stash_bufs, row["stash_read"]))
            rest = iter(read(front_bufs, row["front_read"]))
            front = [
                next(rest) if place is None else stash_lib.take(l_kept, place, a)
                for a, place in zip(box["front"], places, strict=True)
            ]
            x, row0 = zeros_act(), chunk * n

            def body(acc_blocks, xs):
                layer_params, j, kept, fr = xs
                leaves, ws = _layer_pullback(layer, layer_params, x, j, kept, x, known)
                d_lay = jax.tree.unflatten(
                    jax.tree.structure(layer_params), weight_split.run_weight_grad(ws, leaves, fr)
                )

                def add(a, dw, dim):
                    dw = ticks.scatter_grad(dw, dim - 1 if dim >= 0 else -1, dtype, ctx.data_axis)
                    return a.at[row0 + j].add(vary(dw, varying_axes(a)), mode="promise_in_bounds")

                return jax.tree.map(add, acc_blocks, d_lay, dims_blocks), None

            idx = jnp.arange(n, dtype=jnp.int32)
            acc_blocks, _ = jax.lax.scan(body, acc[STACKED], (ch, idx, l_kept, front))
            return zeros_act(), zeros_act(), kept_zeros(), front_zeros(), {**acc, STACKED: acc_blocks}, loss

        branches = [
            idle,
            ticks.scoped(ticks.SCOPE_FORWARD, forward),
            ticks.scoped(ticks.SCOPE_BACKWARD, backward),
            ticks.scoped(ticks.SCOPE_WEIGHT, weight),
        ]
        send_f, send_b, kept, front, acc, loss = ticks.switch(row["kind"], branches, acc, loss)
        return send_f, send_b, [kept, front], acc, loss

    bufs = (
        ticks.zeros((prog.act_slots, *act.shape), act.dtype, act_axes),
        ticks.zeros((prog.grad_slots, *act.shape), act.dtype, act_axes),
        [
            [ticks.zeros((prog.stash_slots, *stacked(part, a)), a.dtype, varying_axes(a)) for part, a in kept_avals],
            [ticks.zeros((prog.front_slots, n, *a.shape), a.dtype, varying_axes(a)) for a in rest],
        ],
    )
    acc = ticks.accumulator(params, dims, ctx.data_axis)
    loss = ticks.zeros((), jnp.float32, loss_axes)
    return ticks.scan_table(run, prog, bufs, ("stash_write", "front_write"), acc, loss, v_shape=v_shape)
