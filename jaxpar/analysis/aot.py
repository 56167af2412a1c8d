"""``jaxpar plan --aot``: compile planned layouts ahead of time and put the compiler's numbers
beside the estimates.

For each layout it builds the jaxpar config (:func:`layout_config`), compiles the real train step
for that many simulated CPU devices from abstract arrays (:func:`jaxpar.analysis.compiled.analyze_layout`,
the one compile path, with LLVM optimisation off; nothing is allocated or run), and compares per-device argument memory and per-axis collective bytes with the
estimates (:class:`AotComparison`). JAX is imported only here, after the device count is set.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any

from jaxpar import acts
from jaxpar.analysis.estimate import (
    DTYPE_BYTES,
    ParallelLayout,
    communication,
    estimated_argument_bytes,
    peak_terms,
    safe_ratio,
)
from jaxpar.axes import MESH_AXES, MeshAxis
from jaxpar.config import ConfigDict, ConfigError, default_config, validate


def layout_config(cfg: ConfigDict, layout: ParallelLayout, grad_reduce_dtype: str | None = None) -> ConfigDict:
    """The jaxpar config that trains ``layout``: a copy of ``cfg`` with the layout's mesh, ZeRO stage,
    sequence parallelism, microbatches, global batch, sequence length, remat (= recompute),
    pipeline schedule and attention (kernel, block, context exchange), validated (a one-line :class:`ConfigError` names what jaxpar cannot run).

    ``grad_reduce_dtype`` (default: the config's) is the data-axis reduction dtype; ZeRO-3 reduces
    in ``model.compute_dtype`` (the config requires it). With RoPE, ``model.max_seq_len`` is raised
    to the sequence length if it is shorter (it sizes nothing then).
    """
    return layout_run(cfg, layout, grad_reduce_dtype)[0]


def layout_run(
    cfg: ConfigDict, layout: ParallelLayout, grad_reduce_dtype: str | None = None
) -> tuple[ConfigDict, ParallelLayout]:
    """:func:`layout_config` and the layout its validation built: what the compiled step runs. It is
    ``layout`` up to the fields the config leaves inert there (reset to their defaults, e.g. a
    schedule on one stage), so the step and its analysis are handed this one."""
    out = copy.deepcopy(cfg)
    for axis, size in layout.mesh.items():
        out.mesh[axis.value] = size
    out.parallel.zero_stage, out.parallel.sequence_parallel = layout.zero_stage, layout.sequence_parallel
    out.parallel.grad_reduce_dtype = grad_reduce_dtype or cfg.parallel.grad_reduce_dtype
    if layout.shards_parameters:
        out.parallel.grad_reduce_dtype = out.model.compute_dtype
    out.parallel.recompute = layout.recompute  # none | selective | full: the same names
    out.model.attention, out.model.attention_block = layout.attention, layout.attention_block
    out.parallel.context_exchange = layout.context_exchange
    if out.model.position == "rope":
        out.model.max_seq_len = max(out.model.max_seq_len, layout.seq_len)
    out.parallel.microbatches, out.train.global_batch = layout.microbatches, layout.global_batch
    out.train.seq_len = layout.seq_len
    out.parallel.pipeline_schedule, out.parallel.virtual_stages = layout.pipeline_schedule, layout.virtual_stages
    # the layout's split, whatever the config asked for another pipeline size ("": the even split)
    out.parallel.layers_per_stage = ",".join(map(str, layout.stage_layers)) if layout.uneven else ""
    out.parallel.first_stage_layers = out.parallel.last_stage_layers = 0
    # a field that acted in ``cfg`` (or a label the layout carries, e.g. a pinned gpipe on one stage)
    # can be inert on this layout: at its default it trains the same, and validate accepts it
    acts.reset_inert(out, default_config())
    return out, validate(out)


def ensure_aot_devices(num_devices: int) -> None:
    """Make ``num_devices`` devices available to compile for, before JAX starts its backends.

    Sets ``--xla_force_host_platform_device_count`` (simulated CPU devices) unless JAX has started;
    raises a one-line :class:`ConfigError` if fewer devices than ``num_devices`` exist afterwards
    (JAX started earlier in this process with fewer, or ``JAX_PLATFORMS`` excludes the CPU).
    """
    from jaxpar.distributed import ensure_host_devices, jax_started

    started = jax_started()
    ensure_host_devices(num_devices)
    import jax

    have = len(jax.devices())
    try:
        have = max(have, len(jax.devices("cpu")))
    except RuntimeError:  # no CPU backend (JAX_PLATFORMS without cpu)
        pass
    if have >= num_devices:
        return
    if started:
        raise ConfigError(
            f"plan --aot: JAX already started in this process with {have} devices but the layouts need "
            f"{num_devices}; run plan --aot in a fresh process"
        )
    raise ConfigError(
        f"plan --aot: only {have} devices exist but the layouts need {num_devices}; unset JAX_PLATFORMS or "
        f"include cpu in it (XLA_FLAGS=--xla_force_host_platform_device_count={num_devices} is set for you)"
    )


@dataclasses.dataclass(frozen=True)
class AotComparison:
    """One layout's estimates beside its compiled train step (bytes per device; collectives per step)."""

    layout: ParallelLayout
    estimated_argument_bytes: float = 0.0
    estimated_bytes: dict[str, float] = dataclasses.field(default_factory=dict)  # axis -> ring bytes
    argument_bytes: int | None = None  # memory_analysis().argument_size_in_bytes
    temp_bytes: int | None = None
    estimated_temp_bytes: float = 0.0  # jaxpar.analysis.activations, in the dtypes compiled (busiest stage)
    estimated_stage_temp_bytes: list[float] = dataclasses.field(default_factory=list)  # pipeline: every stage
    peak_terms: list[tuple[str, float]] = dataclasses.field(default_factory=list)  # estimate.peak_terms: largest 3
    compiled_bytes: dict[str, float] = dataclasses.field(default_factory=dict)  # axis -> ring bytes
    stage_bytes: list[dict[str, float]] = dataclasses.field(default_factory=list)  # pipeline: per stage, by axis
    compile_s: float = 0.0
    compute_dtype: str = ""
    grad_reduce_dtype: str = ""
    platform: str = ""
    skipped: str = ""  # why it was not compiled

    @property
    def argument_ratio(self) -> float | None:
        return safe_ratio(self.argument_bytes, self.estimated_argument_bytes)

    @property
    def temp_ratio(self) -> float | None:
        return safe_ratio(self.temp_bytes, self.estimated_temp_bytes)

    @property
    def peak_bytes(self) -> int | None:
        """The compiled peak: arguments + temporaries (what memory_analysis() says the step needs)."""
        return None if self.argument_bytes is None or self.temp_bytes is None else self.argument_bytes + self.temp_bytes

    @property
    def estimated_peak_bytes(self) -> float:
        return self.estimated_argument_bytes + self.estimated_temp_bytes

    @property
    def peak_ratio(self) -> float | None:
        return safe_ratio(self.peak_bytes, self.estimated_peak_bytes)

    def fits_compiled(self, budget_bytes: float) -> bool | None:
        """Whether the compiled peak is within ``budget_bytes`` (None: not compiled)."""
        return None if self.peak_bytes is None else self.peak_bytes <= budget_bytes

    def ratio(self, axis: str) -> float | None:
        """compiled / estimated bytes on ``axis`` (None when nothing is estimated)."""
        return safe_ratio(self.compiled_bytes.get(axis), self.estimated_bytes.get(axis))

    def to_dict(self) -> dict[str, Any]:
        if self.skipped:
            return {"skipped": self.skipped}
        return {
            "compile_s": self.compile_s,
            "platform": self.platform,
            "compute_dtype": self.compute_dtype,
            "grad_reduce_dtype": self.grad_reduce_dtype,
            "argument_bytes": self.argument_bytes,
            "estimated_argument_bytes": self.estimated_argument_bytes,
            "argument_ratio": self.argument_ratio,
            "temp_bytes": self.temp_bytes,
            "estimated_temp_bytes": self.estimated_temp_bytes,
            "temp_ratio": self.temp_ratio,
            "memory": {
                "argument_bytes": self.argument_bytes,
                "estimated_argument_bytes": self.estimated_argument_bytes,
                "temp_bytes": self.temp_bytes,
                "estimated_temp_bytes": self.estimated_temp_bytes,
                "temp_ratio": self.temp_ratio,
                "peak_bytes": self.peak_bytes,
                "estimated_peak_bytes": self.estimated_peak_bytes,
                "peak_ratio": self.peak_ratio,
                **(
                    {"estimated_stage_temp_bytes": self.estimated_stage_temp_bytes}
                    if self.estimated_stage_temp_bytes
                    else {}
                ),
                "peak_terms": [{"term": name, "bytes": value} for name, value in self.peak_terms],
            },
            "collectives": {
                axis: {
                    "bytes": self.compiled_bytes.get(axis, 0.0),
                    "estimated_bytes": self.estimated_bytes.get(axis, 0.0),
                    "ratio": self.ratio(axis),
                }
                for axis in MESH_AXES
            },
            **({"stages": self.stage_bytes} if self.stage_bytes else {}),
        }


def aot_compare(
    cfg: ConfigDict,
    layout: ParallelLayout,
    convention: str = "jaxpar",
    grad_reduce_dtype: str | None = None,
    compiler_options: dict[str, Any] | None = None,
) -> AotComparison:
    """Compile ``layout`` of the model in ``cfg`` and compare it with the estimates.

    ``compiler_options`` (XLA debug options for this one compile) default to
    :data:`jaxpar.analysis.compiled.AOT_COMPILER_OPTIONS`: no LLVM optimisation, the same buffers.

    On simulated CPU devices half-precision compute and reductions are compiled in float32 (XLA:CPU
    runs bf16 collectives in fp32, which would double the measured bytes), and the estimates in the
    comparison use the same dtypes; the argument memory (fp32 parameters and Adam state, int32
    batch) does not depend on it, the temporaries do (activations in fp32: up to 2x a bf16 step's),
    and both the compiled and the estimated temporaries are the fp32 ones. A layout jaxpar cannot build (a :class:`ConfigError`, or any
    failure of a pipeline layout while pipelining is in progress) comes back with ``skipped`` set.
    """
    try:
        lcfg, run = layout_run(cfg, layout, grad_reduce_dtype)
    except ConfigError as e:
        return AotComparison(layout, skipped=str(e))
    from jaxpar.analysis.compiled import AOT_COMPILER_OPTIONS, analyze_layout, mesh_for

    try:
        mesh = mesh_for(run)
    except ConfigError as e:
        return AotComparison(layout, skipped=str(e))
    platform = mesh.devices.flat[0].platform
    if platform == "cpu":
        lcfg.model.compute_dtype, lcfg.parallel.grad_reduce_dtype = "float32", "float32"
    start = time.perf_counter()
    try:
        options = AOT_COMPILER_OPTIONS if compiler_options is None else compiler_options
        report = analyze_layout(lcfg, mesh, compiler_options=options, layout=run)
    except ConfigError as e:
        return AotComparison(layout, skipped=str(e))
    except Exception as e:  # noqa: BLE001 - pipeline layouts may not build yet; anything else is a bug
        if layout.pipeline == 1:
            raise
        return AotComparison(layout, skipped=f"pipeline layout did not compile ({type(e).__name__}: {e})")
    elapsed = time.perf_counter() - start
    grad_bytes = DTYPE_BYTES[lcfg.parallel.grad_reduce_dtype]
    comm = communication(lcfg.model, layout, None, grad_bytes, convention=convention)
    mem = report.memory
    return AotComparison(
        layout=layout,
        estimated_argument_bytes=estimated_argument_bytes(lcfg.model, layout, convention, lcfg.optim),
        estimated_bytes=_estimated_axis_bytes(comm, layout),
        argument_bytes=mem.argument_bytes if mem else None,
        temp_bytes=mem.temp_bytes if mem else None,
        estimated_temp_bytes=(mem.estimated_temp_bytes or 0.0) if mem else 0.0,
        estimated_stage_temp_bytes=list(mem.estimated_stage_temp_bytes) if mem else [],
        peak_terms=peak_terms(lcfg.model, layout, lcfg.optim),
        compiled_bytes=compiled_axis_bytes(report, layout),
        stage_bytes=list(report.stages),
        compile_s=elapsed,
        compute_dtype=lcfg.model.compute_dtype,
        grad_reduce_dtype=lcfg.parallel.grad_reduce_dtype,
        platform=platform,
    )


def _estimated_axis_bytes(comm: dict[str, Any], layout: ParallelLayout) -> dict[str, float]:
    """The estimate's bytes per axis as :func:`compiled_axis_bytes` splits the compiled ones: with
    ``data = 1`` and only one of context and expert, the gradient reduction runs over that axis
    alone, in the same rows as its exchange or dispatch, so both count under it."""
    out = {axis: comm[axis].bytes for axis in MESH_AXES}
    alone = [a for a in (MeshAxis.CONTEXT, MeshAxis.EXPERT) if layout.size(a) > 1]
    if layout.data == 1 and len(alone) == 1:
        out[alone[0]] += out[MeshAxis.DATA]
        out[MeshAxis.DATA] = 0.0
    return out


def compiled_axis_bytes(report: Any, layout: ParallelLayout | None = None) -> dict[str, float]:
    """Bytes per device per step on each axis; with a pipeline, of the busiest stage on that axis
    (each stage counted exactly from the schedule, as the estimate's busiest stage). A row over
    several of ``data``, ``expert`` and ``context`` (a gradient reduction's group) counts under
    ``data`` only (:func:`jaxpar.analysis.compiled.counted_axes`): the estimate's ``context`` is the
    attention exchange, its ``expert`` the MoE dispatch and combine."""
    if report.stages:
        return {axis: max(st.get(axis, 0.0) for st in report.stages) for axis in MESH_AXES}
    return {axis: report.axis_bytes(axis) for axis in MESH_AXES}


def run_aot(
    cfg: ConfigDict, layouts: list[ParallelLayout], convention: str = "jaxpar", grad_reduce_dtype: str | None = None
) -> list[AotComparison]:
    """:func:`aot_compare` for each layout (all of one device count), after setting up the devices."""
    if not layouts:
        return []
    ensure_aot_devices(layouts[0].devices)
    return [aot_compare(cfg, layout, convention, grad_reduce_dtype) for layout in layouts]
