"""The training step: loss, gradients, accumulation, ZeRO reduction, clipping, the optimizer.

The whole step runs in one ``shard_map`` over every mesh axis, so each collective is written
down where it belongs (and shows up as exactly that collective in the compiled HLO):

=======================  ==========  =========================================  ===============
stage (layout property)  parameters  gradient reduction over ``data``           optimizer state
=======================  ==========  =========================================  ===============
0 (DP)                   replicated  one ``psum`` (all-reduce) per step         replicated
1 (shards_optimizer)     replicated  one ``psum_scatter`` per step, update the  sharded
                                     local shard, ``all_gather`` the parameters
2 (shards_gradients)     replicated  ``psum_scatter`` every microbatch into a   sharded
                                     sharded accumulation buffer
3 (shards_parameters)    sharded     per layer: ``all_gather`` fwd (+ again in  sharded
                                     bwd), its transpose reduce-scatters grads
=======================  ==========  =========================================  ===============

The step asks the layout's ZeRO properties (:attr:`jaxpar.layout.ParallelLayout.shards_optimizer`
and the others; each implies the ones above it), never the stage number. Parameters ZeRO cannot
split (no dim divisible by ``data``) fall back to the stage-0 path. The ZeRO pieces (marking,
reduction, local shards, gathers) live in :mod:`jaxpar.parallel.zero` and, for stage 3's parameter
gathers, :mod:`jaxpar.ops.zero3`.
Tensor parallelism lives in the model (:mod:`jaxpar.models`, reached through its interface). With ``mesh.pipeline > 1`` the
microbatches run through :mod:`jaxpar.parallel.pipeline` (its schedule is the gradient accumulation): the
layers are split over ``pipeline``, parameters not split over it (embedding, final norm, head) are
also marked varying over ``pipeline`` and their stage-local gradients summed over it. Every ZeRO stage
combines with it: ZeRO-2 reduce-scatters each backward tick's gradients into a sharded accumulator
(1F1B / interleaved), ZeRO-3 gathers each layer over ``data`` inside the ticks that run it.

The optimizer: jaxpar's AdamW (``optim.name='adamw'``) updates each device's shard inside the
``shard_map`` (:meth:`StepBuilder.local_step`); every optax optimizer of :mod:`jaxpar.optim.registry`
updates the global arrays under GSPMD right after it, in the same jit (:meth:`StepBuilder.global_step`;
why: :mod:`jaxpar.optim`). Global-norm clipping is the ``shard_map``'s, before either.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.axes import MESH_AXES, batch_axes, group_axes, shard_context_axes
from jaxpar.compat import trace_once, vary, varying_axes
from jaxpar.config import ConfigDict
from jaxpar.layout import ParallelLayout
from jaxpar.models import get_model, moe
from jaxpar.models.base import Model, ShardContext
from jaxpar.ops import dropout, zero3
from jaxpar.optim.optimizers import adamw
from jaxpar.parallel import zero
from jaxpar.parallel.pipeline import Pipeline
from jaxpar.sharding import ParamPlacement, is_placement
from jaxpar.train import loss_scale as loss_scale_lib
from jaxpar.train.batches import batch_spec


@dataclasses.dataclass(frozen=True)
class StepBuilder:
    """Static description of one layout's step: :meth:`local_step` (jaxpar AdamW) or
    :meth:`global_step` (optax) is what ``Setup`` jits (inside ``shard_map`` for the former)."""

    layout: ParallelLayout  # the run's validated layout: mesh sizes, ZeRO, microbatches, tokens per step
    attention: str  # model.attention resolved on the backend (jaxpar.ops.attention.resolve_attention)
    model_cfg: ConfigDict
    optim_cfg: ConfigDict
    placements: Any  # tree of ParamPlacement
    mesh: Mesh
    schedule: Callable[[jax.Array], jax.Array]
    grad_reduce_dtype: str  # parallel.grad_reduce_dtype: float32 | bfloat16
    pipeline: Pipeline | None = None  # set when mesh.pipeline > 1
    tx: Any = None  # optax.GradientTransformation for global_step (None: jaxpar AdamW in local_step)
    skip_bad_steps: bool = True  # False only to measure what the skip costs
    seed: int = 0  # train.seed: keys the dropout masks with the optimizer step (jaxpar.ops.dropout)
    loss_scale: loss_scale_lib.LossScale | None = None  # fp16 loss scaling (jaxpar.train.loss_scale)

    # ------------------------------------------------------------------ helpers
    @property
    def microbatches(self) -> int:
        return self.layout.microbatches

    @property
    def global_tokens(self) -> int:
        """Target tokens per optimizer step: the loss normaliser."""
        return self.layout.tokens_per_step

    @property
    def dropout(self) -> bool:
        """Whether the model drops anything (``model.dropout`` or ``model.attention_dropout`` > 0);
        off, the step traces no dropout at all."""
        return self.model_cfg.get("dropout", 0.0) > 0 or self.model_cfg.get("attention_dropout", 0.0) > 0

    @property
    def moe(self) -> bool:
        """Whether the model routes tokens to experts: the step then reports ``moe_dropped``."""
        return self.model_cfg.get("num_experts", 0) > 0

    @property
    def drops_tokens(self) -> bool:
        """MoE with capacity dropping (``model.moe_capacity_factor > 0``)."""
        return self.moe and self.model_cfg.get("moe_capacity_factor", 0.0) > 0

    @property
    def counts_drops(self) -> bool:
        """Whether the step counts the choices capacity dropped (:func:`jaxpar.models.moe.count_drops`):
        with capacity dropping, off the pipeline (whose ticks differentiate the parameters only:
        there ``moe_dropped`` is NaN)."""
        return self.drops_tokens and self.pipeline is None

    @functools.cached_property
    def model(self) -> Model:
        """The model family of ``model_cfg`` (:func:`jaxpar.models.get_model`)."""
        return get_model(self.model_cfg)

    def shard_context(self) -> ShardContext:
        """The model's shard context: the mesh axes it binds (:func:`jaxpar.axes.shard_context_axes`, from
        the axes table), sequence parallelism and ZeRO-3's tree of split dims."""
        return self.model.shard_context(
            **shard_context_axes(self.layout.mesh),
            microbatches=self.microbatches,
            zero3_groups=zero3.zero3_groups(self.placements),
            context_exchange=self.layout.context_exchange,
            attention=self.attention,
            attention_block=self.layout.attention_block,
            sequence_parallel=self.layout.sequence_parallel,
            recompute=self.layout.recompute,
            zero3_dims=zero3.zero3_dims(self.placements),
        )

    def _reduce_dtype(self):
        return jnp.bfloat16 if self.grad_reduce_dtype == "bfloat16" else jnp.float32

    def _reduce(self, grads: Any, scatter: bool, prescattered: bool = False) -> Any:
        return zero.reduce_grads(self.placements, grads, scatter, self._reduce_dtype(), prescattered)

    def _grad_norm(self, grads: Any) -> jax.Array:
        def sq(place: ParamPlacement, g):
            axes = tuple(a for a in MESH_AXES if zero.is_split_over(place, a))
            s = jnp.sum(jnp.square(g))
            return jax.lax.psum(s, axes) if axes else s

        return jnp.sqrt(sum(jax.tree.leaves(zero.map_placements(sq, self.placements, grads))))

    # ------------------------------------------------------------------ step
    def local_grads(
        self, params: Any, batch: jax.Array, guard: jax.Array, step: jax.Array | None = None
    ) -> tuple[Any, jax.Array, jax.Array, jax.Array]:
        """This shard's reduced, clipped gradients (laid out like the optimizer state), the loss
        (+ ``guard[1]``), the global gradient norm (before clipping) and the step's MoE choices
        ``(dropped, routed)`` (zeros without dropping, NaN where not counted). ``step`` (the optimizer
        count; with dropout only) keys the dropout masks: each sequence's global row travels with
        the batch as one more column (:func:`jaxpar.ops.dropout.append_rows`)."""
        ctx = self.shard_context()
        if self.dropout:
            ctx = dataclasses.replace(ctx, noise=dropout.Noise(dropout.step_key(self.seed, step)))
            rows = batch_axes(self.layout.mesh)
            global_batch = batch.shape[0] * batch.shape[1] * jax.lax.axis_size(rows)
            batch = dropout.append_rows(batch, global_batch, rows)
        layout = self.layout
        scale = loss_scale_lib.scaled(1.0 / self.global_tokens, guard)  # guard[2]: the fp16 loss scale, if any

        # Differentiate with respect to the varying copy: its gradient is the local, unreduced one.
        local_params = zero.vary_replicated(self.placements, params, over_pipeline=self.pipeline is not None)

        def micro_grads(tokens):  # (loss, grads, (dropped, routed) choices)
            if not self.counts_drops:
                loss, g = jax.value_and_grad(lambda p: self.model.loss_sum(p, tokens, ctx) * scale)(local_params)
                return loss, g, jnp.zeros((2,), jnp.float32)

            def loss_fn(p, probe):
                return self.model.loss_sum(p, tokens, dataclasses.replace(ctx, moe_probe=probe)) * scale

            probe = vary(jnp.zeros((2,), jnp.float32), frozenset(group_axes(ctx.data_axis)))
            loss, (g, drops) = jax.value_and_grad(loss_fn, argnums=(0, 1))(local_params, probe)
            return loss, g, drops

        if self.pipeline is not None:  # the schedule accumulates over microbatches
            scatter = None
            # ZeRO-2: reduce-scattered in every backward tick, accumulated sharded (ZeRO-3: the
            # parameter gathers' transposes reduce-scatter inside the ticks)
            if layout.shards_gradients and not layout.shards_parameters:
                dims = zero.map_placements(
                    lambda place: place.zero_dim if place.sharded_optimizer else -1, self.placements
                )
                scatter = (dims, self._reduce_dtype())
            loss, grads = self.pipeline.loss_and_grads(local_params, batch, ctx, scale, scatter)
            drops = jnp.full((2,), jnp.nan if self.drops_tokens else 0.0, jnp.float32)
            if layout.shards_gradients:
                grads = self._reduce(grads, scatter=True, prescattered=True)
        elif self.microbatches == 1:
            loss, grads, drops = micro_grads(batch[0])
            if layout.shards_gradients:
                grads = self._reduce(grads, scatter=True)
        else:
            # Every microbatch runs in the loop, from zeros (0 + g is g: the sums are unchanged).
            # With the first microbatch outside it, a 2-microbatch loop of one trip is inlined and
            # the second microbatch's collectives no longer depend on the first's layer scans:
            # XLA:CPU may then run them concurrently (jaxpar.analysis.collective_order).
            def reduced_grads(tokens):
                micro_loss, g, d = micro_grads(tokens)
                return micro_loss, (self._reduce(g, scatter=True) if layout.shards_gradients else g), d

            shapes, reduced = trace_once(reduced_grads, batch[0])  # the zeros' types, and the loop's body

            def accumulate(carry, tokens):
                return jax.tree.map(jnp.add, carry, reduced(tokens)), None

            zeros = jax.tree.map(lambda s: vary(jnp.zeros(s.shape, s.dtype), varying_axes(s)), shapes)
            (loss, grads, drops), _ = jax.lax.scan(accumulate, zeros, batch)
        if not layout.shards_gradients:  # one reduction per step: reduce-scatter where the optimizer is sharded
            grads = self._reduce(grads, scatter=layout.shards_optimizer)
        grads, loss = loss_scale_lib.unscale(grads, jax.lax.psum(loss, ctx.data_axis), guard)
        if self.counts_drops:  # this shard's counts: one sum over the batch's shards per step
            drops = jax.lax.psum(drops, ctx.data_axis)
        loss = loss + guard[1]

        # aux-loss-free balancing: the expert bias's entry is its load statistic, not a gradient
        grad_norm = self._grad_norm(moe.take_balance(grads, self.model.stacked)[0])
        clip = self.optim_cfg.clip_norm
        if clip > 0:  # optax.clip_by_global_norm semantics
            factor = jnp.where(grad_norm < clip, 1.0, clip / grad_norm)
            grads = jax.tree.map(lambda g: g * factor, grads)
        return grads, loss, grad_norm, drops

    def _drop_metrics(self, drops: jax.Array) -> dict[str, jax.Array]:
        """MoE models: ``moe_dropped``, the share of the step's routed (token, expert) choices that
        capacity dropped (0 dropless), and ``moe_dropped_choices``, their count over all layers and
        microbatches; nothing for a dense model."""
        if not self.moe:
            return {}
        return {"moe_dropped": jnp.where(drops[1] > 0, drops[0] / drops[1], drops[0]), "moe_dropped_choices": drops[0]}

    def _ok(self, loss: jax.Array, grad_norm: jax.Array, guard: jax.Array) -> jax.Array:
        if not self.skip_bad_steps:  # measuring what the skip costs (tests/test_optim.py)
            return jnp.bool_(True)
        return jnp.isfinite(loss) & jnp.isfinite(grad_norm) & (loss <= guard[0])

    def local_step(self, params: Any, opt_state: Any, batch: jax.Array, guard: jax.Array) -> tuple[Any, Any, dict]:
        """One AdamW step on this shard (``optim.name='adamw'``). ``guard`` = (max_loss, loss_offset):
        the update is skipped (parameters and optimizer state returned unchanged) when the loss or
        the gradient norm is not finite or the loss exceeds max_loss; loss_offset is added to the
        reported loss (0 in training; NaN injects a bad step for fault drills)."""
        step, guard = opt_state["count"], loss_scale_lib.with_scale(guard, opt_state)
        grads, loss, grad_norm, drops = self.local_grads(params, batch, guard, *((step,) if self.dropout else ()))
        lr = self.schedule(step)
        ok = self._ok(loss, grad_norm, guard)
        grads, balance = moe.take_balance(grads, self.model.stacked)
        if balance is not None:  # ZeRO-1/2: the statistic is this shard's, the bias stored whole
            place = self.placements[self.model.stacked]["moe"]["expert_bias"]
            balance = zero.gather_update(balance, place) if zero.shards_locally(place) else balance
        new_params, new_state = adamw.update(self.optim_cfg, self.placements, params, grads, opt_state, lr, ok)
        new_params = moe.apply_balance(new_params, balance, self.model.stacked, self._bias_rate, ok)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "skipped": 1 - ok.astype(jnp.int32)}
        metrics |= self._drop_metrics(drops)
        return new_params, *loss_scale_lib.advance(self.loss_scale, opt_state, new_state, metrics, grad_norm)

    def global_step(self, params: Any, opt_state: Any, batch: jax.Array, guard: jax.Array) -> tuple[Any, Any, dict]:
        """One step of an optax optimizer: gradients from the ``shard_map`` (:meth:`local_grads`),
        then ``tx.update`` on the global arrays under GSPMD, in the same jit. XLA partitions the
        update and inserts the reductions a non-elementwise optimizer needs (Adafactor's factored
        means and RMS, Muon's Newton-Schulz matmuls) over whatever mesh axes the state is split
        on, so every optimizer computes exactly what it computes on one device. Parameters are read
        under their optimizer spec (ZeRO-1/2: this device's shard; no data moves) and written back
        under their storage spec (ZeRO-1/2: the all-gather). A bad step selects the old values."""
        grad_specs = jax.tree.map(lambda place: place.optimizer, self.placements, is_leaf=is_placement)
        step, guard = opt_state["count"], loss_scale_lib.with_scale(guard, opt_state)
        keyed = (step,) if self.dropout else ()  # the step keys the dropout masks
        grads, loss, grad_norm, drops = jax.shard_map(
            self.local_grads,
            mesh=self.mesh,
            in_specs=(self.param_specs(), batch_spec(self.mesh), P(), *((P(),) * len(keyed))),
            out_specs=(grad_specs, P(), P(), P()),
        )(params, batch, guard, *keyed)
        lr = self.schedule(step)
        ok = self._ok(loss, grad_norm, guard)
        view = jax.tree.map(
            lambda p, s: jax.lax.with_sharding_constraint(p, NamedSharding(self.mesh, s)), params, grad_specs
        )
        grads, balance = moe.take_balance(grads, self.model.stacked)
        updates, tx_state = self.tx.update(grads, opt_state["tx"], view)
        new_params = moe.apply_balance(
            optax.apply_updates(view, updates), balance, self.model.stacked, self._bias_rate, ok
        )
        if self.skip_bad_steps:
            new_params = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_params, view)
            tx_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), tx_state, opt_state["tx"])
        new_state = {"count": jnp.where(ok, step + 1, step), "tx": tx_state}
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "skipped": 1 - ok.astype(jnp.int32)}
        metrics |= self._drop_metrics(drops)
        return new_params, *loss_scale_lib.advance(self.loss_scale, opt_state, new_state, metrics, grad_norm)

    @property
    def _bias_rate(self) -> float:
        return float(self.model_cfg.get("router_bias_rate", 0.0))

    def param_specs(self) -> Any:
        return jax.tree.map(lambda place: place.storage, self.placements, is_leaf=is_placement)
