"""The sweep's layout grid: which layouts of N devices ``jaxpar sweep`` runs, their names, and the
cluster the planner's estimates beside the measurements assume.

The layouts are the planner's (:func:`jaxpar.analysis.plan.search_layouts`): every (data, tensor,
pipeline, expert) mesh whose sizes divide the model, ZeRO 0-3, sequence parallelism, each pipeline schedule
(interleaved with each number of virtual stages), recompute off; microbatches per
:func:`_microbatches`. The time estimate needs a cluster: on a GPU its data-sheet preset, on CPU
:func:`cpu_cluster` (a rough model; the estimate-vs-measured figure shows how rough).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Iterable

from jaxpar.analysis.clusters import GB, PRESETS, Cluster
from jaxpar.analysis.estimate import ParallelLayout
from jaxpar.analysis.plan import PlanOptions, search_layouts
from jaxpar.axes import MESH_AXES
from jaxpar.config import ConfigDict, ConfigError

AXES = tuple(axis.value for axis in MESH_AXES)


def layout_name(layout: ParallelLayout) -> str:
    """A short unique name: ``d2t2p2v2-z1-sp-interleaved-m4`` (mesh, ZeRO, +SP, schedule, microbatches);
    with context parallelism ``c<size>`` after the mesh (``c<size>ag`` for the all-gather exchange), with
    expert parallelism ``e<size>``."""
    name = f"d{layout.data}t{layout.tensor}p{layout.pipeline}"
    name += f"v{layout.virtual_stages}" if layout.virtual_stages > 1 else ""
    if layout.context > 1:
        name += f"c{layout.context}" + ("ag" if layout.context_exchange == "all_gather" else "")
    if layout.expert > 1:
        name += f"e{layout.expert}"
    name += f"-z{layout.zero_stage}" + ("-sp" if layout.sequence_parallel else "")
    if layout.pipeline > 1:
        name += f"-{layout.pipeline_schedule}"
    return name + f"-m{layout.microbatches}"


def _microbatches(layout: ParallelLayout) -> int:
    """The sweep's microbatch count: 1 without a pipeline; else 2p if the batch allows, at least p."""
    per_shard = layout.microbatches * layout.microbatch_size
    if layout.pipeline == 1:
        return 1
    for m in (2 * layout.pipeline, layout.pipeline):
        if per_shard % m == 0:
            return m
    return layout.microbatches


def sweep_layouts(
    model: ConfigDict, num_devices: int, global_batch: int, seq_len: int, cluster: Cluster
) -> list[ParallelLayout]:
    """Every layout of ``num_devices`` the planner accepts for this batch, recompute off, one
    microbatch count per layout (see the module docstring), pure data parallelism first."""
    options = PlanOptions(headroom=0.0)
    found: dict[str, ParallelLayout] = {}
    for schedule in ("1f1b", "gpipe", "interleaved"):
        fixed = {"recompute": "none", "pipeline_schedule": schedule}
        try:
            estimates = search_layouts(
                model, cluster, num_devices, global_batch, seq_len, options, fixed, keep_unfit=True
            )
        except ConfigError:
            continue  # e.g. no layout of this schedule
        for est in estimates:
            layout = est.layout
            if schedule != "1f1b" and layout.pipeline == 1:
                continue  # the schedule is moot without a pipeline: counted once, under 1f1b
            m = _microbatches(layout)
            if layout.pipeline_schedule == "interleaved" and m % layout.pipeline:
                continue
            layout = dataclasses.replace(
                layout, microbatches=m, microbatch_size=global_batch // (layout.batch_shards * m)
            )
            found.setdefault(layout_name(layout), layout)
    order = {"1f1b": 0, "gpipe": 1, "interleaved": 2}
    return sorted(
        found.values(),
        key=lambda x: (
            x.pipeline,
            x.tensor,
            x.expert,
            x.virtual_stages,
            order[x.pipeline_schedule],
            x.zero_stage,
            x.sequence_parallel,
        ),
    )


def select(layouts: list[ParallelLayout], only: Iterable[str] = ()) -> list[ParallelLayout]:
    """The layouts whose name matches any of the ``only`` regular expressions (all without any)."""
    patterns = []
    for text in only:
        try:
            patterns.append(re.compile(text))
        except re.error as e:
            raise ConfigError(f"--only '{text}': not a regular expression ({e}); e.g. --only 'z3|p4'") from None
    chosen = [layout for layout in layouts if not patterns or any(p.search(layout_name(layout)) for p in patterns)]
    if not chosen:
        names = ", ".join(layout_name(layout) for layout in layouts[:6])
        raise ConfigError(f"--only {' '.join(only)}: matches none of the {len(layouts)} layouts (e.g. {names})")
    return chosen


def measure_copy_gbps(megabytes: int = 64) -> float:
    """Host memory copy rate, GB/s (best of 5 numpy copies): the link of simulated CPU devices."""
    import numpy as np

    src = np.ones(megabytes * 2**20 // 8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return src.nbytes / best / GB


def cpu_cluster(num_devices: int, peak_flops: float, copy_gbps: float) -> Cluster:
    """Simulated CPU devices as a one-node cluster: the measured peak per device; links at the
    measured copy rate shared by the devices; memory unbounded for the planner (host RAM)."""
    link = max(copy_gbps / num_devices, 1e-3)
    return Cluster(
        "cpu-simulated",
        peak_flops / 1e12,
        1e15,
        copy_gbps,
        num_devices,
        link,
        link,
        "simulated CPU devices: measured fp32 matmul peak and memory copy rate, shared",
    )


def device_cluster(num_devices: int, peak_flops: float) -> Cluster:
    """The data-sheet preset of the accelerator in use, else :func:`cpu_cluster`."""
    import jax

    kind = getattr(jax.devices()[0], "device_kind", "").lower()
    for name, cluster in PRESETS.items():
        if name.split("-")[0] in kind:
            return dataclasses.replace(cluster, devices_per_node=max(cluster.devices_per_node, num_devices))
    return cpu_cluster(num_devices, peak_flops, measure_copy_gbps())
