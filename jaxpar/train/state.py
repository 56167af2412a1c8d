"""Shapes first, then specs, then ``jit(init, out_shardings=...)``: one layout's compiled pieces.

:class:`Setup` holds, for a config, its validated layout and a mesh, the abstract parameter tree, the
per-parameter placements (:mod:`jaxpar.sharding`), the shardings of parameters, optimizer state and
batches, and the jitted ``init``, ``train_step`` and ``eval_step``. Nothing here allocates until
``init`` runs, so the same object serves AOT analysis (``lower_train_step``) on abstract arrays.

With ``mesh.pipeline > 1`` (:mod:`jaxpar.parallel.pipeline`) the parameters are held in the pipeline's *stage
form* (``pipeline.to_stage_form``): block parameters in the stored layer order (the model order
unless virtual stages are used) and, with an untied output layer, embedding and output layer packed
into ``ends`` split over ``pipeline``. ``init`` builds that form; checkpoints hold the *model form*
(:meth:`Setup.to_model_order` / :meth:`Setup.from_model_order`), so they restore onto any layout.
Each form's facts are one :class:`ParamForm` record: :attr:`Setup.train_form`, :attr:`Setup.model_form`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import acts
from jaxpar.axes import MESH_AXES
from jaxpar.compat import Uncached, cached_collectives_hang, cached_pipelines_are_wrong, persistent_cache_skipped
from jaxpar.config import ConfigDict, default_config, validate
from jaxpar.layout import ParallelLayout
from jaxpar.models import get_model
from jaxpar.ops.attention import resolve_attention
from jaxpar.optim import registry
from jaxpar.optim import state as opt_state_lib
from jaxpar.optim.lr import make_schedule
from jaxpar.optim.optimizers import adamw
from jaxpar.parallel import pipeline as pipeline_lib
from jaxpar.sharding import Strategy, check_sufficiently_sharded, named, param_placements, specs
from jaxpar.train import loss_scale as loss_scale_lib
from jaxpar.train.batches import BatchFeed, batch_spec, eval_spec
from jaxpar.train.step import StepBuilder


@dataclasses.dataclass(frozen=True)
class ParamForm:
    """One form of the parameters and what follows from it: the *train* form the step runs (the
    pipeline's stage form when ``mesh.pipeline > 1``, else the family's own tree) or the *model* form
    (the family's tree, layers in model order: checkpoints and HF weights). One record per form, so
    no code pairs a field of one form with a field of the other."""

    abstract: Any  # shapes and dtypes of the parameters (jax.ShapeDtypeStruct leaves)
    placements: Any  # a ParamPlacement per leaf (jaxpar.sharding)
    tx: Any  # the optax transformation of this tree; None for jaxpar's AdamW (inside the shard_map)
    param_specs: Any  # storage PartitionSpecs of the parameters
    opt_specs: Any  # PartitionSpecs of the optimizer state, from its shapes (jaxpar.optim.state)
    param_shardings: Any
    opt_shardings: Any


class Setup:
    """Everything one layout needs to train, built from (config, layout, mesh) without allocating."""

    def __init__(self, cfg: ConfigDict, layout: ParallelLayout, mesh: Mesh):
        """``layout``: ``cfg``'s layout as :func:`jaxpar.config.validate` returns it (the step runs what
        validates; the layout's fields are read from it, not from ``cfg``); ``mesh``: its mesh
        (:func:`jaxpar.mesh.make_mesh`)."""
        if dict(mesh.shape) != {axis.value: size for axis, size in layout.mesh.items()}:
            raise ValueError(f"the mesh {dict(mesh.shape)} is not the layout's {layout.mesh}; build it with make_mesh")
        self.cfg, self.layout, self.mesh = cfg, layout, mesh
        self.model = get_model(cfg.model)  # the model family (jaxpar.models), validated
        self.pipeline = pipeline_lib.Pipeline.from_layout(layout, self.model) if layout.pipeline > 1 else None
        # XLA:CPU executables read back from the persistent compilation cache: a pipeline's compute
        # wrong losses on jax 0.10, and one with collectives across processes hangs on 0.12.1; such a
        # layout's programs compile without the cache (jaxpar.compat)
        self.skips_cache = mesh.devices.flat[0].platform == "cpu" and (
            (self.pipeline is not None and cached_pipelines_are_wrong())
            or (jax.process_count() > 1 and cached_collectives_hang())
        )
        self.strategy = Strategy.for_layout(layout)
        stages, virtual = layout.pipeline, layout.virtual_stages
        model_abstract = self.model.abstract_params()
        model_logical = self.model.logical_axes()
        train_abstract, train_logical = model_abstract, model_logical
        if stages > 1:  # the stage form (see the module docstring)
            train_abstract = jax.eval_shape(
                functools.partial(
                    pipeline_lib.to_stage_form,
                    stages=stages,
                    virtual_stages=virtual,
                    stage_layers=layout.stage_layers,
                    v_shape=pipeline_lib.v_shaped(layout.pipeline_schedule),
                ),
                model_abstract,
            )
            train_logical = pipeline_lib.stage_form_logical_axes(
                model_logical, stages, pipeline_lib.v_shaped(layout.pipeline_schedule)
            )
        train_placements = param_placements(train_abstract, train_logical, self.strategy, layout)
        # the model form of uneven stages cannot split its [num_layers] over `pipeline`: it is kept
        # whole on every stage (it only exists while a checkpoint or HF weights are converted)
        model_strategy = (
            Strategy({k: axis for k, axis in self.strategy.rules.items() if k != "layers"})
            if layout.uneven
            else self.strategy
        )
        self.schedule = make_schedule(cfg.optim, cfg.train.steps)
        self.optimizer = registry.get(cfg.optim.name)
        self.loss_scale = loss_scale_lib.from_config(cfg.model, cfg.train)  # fp16 only; its state is in opt_state
        self.train_form = self._form(train_abstract, train_placements)
        self.model_form = (
            self.train_form
            if stages == 1
            else self._form(model_abstract, param_placements(model_abstract, model_logical, model_strategy, layout))
        )
        self.replicated_fraction = check_sufficiently_sharded(
            train_abstract, train_placements, layout, cfg.parallel.max_replicated_fraction
        )
        self.feed = BatchFeed(mesh, layout)  # batch shapes, shardings, which rows this process feeds
        # model.attention resolved on this backend (auto: cuDNN on NVIDIA GPUs where it takes the shapes,
        # blockwise elsewhere and always with context parallelism, which merges blockwise partials)
        self.attention = (
            "blockwise"
            if layout.context > 1
            else resolve_attention(
                layout.attention,
                mesh.devices.flat[0].platform,
                cfg.model.head_dim,
                compute_dtype=cfg.model.compute_dtype,
                attention_dropout=cfg.model.attention_dropout,
                attention_mask=cfg.model.attention_mask,
            )
        )
        self.builder = StepBuilder(
            layout=layout,
            attention=self.attention,
            model_cfg=cfg.model,
            optim_cfg=cfg.optim,
            placements=train_placements,
            mesh=mesh,
            schedule=self.schedule,
            grad_reduce_dtype=cfg.parallel.grad_reduce_dtype,
            pipeline=self.pipeline,
            tx=self.train_form.tx,
            seed=cfg.train.seed,
            loss_scale=self.loss_scale,
        )
        self.train_step = self._make_train_step()
        self.eval_step = self._make_eval_step()
        self._init: Any = None  # the jitted init, built on first use (init)

    # ------------------------------------------------------------------ init
    def init(self, seed: int) -> tuple[Any, Any]:
        """Initialise parameters and optimizer state, each device creating only its shard. The
        program is compiled once per ``Setup``: a sweep's later passes start from it again."""
        if self._init is None:
            model, stages, virtual = self.model, self.layout.pipeline, self.layout.virtual_stages
            split, v_shape = self.layout.stage_layers, pipeline_lib.v_shaped(self.layout.pipeline_schedule)

            form = self.train_form

            @functools.partial(jax.jit, out_shardings=(form.param_shardings, form.opt_shardings))
            def _init(key):
                params = model.init(key)
                if stages > 1:
                    params = pipeline_lib.to_stage_form(params, stages, virtual, split, v_shape)
                return params, self.init_opt_state(params)

            self._init = _init
        with (
            jax.sharding.use_mesh(self.mesh) if hasattr(jax.sharding, "use_mesh") else contextlib.nullcontext(),
            persistent_cache_skipped(self.skips_cache),
        ):
            return self._init(jax.random.key(seed))

    def init_from_hf(self, source: Any) -> tuple[Any, Any]:
        """This layout's (parameters, fresh optimizer state) from HF weights: ``source`` holds the
        model-form parameters loaded with :attr:`model_param_shardings` (the trainer's edge reads
        them with ``jaxpar.port.weights.load_checked``, each device reading only its shard)."""
        with persistent_cache_skipped(self.skips_cache):
            opt = jax.jit(
                functools.partial(self.init_opt_state, model_form=True), out_shardings=self.model_form.opt_shardings
            )(source)
        return self.from_model_order(source, opt)

    # ------------------------------------------------------------------ optimizer state
    def init_opt_state(self, params: Any, model_form: bool = False) -> Any:
        """The optimizer's initial state for ``params`` (the train form, or the model form): jaxpar
        AdamW's {count, mu, nu}, else {count, tx: the optax state}."""
        return self._init_opt_state((self.model_form if model_form else self.train_form).tx, params)

    def _init_opt_state(self, tx: Any, params: Any) -> Any:
        if self.optimizer.in_shard_map:
            return loss_scale_lib.add_state(adamw.init_state(params), self.loss_scale)
        return loss_scale_lib.add_state({"count": jnp.zeros((), jnp.int32), "tx": tx.init(params)}, self.loss_scale)

    def _form(self, abstract: Any, placements: Any) -> ParamForm:
        """A parameter form's record. The optax path (every optimizer but jaxpar's AdamW) builds one
        transformation per form: the weight-decay mask and the per-tensor batch dims follow its tree;
        the optimizer-state specs come from the state's shapes (:mod:`jaxpar.optim.state`)."""
        if self.optimizer.in_shard_map:
            tx, opt_specs = None, loss_scale_lib.add_specs(adamw.state_specs(placements), self.loss_scale)
        else:
            tx = self.optimizer.build(self.cfg.optim, self.schedule, placements)
            opt = jax.eval_shape(functools.partial(self._init_opt_state, tx), abstract)
            opt_specs = opt_state_lib.state_specs(opt, abstract, specs(placements, "optimizer"))
        param_specs = specs(placements, "storage")
        return ParamForm(
            abstract, placements, tx, param_specs, opt_specs, named(self.mesh, param_specs), named(self.mesh, opt_specs)
        )

    # ------------------------------------------------------------------ checkpoint order
    def _reorder(self, params: Any, opt: Any, to_model: bool) -> tuple[Any, Any]:
        p, v, split = self.layout.pipeline, self.layout.virtual_stages, self.layout.stage_layers
        v_shape = pipeline_lib.v_shaped(self.layout.pipeline_schedule)
        ends = pipeline_lib.has_ends(self.cfg.model, p, v_shape)
        if p <= 1 or (v <= 1 and not self.layout.uneven and not ends):  # one form
            return params, opt
        move = pipeline_lib.to_model_form if to_model else pipeline_lib.to_stage_form
        form = self.model_form if to_model else self.train_form
        out, dst = (form.param_shardings, form.opt_shardings), form.abstract
        target = jax.eval_shape(functools.partial(self._init_opt_state, form.tx), dst)
        n = self.cfg.model.num_layers
        index = (
            pipeline_lib.model_index(n, p, v, split, v_shape)
            if to_model
            else pipeline_lib.stored_order(n, p, v, split, v_shape)
        )
        permute = (  # a padding row (index n, uneven stages) is filled with zeros
            opt_state_lib.layer_permuter(index)
            if to_model or not self.layout.uneven
            else lambda x, dim: jnp.take(x, index, axis=dim, mode="fill", fill_value=0)
        )

        @functools.partial(jax.jit, out_shardings=out)
        def reorder(params, opt):
            # every state leaf moves like its parameter (jaxpar.optim.state.convert_state)
            return move(params, p, v, split, v_shape), opt_state_lib.convert_state(
                opt, target, dst, to_model, permute, ends, self.model.stacked
            )

        with persistent_cache_skipped(self.skips_cache):
            return reorder(params, opt)

    def to_model_order(self, params: Any, opt: Any) -> tuple[Any, Any]:
        """Stage form -> model form (parameters and optimizer state). Checkpoints hold the model form
        (layers in the model's order, separate embedding and output layer), so they restore onto
        any layout; :meth:`from_model_order` is the inverse."""
        return self._reorder(params, opt, to_model=True)

    def from_model_order(self, params: Any, opt: Any) -> tuple[Any, Any]:
        return self._reorder(params, opt, to_model=False)

    # ------------------------------------------------------------------ steps
    def _make_train_step(self, builder: StepBuilder | None = None) -> TrainStep:
        """``builder``: another StepBuilder for this layout (tests compile without the bad-step skip)."""
        builder, form = builder or self.builder, self.train_form
        if self.optimizer.in_shard_map:  # jaxpar AdamW: the whole step in one shard_map
            step = jax.shard_map(
                builder.local_step,
                mesh=self.mesh,
                in_specs=(form.param_specs, form.opt_specs, batch_spec(self.mesh), P()),
                out_specs=(form.param_specs, form.opt_specs, P()),
            )
        else:  # gradients in a shard_map, the optax update under GSPMD (StepBuilder.global_step)
            step = builder.global_step
        replicated = NamedSharding(self.mesh, P())
        jitted = jax.jit(
            step,
            in_shardings=(form.param_shardings, form.opt_shardings, self.feed.batch_sharding, replicated),
            out_shardings=(form.param_shardings, form.opt_shardings, replicated),
            donate_argnums=(0, 1),
        )
        return TrainStep(Uncached(jitted) if self.skips_cache else jitted, replicated)

    def _make_eval_step(self):
        ctx = self.builder.shard_context()

        def local_eval(params, tokens):
            if self.pipeline is not None:
                return jax.lax.psum(self.pipeline.eval_loss_sum(params, tokens, ctx), ctx.data_axis)
            return jax.lax.psum(self.model.loss_sum(params, tokens, ctx), ctx.data_axis)

        form = self.train_form
        fn = jax.shard_map(local_eval, mesh=self.mesh, in_specs=(form.param_specs, eval_spec(self.mesh)), out_specs=P())
        jitted = jax.jit(fn, in_shardings=(form.param_shardings, self.feed.eval_sharding))
        return Uncached(jitted) if self.skips_cache else jitted

    # ------------------------------------------------------------------ analysis
    def abstract_state(self, model_form: bool = False) -> tuple[Any, Any, jax.ShapeDtypeStruct]:
        """Abstract (params, opt_state, batch) carrying their shardings: the stage form for AOT
        lowering, the model form (``model_form``) for restoring a checkpoint."""
        form = self.model_form if model_form else self.train_form
        tree = form.abstract
        params = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, form.param_shardings
        )
        opt = jax.eval_shape(functools.partial(self._init_opt_state, form.tx), tree)
        opt = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), opt, form.opt_shardings)
        batch = jax.ShapeDtypeStruct(self.feed.batch_shape(), jnp.int32, sharding=self.feed.batch_sharding)
        return params, opt, batch

    def lower_train_step(self):
        guard = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=NamedSharding(self.mesh, P()))
        return self.train_step.lower(*self.abstract_state(), guard)


def one_device_checkpoint_state(cfg: ConfigDict) -> tuple[Any, Any]:
    """Abstract (params, opt_state) of ``cfg``'s checkpoints (the model form) placed on one device:
    what reading a checkpoint outside its training layout needs (drill comparisons, export)."""
    from jaxpar.mesh import single_device_mesh

    one = ConfigDict(cfg.to_dict())
    for axis in MESH_AXES:  # every axis, so a new one cannot be forgotten here
        one.mesh[axis.value] = 1
    one.parallel.zero_stage = 0
    one.parallel.microbatches = 1
    one.parallel.virtual_stages = 1
    # e.g. parallel.pipeline_schedule, parallel.sequence_parallel: inert on one device
    acts.reset_inert(one, default_config())
    params, opt, _ = Setup(one, validate(one, 1), single_device_mesh()).abstract_state(model_form=True)
    return params, opt


class TrainStep:
    """The jitted step ``(params, opt_state, batch, guard) -> (params, opt_state, metrics)``.

    Calling it fills ``guard`` from ``max_loss`` (updates whose loss exceeds it are skipped;
    default: never) and ``loss_offset`` (added to the loss; NaN injects a bad step), or takes
    ``guard`` as a float32 ``[max_loss, loss_offset]`` array already on the mesh (replicated): the
    training loop computes it on the device (:class:`jaxpar.train.guard.SpikeThreshold`).
    """

    def __init__(self, jitted: Any, replicated: NamedSharding):
        self.jitted, self.replicated = jitted, replicated

    def __call__(
        self,
        params: Any,
        opt_state: Any,
        batch: jax.Array,
        max_loss: float = float("inf"),
        loss_offset: float = 0.0,
        guard: jax.Array | None = None,
    ) -> tuple[Any, Any, dict]:
        if guard is None:
            values = np.array([max_loss, loss_offset], np.float32)  # same on every process
            guard = jax.make_array_from_callback(values.shape, self.replicated, lambda index: values[index])
        return self.jitted(params, opt_state, batch, guard)

    def lower(self, *args: Any) -> Any:
        return self.jitted.lower(*args)

    def _cache_size(self) -> int:
        return self.jitted._cache_size()
