"""The model interface: what the train step, the pipeline, ZeRO-3, the planner and the importers use.

A model family is a subclass of :class:`Model` registered under a ``model.name``
(:mod:`jaxpar.models`); nothing outside ``jaxpar/models`` reaches a model otherwise. It gives
:meth:`Model.init` (a plain nested dict) and :meth:`Model.logical_axes` (the same tree of logical
dim names, mapped to mesh axes by :mod:`jaxpar.sharding`); the shard-local forward pieces, run in
``shard_map`` with explicit collectives (Megatron style, Shoeybi et al. 2019): :meth:`Model.embed`,
:meth:`Model.block`, :meth:`Model.head_loss` and their composition :meth:`Model.loss_sum`;
:attr:`Model.stacked` (the scanned subtree) and :attr:`Model.roles` (the pipeline stage of every
other top-level entry), from which :mod:`jaxpar.models.inventory` derives the planner's inventory;
and :attr:`Model.hf`, the Hugging Face maps of :mod:`jaxpar.port.weights` (``None``: no HF format).

ZeRO-3 reaches the model as a tree of split dims (:attr:`ShardContext.zero3_dims`,
:mod:`jaxpar.ops.zero3`) that :meth:`Model.gather_shared` and :meth:`Model.run_blocks` gather with,
so a family writes no ZeRO code and matches no parameter paths.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jaxpar.compat import trace_once, vary, varying_axes
from jaxpar.config import ConfigDict, ConfigError
from jaxpar.ops import dropout, zero3
from jaxpar.ops.attention import document_ids
from jaxpar.ops.context_parallel import split_tokens
from jaxpar.ops.remat import remat_policy

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Role of a top-level (non-stacked) parameter -> the pipeline stage that uses it (Megatron's placement).
ROLE_STAGE = {
    "embedding": "first",
    "positions": "first",
    "dense_layers": "first",
    "final_norm": "last",
    "output": "last",
}


@dataclasses.dataclass(frozen=True)
class ShardContext:
    """Static facts the shard-local forward pass needs. Families subclass it to add their settings.

    ``zero3_dims``: ZeRO-3's tree of split dims, like the parameter tree
    (:func:`jaxpar.ops.zero3.zero3_dims`); ``None`` without ZeRO-3. Not hashed (a dict).
    """

    tensor_axis: str | None = None  # None: no mesh axes bound (plain single-device run)
    data_axis: str | tuple[str, ...] | None = None  # the ZeRO group: data, or (data, context)
    context_axis: str | None = None  # set when mesh.context > 1 (jaxpar.ops.context_parallel)
    expert_axis: str | None = None  # the axis MoE experts are split over (jaxpar.models.moe)
    microbatches: int = 1  # per optimizer step: losses added once per microbatch are weighted 1/m
    context_exchange: str = "ring"  # ring | all_gather
    attention: str = "dot_product"  # resolved implementation: dot_product | blockwise | cudnn
    attention_block: int = 512
    sequence_parallel: bool = False
    zero3_dims: Any = dataclasses.field(default=None, hash=False)
    # ZeRO-3's gather group per parameter where they differ (the experts' leaves out `expert`;
    # jaxpar.ops.zero3.zero3_groups); None: every parameter is gathered over data_axis
    zero3_groups: Any = dataclasses.field(default=None, hash=False)
    recompute: str = "none"  # parallel.recompute: none | selective | full
    compute_dtype: str = "bfloat16"
    dropout: float = 0.0  # model.dropout (hidden); jaxpar.ops.dropout
    attention_dropout: float = 0.0  # model.attention_dropout
    attention_mask: str = "causal"  # model.attention_mask: causal | block_causal (documents end at eos_token_id)
    eos_token_id: int = -1  # model.eos_token_id: the document separator of block_causal
    # block_causal: the document ids (b, s) of the whole sequence, set by Model.loss_sum (traced)
    segments: Any = dataclasses.field(default=None, hash=False, compare=False)
    # MoE with capacity: the train step's zero (2,) probe, varying over the batch's axes, whose gradient
    # counts this shard's dropped choices (traced; jaxpar.models.moe.count_drops)
    moe_probe: Any = dataclasses.field(default=None, hash=False, compare=False)
    # the step's dropout noise (traced: key, rows, layer); None: no dropout (evaluation, rates 0)
    noise: Any = dataclasses.field(default=None, hash=False, compare=False)
    # uneven pipeline stages (traced, this stage's): rows of the stacked subtree that are layers (the
    # rows after them are padding, skipped), and the model-form index of the first; None: all rows
    layers: Any = dataclasses.field(default=None, hash=False, compare=False)
    first_layer: Any = dataclasses.field(default=None, hash=False, compare=False)

    def documents(self) -> jax.Array | None:
        """The document ids attention masks by (``model.attention_mask=block_causal``), or None; a
        :class:`~jaxpar.config.ConfigError` where block_causal reached a block without them (a path
        that does not go through :meth:`Model.loss_sum`)."""
        if self.attention_mask != "block_causal":
            return None
        if self.segments is None:
            raise ConfigError(
                "model.attention_mask=block_causal is not supported on this path (the document ids are computed "
                "in Model.loss_sum); set model.attention_mask=causal"
            )
        return self.segments

    @property
    def zero3(self) -> bool:
        """Whether parameters are gathered over ``data`` (ZeRO-3)."""
        return self.zero3_dims is not None


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One HF tensor <-> one jaxpar parameter.

    ``kind``: ``copy``; ``transpose`` (HF ``nn.Linear`` is (out, in)); ``heads_in``: jaxpar
    (h, n, d) <-> HF (n*d, h); ``heads_out``: jaxpar (n, d, h) <-> HF (h, n*d). ``name`` holds
    ``{i}`` for the layers of the stacked subtree. ``what``: the HF shape in model-config terms (for
    messages). ``rope``: rows rotated by RoPE (permuted for Meta's interleaved layout).
    """

    path: tuple[str, ...]
    name: str
    kind: str
    what: str
    rope: bool = False


@dataclasses.dataclass(frozen=True)
class HFMap:
    """A family's HF checkpoint format: tensor names, config.json fields, required settings."""

    tensors: tuple[HFTensor, ...]
    config_fields: tuple[tuple[str, str], ...]  # (model.<field>, the HF config.json key naming it)
    requires: tuple[tuple[str, Any], ...] = ()  # (model.<field>, value) the format can hold
    label: str = "HF"  # in messages: "HF LLaMA checkpoints need ..."

    def without_dense_mlp(self) -> tuple[HFTensor, ...]:
        """Every tensor but the dense MLP's: the base an MoE family adds its experts to."""
        return tuple(t for t in self.tensors if t.path[:2] != (Model.stacked, "mlp"))


def expert_tensors(prefix: str, router: str, gate: str, up: str, down: str) -> tuple[HFTensor, ...]:
    """The HF tensors of an MoE layer (:mod:`jaxpar.models.moe`): the router under ``prefix + router``
    and one (gate, up, down) triple per expert under ``prefix + "experts.{e}." + name``."""
    experts = prefix + "experts.{e}."
    return (
        HFTensor((Model.stacked, "moe", "router"), prefix + router, "transpose", "(num_experts, embed_dim)"),
        HFTensor((Model.stacked, "moe", "w_gate"), experts + gate, "transpose", "(mlp_dim, embed_dim)"),
        HFTensor((Model.stacked, "moe", "w_up"), experts + up, "transpose", "(mlp_dim, embed_dim)"),
        HFTensor((Model.stacked, "moe", "w_down"), experts + down, "transpose", "(embed_dim, mlp_dim)"),
    )


def require_settings(cfg: ConfigDict, family: str, settings: tuple[tuple[str, Any], ...]) -> None:
    """A one-line :class:`~jaxpar.config.ConfigError` for the first ``(model field, value)`` of
    ``settings`` that ``cfg`` does not hold: the family ``family`` computes only with them."""
    for field, want in settings:
        if cfg[field] != want:
            raise ConfigError(
                f"model.{field}={cfg[field]!r}: model.name={family} needs model.{field}={want!r}; "
                "use model.name=llama for other combinations"
            )


class Model(abc.ABC):
    """A model family bound to one ``model`` config. Subclasses set the class attributes and
    implement the abstract methods; the ZeRO-3 gathers, the layer scan with remat and the whole
    loss are written here once."""

    name: ClassVar[str]
    stacked: ClassVar[str] = "blocks"  # the subtree whose leaves carry a leading `layers` dim
    roles: ClassVar[Mapping[str, str]] = {}  # top-level key -> role (see ROLE_STAGE)
    hf: ClassVar[HFMap | None] = None

    def __init__(self, cfg: ConfigDict):
        self.cfg = cfg

    @classmethod
    def validate(cls, cfg: ConfigDict) -> None:
        """Raise a one-line :class:`~jaxpar.config.ConfigError` for settings the family cannot run
        (the shared fields are checked by :func:`jaxpar.config.validate`; nothing more by default)."""
        return None

    # ------------------------------------------------------------------ parameters
    @abc.abstractmethod
    def init(self, key: jax.Array) -> dict:
        """Parameters as a plain nested dict."""

    @abc.abstractmethod
    def logical_axes(self) -> dict:
        """Logical dim names of every parameter: the :meth:`init` tree with tuples of str as leaves."""

    def abstract_params(self) -> Any:
        """Shapes and dtypes of :meth:`init` (``jax.eval_shape``: nothing allocated)."""
        return jax.eval_shape(self.init, jax.random.key(0))

    def layer_stacks(self) -> dict[str, int]:
        """Every subtree whose leaves stack layers on their first dim, with the model-order index of
        its layer 0 (HF's ``{i}``): the scanned subtree at 0 unless a family has more."""
        return {self.stacked: 0}

    # ------------------------------------------------------------------ forward (shard-local)
    @abc.abstractmethod
    def shard_context(self, **parallel: Any) -> ShardContext:
        """The family's :class:`ShardContext` with its settings and the given parallel facts."""

    @abc.abstractmethod
    def embed(self, params: dict, tokens: jax.Array, ctx: ShardContext) -> jax.Array:
        """Token (and position) embedding of ``tokens`` (b, s): the first layer's input, reduced
        over ``ctx.tensor_axis`` (the same on every tensor rank; sequence-split with SP)."""

    @abc.abstractmethod
    def block(self, x: jax.Array, layer: dict, positions: jax.Array, ctx: ShardContext) -> jax.Array:
        """One layer; ``layer`` is one slice of the stacked subtree (already gathered under ZeRO-3).
        The output, like the input, is reduced over ``ctx.tensor_axis`` (Megatron's "g")."""

    @abc.abstractmethod
    def head_loss(self, params: dict, x: jax.Array, targets: jax.Array, ctx: ShardContext) -> jax.Array:
        """Final norm, logits and the summed next-token cross-entropy of ``targets``: an fp32
        scalar reduced over ``ctx.tensor_axis`` (vocabulary-parallel), local to this data shard."""

    # ------------------------------------------------------------------ written once
    def gather_shared(self, params: dict, ctx: ShardContext) -> dict:
        """ZeRO-3: gather the non-stacked entries of ``params`` (any subset of the top level);
        the stacked subtree is gathered one layer at a time by :meth:`run_blocks`."""
        if not ctx.zero3:
            return params
        dims, dt = ctx.zero3_dims, DTYPES[ctx.compute_dtype]
        groups = ctx.zero3_groups
        return {
            k: v if k == self.stacked else zero3.gather_tree(v, dims[k], ctx.data_axis, dt, groups and groups[k])
            for k, v in params.items()
        }

    def run_blocks(self, x: jax.Array, blocks: dict, positions: jax.Array, ctx: ShardContext) -> jax.Array:
        """Scan :meth:`block` over the leading ``layers`` dim of ``blocks`` (gathering each layer
        under ZeRO-3), rematerialised per ``ctx.recompute`` (:func:`jaxpar.ops.remat.remat_policy`)."""
        return scan_layers(self.block, x, blocks, positions, ctx, self.stacked)

    def layer_step(self, positions: jax.Array, ctx: ShardContext):
        """``(x, layer) -> x`` for one stored layer (gathered first under ZeRO-3): what a
        layer-by-layer backward (the pipeline's full-remat path) differentiates."""
        return layer_step(self.block, positions, ctx, self.stacked)

    def loss_sum(self, params: dict, tokens: jax.Array, ctx: ShardContext) -> jax.Array:
        """Summed next-token loss of ``tokens`` (b, s+1) on this shard (local rows).

        Where the head's parameters meet collectives in the loss (ZeRO-3's gathers, sequence
        parallelism's all-reduce of the final norm's gradient), the ``final_norm`` / ``output``
        entries pass unchanged through the layer scan's carry and are gathered after it, so every
        collective of the head depends on the scan: XLA:CPU's in-process rendezvous would otherwise
        pair it with a loop's collective (:mod:`jaxpar.analysis.collective_order`). Elsewhere
        nothing is carried: a carried copy costs temporaries, and ZeRO 0-2's gradient reductions
        follow the loss anyway.
        """
        inputs, targets, positions, ctx = bind_tokens(tokens, ctx)
        late = {}
        if ctx.zero3 or ctx.sequence_parallel:
            late = {k: v for k, v in params.items() if ROLE_STAGE.get(self.roles.get(k, "")) == "last"}
        early = self.gather_shared({k: v for k, v in params.items() if k not in late}, ctx)
        x = self.embed(early, inputs, ctx)
        x, late = scan_layers(self.block, x, params[self.stacked], positions, ctx, self.stacked, carried=late)
        return self.head_loss({**early, **self.gather_shared(late, ctx)}, x, targets, ctx)


def bind_tokens(tokens: jax.Array, ctx: ShardContext) -> tuple[jax.Array, jax.Array, jax.Array, ShardContext]:
    """(inputs, targets, positions, ctx) of a token batch (b, s+1) on this shard, and the context bound to
    it: dropout's row column stripped (:func:`jaxpar.ops.dropout.bind`) and, with
    ``model.attention_mask=block_causal``, the document ids of the whole sequence in ``ctx.segments`` (every
    context rank holds it: :mod:`jaxpar.ops.context_parallel`). :meth:`Model.loss_sum` and every pipeline
    stage (:mod:`jaxpar.parallel.pipeline`, which runs a microbatch's tokens through each stage) start here,
    so a block's attention masks by the same documents on every path."""
    tokens, ctx = dropout.bind(tokens, ctx)
    if ctx.attention_mask == "block_causal":
        ctx = dataclasses.replace(ctx, segments=document_ids(tokens[:, :-1], ctx.eos_token_id))
    inputs, targets, positions = split_tokens(tokens, ctx.context_axis)
    return inputs, targets, positions, ctx


def layer_step(block, positions: jax.Array, ctx: ShardContext, stacked: str):
    """``(x, layer[, index[, row]]) -> block(x, gathered layer)``: one stored layer, gathered under
    ZeRO-3; ``index`` (with dropout): the layer's model-form index, which keys its masks; ``row``:
    its row in the stacked subtree, which with uneven stages (``ctx.layers``) skips a padding row:
    ``x`` passes unchanged, nothing is gathered and the row's gradient is zero."""
    dims = zero3.layer_dims(ctx.zero3_dims[stacked]) if ctx.zero3 else None
    groups = ctx.zero3_groups[stacked] if ctx.zero3 and ctx.zero3_groups is not None else None
    dt = DTYPES[ctx.compute_dtype]

    def run(x: jax.Array, layer: dict, index: jax.Array | None = None) -> jax.Array:
        if dims is not None:
            layer = zero3.gather_tree(layer, dims, ctx.data_axis, dt, groups)
        return block(x, layer, positions, ctx if index is None else dropout.at_layer(ctx, index))

    def one(x: jax.Array, layer: dict, index: jax.Array | None = None, row: jax.Array | None = None) -> jax.Array:
        if ctx.layers is None or row is None:
            return run(x, layer, index)
        shape, ran = trace_once(run, x, layer, index)
        axes = varying_axes(shape)  # both branches vary alike
        return jax.lax.cond(
            row < ctx.layers,
            lambda x, layer, index: vary(ran(x, layer, index), axes),
            lambda x, layer, index: vary(x, axes),
            x,
            layer,
            index,
        )

    return one


def scan_layers(
    block,
    x: jax.Array,
    blocks: dict,
    positions: jax.Array,
    ctx: ShardContext,
    stacked: str = Model.stacked,
    carried: Any = None,
) -> Any:
    """``lax.scan`` of ``block(x, layer, positions, ctx)`` over the stacked layers; with remat or
    ZeRO-3 the body is checkpointed (ZeRO-3 alone: every residual but the gathered parameters).

    ``carried`` (a tree, optional) passes through the loop unchanged and is returned beside ``x``,
    so that what uses it afterwards depends on the loop (:meth:`Model.loss_sum`). With dropout or
    uneven pipeline stages the loop also runs over the row numbers: with dropout the layers'
    model-form indices (from ``ctx.noise.layer``) key their masks (:mod:`jaxpar.ops.dropout`); rows
    from ``ctx.layers`` on are padding, skipped (:func:`layer_step`).
    """
    step_one = layer_step(block, positions, ctx, stacked)
    rewrite = bool(jax.tree.leaves(carried))
    numbered = dropout.active(ctx)
    by_row = numbered or ctx.layers is not None  # the loop also runs over the row numbers
    if by_row:
        blocks = (blocks, jnp.arange(jax.tree.leaves(blocks)[0].shape[0], dtype=jnp.int32))

    def one(x, layer):
        if not by_row:
            return step_one(x, layer)
        layer, row = layer
        return step_one(x, layer, ctx.noise.layer + row if numbered else None, row)

    def body(carry, layer):
        if not rewrite:
            return one(carry, layer), None
        h, passed, step = carry
        # Rewrite the carried leaves in every iteration: select(step >= 0, v, 0) is v, but neither
        # JAX (which forwards an unchanged carry around the loop) nor XLA removes it, so the loop
        # body writes their buffers and XLA:CPU makes their readers after the loop (and, in the
        # backward pass, the loop after their writers) wait for it. A pass-through element is
        # touched by no thunk of the body: its readers would not wait. The step counter varies over
        # no mesh axis, so the leaves keep their varying axes.
        passed = jax.tree.map(lambda v: jnp.where(step >= 0, v, jnp.zeros_like(v)), passed)
        return (one(h, layer), passed, step + 1), None

    if ctx.recompute != "none" or ctx.zero3:
        body = jax.checkpoint(body, policy=remat_policy(ctx.recompute), prevent_cse=False)
    if not rewrite:
        x, _ = jax.lax.scan(body, x, blocks)
        return x if carried is None else (x, carried)
    (x, out, _), _ = jax.lax.scan(body, (x, carried, jnp.int32(0)), blocks)
    return x, out
