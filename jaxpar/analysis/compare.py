"""``jaxpar compare``: chosen layouts side by side, estimated (and with ``--aot`` compiled).

Where ``jaxpar plan`` searches, ``compare`` answers "which of these?": each ``--layout`` names a
layout (``data=8,zero=3`` / ``data=2,tensor=4,sp=1`` / ``tensor=8,pipeline=8,virtual=3,recompute=full``),
and the table shows them in the order given, whether or not they fit, with memory, step time, MFU
and the exposed communication per axis, then each one's memory and step time relative to the
first. A choice a layout leaves open (ZeRO stage, microbatches, recompute, SP, schedule) is the
fastest variant that fits, as ``plan`` would pick (if none fits, the leanest). ``--aot`` compiles
all of them on simulated CPU devices.

    jaxpar compare --config configs/llama2_7b.py --cluster h100-80g \\
        --layout data=8,zero=3 --layout data=2,tensor=4,zero=1 --layout tensor=8 --aot

This module evaluates; the flags and the tables are in :mod:`jaxpar.cli.compare`.
"""

from __future__ import annotations

import math
from typing import Any

from jaxpar.analysis.clusters import Cluster
from jaxpar.analysis.plan import LayoutEstimate, PlanOptions, search_layouts
from jaxpar.axes import MESH_AXES
from jaxpar.config import ConfigDict, ConfigError


def device_count(pinned: list[dict[str, Any]]) -> int:
    """The one device count (data*tensor*pipeline*context) of the pinned layouts; a ConfigError if they differ."""
    sizes = {math.prod(p.get(axis, 1) for axis in MESH_AXES) for p in pinned}
    if len(sizes) != 1:
        raise ConfigError(f"--layout: the layouts use different device counts ({sorted(sizes)}); give each the same "
                          "data*tensor*pipeline*context")
    return sizes.pop()


def compare_layouts(model: ConfigDict, cluster: Cluster, pinned: list[dict[str, Any]], global_batch: int,
                    seq_len: int, options: PlanOptions) -> list[LayoutEstimate]:
    """One estimate per pinned layout, in the order given: the fastest variant that fits, or, if none
    fits, the leanest (how far off it is)."""
    num_devices = device_count(pinned)
    estimates = []
    for fixed in pinned:
        fixed = {**{axis.value: 1 for axis in MESH_AXES}, **fixed}
        found = search_layouts(model, cluster, num_devices, global_batch, seq_len, options, fixed, keep_unfit=True)
        estimates.append(found[0] if found[0].fits else min(found, key=lambda e: e.memory.total_bytes))
    return estimates


def relative_to_first(estimates: list[LayoutEstimate]) -> list[dict[str, float]]:
    """Each layout's total memory and step time as a multiple of the first one's."""
    base = estimates[0]
    return [{"memory": e.memory.total_bytes / base.memory.total_bytes, "step_time": e.step_time_s / base.step_time_s}
            for e in estimates]
