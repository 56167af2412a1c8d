"""Matmul FLOPs a compiled step executes, counted from its optimized HLO with loop trip counts.

XLA's ``cost_analysis`` counts a while loop's body once, and a conditional's branches as if all ran,
so it cannot tell a pipeline schedule that recomputes its forward from one that does not. Here each
``dot`` counts 2 x (output elements) x (contracted elements) per run; the runs of its computation
come from :func:`jaxpar.analysis.hlo.executions` (while bodies times their trip counts, every
conditional branch once), and inside the pipeline's tick loop each op is scaled by the share of
ticks in which the stage takes its branch (:func:`jaxpar.analysis.compiled.pipeline_fraction`, read
from the schedule's named scopes). Elementwise work is left out: on a transformer it is a few
percent of the dots.
"""

from __future__ import annotations

import math
from typing import Any

from jaxpar.analysis.compiled import pipeline_fraction
from jaxpar.analysis.hlo import OP_NAME, array_dims, executions, parse_hlo

_CONTRACTING = "lhs_contracting_dims={"


def _dot_flops(type_text: str, operands: list[str], attrs: str) -> float:
    """2 * output elements * contracted size of one dot (its lhs operand's contracting dims)."""
    out = math.prod(array_dims(type_text))
    lhs = array_dims(operands[0].rsplit(" ", 1)[0]) if operands else []
    at = attrs.find(_CONTRACTING)
    if at < 0 or not lhs:
        return 2.0 * out
    dims = attrs[at + len(_CONTRACTING) : attrs.index("}", at)]
    contracted = math.prod(lhs[int(k)] for k in dims.split(",") if k.strip())
    return 2.0 * out * contracted


def executed_dot_flops(hlo_text: str, pipeline: Any = None, pipeline_stage: int = 0) -> float:
    """Dot FLOPs one device runs per call of the module; with ``pipeline`` (a
    :class:`~jaxpar.parallel.pipeline.Pipeline`), those of pipeline rank ``pipeline_stage``."""
    entry, comps = parse_hlo(hlo_text)
    runs = executions(entry, comps, [], all_branches=pipeline is not None)
    total = 0.0
    for comp, instrs in comps.items():
        n = runs.get(comp, 0)
        if not n:
            continue
        for ins in instrs:
            if ins.opcode != "dot":
                continue
            share = 1.0
            if pipeline is not None:
                found = OP_NAME.search(ins.attrs)
                share = pipeline_fraction(found.group(1) if found else "", pipeline, pipeline_stage)
            total += n * share * _dot_flops(ins.type_text, ins.operands, ins.attrs)
    return total
