"""``jaxpar compare``: chosen layouts side by side, estimated (and with ``--aot`` compiled).

Where ``jaxpar plan`` searches, ``compare`` answers "which of these?": each ``--layout`` names a
layout (``data=8,zero=3`` / ``tensor=8,pipeline=8,virtual=3,recompute=full``), shown in the order
given, fitting or not, with memory, step time, MFU, exposed communication per axis, and memory and
step time relative to the first. A choice a layout leaves open (ZeRO stage, microbatches,
recompute, SP, schedule) keeps the config's value where the layout can take it
(:func:`config_choices`), else is searched (the fastest variant that fits, or the leanest);
:func:`choice_sources` says which. ``--aot`` compiles them on simulated CPU devices.

    jaxpar compare --config configs/llama2_7b.py --cluster h100-80g \\
        --layout data=8,zero=3 --layout data=2,tensor=4,zero=1 --layout tensor=8 --aot

The flags and tables are in :mod:`jaxpar.cli.compare`.
"""

from __future__ import annotations

import math
from typing import Any

from jaxpar.analysis.clusters import Cluster
from jaxpar.analysis.plan import LayoutEstimate, PlanOptions, search_layouts
from jaxpar.axes import MESH_AXES
from jaxpar.config import ConfigDict, ConfigError


def device_count(pinned: list[dict[str, Any]]) -> int:
    """The one device count (the product of the mesh sizes) of the pinned layouts; a ConfigError if they differ."""
    sizes = {math.prod(p.get(axis, 1) for axis in MESH_AXES) for p in pinned}
    if len(sizes) != 1:
        raise ConfigError(
            f"--layout: the layouts use different device counts ({sorted(sizes)}); give each the same "
            "data*tensor*pipeline*context*expert"
        )
    return sizes.pop()


CHOICES = ("zero_stage", "recompute", "sequence_parallel", "microbatches", "pipeline_schedule", "virtual_stages")


def config_choices(cfg: ConfigDict) -> dict[str, Any]:
    """The layout choices a train config makes besides the mesh (what ``compare`` keeps when a
    ``--layout`` leaves them open)."""
    return {
        "zero_stage": cfg.parallel.zero_stage,
        "recompute": cfg.parallel.recompute,
        "sequence_parallel": cfg.parallel.sequence_parallel,
        "microbatches": cfg.parallel.microbatches,
        "pipeline_schedule": cfg.parallel.pipeline_schedule,
        "virtual_stages": cfg.parallel.virtual_stages,
    }


def _applicable(fixed: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The config choices that mean something on this mesh: ZeRO needs data > 1, SP tensor > 1, a
    schedule and virtual stages a pipeline."""
    keep = {}
    for name, value in defaults.items():
        if name in fixed:
            continue
        if name == "zero_stage" and fixed.get("data", 1) == 1 and value:
            continue
        if name == "sequence_parallel" and fixed.get("tensor", 1) == 1 and value:
            continue
        if name in ("pipeline_schedule", "virtual_stages") and fixed.get("pipeline", 1) == 1:
            continue
        keep[name] = value
    return keep


def compare_layouts(
    model: ConfigDict,
    cluster: Cluster,
    pinned: list[dict[str, Any]],
    global_batch: int,
    seq_len: int,
    options: PlanOptions,
    defaults: dict[str, Any] | None = None,
) -> list[LayoutEstimate]:
    """One estimate per pinned layout, in the order given.

    ``defaults`` (:func:`config_choices`) fill the choices a layout leaves open, as long as the layout
    can take them (dropped one at a time, microbatches first, while the search finds no layout). The
    rest is searched: the fastest variant that fits, or, if none fits, the leanest (how far off it is).
    """
    num_devices = device_count(pinned)
    estimates = []
    for given in pinned:
        given = {**{axis.value: 1 for axis in MESH_AXES}, **given}
        taken = _applicable(given, defaults or {})
        order = [
            k
            for k in (
                "microbatches",
                "virtual_stages",
                "pipeline_schedule",
                "sequence_parallel",
                "recompute",
                "zero_stage",
            )
            if k in taken
        ]
        while True:
            try:
                found = search_layouts(
                    model, cluster, num_devices, global_batch, seq_len, options, {**given, **taken}, keep_unfit=True
                )
                break
            except ConfigError:
                if not order:
                    raise
                taken.pop(order.pop(0))
        estimates.append(found[0] if found[0].fits else min(found, key=lambda e: e.memory.total_bytes))
    return estimates


def choice_sources(
    pinned: dict[str, Any], estimate: LayoutEstimate, defaults: dict[str, Any] | None = None
) -> dict[str, str]:
    """For each open choice of a layout: ``given`` (in ``--layout``), ``config`` (the config's value,
    kept) or ``chosen`` (searched: the config's value did not apply or is not known)."""
    out = {}
    layout = estimate.layout
    for name in CHOICES:
        if name in pinned:
            out[name] = "given"
        elif defaults is not None and defaults.get(name) == getattr(layout, name):
            out[name] = "config"
        else:
            out[name] = "chosen"
    return out


def relative_to_first(estimates: list[LayoutEstimate]) -> list[dict[str, float]]:
    """Each layout's total memory and step time as a multiple of the first one's."""
    base = estimates[0]
    return [
        {"memory": e.memory.total_bytes / base.memory.total_bytes, "step_time": e.step_time_s / base.step_time_s}
        for e in estimates
    ]
