"""The parallel layout: one frozen type for "how the work is split", and the only home of its rules.

A :class:`ParallelLayout` holds the mesh size of every :class:`~jaxpar.axes.MeshAxis` and the choices
that change what each device holds and does: the ZeRO stage, sequence parallelism, the number and
size of microbatches, the sequence length, the recompute policy and the pipeline schedule. A run's
layout is built and validated once, by :func:`jaxpar.config.validate`, and handed down: ``jaxpar
train`` passes it to the trainer, :class:`~jaxpar.train.state.Setup`, the pipeline, the step builder
and the rules (:mod:`jaxpar.sharding`); ``inspect`` to the compiled analysis. The planner (``plan``,
``compare``) builds one per candidate layout. Every cross-field rule and all batch arithmetic live in
:meth:`ParallelLayout.validate` and nowhere else, so a layout that validates is one the step runs
(field domains, such as "a mesh size is >= 1", are checked with the config schema).

ZeRO's behaviour is asked through :attr:`~ParallelLayout.shards_optimizer`,
:attr:`~ParallelLayout.shards_gradients` and :attr:`~ParallelLayout.shards_parameters`, the three
partitions of the ZeRO paper (Rajbhandari et al. 2020: P_os, P_os+g, P_os+g+p), not by comparing
``zero_stage``.

Batch arithmetic (as in DeepSpeed's ``train_batch_size = micro_batch * grad_accum * dp``):
``global_batch = microbatch_size * microbatches * data``; tokens per step =
``global_batch * seq_len``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from jaxpar.axes import MESH_AXES, MeshAxis, batch_axes, group_axes
from jaxpar.errors import require

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
SPLIT_BACKWARD = ("zb-h1", "zb-v")  # schedules that run the input and the weight gradient as separate ticks
V_SHAPED = ("zb-v",)  # device d holds virtual stages d and 2p-1-d (the first and the last on device 0)
RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("auto", "dot_product", "blockwise", "cudnn")  # model.attention (jaxpar.ops.attention)
CONTEXT_EXCHANGES = ("ring", "all_gather")  # parallel.context_exchange (jaxpar.ops.context_parallel)
# Model dims split over `tensor` by the Megatron rules (jaxpar.axes.TENSOR_RULES): each must divide.
TENSOR_SPLIT_FIELDS = ("num_heads", "num_kv_heads", "mlp_dim", "vocab_size")


# (axis, its field) for every mesh axis, read once: the planner asks a layout's mesh about a million
# times a search, and an enum's ``.value`` costs more than the lookup itself
_AXIS_FIELDS = tuple((axis, axis.value) for axis in MESH_AXES)
_FIELD_OF = dict(_AXIS_FIELDS)  # a StrEnum key: a plain axis name finds its field too


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """Mesh sizes (one field per :class:`MeshAxis`, read as a mapping with :attr:`mesh`) plus the
    choices that change memory and time. Hashable: it keys caches and jit static arguments.

    A config sets these fields under the same names: the mesh sizes as ``mesh.<axis>``, the choices
    as ``parallel.<field>`` (``parallel.recompute``, ``parallel.microbatches``,
    ``parallel.pipeline_schedule``, ``parallel.virtual_stages``, ...). Three kinds of field come from
    other sections, because they are not choices of how to split the work: ``seq_len`` is
    ``train.seq_len`` and ``microbatch_size`` is derived from ``train.global_batch`` (the training
    problem: ``global_batch / (microbatches * data * expert)``), and ``attention`` /
    ``attention_block`` are ``model.attention`` / ``model.attention_block`` (a kernel choice of the
    model, carried here so the planner can price it). ``stage_layers`` and ``stage_split`` are
    resolved from ``parallel.layers_per_stage`` / ``first_stage_layers`` / ``last_stage_layers``
    (:func:`resolve_stage_layers`)."""

    data: int = 1
    tensor: int = 1
    pipeline: int = 1
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedule)
    zero_stage: int = 0
    microbatches: int = 1  # m: microbatches per optimizer step (gradient accumulation or pipeline)
    microbatch_size: int = 1  # b: sequences per data shard per microbatch
    seq_len: int = 2048
    recompute: str = "none"  # none | selective (attention core) | full (keep layer inputs)
    sequence_parallel: bool = False
    pipeline_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zb-h1 | zb-v (used when pipeline > 1)
    # after the fields above so that positional ParallelLayout(data, tensor, pipeline, virtual, zero, m, b, ...)
    # calls (planner, tests, experiments) keep their meaning
    context: int = 1  # context parallelism: the sequence split over `context` (jaxpar.ops.context_parallel)
    attention: str = "auto"  # auto | dot_product | blockwise | cudnn (model.attention)
    attention_block: int = 512  # blockwise: query and key/value block length (model.attention_block)
    context_exchange: str = "ring"  # ring | all_gather (used when context > 1)
    expert: int = 1  # expert parallelism: MoE experts split over `expert`; the batch over data x expert
    # layers of each pipeline stage (uneven stages, virtual_stages = 1); () = num_layers / pipeline each
    stage_layers: tuple[int, ...] = ()
    stage_split: str = ""  # where stage_layers came from: the config field, or "balanced" (see resolve_stage_layers)

    def __post_init__(self) -> None:  # a split read back from JSON is a list: keep the layout hashable
        object.__setattr__(self, "stage_layers", tuple(self.stage_layers))

    @classmethod
    def from_config(cls, cfg: Any) -> ParallelLayout:
        """The layout a train config (a ``ConfigDict``) runs: global_batch / (microbatches * data)
        sequences per shard and microbatch. Unvalidated: :func:`jaxpar.config.validate` calls it and
        returns the validated layout, which a run builds once and passes down."""
        mesh, par, train = cfg.mesh, cfg.parallel, cfg.train
        per_step = par.microbatches * mesh.data * mesh.expert
        split, source = resolve_stage_layers(cfg.model.num_layers, mesh.pipeline, par)
        return cls(
            **{axis.value: mesh[axis.value] for axis in MESH_AXES},
            virtual_stages=par.virtual_stages,
            zero_stage=par.zero_stage,
            microbatches=par.microbatches,
            microbatch_size=train.global_batch // per_step if per_step > 0 else 0,
            seq_len=train.seq_len,
            recompute=par.recompute,
            sequence_parallel=par.sequence_parallel,
            pipeline_schedule=par.pipeline_schedule,
            attention=cfg.model.attention,
            attention_block=cfg.model.attention_block,
            context_exchange=par.context_exchange,
            stage_layers=split,
            stage_split=source,
        )

    # ------------------------------------------------------------------ derived quantities
    @property
    def mesh(self) -> dict[MeshAxis, int]:
        """Size of every mesh axis, keyed by :class:`MeshAxis`."""
        return {axis: getattr(self, field) for axis, field in _AXIS_FIELDS}

    def size(self, axis: MeshAxis | str) -> int:
        return getattr(self, _FIELD_OF.get(axis) or MeshAxis(axis).value)

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def batch_shards(self) -> int:
        """How many shards the batch's sequences are split into: the product of the batch axes'
        sizes (:func:`jaxpar.axes.batch_axes`: ``data x expert``)."""
        return math.prod(self.size(a) for a in group_axes(batch_axes(self.mesh)))

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.microbatch_size * self.microbatches * self.batch_shards

    @property
    def microbatch_sequences(self) -> int:
        """Global sequences per microbatch."""
        return self.microbatch_size * self.batch_shards

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def seq_local(self) -> int:
        """Tokens of each sequence one context rank holds (two chunks of ``seq_len / (2 * context)``)."""
        return self.seq_len // self.context

    @property
    def shards_optimizer(self) -> bool:
        """ZeRO >= 1: the optimizer state is split over the data group; each rank updates its shard."""
        return self.zero_stage >= 1

    @property
    def shards_gradients(self) -> bool:
        """ZeRO >= 2: the gradients are reduce-scattered every microbatch into an accumulator split
        like the optimizer state (stage 3: by the parameter gathers' transposes)."""
        return self.zero_stage >= 2

    @property
    def shards_parameters(self) -> bool:
        """ZeRO-3 (FSDP): the parameters are stored split over the data group, gathered per layer."""
        return self.zero_stage >= 3

    def zero_shards(self, expert_weight: bool = False) -> int:
        """Devices a parameter's ZeRO shards (and its gradient's reduction) span, its data group
        (:func:`jaxpar.axes.data_group`): data x context for an expert's weight, which the ``expert``
        axis splits, and data x context x expert for every other parameter."""
        n = self.data * self.context
        return n if expert_weight else n * self.expert

    @property
    def stages(self) -> int:
        """Virtual pipeline stages: the number of layer chunks the layers are cut into."""
        return self.pipeline * self.virtual_stages

    def layers_per_stage(self, num_layers: int) -> int:
        """Layers of one chunk (one pipeline rank holds ``virtual_stages`` chunks); with uneven stages
        the most any stage holds, which is what every stage stores (the rest padding)."""
        return max(self.stage_layers) if self.uneven else num_layers // self.stages

    def stored_layers(self, num_layers: int) -> int:
        """Layer rows one pipeline rank stores (all its chunks): ``num_layers / pipeline``, or with
        uneven stages the most any stage holds (the stage that sets per-stage memory)."""
        return max(self.stage_layers) if self.uneven else num_layers // self.pipeline

    def stage_layer_counts(self, num_layers: int) -> tuple[int, ...]:
        """Layers of each pipeline rank (its ``virtual_stages`` chunks together)."""
        return self.stage_layers or (num_layers // self.pipeline,) * self.pipeline

    def stage_split_line(self) -> str:
        """One line stating an uneven split and where it came from ("" when the stages are even)."""
        if not self.uneven:
            return ""
        counts, n = ",".join(map(str, self.stage_layers)), sum(self.stage_layers)
        why = (
            f"model.num_layers={n} does not divide mesh.pipeline={self.pipeline}: a balanced split, the extra "
            "layers on the middle stages first; set parallel.layers_per_stage to choose"
            if self.stage_split == "balanced"
            else self.stage_split
        )
        return f"pipeline stages hold {counts} layers ({why})"

    @property
    def uneven(self) -> bool:
        """Whether the pipeline stages hold different numbers of layers."""
        return len(set(self.stage_layers)) > 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"devices": self.devices, "global_batch": self.global_batch}

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> ParallelLayout:
        """The layout of a :meth:`to_dict` (or ``dataclasses.asdict``) read back from JSON: the derived
        ``devices`` and ``global_batch`` are dropped, and ``schedule``, this field's name in files written
        before it became ``pipeline_schedule``, is read as that field."""
        out = {k: v for k, v in fields.items() if k not in ("devices", "global_batch")}
        if "schedule" in out and "pipeline_schedule" not in out:
            out["pipeline_schedule"] = out.pop("schedule")
        return cls(**out)

    # ------------------------------------------------------------------ rules
    def validate(
        self, model: Mapping[str, Any], global_batch: int | None = None, num_devices: int | None = None
    ) -> ParallelLayout:
        """Raise a one-line :class:`ConfigError` naming the field and the fix if the step cannot run
        this layout for ``model`` (the ``model`` sub-config, or any mapping with its fields).

        ``global_batch``: the configured sequences per step, which must split into ``microbatches``
        x ``data`` equal shards (a layout alone cannot express a remainder). ``num_devices``: the
        devices present, which must equal the product of the mesh sizes. Returns ``self``.
        """
        for axis in MESH_AXES:
            require(self.size(axis) >= 1, f"mesh.{axis}={self.size(axis)}: a mesh axis size must be >= 1")
        if num_devices is not None:
            sizes = "*".join(str(self.size(a)) for a in MESH_AXES)
            names = "*".join(a.value for a in MESH_AXES)
            require(
                self.devices == num_devices,
                f"mesh: {names} = {sizes} = {self.devices} but {num_devices} devices are available; change "
                f"--config.mesh.data (or another mesh size) so the product is {num_devices}",
            )
        require(self.zero_stage in (0, 1, 2, 3), f"parallel.zero_stage={self.zero_stage}: use 0, 1, 2 or 3")
        require(
            self.recompute in RECOMPUTE, f"parallel.recompute='{self.recompute}': use one of {', '.join(RECOMPUTE)}"
        )
        require(
            self.pipeline_schedule in SCHEDULES,
            f"parallel.pipeline_schedule='{self.pipeline_schedule}': use one of {', '.join(SCHEDULES)}",
        )
        require(self.virtual_stages >= 1, f"parallel.virtual_stages={self.virtual_stages}: must be >= 1")
        require(self.microbatches >= 1, f"parallel.microbatches={self.microbatches}: must be >= 1")
        require(self.seq_len >= 2, f"train.seq_len={self.seq_len}: must be >= 2")
        require(self.attention in ATTENTION, f"model.attention='{self.attention}': use one of {', '.join(ATTENTION)}")
        require(self.attention_block >= 1, f"model.attention_block={self.attention_block}: must be >= 1, e.g. 512")
        require(
            self.context_exchange in CONTEXT_EXCHANGES,
            f"parallel.context_exchange='{self.context_exchange}': use one of {', '.join(CONTEXT_EXCHANGES)}",
        )
        self._validate_context()
        self._validate_model(model)
        self._validate_batch(global_batch)
        self._validate_pipeline(model)
        return self

    def _validate_experts(self, model: Mapping[str, Any]) -> None:
        experts = model.get("num_experts", 0)
        require(
            not (experts and model.get("moe_capacity_factor", 0.0) and self.context > 1),
            f"model.moe_capacity_factor={model.get('moe_capacity_factor')} with mesh.context={self.context}: "
            "the drop rule counts each sequence's choices, and context parallelism splits a sequence over "
            "ranks; set --config.model.moe_capacity_factor=0 (dropless) or mesh.context=1",
        )
        shared = model.get("shared_expert_dim", 0)
        require(
            shared % self.tensor == 0,
            f"model.shared_expert_dim={shared} is not divisible by mesh.tensor={self.tensor}; choose a tensor "
            f"size that divides {shared}",
        )
        if self.expert == 1:
            return
        require(
            experts > 0,
            f"mesh.expert={self.expert} but model.num_experts=0 (a dense model has no experts to split); "
            "set --config.mesh.expert=1, or put those devices on mesh.data",
        )
        require(
            experts % self.expert == 0,
            f"model.num_experts={experts} is not divisible by mesh.expert={self.expert}; choose an expert "
            f"size that divides {experts}",
        )
        require(
            self.pipeline == 1 or not self.shards_gradients,
            f"parallel.zero_stage={self.zero_stage} with mesh.expert={self.expert} and mesh.pipeline="
            f"{self.pipeline} is not supported yet (the pipeline's sharded gradient ticks reduce every "
            "parameter over one group); use --config.parallel.zero_stage=1 or mesh.pipeline=1",
        )

    def _validate_model(self, model: Mapping[str, Any]) -> None:
        self._validate_experts(model)
        for name in TENSOR_SPLIT_FIELDS:
            require(
                model[name] % self.tensor == 0,
                f"model.{name}={model[name]} is not divisible by mesh.tensor={self.tensor}; "
                f"choose a tensor size that divides {model[name]}",
            )
        require(
            self.pipeline == 1 or not model.get("first_dense_layers", 0),
            f"model.first_dense_layers={model.get('first_dense_layers')} with mesh.pipeline={self.pipeline}: "
            "deepseek_v3's dense first layers are not placed on pipeline stages yet; use mesh.pipeline=1",
        )
        self._validate_stage_layers(model["num_layers"])
        require(
            self.seq_len <= model["max_seq_len"],
            f"train.seq_len={self.seq_len} exceeds model.max_seq_len={model['max_seq_len']}; lower train.seq_len",
        )
        if self.sequence_parallel:
            split = self.tensor * self.context
            what = "mesh.tensor" if self.context == 1 else "mesh.context*mesh.tensor"
            require(
                self.seq_len % split == 0,
                f"train.seq_len={self.seq_len} is not divisible by {what}={split} (parallel."
                f"sequence_parallel); use a multiple of {split}",
            )

    def _validate_stage_layers(self, num_layers: int) -> None:
        counts, field = self.stage_layers, self.stage_split or "parallel.layers_per_stage"
        if not counts:
            require(
                num_layers % self.stages == 0,
                f"model.num_layers={num_layers} is not divisible by mesh.pipeline*parallel.virtual_stages="
                f"{self.stages}; choose a pipeline size that divides the layers",
            )
            return
        shown = ",".join(map(str, counts))
        require(
            len(counts) == self.pipeline,
            f"{field}: {len(counts)} stage counts ({shown}) for mesh.pipeline={self.pipeline}; give one count per stage",
        )
        require(
            min(counts) >= 1,
            f"{field}: the split {shown} leaves a stage without layers (model.num_layers={num_layers}, mesh.pipeline="
            f"{self.pipeline}); every stage needs at least one layer",
        )
        require(
            sum(counts) == num_layers,
            f"{field}: the split {shown} sums to {sum(counts)}, not model.num_layers={num_layers}; make the counts "
            f"add up to {num_layers}",
        )
        require(
            self.virtual_stages == 1 or not self.uneven,
            f"{field}: uneven stages ({shown}) with parallel.virtual_stages={self.virtual_stages} are not supported "
            "(each rank's chunks are cut as equal slices of its stored layers); use --config.parallel.virtual_stages=1 "
            "and a schedule other than interleaved, or layers that divide mesh.pipeline*parallel.virtual_stages",
        )
        require(
            self.pipeline_schedule not in SPLIT_BACKWARD or not self.uneven,
            f"{field}: uneven stages ({shown}) with parallel.pipeline_schedule={self.pipeline_schedule} are not supported yet (the "
            "split backward runs every stored layer row, padding included); use --config.parallel.pipeline_schedule=1f1b, "
            "or layers that divide mesh.pipeline",
        )

    def _validate_context(self) -> None:
        c = self.context
        if c == 1:
            return
        require(
            self.seq_len % (2 * c) == 0,
            f"train.seq_len={self.seq_len} is not divisible by 2*mesh.context={2 * c} (each context rank holds "
            f"two chunks, i and 2c-1-i, to balance the causal mask); use a multiple of {2 * c}",
        )
        require(
            self.attention in ("blockwise", "auto"),
            f"model.attention={self.attention} with mesh.context={c}: context parallelism runs the blockwise "
            "kernel on every exchanged key/value block (it merges partial results by their log-sum-exp); set "
            "--config.model.attention=blockwise",
        )
        # The pipeline runs each stage's layers inside a per-stage branch (lax.switch); the ring's
        # collective-permutes inside it exchange wrong blocks on XLA:CPU (forward loss off in the 3rd
        # digit) or abort there. The all-gather exchange is exact inside the branches.
        require(
            self.pipeline == 1 or self.context_exchange == "all_gather",
            f"parallel.context_exchange=ring with mesh.pipeline={self.pipeline}: the ring's collective-permutes "
            "cannot run inside the pipeline's per-stage branches; set --config.parallel.context_exchange="
            "all_gather",
        )

    def _validate_batch(self, global_batch: int | None) -> None:
        per_step = self.microbatches * self.batch_shards
        names = "parallel.microbatches*mesh.data" + ("*mesh.expert" if self.expert > 1 else "")
        sizes = f"{self.microbatches}*{self.data}" + (f"*{self.expert}" if self.expert > 1 else "")
        if global_batch is not None:
            require(global_batch >= 1, f"train.global_batch={global_batch}: must be >= 1")
            require(
                global_batch % per_step == 0,
                f"train.global_batch={global_batch} is not divisible by {names}="
                f"{sizes}={per_step}; use a multiple of {per_step}",
            )
        require(
            self.microbatch_size >= 1,
            f"train.global_batch={self.global_batch} gives {self.microbatch_size} sequences per data shard "
            f"and microbatch; use at least {names}={per_step} sequences",
        )

    def _validate_pipeline(self, model: Mapping[str, Any]) -> None:
        p, m, v, schedule = self.pipeline, self.microbatches, self.virtual_stages, self.pipeline_schedule
        if p == 1:
            require(
                v == 1, f"parallel.virtual_stages={v} needs mesh.pipeline > 1; set --config.parallel.virtual_stages=1"
            )
            return
        require(
            schedule != "interleaved" or v >= 2,
            f"parallel.virtual_stages={v}: the interleaved schedule needs at least 2 chunks per stage; set "
            "--config.parallel.virtual_stages=2 or --config.parallel.pipeline_schedule=1f1b",
        )
        require(
            schedule in ("interleaved", *V_SHAPED) or v == 1,
            f"parallel.virtual_stages={v} is only used by the interleaved and zb-v schedules; set "
            "--config.parallel.pipeline_schedule=interleaved or --config.parallel.virtual_stages=1",
        )
        require(
            schedule not in V_SHAPED or v == 2,
            f"parallel.virtual_stages={v}: {schedule} places two chunks per device in V order; set "
            "--config.parallel.virtual_stages=2",
        )
        require(
            schedule not in ("1f1b", *SPLIT_BACKWARD) or m >= p,
            f"parallel.microbatches={m} < mesh.pipeline={p}: {schedule.upper()} needs at least one microbatch per stage; "
            f"set --config.parallel.microbatches={p} or more",
        )
        require(
            schedule not in SPLIT_BACKWARD or self.recompute == "none",
            f"parallel.pipeline_schedule={schedule} with parallel.recompute={self.recompute}: the split backward computes the "
            "weight gradients from the forward's stashed residuals, which recomputation does not keep; set "
            "--config.parallel.recompute=none or --config.parallel.pipeline_schedule=1f1b",
        )
        require(
            schedule not in SPLIT_BACKWARD or not model.get("num_experts", 0),
            f"parallel.pipeline_schedule={schedule} with an MoE model (model.num_experts={model.get('num_experts', 0)}) is "
            "not supported yet; set --config.parallel.pipeline_schedule=1f1b",
        )
        require(
            schedule != "interleaved" or m % p == 0,
            f"parallel.microbatches={m} is not a multiple of mesh.pipeline={p} (interleaved runs microbatches "
            f"in groups of p); set --config.parallel.microbatches={p * -(-m // p)}",
        )
        require(
            # ZeRO-2 (ZeRO-3's gathers reduce-scatter in their transposes, inside the scan)
            not (self.shards_gradients and not self.shards_parameters) or schedule != "gpipe",
            "parallel.zero_stage=2 with parallel.pipeline_schedule=gpipe is not supported (GPipe's gradient is the "
            "transpose of its whole forward scan, accumulated full size); use --config.parallel.pipeline_schedule=1f1b, "
            "or --config.parallel.zero_stage=1 or 3",
        )


def balanced_split(num_layers: int, stages: int) -> tuple[int, ...]:
    """``num_layers`` over ``stages`` as evenly as possible: the layers left over go to the middle
    stages first (they hold neither the embedding nor the loss), then the last, then the first."""
    base, extra = divmod(num_layers, stages)
    counts = [base] * stages
    for d in ([*range(1, stages - 1), stages - 1, 0] if stages > 1 else [0])[:extra]:
        counts[d] += 1
    return tuple(counts)


def resolve_stage_layers(num_layers: int, pipeline: int, cfg: Any) -> tuple[tuple[int, ...], str]:
    """(layers per stage, the field they came from) for the ``parallel`` sub-config: explicit counts
    (``layers_per_stage``, e.g. "1,2,1"), a first / last stage count with the rest split evenly over
    the stages between (Megatron's ``--decoder-first/last-pipeline-num-layers``), or, when nothing is
    set and the layers do not divide the stages, :func:`balanced_split` (field "balanced"). ``()``:
    the even split. A request that cannot be read or resolved raises a one-line ConfigError; the
    counts are checked against the model by :meth:`ParallelLayout.validate`."""
    text, first, last = cfg.layers_per_stage.strip(), cfg.first_stage_layers, cfg.last_stage_layers
    if text:
        require(
            not (first or last),
            f"parallel.layers_per_stage='{text}' with parallel.first_stage_layers={first} / last_stage_layers={last}: "
            "give either the counts of every stage or the first / last stage counts, not both",
        )
        parts = [x.strip() for x in text.split(",")]
        require(
            all(x.isascii() and x.isdigit() for x in parts),
            f"parallel.layers_per_stage='{text}': give one layer count per stage, comma-separated, e.g. 1,2,1",
        )
        return tuple(int(x) for x in parts), "parallel.layers_per_stage"
    for name, value in (("first_stage_layers", first), ("last_stage_layers", last)):
        require(value >= 0, f"parallel.{name}={value}: must be >= 0 (0: not set)")
    if first or last:
        fields = "parallel." + "/".join(n for n, v in (("first_stage_layers", first), ("last_stage_layers", last)) if v)
        ends = (1 if first else 0) + (1 if last else 0)
        rest, between = num_layers - first - last, pipeline - ends
        require(
            between >= 1 or rest == 0,
            f"{fields}: with mesh.pipeline={pipeline} no stage is left for the other {rest} of model.num_layers="
            f"{num_layers}; make the first and last stage counts add up to {num_layers}",
        )
        require(
            rest >= between and (between == 0 or rest % between == 0),
            f"{fields}: the remaining {rest} of model.num_layers={num_layers} do not split evenly over the "
            f"{between} other stages; choose counts that leave a multiple of {between} (at least {between})",
        )
        middle = [rest // between] * between if between else []
        counts = ([first] if first else []) + middle + ([last] if last else [])
        return tuple(counts), fields
    if pipeline > 1 and num_layers % pipeline and num_layers >= pipeline and cfg.virtual_stages == 1:
        return balanced_split(num_layers, pipeline), "balanced"
    return (), ""
