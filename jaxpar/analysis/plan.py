"""ParallelLayout search: every (data, tensor, pipeline, context, expert) split and schedule choice, ranked by estimated step time.

``jaxpar plan`` answers "how should I lay out this model on that cluster?" from the closed-form
estimates of :mod:`jaxpar.analysis.estimate` alone, in seconds for any cluster size. It enumerates
tensor sizes (:func:`_tensor_sizes`), pipeline sizes up to the layers, context sizes
(:func:`_context_sizes`), expert sizes for MoE models (:func:`_expert_sizes`), data = devices /
(tensor * pipeline * context * expert), ZeRO 0-3, microbatch sizes (ascending until memory runs
out), recompute none/selective/full, sequence parallelism on or off, 1F1B, interleaved, ZB-H1 or
ZB-V (Qi et al. 2024) where the step runs them; a pipeline size that does not divide the layers
takes the balanced split ``jaxpar train`` takes. Layouts over device memory x (1 - headroom) are
dropped, the rest ranked.

``jaxpar plan --aot`` then compiles the real train step of the top ``--aot-top`` layouts ahead of
time on simulated CPU devices (nothing allocated or run; JAX imported only then) and compares the
compiled argument memory and collective bytes per axis with the estimates
(:mod:`jaxpar.analysis.aot`). Flags and tables: :mod:`jaxpar.cli.plan`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

from jaxpar.analysis.clusters import GIB, Cluster
from jaxpar.analysis.estimate import (
    RECOMPUTE,
    AxisComm,
    MemoryEstimate,
    ParallelLayout,
    StepTime,
    communication,
    count_params,
    flops_params,
    memory_estimate,
    step_time,
)
from jaxpar.axes import MeshAxis
from jaxpar.config import MAX_DEVICES, ConfigDict, ConfigError
from jaxpar.layout import SCHEDULES, SPLIT_BACKWARD, V_SHAPED, balanced_split

MICROBATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
MAX_VIRTUAL_STAGES = 8


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """Assumptions of the estimate, shown with every plan."""

    headroom: float = 0.1  # share of device memory kept free (allocator fragmentation, XLA temporaries)
    convention: str = "jaxpar"  # what our step holds and sends, or the ZeRO paper / Megatron formulas
    grad_reduce_bytes: int = 4  # 4 fp32, 2 bf16
    efficiency: float = 0.55  # achieved share of peak FLOP/s in matmuls
    link_efficiency: float = 0.75  # achieved share of nominal link bandwidth
    dp_exposed_fraction: float = 0.1  # share of the data-axis reduction never hidden behind compute
    # the ``optim`` sub-config whose state is priced (jaxpar.optim.registry's formula); None: AdamW's
    # two fp32 moments
    optim: Any = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        """Shares outside their range give negative or infinite step times: refused here, whoever builds it."""
        for name in ("efficiency", "link_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"plan: {name}={getattr(self, name)}: use a share of peak in (0, 1]")
        if not 0 <= self.headroom < 1:
            raise ConfigError(f"plan: headroom={self.headroom}: use a value in [0, 1)")
        if not 0 <= self.dp_exposed_fraction <= 1:
            raise ConfigError(f"plan: dp_exposed_fraction={self.dp_exposed_fraction}: use a value in [0, 1]")


@dataclasses.dataclass(frozen=True)
class LayoutEstimate:
    """One evaluated layout: memory, communication and time, and whether it fits the budget."""

    layout: ParallelLayout
    memory: MemoryEstimate
    communication: dict[str, AxisComm]
    time: StepTime
    budget_bytes: float
    why: str = ""
    context_s: float = 0.0  # the attention exchange over `context` (exposed, in step_time_s)

    @property
    def fits(self) -> bool:
        return self.memory.total_bytes <= self.budget_bytes

    @property
    def step_time_s(self) -> float:
        return self.time.step_s

    @property
    def mfu(self) -> float:
        return self.time.mfu

    @property
    def bubble_fraction(self) -> float:
        return self.time.bubble_fraction

    @property
    def tokens_per_s(self) -> float:
        return self.layout.tokens_per_step / self.time.step_s

    def to_dict(self) -> dict[str, Any]:
        return self.layout.to_dict() | {
            "memory": self.memory.to_dict(),
            "step_time_s": self.step_time_s,
            "mfu": self.mfu,
            "bubble_fraction": self.bubble_fraction,
            "tokens_per_s": self.tokens_per_s,
            "fits": self.fits,
            "time": self.time.to_dict() | {"context_s": self.context_s},
            "communication": {axis: c.to_dict() for axis, c in self.communication.items()},
            **({"why": self.why} if self.why else {}),
        }


def evaluate_layout(
    model: ConfigDict, cluster: Cluster, layout: ParallelLayout, options: PlanOptions = PlanOptions()
) -> LayoutEstimate:
    """Memory, communication and step time of one layout (checked against the model first)."""
    layout.validate(model)
    comm = communication(
        model, layout, cluster, options.grad_reduce_bytes, options.link_efficiency, convention=options.convention
    )
    c = layout.context
    # step_time divides the step's compute by data*tensor; each device also holds only s/c tokens of
    # every sequence, which is the same as c x the FLOP rate (compute and its backward window scale alike)
    time = step_time(
        model,
        layout,
        cluster,
        efficiency=options.efficiency * c,
        dp_exposed_fraction=options.dp_exposed_fraction,
        comm=comm,
        convention=options.convention,
    )
    context_s = comm[MeshAxis.CONTEXT].time_s
    if context_s:  # exposed like the tensor traffic: the ring's sends wait on the previous hop's attention
        exposed = context_s / (1 - time.bubble_fraction)
        step = time.step_s + exposed
        time = dataclasses.replace(
            time, step_s=step, bubble_s=time.bubble_s + exposed - context_s, mfu=time.mfu * time.step_s / step
        )
    return LayoutEstimate(
        layout=layout,
        memory=memory_estimate(model, layout, options.convention, options.optim),
        communication=comm,
        time=time,
        budget_bytes=cluster.memory_bytes * (1 - options.headroom),
        context_s=context_s,
    )


class _Snapshot(dict):
    """A plain-dict copy of the model sub-config with attribute access: ConfigDict lookups dominate otherwise."""

    __getattr__ = dict.__getitem__


def _tensor_sizes(model: ConfigDict, cluster: Cluster, num_devices: int) -> list[int]:
    """Powers of two inside one node dividing heads, kv-heads, mlp and vocab (else the layout is invalid)."""
    out, t = [], 1
    while t <= min(cluster.devices_per_node, num_devices):
        dims = (model.num_heads, model.num_kv_heads, model.mlp_dim, model.vocab_size)
        if num_devices % t == 0 and all(d % t == 0 for d in dims):
            out.append(t)
        t *= 2
    return out


def _context_sizes(seq_len: int, fixed: dict[str, Any]) -> list[int]:
    """Context sizes c: the pinned one, else 1 and the powers of two whose 2c sequence chunks each
    fill a blockwise-attention block (``seq_len / 2c >= attention_block``); shorter chunks leave the
    ring's per-hop kernels mostly padding, and such a sequence fits without splitting."""
    if "context" in fixed:
        return [fixed["context"]]
    block = fixed.get("attention_block", ParallelLayout.attention_block)
    out, c = [1], 2
    while seq_len % (2 * c) == 0 and seq_len // (2 * c) >= block:
        out.append(c)
        c *= 2
    return out


def _expert_sizes(model: ConfigDict, devices: int, fixed: dict[str, Any]) -> list[int]:
    """Expert sizes e: the pinned one, else 1 for a dense model, and for an MoE model every e that
    divides both the expert count and the ``devices`` left for data parallelism (``expert`` takes its
    devices from ``data``: :func:`jaxpar.axes.batch_axes`)."""
    if "expert" in fixed:
        return [fixed["expert"]]
    experts = model.get("num_experts", 0)
    return [e for e in _divisors(devices) if experts and experts % e == 0] if experts else [1]


def _meshes(
    model: ConfigDict, cluster: Cluster, num_devices: int, global_batch: int, fixed: dict[str, Any], seq_len: int = 0
):
    """(data, tensor, pipeline, context, expert) with pipeline at most the layers, context from
    :func:`_context_sizes`, expert from :func:`_expert_sizes` and data x expert dividing the global batch."""
    dense_first = model.get("first_dense_layers", 0)  # deepseek_v3: no pipeline yet (jaxpar.layout)
    for t in [fixed["tensor"]] if "tensor" in fixed else _tensor_sizes(model, cluster, num_devices):
        rest = num_devices // t if num_devices % t == 0 else 0
        pipelines = (
            [fixed["pipeline"]]
            if "pipeline" in fixed
            else [p for p in _divisors(rest) if p <= model.num_layers and (p == 1 or not dense_first)]
        )
        for p in pipelines:  # layers that do not divide p: the balanced split (jaxpar.layout.balanced_split)
            if not (rest and rest % p == 0 and p <= model.num_layers):
                continue
            for c in _context_sizes(seq_len, fixed):
                if (rest // p) % c:
                    continue
                for e in _expert_sizes(model, rest // (p * c), fixed):
                    if (rest // (p * c)) % e:
                        continue
                    data = rest // (p * c * e)
                    if fixed.get("data", data) == data and global_batch % (data * e) == 0:
                        yield data, t, p, c, e


def _uneven(num_layers: int, pipeline: int) -> dict[str, Any]:
    """The layout fields of the balanced split where the layers do not divide the stages."""
    if pipeline == 1 or num_layers % pipeline == 0:
        return {}
    return {"stage_layers": balanced_split(num_layers, pipeline), "stage_split": "balanced"}


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in ascending order, in O(sqrt(n)) steps (n <= MAX_DEVICES: at most ~1000)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0] if n > 0 else []
    return small + [n // d for d in reversed(small) if d * d != n]


def _schedules(model: ConfigDict, pipeline: int, fixed: dict[str, Any]) -> list[tuple[str, int]]:
    """(schedule, virtual stages): 1F1B, ZB-H1, and interleaved and ZB-V with each v dividing L/p
    (GPipe only when pinned). The search keeps those :meth:`ParallelLayout.validate` accepts, so the
    zero-bubble schedules appear only where ``jaxpar train`` runs them (ZB-V: v = 2)."""
    keep = fixed.get("pipeline_schedule")
    if pipeline == 1:  # no pipeline: the schedule is moot; keep a pinned gpipe/1f1b label
        return [] if keep in ("interleaved", *SPLIT_BACKWARD) else [(keep or "1f1b", 1)]
    per_rank = model.num_layers // pipeline if model.num_layers % pipeline == 0 else 1  # uneven: no interleaving
    chunks = [v for v in range(2, min(per_rank, MAX_VIRTUAL_STAGES) + 1) if per_rank % v == 0]
    if "virtual_stages" in fixed and fixed["virtual_stages"] > MAX_VIRTUAL_STAGES:
        chunks.append(fixed["virtual_stages"])
    out = [(s, 1) for s in SCHEDULES if s != "interleaved" and s not in V_SHAPED]
    out += [(s, v) for s in ("interleaved", *V_SHAPED) for v in chunks]
    return [(s, v) for s, v in out if (s == keep if keep else s != "gpipe") and fixed.get("virtual_stages", v) == v]


def _microbatch_sizes(per_shard: int, pipeline: int, fixed: dict[str, Any]) -> list[int]:
    """Microbatch sizes b, ascending: powers of two dividing the per-shard batch with m >= p, or the pinned one."""
    if "microbatches" in fixed:
        m = fixed["microbatches"]
        return [per_shard // m] if per_shard % m == 0 else []
    if "microbatch_size" in fixed:
        return [fixed["microbatch_size"]] if per_shard % fixed["microbatch_size"] == 0 else []
    return [b for b in MICROBATCH_SIZES if per_shard % b == 0 and per_shard // b >= pipeline]


class SearchResult(list):
    """The ranked :class:`LayoutEstimate` list of :func:`search_layouts`, with the counts taken before
    layouts over the budget were dropped: ``considered`` (every layout the step can run) and
    ``fitting`` (those within the budget)."""

    considered: int = 0
    fitting: int = 0


def search_layouts(
    model: ConfigDict,
    cluster: Cluster,
    num_devices: int,
    global_batch: int,
    seq_len: int,
    options: PlanOptions = PlanOptions(),
    fixed: dict[str, Any] | None = None,
    keep_unfit: bool = False,
) -> list[LayoutEstimate]:
    """Every layout of ``num_devices`` for this batch, fitting ones first, ranked by step time.

    ``fixed`` pins :class:`ParallelLayout` fields (e.g. ``{"tensor": 8, "zero_stage": 1}``). Layouts
    over the memory budget are dropped unless ``keep_unfit``; microbatch sizes ascend and stop at
    the first that does not fit (memory grows with b). Raises :class:`ConfigError` when nothing
    fits, naming the smallest requirement found.
    """
    if not 1 <= num_devices <= MAX_DEVICES:  # bounds the search; no cluster has more
        raise ConfigError(f"plan: {num_devices} devices: use between 1 and {MAX_DEVICES} (more than any cluster has)")
    model = _Snapshot(model.to_dict() if isinstance(model, ConfigDict) else model)  # fast field access
    fixed = dict(fixed or {})
    unknown = set(fixed) - {f.name for f in dataclasses.fields(ParallelLayout)}
    if unknown:
        raise ConfigError(f"plan: unknown layout field(s) {', '.join(sorted(unknown))}")
    probe = {
        "pipeline_schedule": "interleaved" if fixed.get("virtual_stages", 1) > 1 else "1f1b",
        "seq_len": seq_len,
        "microbatches": fixed.get("pipeline", 1),
    } | fixed  # unpinned choices: ones every mesh can take
    if probe["pipeline_schedule"] in SPLIT_BACKWARD:  # searched on pipelines only: probe the smallest even one
        chunks = 2 if probe["pipeline_schedule"] in V_SHAPED else 1  # a V holds two chunks per device
        p = fixed.get("pipeline") or next(
            (p for p in range(2, model.num_layers + 1) if model.num_layers % (p * chunks) == 0), 2
        )
        probe |= {"pipeline": p, "microbatches": p, "virtual_stages": chunks if p > 1 else 1} | fixed
    if probe.get("context", 1) > 1 and "attention" not in fixed:
        probe["attention"] = "blockwise"
    probe |= {} if probe.get("virtual_stages", 1) > 1 else _uneven(model.num_layers, probe.get("pipeline", 1))
    ParallelLayout(**probe).validate(model)  # a pinned field the model cannot take fails here, with its reason
    results = SearchResult()
    smallest: LayoutEstimate | None = None
    for data, t, p, c, e in _meshes(model, cluster, num_devices, global_batch, fixed, seq_len):
        attention = {"attention": "blockwise"} if c > 1 and "attention" not in fixed else {}  # what the ring runs
        attention |= {k: fixed[k] for k in ("attention", "attention_block", "context_exchange") if k in fixed}
        per_shard = global_batch // (data * e)
        sizes = _microbatch_sizes(per_shard, p, fixed)
        choices = itertools.product(
            [fixed["zero_stage"]] if "zero_stage" in fixed else (0, 1, 2, 3) if data * e > 1 else (0,),
            [fixed["recompute"]] if "recompute" in fixed else RECOMPUTE,
            [fixed["sequence_parallel"]] if "sequence_parallel" in fixed else (False, True) if t > 1 else (False,),
            _schedules(model, p, fixed),
        )
        for zero, recompute, sp, (schedule, v) in choices:
            over_budget = False
            for b in sizes:
                m = per_shard // b
                layout = ParallelLayout(
                    data=data,
                    tensor=t,
                    pipeline=p,
                    virtual_stages=v,
                    zero_stage=zero,
                    microbatches=m,
                    microbatch_size=b,
                    seq_len=seq_len,
                    recompute=recompute,
                    sequence_parallel=sp,
                    pipeline_schedule=schedule,
                    context=c,
                    expert=e,
                    **attention,
                    **_uneven(model.num_layers, p),
                )
                try:
                    layout.validate(model)  # only layouts the step runs are candidates
                except ConfigError:
                    continue
                results.considered += 1
                if over_budget:  # larger microbatches only need more memory: counted, not evaluated
                    continue
                est = evaluate_layout(model, cluster, layout, options)
                results.fitting += est.fits
                if smallest is None or est.memory.total_bytes < smallest.memory.total_bytes:
                    smallest = est
                if est.fits or keep_unfit:
                    results.append(est)
                else:
                    over_budget = True
    if smallest is None:
        raise ConfigError(
            f"plan: no layout of {num_devices} devices matches global batch {global_batch} and the pinned choices "
            f"{fixed or '{}'}; make the global batch a multiple of data*microbatches or relax the pins"
        )
    if not results:
        need = smallest.memory.total_bytes / GIB
        raise ConfigError(
            f"plan: model of {count_params(model) / 1e9:.1f}B params does not fit {num_devices} x {cluster.name} at any "
            f"layout (smallest needs {need:.1f} GiB of {smallest.budget_bytes / GIB:.1f} GiB per device at "
            f"{describe(smallest.layout)}); add devices, lower --seq or --global-batch, or lower --headroom"
        )
    results.sort(key=lambda e: (not e.fits, e.step_time_s, e.memory.total_bytes))  # in place: keeps the counts
    if results[0].fits:
        results[0] = dataclasses.replace(results[0], why=explain(results[0], cluster))
    return results


def describe(layout: ParallelLayout) -> str:
    """A short one-line name of a layout."""
    v = f",virtual={layout.virtual_stages}" if layout.virtual_stages > 1 else ""
    v += f",context={layout.context} ({layout.context_exchange})" if layout.context > 1 else ""
    v += f",expert={layout.expert}" if layout.expert > 1 else ""
    v += f",layers={'/'.join(map(str, layout.stage_layers))}" if layout.uneven else ""
    sp = " +SP" if layout.sequence_parallel else ""
    return (
        f"data={layout.data},tensor={layout.tensor},pipeline={layout.pipeline}{v} ZeRO-{layout.zero_stage} "
        f"m={layout.microbatches} b={layout.microbatch_size} recompute={layout.recompute}{sp} {layout.pipeline_schedule}"
    )


def explain(est: LayoutEstimate, cluster: Cluster) -> str:
    """Why the winner wins, in the usual terms (Narayanan et al. 2021, section 3.3): TP inside a node, PP
    across nodes, DP/ZeRO outermost."""
    layout, parts = est.layout, []
    node = f"one {cluster.devices_per_node}-device node ({cluster.intra_node_gbps:g} GB/s links)"
    if layout.tensor > 1:
        if est.memory.convention == "jaxpar":  # the recomputed forward repeats only the attention all-reduce
            per_layer = 4 if layout.recompute == "none" else 5
        else:
            per_layer = 6 if layout.recompute == "full" else 4
        parts.append(f"tensor={layout.tensor} keeps its {per_layer} collectives per layer per microbatch inside {node}")
    else:
        parts.append("no tensor parallelism is needed: the model states and activations fit without splitting layers")
    if layout.pipeline > 1:
        where = "across nodes" if est.communication[MeshAxis.PIPELINE].link == "inter" else "inside the node"
        v = f", {layout.virtual_stages} virtual stages" if layout.virtual_stages > 1 else ""
        parts.append(
            f"pipeline={layout.pipeline} runs {where}, sending only 2*b*s*h per microbatch per boundary "
            f"({est.bubble_fraction:.1%} bubble at m={layout.microbatches}{v}, {layout.pipeline_schedule})"
        )
    if layout.context > 1:
        where = "inside the node" if est.communication[MeshAxis.CONTEXT].link == "intra" else "across nodes"
        how = (
            "passes keys and values around a ring"
            if layout.context_exchange == "ring"
            else "all-gathers keys and values"
        )
        parts.append(
            f"context={layout.context} splits each sequence into {2 * layout.context} chunks and {how} {where} every layer "
            f"({est.context_s / est.step_time_s:.1%} of the step exposed)"
        )
    if layout.expert > 1:
        where = "inside the node" if est.communication[MeshAxis.EXPERT].link == "intra" else "across nodes"
        parts.append(
            f"expert={layout.expert} splits the experts and all-gathers each MoE layer's tokens (and reduce-scatters "
            f"its output) {where} ({est.time.expert_s / est.step_time_s:.1%} of the step exposed)"
        )
    if layout.data > 1:
        zero = f"ZeRO-{layout.zero_stage}" if layout.zero_stage else "plain DP"
        exposed = est.time.data_exposed_s / est.step_time_s
        hidden = "mostly hidden" if exposed < 0.1 else "only partly hidden"
        parts.append(
            f"data={layout.data} with {zero} is outermost, its gradient reduction {hidden} behind the backward "
            f"({exposed:.1%} of the step exposed)"
        )
    parts.append(
        f"it needs {est.memory.total_bytes / GIB:.1f} of {est.budget_bytes / GIB:.1f} GiB per device "
        f"(recompute={layout.recompute}) and reaches {est.mfu:.1%} MFU"
    )
    return "; ".join(parts) + "."


def flops_convention(model: ConfigDict) -> str:
    """How MFU counts FLOPs (:func:`jaxpar.models.flops.flops_per_token`), in one line."""
    text = "6 x parameters + 12 x L x heads x head_dim x s per token (PaLM appendix B, no causal discount)"
    if model.get("num_experts", 0):
        active = flops_params(model)
        count = f"{active / 1e9:.2f}B" if active >= 1e9 else f"{active / 1e6:.2f}M"
        text += (
            f"; MoE: active parameters only ({count}: the {model.experts_per_token} of "
            f"{model.num_experts} experts a token runs through, as Mixtral's 12.9B active)"
        )
    return text


def plan_summary(
    model: ConfigDict, cluster: Cluster, num_devices: int, estimates: list[LayoutEstimate], options: PlanOptions
) -> dict[str, Any]:
    """The JSON document of a plan: cluster, assumptions and the ranked layouts."""
    return {
        "model": {"name": model.name, "params": count_params(model), "flops_convention": flops_convention(model)},
        "cluster": cluster.to_dict(),
        "devices": num_devices,
        "nodes": num_devices // cluster.devices_per_node,
        "options": {
            **{f.name: getattr(options, f.name) for f in dataclasses.fields(options) if f.name != "optim"},
            "optimizer": options.optim.name if options.optim is not None else "adamw",
        },
        "memory_budget_bytes": cluster.memory_bytes * (1 - options.headroom),
        "layouts": [e.to_dict() for e in estimates],
    }
