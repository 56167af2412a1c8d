"""What the compiler actually did: collectives and per-device memory of a compiled train step.

:func:`analyze_compiled` reads the optimized HLO (``compiled.as_text()``) and
``compiled.memory_analysis()`` of an AOT-compiled step. Every collective (all-reduce,
all-gather, reduce-scatter, collective-permute, all-to-all; an async ``-start``/``-done`` pair
counts once) is attributed to mesh axes through its replica groups, multiplied by the trip counts
of the while loops around it, and priced as ring traffic per device (nccl-tests PERFORMANCE.md,
NCCL's nccl-tests PERFORMANCE.md): all-reduce 2(n-1)/n*S, all-gather and reduce-scatter (n-1)/n*S with S the
full array (the all-gather output, the reduce-scatter input), all-to-all (n-1)/n*S,
collective-permute S. :func:`analyze_layout` compiles a config's step from abstract arrays and
puts the formula values of :func:`estimated_collectives` and :func:`estimated_memory` beside
each measurement.

Device ids in replica groups are SPMD partition ids (``use_global_device_ids`` with one
replica), i.e. positions in ``mesh.devices.flat``; that is how ``jit`` assigns devices to a mesh.
A group whose members differ only along ``data`` is attributed to ``("data",)``; groups of one
device move no bytes and are kept out of the rows (counted in ``trivial_ops``). Calls, fusions
and async wrappers run once per execution of their caller; a conditional runs one branch per
execution, counted as its branch with the most collective bytes (an upper bound when the branches
differ, see :func:`executions`); a while loop without a known trip count is counted once, with a
warning. Pipeline layouts are exact instead: their switches pick a branch per tick and stage from
the schedule table, and each collective is counted per stage from the named scopes of its branch
(:func:`pipeline_fraction`); the rows are the busiest stage's.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from typing import Any

import numpy as np

from jaxpar.analysis.collective_order import unordered_in
from jaxpar.analysis.estimate import safe_ratio
from jaxpar.analysis.expected import estimated_collectives, estimated_memory
from jaxpar.analysis.hlo import (  # noqa: F401 - parse_hlo, parse_replica_groups, shape_bytes: re-exported
    OP_NAME,
    Instr,
    executions,
    parse_hlo,
    parse_replica_groups,
    replica_groups,
    shape_bytes,
    source_target_pairs,
)
from jaxpar.analysis.traffic import ring_bytes
from jaxpar.axes import MeshAxis, gradient_axes
from jaxpar.config import ConfigDict, ConfigError, validate
from jaxpar.layout import ParallelLayout

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
MB, MIB = 1e6, 2**20
# LLVM optimisation off: ~40% less CPU compile time, the same buffers and collectives.
AOT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}
# --------------------------------------------------------------------------- report types


@dataclasses.dataclass
class CollectiveOp:
    """One collective instruction of the optimized HLO (per-op list, for debugging)."""

    name: str
    kind: str
    axes: tuple[str, ...]  # mesh axes its groups span; () for single-device groups
    group_size: int  # n, devices per group (pairs for collective-permute)
    size_bytes: float  # S: the full array (all-gather output, reduce-scatter input)
    executions: int  # times it runs per step: enclosing loop trip counts (0: a conditional branch not counted)
    bytes_per_device: float  # ring bytes * executions
    shape: str
    computation: str
    op_name: str  # jax source location (metadata), e.g. ".../transpose(jvp())/psum_invariant"
    sources: tuple[int, ...] = ()  # collective-permute: the devices that send


@dataclasses.dataclass
class CollectiveRow:
    """Collectives of one (kind, axes), measured and estimated (formula) per device per step."""

    kind: str
    axes: tuple[str, ...]
    count: int  # executions per step of the compiled ops (combined ops count once)
    bytes_per_device: float
    estimated_bytes: float | None = None
    estimated_count: int | None = None  # logical collectives in the formula (before XLA combines)

    @property
    def ratio(self) -> float | None:
        return safe_ratio(self.bytes_per_device, self.estimated_bytes)


@dataclasses.dataclass
class MemoryReport:
    """``compiled.memory_analysis()`` per device, bytes; estimated values from the formulas.

    ``estimated_temp_bytes``: :func:`jaxpar.analysis.temporaries.estimated_temp_bytes` (the busiest
    pipeline stage: every device runs the same program, whose temp buffer fits all stages);
    ``estimated_stage_temp_bytes``: each stage's. The peak is arguments + temporaries.
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    generated_code_bytes: int
    estimated_argument_bytes: float | None = None
    estimated_output_bytes: float | None = None
    estimated_temp_bytes: float | None = None
    estimated_stage_temp_bytes: list[float] = dataclasses.field(default_factory=list)

    @property
    def argument_ratio(self) -> float | None:
        return safe_ratio(self.argument_bytes, self.estimated_argument_bytes)

    @property
    def temp_ratio(self) -> float | None:
        return safe_ratio(self.temp_bytes, self.estimated_temp_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.argument_bytes + self.temp_bytes

    @property
    def estimated_peak_bytes(self) -> float | None:
        if self.estimated_argument_bytes is None or self.estimated_temp_bytes is None:
            return None
        return self.estimated_argument_bytes + self.estimated_temp_bytes

    @property
    def peak_ratio(self) -> float | None:
        return safe_ratio(self.peak_bytes, self.estimated_peak_bytes)

    @property
    def output_ratio(self) -> float | None:
        return safe_ratio(self.output_bytes, self.estimated_output_bytes)

    @property
    def args_plus_temps_mib(self) -> float:
        return (self.argument_bytes + self.temp_bytes) / MIB


@dataclasses.dataclass
class CompiledReport:
    """Collectives by (kind, axes), the per-op list, memory, and what the formulas estimate."""

    rows: list[CollectiveRow]
    ops: list[CollectiveOp]
    memory: MemoryReport | None
    layout: dict[str, Any] = dataclasses.field(default_factory=dict)
    estimated: dict[str, Any] = dataclasses.field(default_factory=dict)
    flops: float | None = None  # cost_analysis() of one device's program
    trivial_ops: int = 0  # collectives over single-device groups (no traffic)
    warnings: list[str] = dataclasses.field(default_factory=list)
    # pipeline layouts: ring bytes per device per step of each stage, by axis (rows: the busiest stage)
    stages: list[dict[str, float]] = dataclasses.field(default_factory=list)
    # "collective after loop in computation": may run concurrently with the loop's collectives on
    # XLA:CPU (jaxpar.analysis.collective_order); the train step keeps this empty
    unordered: list[str] = dataclasses.field(default_factory=list)

    def row(self, kind: str, axes: tuple[str, ...] | str) -> CollectiveRow | None:
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        return next((r for r in self.rows if r.kind == kind and r.axes == axes), None)

    def bytes(self, kind: str, axes: tuple[str, ...] | str) -> float:
        r = self.row(kind, axes)
        return r.bytes_per_device if r else 0.0

    def count(self, kind: str, axes: tuple[str, ...] | str) -> int:
        r = self.row(kind, axes)
        return r.count if r else 0

    def total_bytes(self, axis: str | None = None) -> float:
        """Ring bytes per device per step, over all rows or the rows that involve ``axis``."""
        return sum(r.bytes_per_device for r in self.rows if axis is None or axis in r.axes)

    def total_estimated_bytes(self, axis: str | None = None) -> float:
        return sum(r.estimated_bytes or 0.0 for r in self.rows if axis is None or axis in r.axes)

    def axis_bytes(self, axis: str) -> float:
        """Ring bytes per device per step counted under ``axis`` (:func:`counted_axes`)."""
        return sum(r.bytes_per_device for r in self.rows if axis in counted_axes(r.axes))

    def to_dict(self) -> dict[str, Any]:
        mem = None
        if self.memory is not None:
            mem = dataclasses.asdict(self.memory)
            mem.update(
                argument_ratio=self.memory.argument_ratio,
                output_ratio=self.memory.output_ratio,
                temp_ratio=self.memory.temp_ratio,
                peak_bytes=self.memory.peak_bytes,
                estimated_peak_bytes=self.memory.estimated_peak_bytes,
                peak_ratio=self.memory.peak_ratio,
            )
        return {
            "collectives": [dataclasses.asdict(r) | {"axes": list(r.axes), "ratio": r.ratio} for r in self.rows],
            "memory": mem,
            "estimated": self.estimated,
            "layout": self.layout,
            "flops": self.flops,
            "trivial_ops": self.trivial_ops,
            "warnings": list(self.warnings),
            "stages": list(self.stages),
            "unordered": list(self.unordered),
            "ops": [dataclasses.asdict(op) | {"axes": list(op.axes)} for op in self.ops],
        }


# The axes a gradient reduction group is made of (jaxpar.axes.data_group): a row over several of them is
# the reduction of a ZeRO group, counted under `data` in per-axis totals (the estimates' data entry).
GROUP_AXES = gradient_axes()


def counted_axes(axes: tuple[str, ...]) -> tuple[str, ...]:
    """The mesh axes a row's bytes count under in per-axis totals: its own, except that a row over
    several of data, expert and context (a gradient reduction group, or the MoE auxiliary loss's
    token statistics) counts under ``data`` in their place; the ``expert`` and ``context`` totals
    are then the MoE dispatch and the attention exchange alone."""
    group = [a for a in axes if a in GROUP_AXES]
    if len(group) < 2:
        return axes
    return (*(a for a in axes if a not in GROUP_AXES), MeshAxis.DATA)


# --------------------------------------------------------------------------- attribution


def _axes_of(ids: list[int], coords: np.ndarray, names: tuple[str, ...]) -> tuple[str, ...]:
    """The mesh axes along which the devices ``ids`` (positions in ``mesh.devices.flat``) differ."""
    if any(not 0 <= i < len(coords) for i in ids):
        raise ValueError(f"replica group {ids} names a device outside the {len(coords)}-device mesh")
    pts = coords[np.asarray(ids)]
    return tuple(name for k, name in enumerate(names) if len(set(pts[:, k].tolist())) > 1)


def _collective(ins: Instr, symbols: dict[str, str], coords: np.ndarray, names: tuple[str, ...]):
    kind = ins.opcode.removesuffix("-start")
    operand_types = []
    for op in ins.operands:
        ref = op.split()[-1].lstrip("%")
        operand_types.append(op if "[" in op else symbols.get(ref, ""))
    operand_bytes = sum(shape_bytes(t) for t in operand_types) or shape_bytes(ins.type_text)
    try:
        groups = source_target_pairs(ins.attrs) if kind == "collective-permute" else replica_groups(ins.attrs)
    except ValueError as e:
        raise ValueError(f"{ins.name}: {e}") from None
    if kind == "collective-permute":
        axes = tuple(sorted({a for p in groups for a in _axes_of(p, coords, names)}, key=names.index))
        return kind, axes, len(groups), operand_bytes, tuple(sorted(p[0] for p in groups))
    if groups is None:
        groups = [list(range(len(coords)))]
    n = len(groups[0])
    axes = tuple(sorted({a for g in groups for a in _axes_of(g, coords, names)}, key=names.index))
    size = operand_bytes * n if kind == "all-gather" else operand_bytes
    return kind, axes, n, size, ()


def analyze_compiled(
    compiled: Any,
    mesh: Any,
    *,
    estimated: dict | None = None,
    estimated_memory: dict | None = None,
    pipeline: Any = None,
) -> CompiledReport:
    """Collectives (by kind and mesh axes, bytes per device per step) and memory of ``compiled``.

    ``estimated`` (from :func:`estimated_collectives`) and ``estimated_memory`` put the formula values
    beside the measurements: rows the formulas expect but the program lacks appear with count 0,
    rows the formulas do not expect get estimated bytes 0.

    ``pipeline`` (a :class:`jaxpar.parallel.pipeline.Pipeline`): the step runs a schedule, whose ticks take
    one branch of each switch per device. Every collective is then counted exactly, per stage: its
    runs with all branches executing (:func:`executions`) times the share of ticks in which that
    stage takes its branch (:func:`pipeline_fraction`, from the named scopes in its op_name); a
    collective-permute moves bytes only from the devices that send. ``rows`` are the busiest
    stage's, ``stages`` has every stage's bytes by axis.
    """
    names = tuple(mesh.axis_names)
    coords = np.array(list(np.ndindex(*mesh.devices.shape)), dtype=int).reshape(-1, len(names))
    entry, comps = parse_hlo(compiled.as_text())
    warnings: list[str] = []
    found, cost, trivial = [], defaultdict(float), 0
    for comp, instrs in comps.items():
        symbols = {i.name: i.type_text for i in instrs}
        for ins in instrs:
            if ins.opcode.removesuffix("-start") not in KINDS:
                continue
            kind, axes, n, size, sources = _collective(ins, symbols, coords, names)
            if not axes:
                trivial += 1
                continue
            found.append((comp, ins, kind, axes, n, size, sources))
            cost[comp] += ring_bytes(kind, n, size)
    runs = executions(entry, comps, warnings, cost, all_branches=pipeline is not None)
    ops = []
    for comp, ins, kind, axes, n, size, sources in found:
        times = runs.get(comp, 0)  # 0: only in conditional branches counted as a larger sibling
        meta = OP_NAME.search(ins.attrs)
        moved, source = ring_bytes(kind, n, size) * times, meta.group(1) if meta else ""
        ops.append(CollectiveOp(ins.name, kind, axes, n, size, times, moved, ins.type_text, comp, source, sources))
    stages: list[dict[str, float]] = []
    if pipeline is not None:
        per_stage = [_stage_rows(ops, pipeline, d, coords, names) for d in range(pipeline.table.stages)]
        stages = [
            {
                "stage": d,
                **{
                    axis: sum(r.bytes_per_device for r in rows.values() if axis in counted_axes(r.axes))
                    for axis in names
                },
            }
            for d, rows in enumerate(per_stage)
        ]
        rows = max(per_stage, key=lambda rows: sum(r.bytes_per_device for r in rows.values()))
    else:
        rows = {}
        for op in (op for op in ops if op.executions):
            row = rows.setdefault((op.kind, op.axes), CollectiveRow(op.kind, op.axes, 0, 0.0))
            row.count += op.executions
            row.bytes_per_device += op.bytes_per_device
    for (kind, axes), exp in (estimated or {}).items():
        row = rows.setdefault((kind, axes), CollectiveRow(kind, axes, 0, 0.0))
        row.estimated_bytes, row.estimated_count = exp["bytes_per_device"], exp["count"]
    for row in rows.values():
        if row.estimated_bytes is None and estimated is not None:
            row.estimated_bytes, row.estimated_count = 0.0, 0
    order = {k: i for i, k in enumerate(KINDS)}
    sorted_rows = sorted(rows.values(), key=lambda r: (order[r.kind], len(r.axes), r.axes))
    return CompiledReport(
        rows=sorted_rows,
        ops=ops,
        memory=_memory(compiled, estimated_memory or {}),
        estimated={"collectives": _estimated_json(estimated or {}), "memory": estimated_memory or {}},
        flops=_flops(compiled),
        trivial_ops=trivial,
        warnings=warnings,
        stages=stages,
        unordered=[f"{u.collective} after {u.loop} in {u.computation}" for u in unordered_in(comps)],
    )


_SEND_SCOPE = re.compile(r"pp_send_(fwdv|bwdv|fwd|bwd)_(\d+)")


def pipeline_fraction(op_name: str, pipeline: Any, pipeline_stage: int) -> float:
    """Share of the schedule loop's ticks in which ``pipeline_stage`` runs the branch holding a collective,
    read from the named scopes of :mod:`jaxpar.parallel.pipeline` in its op_name (1 outside the loop).

    1F1B / interleaved (one loop of ``table.ticks``): ``pp_forward`` / ``pp_backward`` where the
    stage's program runs F / B; ``pp_first`` / ``pp_last`` where that action is on the first / last
    virtual stage (``pp_ends``: either); ``pp_send_<dir>_<k>`` where the tick's send pattern is k. GPipe (a forward loop
    of m+p-1 ticks and its transpose): ``pp_work`` where 0 <= tick - stage < m, ``pp_first`` /
    ``pp_last`` on stage 0 / p-1.
    """
    from jaxpar.parallel import pipeline as pl

    table, prog = pipeline.table, pipeline.program
    p, v, m = table.stages, table.virtual_stages, table.microbatches
    tags = set(re.findall(r"pp_[a-z]+", op_name))
    send = _SEND_SCOPE.search(op_name)
    if not tags and not send:
        return 1.0
    if table.schedule == "gpipe":
        ticks = np.arange(m + p - 1)
        ok = np.ones(len(ticks), bool)
        if pl.SCOPE_WORK in tags:
            ok &= (ticks - pipeline_stage >= 0) & (ticks - pipeline_stage < m)
        if pl.SCOPE_FIRST in tags:
            ok &= pipeline_stage == 0
        if pl.SCOPE_LAST in tags:
            ok &= pipeline_stage == p - 1
        if send:
            ok &= prog.pattern[send.group(1)][: len(ticks)] == int(send.group(2))
        return float(ok.mean())
    kind, chunk = prog.per_stage["kind"][:, pipeline_stage], prog.per_stage["chunk"][:, pipeline_stage]
    k = np.array([pl.virtual_stage(table.schedule, p, int(c), pipeline_stage) for c in chunk])
    is_first, is_last = k == 0, k == p * v - 1
    ok = np.ones(table.ticks, bool)
    if pl.SCOPE_FORWARD in tags:
        ok &= kind == pl.FORWARD
    if pl.SCOPE_BACKWARD in tags:
        ok &= kind == pl.BACKWARD
    if pl.SCOPE_WEIGHT in tags:
        ok &= kind == pl.WEIGHT
    if pl.SCOPE_FIRST in tags:
        ok &= is_first
    if pl.SCOPE_LAST in tags:
        ok &= is_last
    if pl.SCOPE_ENDS in tags:
        ok &= is_first | is_last
    if pl.SCOPE_KEPT in tags:
        ok &= ~is_last
    if send:
        ok &= prog.pattern[send.group(1)] == int(send.group(2))
    return float(ok.mean())


def _stage_rows(
    ops: list[CollectiveOp], pipeline: Any, pipeline_stage: int, coords: np.ndarray, names: tuple[str, ...]
) -> dict[tuple[str, tuple[str, ...]], CollectiveRow]:
    """Rows of one pipeline stage (its device at data = tensor = 0)."""
    device = next(
        i
        for i, c in enumerate(coords)
        if all(c[k] == (pipeline_stage if name == MeshAxis.PIPELINE else 0) for k, name in enumerate(names))
    )
    rows: dict[tuple[str, tuple[str, ...]], CollectiveRow] = {}
    for op in ops:
        share = pipeline_fraction(op.op_name, pipeline, pipeline_stage)
        executions = op.executions * share
        if not executions:
            continue
        moved = op.bytes_per_device * share
        if op.kind == "collective-permute" and device not in op.sources:
            moved = 0.0  # it receives only
        row = rows.setdefault((op.kind, op.axes), CollectiveRow(op.kind, op.axes, 0, 0.0))
        row.count += round(executions)
        row.bytes_per_device += moved
    return rows


def _estimated_json(estimated: dict) -> list[dict[str, Any]]:
    return [{"kind": k, "axes": list(a), **v} for (k, a), v in estimated.items()]


def _memory(compiled: Any, estimated_memory: dict) -> MemoryReport | None:
    try:
        stats = compiled.memory_analysis()
    except Exception:  # some backends do not implement it
        return None
    if stats is None:
        return None
    return MemoryReport(
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        generated_code_bytes=int(stats.generated_code_size_in_bytes),
        estimated_argument_bytes=estimated_memory.get("argument_bytes"),
        estimated_output_bytes=estimated_memory.get("output_bytes"),
    )


def _flops(compiled: Any) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    return float(cost["flops"]) if cost and "flops" in cost else None


# --------------------------------------------------------------------------- one layout


def report_fields(cfg: ConfigDict, layout: ParallelLayout) -> dict[str, Any]:
    """The fields a compiled report is about (its JSON "layout" object: mesh sizes, ZeRO, SP,
    batch, recompute, dtypes): the layout's, and the config's dtypes."""
    return {
        MeshAxis.DATA: layout.data,
        MeshAxis.TENSOR: layout.tensor,
        MeshAxis.PIPELINE: layout.pipeline,
        MeshAxis.CONTEXT: layout.context,
        MeshAxis.EXPERT: layout.expert,
        "context_exchange": layout.context_exchange,
        "zero_stage": layout.zero_stage,
        "sequence_parallel": layout.sequence_parallel,
        "microbatches": layout.microbatches,
        "global_batch": layout.global_batch,
        "seq_len": layout.seq_len,
        "recompute": layout.recompute,
        "compute_dtype": cfg.model.compute_dtype,
        "grad_reduce_dtype": cfg.parallel.grad_reduce_dtype,
    }


def mesh_for(layout: ParallelLayout) -> Any:
    """The layout's mesh on the first data*tensor*pipeline*context*expert devices (CPU ones if the
    default backend has too few)."""
    import jax

    from jaxpar.mesh import make_mesh

    devices = jax.devices()
    if len(devices) < layout.devices:
        devices = jax.devices("cpu")
    if len(devices) < layout.devices:
        raise ConfigError(
            f"mesh: the layout needs {layout.devices} devices but only {len(devices)} exist; set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={layout.devices} before JAX starts"
        )
    return make_mesh(layout, devices[: layout.devices])


def analyze_layout(
    cfg: ConfigDict,
    mesh: Any = None,
    compiler_options: dict[str, Any] | None = None,
    layout: ParallelLayout | None = None,
) -> CompiledReport:
    """Build the layout's :class:`~jaxpar.train.state.Setup`, compile its train step ahead of
    time from abstract arrays (nothing allocated), and analyze it against the formulas: the one
    compile path of ``inspect``, ``plan --aot`` and ``compare --aot``. ``layout``: ``cfg``'s
    validated layout (``inspect`` and the planner pass the one they hold; without it ``cfg`` is
    validated here). ``compiler_options`` such as :data:`AOT_COMPILER_OPTIONS` change compile time,
    not the numbers (tested)."""
    from jaxpar.train.state import Setup

    layout = layout if layout is not None else validate(cfg)
    setup = Setup(cfg, layout, mesh if mesh is not None else mesh_for(layout))
    compiled = setup.lower_train_step().compile(compiler_options=compiler_options)
    if layout.pipeline > 1:
        report = _analyze_pipeline(cfg, layout, setup, compiled)
    else:
        report = analyze_compiled(
            compiled,
            setup.mesh,
            estimated=estimated_collectives(cfg, layout, setup.train_form.placements),
            estimated_memory=estimated_memory(cfg, layout, setup.train_form.placements),
        )
    report.layout = report_fields(cfg, layout)
    if report.memory is not None:
        _estimate_temps(report.memory, cfg, layout)
    half = {cfg.model.compute_dtype, cfg.parallel.grad_reduce_dtype} & {"bfloat16", "float16"}
    if half and setup.mesh.devices.flat[0].platform == "cpu":
        report.warnings.append(
            f"XLA:CPU runs {'/'.join(sorted(half))} collectives in float32 (float normalization): their measured "
            "bytes are 2x what a GPU/TPU moves; inspect with --config.model.compute_dtype=float32 "
            "--config.parallel.grad_reduce_dtype=float32 for exact ratios"
        )
    return report


def _estimate_temps(memory: MemoryReport, cfg: ConfigDict, layout: ParallelLayout) -> None:
    """Put the estimated temporaries (:mod:`jaxpar.analysis.activations`, in the dtypes compiled) beside
    the measured ones."""
    from jaxpar.analysis import temporaries

    temps = temporaries.stage_temps(cfg.model, layout)
    memory.estimated_temp_bytes = max(t.total_bytes for t in temps)
    memory.estimated_stage_temp_bytes = [t.total_bytes for t in temps] if len(temps) > 1 else []


def _analyze_pipeline(cfg: ConfigDict, layout: ParallelLayout, setup: Any, compiled: Any) -> CompiledReport:
    """A pipeline layout: rows of the busiest stage; per stage, each axis beside the estimate of
    :func:`jaxpar.analysis.estimate.jaxpar_stage_traffic` (data: the same on every stage; expert:
    :func:`jaxpar.analysis.traffic.expert_traffic`); the
    argument memory beside the estimate of :func:`jaxpar.analysis.estimate.estimated_argument_bytes`."""
    from jaxpar.analysis.estimate import DTYPE_BYTES, communication, estimated_argument_bytes, jaxpar_stage_traffic
    from jaxpar.analysis.traffic import expert_traffic

    memory = {"argument_bytes": estimated_argument_bytes(cfg.model, layout, "jaxpar", cfg.optim)}
    report = analyze_compiled(compiled, setup.mesh, pipeline=setup.pipeline, estimated_memory=memory)
    grad_bytes = DTYPE_BYTES[cfg.parallel.grad_reduce_dtype]
    data = communication(cfg.model, layout, None, grad_bytes, "jaxpar")[MeshAxis.DATA]
    for st in report.stages:
        traffic = jaxpar_stage_traffic(cfg.model, layout, st["stage"], grad_bytes)  # ZeRO-2/3: per stage
        st["estimated"] = {
            MeshAxis.DATA: traffic.get(MeshAxis.DATA, (data.bytes,))[0],
            MeshAxis.TENSOR: traffic[MeshAxis.TENSOR][0],
            MeshAxis.PIPELINE: traffic[MeshAxis.PIPELINE][0],
        }
        if layout.expert > 1:
            st["estimated"][MeshAxis.EXPERT] = expert_traffic(cfg.model, layout, st["stage"])[0]
            if layout.data == 1 and layout.context == 1:  # the reduction runs over expert alone (counted_axes)
                st["estimated"][MeshAxis.EXPERT] += st["estimated"][MeshAxis.DATA]
                st["estimated"][MeshAxis.DATA] = 0.0
    axes = (MeshAxis.DATA, MeshAxis.TENSOR, MeshAxis.PIPELINE)
    busiest = max(report.stages, key=lambda st: sum(st[a] for a in axes))["stage"]
    report.warnings.append(
        f"pipeline layout: the rows are the busiest stage ({busiest}), each collective counted exactly from the "
        "schedule table (the ticks in which that stage takes its branch); the per-stage table holds every "
        "stage's bytes by axis beside the estimate"
    )
    return report
