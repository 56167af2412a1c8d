"""Closed-form estimates of memory, communication, FLOPs and step time for one layout.

Pure functions of (model sub-config, :class:`Layout`[, :class:`Cluster`]): nothing is compiled or
allocated, so any model can be planned for any cluster in microseconds. Each formula names its
source; tests/test_estimate.py checks the published numbers. Units: bytes, GB = 1e9, seconds.
``b`` is sequences per data shard per microbatch and ``m`` microbatches per step, so
global_batch = b * m * data. Activations are counted in the model's compute dtype (2 bytes bf16).
Communication is ring "bytes on the wire" per device per step (nccl-tests PERFORMANCE.md):
all-reduce 2(n-1)/n * S, all-gather / reduce-scatter (n-1)/n * S, collective-permute S. Devices
are ordered tensor innermost, then data, then pipeline outermost.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from jaxpar.analysis.clusters import Cluster
from jaxpar.config import SCHEDULES, ConfigDict, ConfigError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RECOMPUTE = ("none", "selective", "full")
CONVENTIONS = ("jaxpar", "paper")
TENSOR_DIMS = frozenset({"heads", "kv_heads", "mlp", "vocab"})  # logical dims split over `tensor`
LOGITS_BYTES = 8  # per logit on the last stage: bf16 logits + fp32 log-softmax kept + bf16 gradient


@dataclasses.dataclass(frozen=True)
class Layout:
    """A parallel layout: mesh sizes plus the schedule choices that change memory and time."""

    data: int = 1
    tensor: int = 1
    pipeline: int = 1
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedule)
    zero_stage: int = 0
    microbatches: int = 1  # m: microbatches per optimizer step (accumulation or pipeline)
    microbatch_size: int = 1  # b: sequences per data shard per microbatch
    seq_len: int = 2048
    recompute: str = "none"  # none | selective (attention core) | full (keep layer inputs)
    sequence_parallel: bool = False
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved

    @classmethod
    def from_config(cls, cfg: ConfigDict) -> Layout:
        """The layout a (validated) train config runs."""
        m, t = cfg.mesh, cfg.train
        return cls(m.data, m.tensor, m.pipeline, cfg.pipeline.virtual_stages if m.pipeline > 1 else 1,
                   cfg.parallel.zero_stage, t.microbatches, t.global_batch // (t.microbatches * m.data), t.seq_len,
                   cfg.model.remat, cfg.parallel.sequence_parallel, cfg.pipeline.schedule)

    @property
    def devices(self) -> int:
        return self.data * self.tensor * self.pipeline

    @property
    def global_batch(self) -> int:
        return self.microbatch_size * self.microbatches * self.data

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def check(self, model: ConfigDict) -> None:
        """Raise a one-line :class:`ConfigError` if the layout cannot run this model."""
        for n in ("data", "tensor", "pipeline", "virtual_stages", "microbatches", "microbatch_size", "seq_len"):
            _require(getattr(self, n) >= 1, f"{n}={getattr(self, n)} must be >= 1")
        for n in ("num_heads", "num_kv_heads", "mlp_dim", "vocab_size"):
            _require(model[n] % self.tensor == 0, f"tensor={self.tensor} does not divide model.{n}={model[n]}")
        stages = self.pipeline * self.virtual_stages
        _require(model.num_layers % stages == 0, f"pipeline*virtual={stages} does not divide {model.num_layers} layers")
        _require(self.zero_stage in (0, 1, 2, 3), f"zero={self.zero_stage}; use 0, 1, 2 or 3")
        _require(self.recompute in RECOMPUTE, f"recompute='{self.recompute}'; use {', '.join(RECOMPUTE)}")
        _require(self.schedule in SCHEDULES, f"schedule='{self.schedule}'; use {', '.join(SCHEDULES)}")
        _require(self.virtual_stages == 1 or self.schedule == "interleaved", "virtual > 1 needs schedule=interleaved")
        _require(
            not self.sequence_parallel or self.seq_len % self.tensor == 0, "sequence parallel needs seq % tensor == 0"
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"devices": self.devices, "global_batch": self.global_batch}


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(f"layout: {message}")


# --------------------------------------------------------------------------- parameters


@dataclasses.dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor: logical dims as (name, size) and where it lives (layer | first | last stage)."""

    name: str
    dims: tuple[tuple[str, int], ...]
    place: str

    @property
    def size(self) -> int:
        return math.prod(n for _, n in self.dims)


_SHAPE_FIELDS = ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                 "max_seq_len", "tie_embeddings", "mlp_activation", "norm", "position")  # fmt: skip


def param_tensors(model: ConfigDict) -> tuple[ParamTensor, ...]:
    """Every parameter tensor of our block, per layer or per model, with logical dim names.

    LLaMA block: q (embed, heads*hd), k/v (embed, kv_heads*hd), o (heads*hd, embed), SwiGLU gate/up
    (embed, mlp) and down (mlp, embed), two RMSNorm scales (embed); final norm; embedding (vocab,
    embed); untied output (embed, vocab). Classic GPT switches: ``gelu`` drops the gate, ``layernorm``
    adds a bias to every norm, ``learned`` adds a (max_seq_len, embed) position table. Linear layers
    have no biases (as in param_count_estimate). Cached per shape: the planner calls this a lot.
    """
    return _param_tensors(tuple(model[k] for k in _SHAPE_FIELDS))


@functools.lru_cache(maxsize=256)
def _param_tensors(shape: tuple) -> tuple[ParamTensor, ...]:
    m = dict(zip(_SHAPE_FIELDS, shape))
    h, hd, f, vocab = ("embed", m["embed_dim"]), m["head_dim"], ("mlp", m["mlp_dim"]), ("vocab", m["vocab_size"])
    q, kv = ("heads", m["num_heads"] * hd), ("kv_heads", m["num_kv_heads"] * hd)
    norm = [("scale", (h,))] + ([("bias", (h,))] if m["norm"] == "layernorm" else [])
    shapes = {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "up": (h, f), "down": (f, h)}
    if m["mlp_activation"] == "swiglu":
        shapes["gate"] = (h, f)
    out = [ParamTensor(name, dims, "layer") for name, dims in shapes.items()]
    out += [ParamTensor(f"{n}_{k}", d, "layer") for n in ("attn_norm", "mlp_norm") for k, d in norm]
    out.append(ParamTensor("embedding", (vocab, h), "first"))
    if m["position"] == "learned":
        out.append(ParamTensor("positions", (("pos", m["max_seq_len"]), h), "first"))
    out += [ParamTensor(f"final_norm_{k}", d, "last") for k, d in norm]
    if not m["tie_embeddings"]:
        out.append(ParamTensor("output", (h, vocab), "last"))
    return tuple(out)


def count_params(model: ConfigDict) -> int:
    """Exact parameter count (equals jaxpar.config.param_count_estimate)."""
    return sum(t.size * (model.num_layers if t.place == "layer" else 1) for t in param_tensors(model))


def shard_elements(tensor: ParamTensor, tensor_size: int, data: int, zero_shard: bool) -> float:
    """Elements of ``tensor`` held per device under the jaxpar sharding rules.

    Tensor parallel splits the logical dims heads, kv_heads, mlp and vocab over ``tensor``; norm
    scales/biases and position tables have none, so they are replicated over tensor. ZeRO
    (``zero_shard``) shards over ``data`` the largest dimension that the tensor rules do not map (a
    heads/kv_heads/mlp/vocab dim is never a ZeRO candidate, even at tensor=1) and whose size is
    divisible by ``data``; ties go to the first such dim. If none divides, the tensor stays
    replicated over data. The stacked layer (scan) dimension is never sharded by ZeRO.
    """
    elements = float(tensor.size)
    if any(name in TENSOR_DIMS for name, _ in tensor.dims):
        elements /= tensor_size
    if zero_shard and data > 1 and any(n % data == 0 for name, n in tensor.dims if name not in TENSOR_DIMS):
        elements /= data
    return elements


def stage_tensors(
    model: ConfigDict, layout: Layout, stage: str, shared_on_every_stage: bool = False
) -> list[tuple[ParamTensor, int]]:
    """(tensor, copies) held by the first or last pipeline stage (one stage holds all when p = 1).

    Each rank holds L/p layers (v chunks of L/(p*v) when interleaved). Megatron places the
    embedding and learned positions on the first stage, final norm and output layer on the last;
    with tied embeddings and p > 1 the last stage keeps its own copy of the table.
    ``shared_on_every_stage``: jaxpar's pipeline (``jaxpar/pipeline/forms.py``, stage form) holds on
    every stage what SPMD makes every device hold: the layers, the final norm and positions
    (replicated over ``pipeline``, gradients summed over it) and one V x h table: with an untied
    output layer the ``ends`` slot (embedding on the first stage, output layer on the last), with
    tied embeddings the shared table.
    """
    tensors, p = param_tensors(model), layout.pipeline
    out = [(t, model.num_layers // p if t.place == "layer" else 1) for t in tensors]
    if shared_on_every_stage:  # one ends slot of (vocab, h): counted as the embedding, no output
        return [(t, c) for t, c in out if p == 1 or t.name != "output"]
    out = [(t, c) for t, c in out if t.place == "layer" or p == 1 or t.place == stage]
    if stage == "last" and p > 1 and model.tie_embeddings:
        out += [(t, 1) for t in tensors if t.name == "embedding"]
    return out


def _held_elements(model: ConfigDict, layout: Layout, stage: str, zero_shard: bool, every_stage: bool = False) -> float:
    held = stage_tensors(model, layout, stage, every_stage)
    return sum(c * shard_elements(t, layout.tensor, layout.data, zero_shard) for t, c in held)


# --------------------------------------------------------------------------- model states


@dataclasses.dataclass(frozen=True)
class ModelStates:
    """Per-device bytes of parameters, gradients and optimizer state."""

    params_bytes: float
    gradient_bytes: float
    optimizer_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.gradient_bytes + self.optimizer_bytes


def zero_paper_states(num_params: float, zero_stage: int, data: int) -> ModelStates:
    """ZeRO paper (Rajbhandari et al. 2019, arXiv:1910.02054, sec. 3 and Fig. 1), K = 12.

    bf16 weights 2P + bf16 gradients 2P + fp32 master/momentum/variance 12P = 16 bytes/param:
    DP 16P, ZeRO-1 4P + 12P/N, ZeRO-2 2P + 14P/N, ZeRO-3 16P/N.
    """
    shard = [1.0 if zero_stage < k else float(data) for k in (3, 2, 1)]
    return ModelStates(2 * num_params / shard[0], 2 * num_params / shard[1], 12 * num_params / shard[2])


def model_states(model: ConfigDict, layout: Layout, stage: str = "first", convention: str = "jaxpar") -> ModelStates:
    """Model-state bytes per device of one pipeline stage, under one of two stated conventions.

    ``paper``: the ZeRO paper's 16 bytes/param applied to the parameters a device holds after
    tensor/pipeline splitting (norms replicated over tensor), divided by N = data as the paper does.
    ``jaxpar``: what our trainer holds (with a pipeline: every stage holds one V x h table, the
    final norm and positions, see :func:`stage_tensors`): fp32 master params (model.param_dtype) sharded over data only at ZeRO-3; Adam mu + nu in the param dtype (8 bytes/param) sharded at ZeRO >= 1; fp32
    gradients (not step arguments, but live at the update) sharded at ZeRO >= 2; sharding follows
    :func:`shard_elements`.
    """
    if convention not in CONVENTIONS:
        raise ConfigError(f"convention '{convention}': use one of {', '.join(CONVENTIONS)}")
    if convention == "paper":
        return zero_paper_states(_held_elements(model, layout, stage, False), layout.zero_stage, layout.data)
    full = _held_elements(model, layout, stage, False, every_stage=True)
    zero = _held_elements(model, layout, stage, True, every_stage=True)
    pb, z = DTYPE_BYTES[model.param_dtype], layout.zero_stage
    return ModelStates(pb * (zero if z >= 3 else full), pb * (zero if z >= 2 else full), 2 * pb * (zero if z else full))


# --------------------------------------------------------------------------- activations


def korthikanti_activation_bytes(
    s: int, b: int, h: int, a: int, tensor: int = 1, sequence_parallel: bool = False, recompute: str = "none"
) -> float:
    """Activation bytes per GPT layer per microbatch (Korthikanti et al. 2022, arXiv:2205.05198, Table 2).

    2-byte activations, 1-byte dropout masks, GeLU MLP with f = 4h. Per layer: attention
    11sbh + 5as^2b, MLP 19sbh, two layernorms 4sbh = sbh(34 + 5as/h).
    """
    t, sbh = tensor, s * b * h
    if recompute == "full":  # keep only the layer input
        return 2 * sbh / (t if sequence_parallel else 1)
    if recompute == "selective":  # attention core (the 5as^2b term) recomputed
        return 34 * sbh / t if sequence_parallel else sbh * (10 + 24 / t)
    if sequence_parallel:
        return sbh * (34 + 5 * a * s / h) / t
    return sbh * (10 + 24 / t + 5 * a * s / (h * t))  # t = 1 gives sbh(34 + 5as/h)


def layer_activation_bytes(model: ConfigDict, layout: Layout) -> float:
    """Activation bytes our layer keeps for its backward, per microbatch, derived like Korthikanti.

    With e bytes per activation (2 for bf16), q = heads*hd, k = kv_heads*hd, f = mlp_dim and no
    dropout anywhere, the tensors saved for the backward are:

    - attention: RMSNorm input e*sbh; QKV matmul input (shared) e*sbh; Q e*sbq and K e*sbk for
      QK^T (RoPE is linear, it needs nothing); softmax output e*a*s^2*b, used by both the softmax
      and the AV backward (no dropout, so no mask and no second copy); V e*sbk; output-projection
      input e*sbq. -> e*sb(2h + 2q + 2k) + e*a*s^2*b.
    - MLP: RMSNorm input e*sbh; gate/up input (shared) e*sbh; SwiGLU keeps gate and up outputs
      e*sbf each and the down-projection input e*sbf -> e*sb(2h + 3f), assuming silu(gate) is
      recomputed in the fused elementwise backward (XLA fuses it; 4f if it is stored). GeLU: the
      up output and the GeLU output -> e*sb(2h + 2f).

    With e = 2, q = k = h, f = 4h (GeLU) this is 32sbh + 2as^2b: Korthikanti's 34sbh + 5as^2b
    minus its dropout masks and dropout output (2sbh + 3as^2b). The 4*e*sbh of norm and matmul
    inputs sit outside the tensor-parallel region: replicated over tensor unless sequence parallel
    shards them; everything else is split by tensor. ``selective`` recomputes the attention core
    (drops the s^2 term, Korthikanti's selective; jax's ``checkpoint_dots`` policy would instead
    keep the QK^T output, e*a*s^2*b). ``full`` keeps only the layer input e*sbh.
    """
    e, s, b, t = DTYPE_BYTES[model.compute_dtype], layout.seq_len, layout.microbatch_size, layout.tensor
    q, k = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    sp = t if layout.sequence_parallel else 1
    if layout.recompute == "full":
        return e * s * b * model.embed_dim / sp
    outside = 4 * e * s * b * model.embed_dim / sp
    inside = e * s * b * (2 * q + 2 * k + (3 if model.mlp_activation == "swiglu" else 2) * model.mlp_dim) / t
    scores = 0.0 if layout.recompute == "selective" else e * model.num_heads * s * s * b / t
    return outside + inside + scores


def inflight_microbatches(layout: Layout, stage: str = "first") -> float:
    """Microbatches whose activations a stage holds at its peak (Narayanan 2021; Korthikanti 2022 sec. 4.2).

    p = 1: 1 (accumulation runs microbatches one after another). GPipe: m. 1F1B: min(p, m) on the
    first stage, 1 on the last. Interleaved: first stage p * (1 + (p-1)/(p*v)).
    """
    p, m, v = layout.pipeline, layout.microbatches, layout.virtual_stages
    if p == 1 or (stage == "last" and layout.schedule != "gpipe"):
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    return min(float(m), p * (1 + (p - 1) / (p * v)) if layout.schedule == "interleaved" else float(p))


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes per device on the busiest pipeline stage."""

    convention: str
    stage: str  # first | last (the heavier one; "first" when p = 1)
    params_bytes: float
    gradient_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    transient_bytes: float  # gathered/cast weights of 2 layers + the full-recompute working set
    inflight_microbatches: float

    @property
    def model_states_bytes(self) -> float:
        return self.params_bytes + self.gradient_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> float:
        return self.model_states_bytes + self.activation_bytes + self.transient_bytes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {
            "model_states_bytes": self.model_states_bytes,
            "total_bytes": self.total_bytes,
        }


def memory_estimate(model: ConfigDict, layout: Layout, convention: str = "jaxpar") -> MemoryEstimate:
    """Model states + stored activations (+ logits on the last stage) + transients; the heavier stage wins."""
    per_layer = layer_activation_bytes(model, layout) * model.num_layers // layout.pipeline
    layer_params = sum(shard_elements(t, layout.tensor, 1, False) for t in param_tensors(model) if t.place == "layer")
    transient = 2 * layer_params * DTYPE_BYTES[model.compute_dtype]
    if layout.recompute == "full":
        transient += layer_activation_bytes(model, dataclasses.replace(layout, recompute="none"))
    logits = LOGITS_BYTES * layout.seq_len * layout.microbatch_size * model.vocab_size / layout.tensor
    candidates = []
    for stage in ("first", "last") if layout.pipeline > 1 else ("first",):
        states, inflight = model_states(model, layout, stage, convention), inflight_microbatches(layout, stage)
        act = (per_layer + (logits if stage == "last" or layout.pipeline == 1 else 0)) * inflight
        candidates.append(MemoryEstimate(convention, stage, *dataclasses.astuple(states), act, transient, inflight))
    return max(candidates, key=lambda c: c.total_bytes)


# --------------------------------------------------------------------------- communication


def all_reduce_bytes(size_bytes: float, n: int) -> float:
    """Ring all-reduce traffic per device: 2(n-1)/n * S (nccl-tests PERFORMANCE.md)."""
    return 2 * (n - 1) / n * size_bytes


def all_gather_bytes(size_bytes: float, n: int) -> float:
    """Ring all-gather or reduce-scatter traffic per device: (n-1)/n * S (S = the full array)."""
    return (n - 1) / n * size_bytes


@dataclasses.dataclass(frozen=True)
class AxisComm:
    """Traffic one device sends over one mesh axis per optimizer step; link is intra | inter | none."""

    axis: str
    size: int
    bytes: float
    collectives: int
    link: str
    time_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def axis_link(layout: Layout, axis: str, cluster: Cluster) -> str:
    """The link a ring over ``axis`` uses. With devices ordered tensor, data, pipeline, a ring stays in
    a node when the span of device ids it touches (t, t*N, t*N*p) fits in one; else it crosses the NIC."""
    span = {"tensor": layout.tensor, "data": layout.tensor * layout.data, "pipeline": layout.devices}[axis]
    return "intra" if span <= cluster.devices_per_node else "inter"


def communication(
    model: ConfigDict,
    layout: Layout,
    cluster: Cluster | None = None,
    grad_reduce_bytes: int = 4,
    link_efficiency: float = 0.75,
    convention: str = "paper",
) -> dict[str, AxisComm]:
    """Bytes per device per step on each mesh axis (FORMULAS.md section 3), with times if a cluster is given.

    ``paper`` (the published formulas, the default):
    data (ZeRO paper sec. 7): DP all-reduces gradients once per step; ZeRO-1 reduce-scatters them
    and all-gathers the updated params once (same bytes); ZeRO-2 reduce-scatters every microbatch
    (m RS + 1 AG); ZeRO-3 all-gathers params in forward and backward and reduce-scatters gradients
    every microbatch (3m x (N-1)/N, 1.5x DP at m = 1). S = per-device parameter count (after TP/PP)
    x ``grad_reduce_bytes`` (4 fp32, 2 bf16). tensor (Shoeybi et al. 2019; Korthikanti 2022):
    4 all-reduces of b*s*h per layer per microbatch (2 fwd, 2 bwd), 6 with full recompute; with SP
    each becomes all-gather + reduce-scatter, same bytes. The 2 embedding/output collectives per
    microbatch are ignored (< 1/(2L/p) of the layer traffic). pipeline (Narayanan 2021): one
    activation forward and one gradient backward of b*s*h per microbatch per boundary, x v when
    interleaved, /t with SP (Megatron's scatter-gather: each rank sends its sequence shard).

    ``jaxpar``: what the jaxpar train step compiles to (checked against the compiled HLO by
    tests/test_plan_aot.py); see :func:`_jaxpar_data` and :func:`jaxpar_stage_traffic` (tensor and
    pipeline axes of each pipeline stage; the busiest stage counts).

    Times use ``link_efficiency`` x the nominal bandwidth (the seed plans with 70-80% of nominal).
    """
    if convention not in CONVENTIONS:
        raise ConfigError(f"convention '{convention}': use one of {', '.join(CONVENTIONS)}")
    n, t, p, m, z = layout.data, layout.tensor, layout.pipeline, layout.microbatches, layout.zero_stage
    bsh = layout.microbatch_size * layout.seq_len * model.embed_dim * DTYPE_BYTES[model.compute_dtype]
    pp_calls = 2 * m * layout.virtual_stages
    pipeline = (p, pp_calls * bsh / (t if layout.sequence_parallel else 1), pp_calls)
    if convention == "jaxpar":
        stages = [jaxpar_stage_traffic(model, layout, d, grad_reduce_bytes) for d in range(p)]
        data = _jaxpar_data(model, layout, grad_reduce_bytes)
        traffic = {
            "data": (n, *max((st.get("data", data) for st in stages), key=lambda x: x[0])),
            "tensor": (t, *max((st["tensor"] for st in stages), key=lambda x: x[0])),
            "pipeline": (p, *max((st["pipeline"] for st in stages), key=lambda x: x[0])),
        }
    else:
        grads = max(_held_elements(model, layout, st, False) for st in ("first", "last")) * grad_reduce_bytes
        data = {  # (bytes, collectives) by ZeRO stage
            0: (all_reduce_bytes(grads, n), 1),
            1: (all_reduce_bytes(grads, n), 2),  # reduce-scatter + all-gather: the same bytes as one all-reduce
            2: ((m + 1) * all_gather_bytes(grads, n), m + 1),
            3: (3 * m * all_gather_bytes(grads, n), 3 * m),
        }[z]
        tp_calls = (6 if layout.recompute == "full" else 4) * (model.num_layers // p) * m
        traffic = {
            "data": (n, *data),
            "tensor": (t, tp_calls * all_reduce_bytes(bsh, t), tp_calls * (2 if layout.sequence_parallel else 1)),
            "pipeline": pipeline,
        }
    out = {}
    for axis, (size, nbytes, calls) in traffic.items():
        if size == 1:
            out[axis] = AxisComm(axis, 1, 0.0, 0, "none")
            continue
        link = axis_link(layout, axis, cluster) if cluster else "none"
        gbps = {"intra": cluster.intra_node_gbps, "inter": cluster.inter_node_gbps}[link] if cluster else 0.0
        out[axis] = AxisComm(axis, size, nbytes, calls, link, nbytes / (gbps * 1e9 * link_efficiency) if gbps else 0.0)
    return out


def _held_by_place(model: ConfigDict, layout: Layout) -> tuple[float, float]:
    """(layer, other) parameter elements per device after the tensor split, unsharded over data, on
    the stage holding the most parameters (jaxpar's pipeline: every stage holds the non-layer ones)."""
    best = (0.0, 0.0)
    for stage in ("first", "last"):
        held = stage_tensors(model, layout, stage, shared_on_every_stage=True)
        layer = sum(c * shard_elements(t, layout.tensor, 1, False) for t, c in held if t.place == "layer")
        other = sum(c * shard_elements(t, layout.tensor, 1, False) for t, c in held if t.place != "layer")
        best = max(best, (layer, other), key=sum)
    return best


def _jaxpar_data(model: ConfigDict, layout: Layout, grad_reduce_bytes: int) -> tuple[float, int]:
    """Data-axis (bytes, collectives) of the jaxpar step (jaxpar/train/step.py), E the per-device
    parameter elements after the tensor split, g = ``grad_reduce_bytes``, pb the param dtype bytes:

    stage 0: all-reduce E*g once per step. Stage 1: reduce-scatter E*g once and all-gather the
    updated parameters in the param dtype (E*pb, fp32: 2x the bytes of a bf16 reduction). Stage 2:
    the reduce-scatter every microbatch, the all-gather once. Stage 3 runs in the compute dtype
    (a, whatever grad_reduce_dtype says): block parameters are gathered
    twice per microbatch (forward, and again in the backward: the remat policy never keeps the
    gathered copy), the embedding, final norm and output layer once per step (XLA hoists the
    loop-invariant gather out of the accumulation loop and shares it with the first microbatch),
    and every gradient is reduce-scattered per microbatch. Parameters whose dims ``data`` divides
    none of are all-reduced instead; their share is ignored here (the loss and gradient-norm scalars too).
    """
    n, m, z = layout.data, layout.microbatches, layout.zero_stage
    layer, other = _held_by_place(model, layout)
    full, pb = layer + other, DTYPE_BYTES[model.param_dtype]
    if z == 0:
        return all_reduce_bytes(full * grad_reduce_bytes, n), 1
    if z in (1, 2):
        reductions = m if z == 2 else 1
        moved = reductions * all_gather_bytes(full * grad_reduce_bytes, n) + all_gather_bytes(full * pb, n)
        return moved, reductions + 1
    a = DTYPE_BYTES[model.compute_dtype]
    gathered = (2 * m * layer + other) * a
    return all_gather_bytes(gathered, n) + m * all_gather_bytes(full * a, n), 3 * m + 1


def _jaxpar_tensor(model: ConfigDict, layout: Layout) -> tuple[float, int]:
    """Tensor-axis (bytes, collectives) of the jaxpar model (jaxpar/models/llama.py), per microbatch:

    per layer 2 all-reduces of b*s*h forward (attention and MLP outputs) and 2 backward (their
    input gradients); with recompute (selective or full) the attention output's all-reduce runs
    again in the recomputed forward (the MLP one is dead there): 5, not Megatron's 6. With SP each
    all-reduce is an all-gather + reduce-scatter (same bytes), and recompute repeats both gathers
    and the attention reduce-scatter: 5.5 all-reduce equivalents per layer. Per microbatch also
    the vocabulary-parallel embedding (forward, first stage) and the output layer input's gradient
    (backward, last stage), each b*s*h (an all-reduce, or a gather/scatter pair with SP); the
    cross-entropy's max, sum-exp and target logit (3 fp32 all-reduces of b*s, last stage); with
    SP the norm scales' gradients (2L/p + 1 fp32 vectors of h). The busiest stage (the last) counts.
    """
    t, p, m, sp = layout.tensor, layout.pipeline, layout.microbatches, layout.sequence_parallel
    bs = layout.microbatch_size * layout.seq_len
    bsh = bs * model.embed_dim * DTYPE_BYTES[model.compute_dtype]
    layers, remat = model.num_layers // p, layout.recompute != "none"
    per_layer = 4 + (1.5 if sp else 1.0) * remat
    ends = 2 if p == 1 else 1
    moved = (per_layer * layers + ends) * all_reduce_bytes(bsh, t) + 3 * all_reduce_bytes(bs * 4, t)
    calls = (4 + remat) * layers + ends + 3
    if sp:
        moved += (2 * layers + 1) * all_reduce_bytes(model.embed_dim * 4, t)
        calls += (4 + 2 * remat) * layers + ends + 2 * layers + 1  # each pair counts 2, plus the norm scales
    return m * moved, m * calls


def jaxpar_stage_traffic(model: ConfigDict, layout: Layout, stage: int,
                         grad_reduce_bytes: int = 4) -> dict[str, tuple[float, int]]:
    """Tensor- and pipeline-axis (bytes, collectives) per step of one pipeline stage of the jaxpar
    executor (jaxpar/pipeline/executor.py); without a pipeline, :func:`_jaxpar_tensor`.

    Pipeline: stage d sends one activation per microbatch for each of its v chunks but the last
    virtual stage's, and one gradient for each but the first's: (m(v - [d = p-1]) + m(v - [d = 0]))
    sends of b*s*h (/t with SP: each tensor rank sends its sequence shard). Middle stages send 2mv,
    the two ends m(2v-1) (Narayanan et al. 2021 count 2mv per boundary).

    Tensor, per microbatch and chunk of c = L/(p*v) layers, with A = one all-reduce of b*s*h (with
    SP a gather/scatter pair of the same bytes):

    * 1F1B / interleaved: the forward tick runs the chunk (2cA, plus the embedding A on the first
      virtual stage); the last virtual stage's forward tick is idle (its backward does all). The
      backward tick recomputes the stage forward: with full remat a forward scan keeping each layer's
      input (2cA) then, per layer, a recomputed layer under vjp (1A: the MLP output's all-reduce is
      dead there) and its backward (2A): 5cA; SP 5.5cA (recompute needs both gathers and the
      attention scatter) plus 2 fp32 norm-scale gradients of h per layer and sequence. Without full
      remat the backward is the vjp of the stage: (4 + [recompute])cA. The first virtual stage's
      backward recomputes the embedding (A; with SP the embedding is a reduce-scatter, A/2, and its
      backward a gather, A/2: 1.5A in all); the last's adds the output layer's input gradient (A)
      and the cross-entropy's 3 fp32 all-reduces of b*s.
    * GPipe: each stage's forward once and JAX's transpose of it: per layer (4 + [recompute])A as
      :func:`_jaxpar_tensor`, the embedding A on stage 0, output-layer gradient and cross-entropy on
      stage p-1.

    One layer per chunk (c = 1) without full remat, 1F1B / interleaved (whose backward tick runs
    the vjp of a fresh stage forward): XLA unrolls the one-step layer scan and merges
    the recomputed forward with the vjp's own (the checkpoint uses ``prevent_cse=False``): no
    recompute all-reduce is left (with SP one of the three recomputed collective pairs' worth, A,
    stays), measured with jax 0.10.

    Checked against the compiled step per stage (tests/test_plan_aot.py: ratio 1.0000 on 1F1B,
    interleaved and GPipe, with and without SP and ZeRO-3).
    """
    t, p, v, m, sp = layout.tensor, layout.pipeline, layout.virtual_stages, layout.microbatches, layout.sequence_parallel
    if p == 1:
        return {"tensor": _jaxpar_tensor(model, layout), "pipeline": (0.0, 0)}
    data = None  # ZeRO 0/1: the same on every stage (see communication)
    if layout.zero_stage == 2:
        data = _jaxpar_pipeline_zero2(model, layout, stage, grad_reduce_bytes)
    elif layout.zero_stage == 3:
        data = _jaxpar_pipeline_zero3(model, layout, stage)
    v = v if layout.schedule == "interleaved" else 1
    bs = layout.microbatch_size * layout.seq_len
    bsh = bs * model.embed_dim * DTYPE_BYTES[model.compute_dtype]
    send = m * ((v - (stage == p - 1)) + (v - (stage == 0)))
    # + once per step, the fp32 gradients of what every stage holds (final norm, positions, a tied
    # table), summed over pipeline, and the loss
    held = [x for x in param_tensors(model) if x.name.startswith("final_norm") or x.name == "positions"
            or (model.tie_embeddings and x.name == "embedding")]
    summed = 4 + 4 * sum(shard_elements(x, t, layout.data, layout.zero_stage >= 2) for x in held)
    pipeline = (send * bsh / (t if sp else 1) + all_reduce_bytes(summed, p), send + 1)
    if t == 1:
        return {"tensor": (0.0, 0), "pipeline": pipeline, **({"data": data} if data else {})}
    a, c = all_reduce_bytes(bsh, t), model.num_layers // (p * v)
    remat = layout.recompute != "none"
    full = layout.recompute == "full" and layout.schedule != "gpipe"
    per_seq = layout.microbatch_size if full else 1  # the full-remat backward runs sequence by sequence
    recompute = (1.5 if sp else 1.0) * remat
    if c == 1 and not full and layout.schedule != "gpipe":  # XLA merges the recomputed forward (see above)
        recompute = 1.0 if sp and remat else 0.0
    moved, calls = 0.0, 0
    for chunk in range(v):
        first, last = stage == 0 and chunk == 0, stage == p - 1 and chunk == v - 1
        if layout.schedule == "gpipe":
            units = (4 + recompute) * c
        else:
            forward = 0 if last else 2 * c
            backward = (5.5 if sp else 5) * c if full else (4 + recompute) * c
            units = forward + backward
        explicit_embed = 1.5 if sp else 2  # forward, and again in the backward (SP: a scatter, then a pair)
        units += (explicit_embed if layout.schedule != "gpipe" else 1) * first + (1 if last else 0)
        moved += units * a + (3 * all_reduce_bytes(bs * 4, t) if last else 0.0)
        calls += round(units) + (3 if last else 0)
        if sp:  # norm-scale gradients: 2 per layer (+ the final norm on the last stage), per sequence
            moved += per_seq * (2 * c + last) * all_reduce_bytes(model.embed_dim * 4, t)
            calls += per_seq * (2 * c + last)
    return {"tensor": (m * moved, m * calls), "pipeline": pipeline, **({"data": data} if data else {})}


def _zero_gathered(model: ConfigDict, layout: Layout, tensors: list[ParamTensor], nbytes: int) -> float:
    """Ring bytes of one all-gather (or reduce-scatter) over ``data`` of the ZeRO-shardable tensors."""
    n, t = layout.data, layout.tensor
    return sum(all_gather_bytes(shard_elements(x, t, 1, False) * nbytes, n) for x in tensors
               if any(size % n == 0 for name, size in x.dims if name not in TENSOR_DIMS))


def _stage_groups(model: ConfigDict) -> tuple[list[ParamTensor], list[ParamTensor], list[ParamTensor]]:
    """(layer, first-stage, last-stage) tensors as the jaxpar pipeline uses them: the first stage
    embeds (embedding, positions), the last projects (output table or the tied embedding, final norm)."""
    tensors = param_tensors(model)
    table = [x for x in tensors if x.name == ("embedding" if model.tie_embeddings else "output")]
    return ([x for x in tensors if x.place == "layer"], [x for x in tensors if x.place == "first"],
            table + [x for x in tensors if x.name.startswith("final_norm")])


def _jaxpar_pipeline_zero2(model: ConfigDict, layout: Layout, stage: int,
                           grad_reduce_bytes: int = 4) -> tuple[float, int]:
    """Data-axis (bytes, collectives) of one pipeline stage with ZeRO-2 (1F1B / interleaved): every
    backward tick reduce-scatters its chunk's layer gradients, and the first / last virtual stage's
    also the gradients of every non-layer parameter the stage holds (embedding or output table,
    final norm, positions: :func:`stage_tensors`), into the sharded accumulator, m per step each;
    after the update one all-gather of every parameter the stage holds (param dtype). Parameters
    no ZeRO dim divides are all-reduced instead (not counted)."""
    p, m = layout.pipeline, layout.microbatches
    held = stage_tensors(model, layout, "first", shared_on_every_stage=True)
    g, pb = grad_reduce_bytes, DTYPE_BYTES[model.param_dtype]
    layers = sum(count * _zero_gathered(model, layout, [x], g) for x, count in held if x.place == "layer")
    shared = sum(_zero_gathered(model, layout, [x], g) for x, _ in held if x.place != "layer")
    scattered = layers + (stage in (0, p - 1)) * shared
    gathered = sum(count * _zero_gathered(model, layout, [x], pb) for x, count in held)
    return m * scattered + gathered, m + 1


def _jaxpar_pipeline_zero3(model: ConfigDict, layout: Layout, stage: int) -> tuple[float, int]:
    """Data-axis (bytes, collectives) of one pipeline stage with ZeRO-3 (jaxpar/pipeline/executor.py).

    With G(x) the all-gather of x elements in the compute dtype ((n-1)/n * x * a; a reduce-scatter
    of the gradient, the gather's transpose, moves as much), per microbatch and chunk of c layers:
    1F1B / interleaved: the forward tick gathers each layer once (cG; the last virtual stage's is
    idle), the backward tick gathers it for the recomputed forward, again for the layer's vjp, and
    reduce-scatters its gradient (3cG; with full remat the backward then runs the whole microbatch
    at once, not sequence by sequence, so the gathers are not repeated per sequence). GPipe: 3cG
    (forward; backward gather and scatter). The first stage gathers the embedding (and positions)
    in each tick that embeds (G forward, 2G backward), the last the output table and final norm
    (2G). Parameters no ZeRO dim divides are all-reduced once per step instead (not counted).
    """
    p, m = layout.pipeline, layout.microbatches
    v = layout.virtual_stages if layout.schedule == "interleaved" else 1
    a = DTYPE_BYTES[model.compute_dtype]
    c = model.num_layers // (p * v)
    layer, first, last = (_zero_gathered(model, layout, group, a) for group in _stage_groups(model))
    # one layer per chunk without full remat: the backward's regather merges with the vjp forward's
    explicit = layout.schedule != "gpipe"
    backward = 2 if c == 1 and explicit and layout.recompute != "full" else 3
    moved = 0.0
    for chunk in range(v):
        is_first, is_last = stage == 0 and chunk == 0, stage == p - 1 and chunk == v - 1
        forward = 0 if layout.schedule == "gpipe" or is_last else c * layer + is_first * first
        moved += forward + backward * c * layer + 2 * is_first * first + 2 * is_last * last
    return m * moved, m * backward * c * v


# --------------------------------------------------------------------------- FLOPs and time


def flops_params(model: ConfigDict) -> int:
    """Parameters doing matmul work: all but the input-embedding lookup and the position table
    (the output projection counts even when tied: the tied table does a V x h matmul)."""
    lookup = 0 if model.tie_embeddings else model.vocab_size * model.embed_dim
    positions = model.max_seq_len * model.embed_dim if model.position == "learned" else 0
    return count_params(model) - lookup - positions


def flops_per_token(model: ConfigDict, seq_len: int, causal: bool = False) -> float:
    """Training FLOPs per token: 6N + 12*L*(heads*hd)*s (PaLM, Chowdhery et al. 2022, appendix B).

    6N is Kaplan et al. 2020 (forward 2N, backward 4N). The attention term counts QK^T and AV
    without the causal mask, as PaLM reports MFU: that is our default (and jaxpar/metrics.py's);
    ``causal=True`` halves it as MaxText does.
    """
    attention = 12 * model.num_layers * model.num_heads * model.head_dim * seq_len
    return 6 * flops_params(model) + attention * (0.5 if causal else 1.0)


def hardware_flops_per_token(
    model: ConfigDict, seq_len: int, recompute: str, causal: bool = False, model_flops: float | None = None
) -> float:
    """FLOPs actually executed (HFU numerator): full recompute reruns the forward (+2N + 4Lqs, the
    8TP of Narayanan 2021), selective reruns the attention core (+4Lqs). ``model_flops`` skips a recount."""
    attention_fwd = 4 * model.num_layers * model.num_heads * model.head_dim * seq_len * (0.5 if causal else 1.0)
    extra = {"none": 0.0, "selective": attention_fwd, "full": 2 * flops_params(model) + attention_fwd}[recompute]
    return (model_flops if model_flops is not None else flops_per_token(model, seq_len, causal)) + extra


def megatron_flops_per_iteration(model: ConfigDict, global_batch: int, seq_len: int, recompute: bool = False) -> float:
    """Megatron's count for a GPT layer (f = 4h, heads*hd = h), B in sequences, no causal discount.

    Model FLOPs 72*B*s*L*h^2*(1 + s/(6h) + V/(12*h*L)) (Megatron-LM's num_floating_point_operations);
    with the recomputed forward 96*B*s*L*h^2*(1 + s/(6h) + V/(16*h*L)) (Narayanan et al. 2021,
    arXiv:2104.04473, sec. 5.1; the logit layer is not recomputed).
    """
    h, n_layers, v = model.embed_dim, model.num_layers, model.vocab_size
    k, vocab_div = (96, 16) if recompute else (72, 12)
    return k * global_batch * seq_len * n_layers * h * h * (1 + seq_len / (6 * h) + v / (vocab_div * h * n_layers))


def bubble_fraction(pipeline: int, microbatches: int, virtual_stages: int = 1, schedule: str = "1f1b") -> float:
    """Idle share of a step: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) interleaved
    (Narayanan et al. 2021; Huang et al. 2019). 1F1B changes memory, not the bubble."""
    v = virtual_stages if schedule == "interleaved" else 1
    return (pipeline - 1) / (v * microbatches + pipeline - 1)


def mfu(model_flops_per_step: float, step_time_s: float, devices: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over peak (PaLM appendix B)."""
    return model_flops_per_step / (step_time_s * devices * peak_flops)


def training_days(num_params: float, tokens: float, devices: int, peak_tflops: float, mfu_: float) -> float:
    """6*P*tokens / (devices * peak * MFU), in days (Kaplan et al. 2020 FLOPs).

    7B on 2T tokens, 1024 A100 (312 TFLOP/s), MFU 0.45 -> 6.8 days. The seed's snippet multiplies
    the 6N FLOPs by an extra 2 ("6*7e9*2e12*2") and would print ~13.5 days: that factor is a bug.
    """
    return 6 * num_params * tokens / (devices * peak_tflops * 1e12 * mfu_) / 86400


def narayanan_training_days(num_params: float, tokens: float, devices: int, achieved_tflops: float) -> float:
    """8*T*P/(n*X) in days (Narayanan et al. 2021, sec. 5.1): 8 = 6 + 2 for the recomputed forward.

    GPT-3 175B, 300B tokens, 1024 A100 at X = 140 TFLOP/s -> ~34 days.
    """
    return 8 * tokens * num_params / (devices * achieved_tflops * 1e12) / 86400


@dataclasses.dataclass(frozen=True)
class StepTime:
    """The step-time model's parts (seconds), the model FLOPs per step and the resulting MFU."""

    compute_s: float
    tensor_s: float
    pipeline_s: float
    data_s: float
    data_exposed_s: float
    bubble_fraction: float
    bubble_s: float
    step_s: float
    model_flops_per_step: float
    mfu: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def step_time(
    model: ConfigDict,
    layout: Layout,
    cluster: Cluster,
    efficiency: float = 0.55,
    dp_exposed_fraction: float = 0.1,
    grad_reduce_bytes: int = 4,
    link_efficiency: float = 0.75,
    causal: bool = False,
    comm: dict[str, AxisComm] | None = None,
) -> StepTime:
    """step = (compute + TP + PP p2p) / (1 - bubble) + exposed data-axis time.

    compute: executed FLOPs of the slowest stage (the last also runs the output layer) at
    ``efficiency`` x peak (the seed: "plan with an MFU ceiling of 55%"). TP and PP traffic are
    exposed. The data-axis reduction overlaps with backward compute except ``dp_exposed_fraction``:
    DP/ZeRO-1 reduce once, after the last microbatch, so only that microbatch's backward can hide
    them; ZeRO-2 overlaps with every backward, ZeRO-3 (prefetched all-gathers) with the forward too.
    """
    comm = comm if comm is not None else communication(model, layout, cluster, grad_reduce_bytes, link_efficiency)
    p, m, tokens = layout.pipeline, layout.microbatches, layout.tokens_per_step
    model_fpt = flops_per_token(model, layout.seq_len, causal)
    hw = hardware_flops_per_token(model, layout.seq_len, layout.recompute, causal, model_fpt)
    out_layer = 6 * model.vocab_size * model.embed_dim if p > 1 else 0.0  # runs on the last stage only
    compute = (
        ((hw - out_layer) / p + out_layer) * tokens / (layout.data * layout.tensor) / (cluster.peak_flops * efficiency)
    )
    bwd = compute * (1 - model_fpt / 3 / hw)  # all but the forward (2N + 4Lqs)
    window = {0: bwd / m, 1: bwd / m, 2: bwd, 3: compute}[layout.zero_stage]
    data = comm["data"].time_s
    data_exposed = max(dp_exposed_fraction * data, data - window)
    bubble = bubble_fraction(p, m, layout.virtual_stages, layout.schedule)
    tp, pp = comm["tensor"].time_s, comm["pipeline"].time_s
    busy = compute + tp + pp
    step = busy / (1 - bubble) + data_exposed
    model_flops = model_fpt * tokens
    achieved = mfu(model_flops, step, layout.devices, cluster.peak_flops)
    return StepTime(
        compute, tp, pp, data, data_exposed, bubble, busy * bubble / (1 - bubble), step, model_flops, achieved
    )
