"""A schedule table timed under stated costs: bubble, makespan and in-flight microbatches.

The table (:func:`~jaxpar.parallel.pipeline.schedule.build_schedule`) fixes each stage's order of
actions; here every action takes its cost instead of one tick: F costs ``T_F``, a split backward's B
and W ``T_B`` and ``T_W``, an unsplit backward ``T_B + T_W``. An action starts when its stage is free
and its input is done (communication free), as in the analysis of Qi et al. 2024
(arXiv:2401.10241), whose bubble rate is (makespan - work per stage) / work per stage:

* GPipe and 1F1B: (p-1)/m (Huang et al. 2019; Narayanan et al. 2021);
* interleaved with v chunks: (p-1)/(v*m) (Narayanan et al. 2021);
* ZB-H1: (p-1)(T_F + T_B - T_W) / (m(T_F + T_B + T_W)), (p-1)/(3m) with equal costs (Qi et al.);
* ZB-V: close to 0 at 1F1B's activation memory when T_F = T_B = T_W (Qi et al., section 6), no formula
  stated.

Costs default to equal; :func:`timed` takes others (e.g. per-branch costs read from a compiled step).
"""

from __future__ import annotations

import dataclasses

from jaxpar.parallel.pipeline.schedule import EVAL, EVAL_V, ScheduleTable, splits_backward, virtual_stage

EQUAL = {"F": 1.0, "B": 1.0, "W": 1.0}


@dataclasses.dataclass(frozen=True)
class Timing:
    """A timed table: ``makespan``, ``work`` (busy time of one stage: every stage does the same),
    ``bubble`` ((makespan - work) / work) and ``in_flight[d]``: the most microbatches stage d holds
    at once (forward done, last backward action not yet: their activations are alive)."""

    makespan: float
    work: float
    bubble: float
    in_flight: tuple[int, ...]


def timed(table: ScheduleTable, costs: dict[str, float] | None = None) -> Timing:
    """Run each stage's actions in table order under ``costs`` (``T_F``, ``T_B``, ``T_W`` as keys
    ``F``, ``B``, ``W``)."""
    c = EQUAL | (costs or {})
    p, last = table.stages, table.stages * table.virtual_stages - 1
    split = splits_backward(table.schedule)
    cost = {"F": c["F"], "B": c["B"] if split else c["B"] + c["W"], "W": c["W"]}
    order = [[row[d] for row in table.grid if row[d] is not None] for d in range(p)]
    end: dict[tuple[str, int, int], float] = {}
    free, pos = [0.0] * p, [0] * p
    while any(pos[d] < len(order[d]) for d in range(p)):
        moved = False
        for d in range(p):
            while pos[d] < len(order[d]):
                a = order[d][pos[d]]
                k = virtual_stage(table.schedule, p, a.chunk, d)
                if a.kind == "F":
                    dep = ("F", a.microbatch, k - 1) if k > 0 else None
                elif a.kind == "B":
                    dep = ("F", a.microbatch, k) if k == last else ("B", a.microbatch, k + 1)
                else:
                    dep = ("B", a.microbatch, k)
                if dep is not None and dep not in end:
                    break
                start = max(free[d], end[dep] if dep else 0.0)
                free[d] = end[(a.kind, a.microbatch, k)] = start + cost[a.kind]
                pos[d], moved = pos[d] + 1, True
        if not moved:  # the table's orders come from a simulation that respects these dependencies
            raise RuntimeError(f"{table.schedule}: the table's orders deadlock under costs {c}")
    work = max(sum(cost[a.kind] for a in seq) for seq in order)
    makespan = max(free)
    return Timing(
        makespan, work, (makespan - work) / work, _in_flight(order, split or table.schedule in (EVAL, EVAL_V))
    )


def _in_flight(order: list[list], split: bool) -> tuple[int, ...]:
    done = "W" if split else "B"
    peaks = []
    for seq in order:
        alive = peak = 0
        for a in seq:
            alive += (a.kind == "F") - (a.kind == done)
            peak = max(peak, alive)
        peaks.append(peak)
    return tuple(peaks)


def published_bubble(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1) -> float | None:
    """The bubble rate its paper states for equal costs (module docstring); None where none is
    stated (a forward-only table)."""
    p, m, v = stages, microbatches, virtual_stages
    formulas = {"gpipe": (p - 1) / m, "1f1b": (p - 1) / m, "interleaved": (p - 1) / (v * m), "zb-h1": (p - 1) / (3 * m)}
    return formulas.get(schedule)
