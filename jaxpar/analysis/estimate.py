"""Closed-form estimates of memory, communication, FLOPs and step time for one layout.

Pure functions of (model sub-config, :class:`ParallelLayout`[, :class:`Cluster`]): nothing is
compiled or allocated, so any model plans for any cluster in microseconds. Each formula names its
source; tests/test_estimate.py checks the published numbers. Units: bytes, GB = 1e9, seconds. ``b``
is sequences per data shard per microbatch, ``m`` microbatches per step: global_batch = b * m *
data (x expert: the batch is split over data x expert). Activations count in the compute dtype. The parameter inventory is
:mod:`jaxpar.models.inventory`, communication per axis :mod:`jaxpar.analysis.traffic` (ring bytes
on the wire); both are re-exported, so ``estimate`` is the one name for every closed-form number.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpar.analysis.clusters import Cluster
from jaxpar.analysis.traffic import (  # noqa: F401 - re-exported
    CONVENTIONS,
    AxisComm,
    all_gather_bytes,
    all_reduce_bytes,
    axis_link,
    communication,
    jaxpar_stage_traffic,
)
from jaxpar.axes import MeshAxis
from jaxpar.config import ConfigDict, ConfigError
from jaxpar.models.flops import (  # noqa: F401 - re-exported
    flops_params,
    flops_per_token,
    hardware_flops_per_token,
    megatron_flops_per_iteration,
)
from jaxpar.models.inventory import (  # noqa: F401 - re-exported: the estimates' vocabulary
    DTYPE_BYTES,
    RECOMPUTE,
    TENSOR_DIMS,
    ParallelLayout,
    ParamTensor,
    count_params,
    param_tensors,
    shard_elements,
    stage_tensors,
)
from jaxpar.models.inventory import (
    held_elements as _held_elements,
)

LOGITS_BYTES = 8  # per logit on the last stage: bf16 logits + fp32 log-softmax kept + bf16 gradient


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
    """ZeRO paper (Rajbhandari et al. 2019, arXiv:1910.02054, sec. 3 and Fig. 1), K = 12: bf16 weights
    2P + bf16 gradients 2P + fp32 master/momentum/variance 12P = 16 bytes/param: DP 16P, ZeRO-1
    4P + 12P/N, ZeRO-2 2P + 14P/N, ZeRO-3 16P/N."""
    shard = [1.0 if zero_stage < k else float(data) for k in (3, 2, 1)]
    return ModelStates(2 * num_params / shard[0], 2 * num_params / shard[1], 12 * num_params / shard[2])


def model_states(
    model: ConfigDict,
    layout: ParallelLayout,
    pipeline_stage: str = "first",
    convention: str = "jaxpar",
    optim: ConfigDict | None = None,
) -> ModelStates:
    """Model-state bytes per device of one pipeline stage, under one of two stated conventions.

    ``paper``: the ZeRO paper's 16 bytes/param for the parameters a device holds after the tensor and
    pipeline split (norms replicated over tensor), divided by N = data as the paper does (MoE: the
    experts' weights split over ``expert`` and N = data for them, N = data x expert for the rest).
    ``jaxpar``: what the trainer holds (a pipeline stage also holds one V x h table, the final norm
    and positions: :func:`stage_tensors`): fp32 master parameters sharded over data (x context) at
    ZeRO-3 only (MoE: the experts' weights split over ``expert``, the rest sharded over data x
    expert (x context), as :func:`jaxpar.sharding.param_placement` places them); Adam mu + nu in the param dtype sharded at ZeRO >= 1 (``optim`` given: its state
    elements per parameter); fp32 gradients, live at the update, sharded at ZeRO >= 2. Sharding
    follows :func:`shard_elements`.
    """
    if convention not in CONVENTIONS:
        raise ConfigError(f"convention '{convention}': use one of {', '.join(CONVENTIONS)}")
    if convention == "paper":
        n = layout.data * layout.context
        if layout.expert == 1:
            return zero_paper_states(_held_elements(model, layout, pipeline_stage, False), layout.zero_stage, n)
        # MoE: the experts' weights (split over expert) shard over data (x context), the rest over data x expert
        parts = (
            zero_paper_states(_held_elements(model, layout, pipeline_stage, False, experts=True), layout.zero_stage, n),
            zero_paper_states(
                _held_elements(model, layout, pipeline_stage, False, experts=False),
                layout.zero_stage,
                n * layout.expert,
            ),
        )
        return ModelStates(*(a + b for a, b in zip(dataclasses.astuple(parts[0]), dataclasses.astuple(parts[1]))))
    full = _held_elements(model, layout, pipeline_stage, False, every_stage=True)
    zero = _held_elements(model, layout, pipeline_stage, True, every_stage=True)
    pb = DTYPE_BYTES[model.param_dtype]
    # optimizer state per parameter: jaxpar.optim.registry's formula (None: AdamW's mu + nu)
    if optim is None:
        per_param = 2.0
    else:  # the optimizer registry builds optax transforms: imported here, not with the planner
        from jaxpar.optim import registry

        per_param = registry.state_elements_ratio(optim, model)
    return ModelStates(
        pb * (zero if layout.shards_parameters else full),
        pb * (zero if layout.shards_gradients else full),
        per_param * pb * (zero if layout.shards_optimizer else full),
    )


# --------------------------------------------------------------------------- activations


def korthikanti_activation_bytes(
    s: int, b: int, h: int, a: int, tensor: int = 1, sequence_parallel: bool = False, recompute: str = "none"
) -> float:
    """Activation bytes per GPT layer per microbatch (Korthikanti et al. 2022, arXiv:2205.05198,
    Table 2): 2-byte activations, 1-byte dropout masks, GeLU MLP with f = 4h; attention
    11sbh + 5as^2b, MLP 19sbh, two layernorms 4sbh: sbh(34 + 5as/h)."""
    t, sbh = tensor, s * b * h
    if recompute == "full":  # keep only the layer input
        return 2 * sbh / (t if sequence_parallel else 1)
    if recompute == "selective":  # attention core (the 5as^2b term) recomputed
        return 34 * sbh / t if sequence_parallel else sbh * (10 + 24 / t)
    if sequence_parallel:
        return sbh * (34 + 5 * a * s / h) / t
    return sbh * (10 + 24 / t + 5 * a * s / (h * t))  # t = 1 gives sbh(34 + 5as/h)


def layer_activation_bytes(model: ConfigDict, layout: ParallelLayout) -> float:
    """Activation bytes our layer keeps for its backward, per microbatch, derived like Korthikanti.

    e bytes per activation, q = heads*hd, k = kv_heads*hd, f = mlp_dim; without dropout it saves:

    - attention: RMSNorm input e*sbh; QKV input e*sbh; Q e*sbq and K e*sbk (RoPE is linear); the
      softmax output e*a*s^2*b; V e*sbk; the output projection's input e*sbq:
      e*sb(2h + 2q + 2k) + e*a*s^2*b.
    - MLP: RMSNorm input e*sbh; gate/up input e*sbh; SwiGLU's gate and up outputs and the down
      projection's input, e*sbf each (silu(gate) is recomputed in XLA's fused backward):
      e*sb(2h + 3f). GeLU: the up and GeLU outputs: e*sb(2h + 2f).

    With e = 2, q = k = h, f = 4h (GeLU) this is 32sbh + 2as^2b: Korthikanti's 34sbh + 5as^2b less
    its dropout masks and output (2sbh + 3as^2b). The 4*e*sbh of norm and matmul inputs sit outside
    the tensor-parallel region (split only by SP); the rest is split by tensor. ``selective`` drops
    the s^2 term (jax's ``checkpoint_dots`` would keep QK^T's output instead); ``full`` keeps only
    the layer input e*sbh. With dropout Korthikanti's terms return: ``model.dropout`` the 1-byte
    masks of the attention- and MLP-output dropouts, 2sbh (split by SP only);
    ``model.attention_dropout`` the 1-byte probability mask and the dropped probabilities,
    (1 + e)*a*s^2*b/t (recomputed with ``selective``): a GPT shape with both is 34sbh + 5as^2b.
    """
    e, s, b, t = DTYPE_BYTES[model.compute_dtype], layout.seq_len, layout.microbatch_size, layout.tensor
    q, k = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    sp = t if layout.sequence_parallel else 1
    if layout.recompute == "full":
        return e * s * b * model.embed_dim / sp
    outside = 4 * e * s * b * model.embed_dim / sp
    inside = e * s * b * (2 * q + 2 * k + (3 if model.mlp_activation == "swiglu" else 2) * model.mlp_dim) / t
    scores = 0.0 if layout.recompute == "selective" else e * model.num_heads * s * s * b / t
    masks = s * b * model.embed_dim * 2 / sp if model.get("dropout", 0.0) > 0 else 0.0
    if model.get("attention_dropout", 0.0) > 0 and layout.recompute != "selective":
        masks += (1 + e) * model.num_heads * s * s * b / t
    return outside + inside + scores + masks


def inflight_microbatches(layout: ParallelLayout, pipeline_stage: str = "first") -> float:
    """Microbatches whose activations a stage holds at its peak (Narayanan 2021; Korthikanti 2022
    sec. 4.2): 1 at p = 1 (accumulation runs them one after another); GPipe m; 1F1B min(p, m) on the
    first stage, 1 on the last; interleaved p * (1 + (p-1)/(p*v)) on the first."""
    p, m, v = layout.pipeline, layout.microbatches, layout.virtual_stages
    if p == 1 or (pipeline_stage == "last" and layout.pipeline_schedule != "gpipe"):
        return 1.0
    if layout.pipeline_schedule == "gpipe":
        return float(m)
    return min(float(m), p * (1 + (p - 1) / (p * v)) if layout.pipeline_schedule == "interleaved" else float(p))


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes per device on the busiest pipeline stage. ``jaxpar``: ``activation_bytes`` is what
    the step keeps for the backward; ``gradient_bytes + activation_bytes + transient_bytes`` =
    ``temp_bytes`` estimates the compiled temporaries (:mod:`jaxpar.analysis.activations`), so
    ``total_bytes`` = parameters + optimizer state + temporaries, the compiled peak without the
    batch. ``paper``: Korthikanti's activations x in-flight microbatches (Narayanan 2021) and two
    gathered layers as transients."""

    convention: str
    pipeline_stage: str  # first | last (the heavier one; "first" when p = 1)
    params_bytes: float
    gradient_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    transient_bytes: float  # jaxpar: the temporaries beyond gradients and residuals; paper: 2 layers + recompute
    inflight_microbatches: float
    temp_bytes: float = 0.0  # jaxpar: estimated memory_analysis().temp_size_in_bytes of the busiest stage
    stage_temp_bytes: tuple[float, ...] = ()  # jaxpar: every pipeline stage's estimated temporaries

    @property
    def model_states_bytes(self) -> float:
        return self.params_bytes + self.gradient_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> float:
        return self.model_states_bytes + self.activation_bytes + self.transient_bytes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {
            "stage_temp_bytes": list(self.stage_temp_bytes),
            "model_states_bytes": self.model_states_bytes,
            "total_bytes": self.total_bytes,
        }


def memory_estimate(
    model: ConfigDict, layout: ParallelLayout, convention: str = "jaxpar", optim: ConfigDict | None = None
) -> MemoryEstimate:
    """Model states + activations + temporaries per device; the heavier pipeline stage wins.
    ``jaxpar``: our step's temporaries term by term (:func:`jaxpar.analysis.temporaries.temp_estimate`,
    held against the compiled ``temp_size_in_bytes`` by tests/test_memory_estimate.py); ``paper``:
    the published formulas (:func:`_paper_memory_estimate`)."""
    if convention == "paper":
        return _paper_memory_estimate(model, layout, optim)
    from jaxpar.analysis import temporaries

    temps = temporaries.stage_temps(model, layout)
    candidates = []
    for pipeline_stage, index in (
        (("first", 0), ("last", layout.pipeline - 1)) if layout.pipeline > 1 else (("first", 0),)
    ):
        states, temp = model_states(model, layout, pipeline_stage, convention, optim), temps[index]
        act = temp.residual_bytes
        transient = max(0.0, temp.total_bytes - act - states.gradient_bytes)
        candidates.append(
            MemoryEstimate(
                convention,
                pipeline_stage,
                *dataclasses.astuple(states),
                act,
                transient,
                inflight_microbatches(layout, pipeline_stage),
                temp.total_bytes,
                tuple(t.total_bytes for t in temps),
            )
        )
    return max(candidates, key=lambda c: c.total_bytes)


def _paper_memory_estimate(
    model: ConfigDict, layout: ParallelLayout, optim: ConfigDict | None = None
) -> MemoryEstimate:
    """The published picture: ZeRO-paper states + Korthikanti-style stored activations (+ logits on
    the last stage) x in-flight microbatches + the gathered/cast weights of 2 layers (+ one layer's
    activations under full recompute); the heavier stage wins."""
    per_layer = layer_activation_bytes(model, layout) * layout.stored_layers(model.num_layers)
    layer_params = sum(shard_elements(t, layout.tensor, 1, False) for t in param_tensors(model) if t.place == "layer")
    transient = 2 * layer_params * DTYPE_BYTES[model.compute_dtype]
    if layout.recompute == "full":
        transient += layer_activation_bytes(model, dataclasses.replace(layout, recompute="none"))
    logits = LOGITS_BYTES * layout.seq_len * layout.microbatch_size * model.vocab_size / layout.tensor
    candidates = []
    for pipeline_stage in ("first", "last") if layout.pipeline > 1 else ("first",):
        states, inflight = (
            model_states(model, layout, pipeline_stage, "paper", optim),
            inflight_microbatches(layout, pipeline_stage),
        )
        act = (per_layer + (logits if pipeline_stage == "last" or layout.pipeline == 1 else 0)) * inflight
        candidates.append(
            MemoryEstimate("paper", pipeline_stage, *dataclasses.astuple(states), act, transient, inflight)
        )
    return max(candidates, key=lambda c: c.total_bytes)


# --------------------------------------------------------------------------- FLOPs and time


def bubble_fraction(pipeline: int, microbatches: int, virtual_stages: int = 1, schedule: str = "1f1b") -> float:
    """Idle share of a step: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) interleaved
    (Narayanan et al. 2021; Huang et al. 2019), (p-1)/(3m+p-1) ZB-H1 with equal F, B and W times
    (Qi et al. 2024). 1F1B changes memory, not the bubble."""
    from jaxpar.parallel.pipeline.schedule import expected_bubble_fraction

    return expected_bubble_fraction(schedule, pipeline, microbatches, virtual_stages)


def safe_ratio(measured: float | None, estimated: float | None) -> float | None:
    """measured / estimated (a compiled number over its formula); None without a measurement or a
    non-zero estimate."""
    return measured / estimated if measured is not None and estimated else None


def mfu(model_flops_per_step: float, step_time_s: float, devices: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over peak (PaLM appendix B)."""
    return model_flops_per_step / (step_time_s * devices * peak_flops)


def training_days(num_params: float, tokens: float, devices: int, peak_tflops: float, mfu_: float) -> float:
    """6*P*tokens / (devices * peak * MFU), in days (Kaplan et al. 2020 FLOPs). 7B on 2T tokens,
    1024 A100 (312 TFLOP/s), MFU 0.45 -> 6.8 days (LLaMA-2 reports 184,320 A100-hours for 7B,
    Touvron et al. 2023: ~7.5 days on 1024 GPUs)."""
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
    expert_s: float = 0.0  # the MoE dispatch and combine over `expert` (exposed, in busy time)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def step_time(
    model: ConfigDict,
    layout: ParallelLayout,
    cluster: Cluster,
    efficiency: float = 0.55,
    dp_exposed_fraction: float = 0.1,
    grad_reduce_bytes: int = 4,
    link_efficiency: float = 0.75,
    causal: bool = False,
    comm: dict[str, AxisComm] | None = None,
    convention: str = "jaxpar",
) -> StepTime:
    """step = (compute + TP + PP p2p + EP) / (1 - bubble) + exposed data-axis time.

    compute: executed FLOPs of the slowest stage (the one with the most layers, which sets every
    tick; the last also runs the output layer, ZB-V's first: it holds the last chunk) at
    ``efficiency`` x peak (default 55%, a typical achieved MFU for large dense training: PaLM 46%,
    Megatron 52%), the tokens split over data x expert x tensor (an MoE layer's experts see, on
    average, k routed copies of the rank's own tokens: the active-parameter FLOPs, balanced). TP, PP
    and the MoE dispatch and combine over ``expert`` (EP) are exposed. The data-axis reduction overlaps with backward
    compute except ``dp_exposed_fraction``: DP/ZeRO-1 reduce once, after the last microbatch, whose
    backward alone can hide it; ZeRO-2 overlaps every backward, ZeRO-3 (prefetched gathers) the
    forward too. Executed FLOPs follow ``recompute`` on every schedule: a pipeline's backward ticks
    read the forward's stashed residuals unless ``parallel.recompute=full``
    (:func:`jaxpar.parallel.pipeline.schedule.keeps_activations`), so at ``none`` the forward runs
    once, and ZB-H1 / ZB-V's B and W ticks together cost the backward's FLOPs; their gain is the
    bubble (:func:`bubble_fraction`).
    """
    comm = comm if comm is not None else communication(model, layout, cluster, grad_reduce_bytes, link_efficiency)
    p, m, tokens = layout.pipeline, layout.microbatches, layout.tokens_per_step
    model_fpt = flops_per_token(model, layout.seq_len, causal)
    hw = hardware_flops_per_token(model, layout.seq_len, layout.recompute, causal, model_fpt)
    out_layer = 6 * model.vocab_size * model.embed_dim if p > 1 else 0.0  # runs on the last stage only
    shards = layout.data * layout.tensor * layout.expert
    share = layout.stored_layers(model.num_layers) / model.num_layers if p > 1 else 1.0  # uneven: the heaviest
    compute = ((hw - out_layer) * share + out_layer) * tokens / shards / (cluster.peak_flops * efficiency)
    bwd = compute * (1 - model_fpt / 3 / hw)  # all but the forward (2N + 4Lqs)
    # the compute a data-axis collective can hide behind: ZeRO-3's gathers the whole step, ZeRO-2's
    # per-microbatch reduce-scatters every backward, a once-per-step all-reduce the last backward
    window = compute if layout.shards_parameters else bwd if layout.shards_gradients else bwd / m
    data = comm[MeshAxis.DATA].time_s
    data_exposed = max(dp_exposed_fraction * data, data - window)
    bubble = bubble_fraction(p, m, layout.virtual_stages, layout.pipeline_schedule)
    tp, pp = comm[MeshAxis.TENSOR].time_s, comm[MeshAxis.PIPELINE].time_s
    ep = comm[MeshAxis.EXPERT].time_s if MeshAxis.EXPERT in comm else 0.0
    busy = compute + tp + pp
    if ep:
        busy += ep
    step = busy / (1 - bubble) + data_exposed
    model_flops = model_fpt * tokens
    achieved = mfu(model_flops, step, layout.devices, cluster.peak_flops)
    return StepTime(
        compute, tp, pp, data, data_exposed, bubble, busy * bubble / (1 - bubble), step, model_flops, achieved, ep
    )


def estimated_argument_bytes(
    model: ConfigDict, layout: ParallelLayout, convention: str = "jaxpar", optim: ConfigDict | None = None
) -> float:
    """What the compiled step takes as arguments per device, estimated: parameters + optimizer state
    of :func:`memory_estimate` (``optim``'s state; None: AdamW's; the gradients are not arguments) +
    the step count (int32) + this data shard's batch (m x b x (s + 1) int32 tokens)."""
    mem = memory_estimate(model, layout, convention, optim)
    batch = layout.microbatches * layout.microbatch_size * (layout.seq_len + 1) * 4
    return mem.params_bytes + mem.optimizer_bytes + 4 + batch


def peak_terms(
    model: ConfigDict, layout: ParallelLayout, optim: ConfigDict | None = None, top: int = 3
) -> list[tuple[str, float]]:
    """The ``top`` largest terms of the estimated peak (arguments + temporaries, ``jaxpar``
    convention) of the busiest pipeline stage, largest first, as (name, bytes per device):
    parameters, optimizer state and batch beside the temporaries' terms of the phase that sets their
    peak (:meth:`jaxpar.analysis.temporaries.TempEstimate.terms`). What tells a user why a layout
    does not fit."""
    from jaxpar.analysis import temporaries

    mem = memory_estimate(model, layout, "jaxpar", optim)
    temps = temporaries.stage_temps(model, layout)
    temp = temps[0 if mem.pipeline_stage == "first" else layout.pipeline - 1]
    batch = layout.microbatches * layout.microbatch_size * (layout.seq_len + 1) * 4
    terms = {"parameters": mem.params_bytes, "optimizer state": mem.optimizer_bytes, "batch": batch + 4}
    terms |= temp.terms()
    return sorted(terms.items(), key=lambda kv: -kv[1])[:top]


def format_peak_terms(terms: list[tuple[str, float]], total: float) -> str:
    """``name 1.23 GiB (45%), ...``: :func:`peak_terms` as one line, shares of ``total`` (the estimated peak)."""
    return ", ".join(f"{name} {value / 2**30:.3f} GiB ({value / total:.0%})" for name, value in terms)
