"""Pipeline schedules as data: the (tick, stage) -> action table and its lowered program.

See :mod:`jaxpar.parallel.pipeline` for the schedules (gpipe, 1f1b, interleaved), the bubble formulas and how
the executor runs a :class:`Program`.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from jaxpar.layout import SCHEDULES, SPLIT_BACKWARD, V_SHAPED, ParallelLayout

IDLE, FORWARD, BACKWARD, WEIGHT = 0, 1, 2, 3
EVAL = "forward"  # the forward-only table of pipelined evaluation (build_eval_schedule)
EVAL_V = "forward-v"  # the same over V-placed chunks (zb-v's layers)


def v_shaped(schedule: str) -> bool:
    """Whether device d holds virtual stages d and 2p-1-d (zb-v) instead of d, d+p, ...."""
    return schedule in (*V_SHAPED, EVAL_V)


def virtual_stage(schedule: str, stages: int, chunk: int, device: int) -> int:
    """The virtual stage of chunk ``chunk`` on ``device``: ``chunk * p + d``, or V order."""
    if v_shaped(schedule):
        return device if chunk == 0 else 2 * stages - 1 - device
    return chunk * stages + device


def device_of(schedule: str, stages: int, k: int) -> int:
    """The device holding virtual stage ``k`` (inverse of :func:`virtual_stage`)."""
    if v_shaped(schedule):
        return k if k < stages else 2 * stages - 1 - k
    return k % stages


# --------------------------------------------------------------------------- schedule tables


@dataclasses.dataclass(frozen=True)
class Action:
    """One unit of work: forward or backward of ``microbatch`` through the stage's chunk ``chunk``
    (virtual stage ``chunk * p + stage``, or V order: :func:`virtual_stage`)."""

    kind: str  # "F" | "B" | "W" (with a split backward "B" is the input gradient, "W" the weights')
    microbatch: int
    chunk: int = 0


@dataclasses.dataclass(frozen=True)
class ScheduleTable:
    """``grid[tick][stage]``: the action a stage runs at a tick (``None``: idle)."""

    schedule: str
    stages: int
    microbatches: int
    virtual_stages: int
    grid: tuple[tuple[Action | None, ...], ...]

    @property
    def ticks(self) -> int:
        return len(self.grid)

    def ticks_of(self) -> dict[tuple[str, int, int], int]:
        """(kind, microbatch, virtual stage) -> tick."""
        return {
            (a.kind, a.microbatch, virtual_stage(self.schedule, self.stages, a.chunk, d)): t
            for t, row in enumerate(self.grid)
            for d, a in enumerate(row)
            if a
        }


def _sequences(schedule: str, p: int, m: int, v: int) -> list[list[Action]]:
    """Each stage's ordered actions (Megatron-LM ``schedules.py`` order)."""
    out = []
    for d in range(p):
        if schedule == "gpipe":
            fwd, bwd, warmup = [(i, 0) for i in range(m)], [(i, 0) for i in reversed(range(m))], m
        elif schedule == "1f1b":
            fwd, bwd, warmup = [(i, 0) for i in range(m)], [(i, 0) for i in range(m)], min(p - 1 - d, m)
        elif schedule == "zb-h1":
            out.append(_zb_h1(d, p, m))
            continue
        elif schedule == "zb-v":
            out.append(_zb_v(d, p, m))
            continue
        else:  # interleaved: microbatches in groups of p, chunk by chunk (backward: chunks reversed)
            fwd, bwd = [], []
            for j in range(m * v):
                group, r = divmod(j, p * v)
                chunk, k = divmod(r, p)
                fwd.append((group * p + k, chunk))
                bwd.append((group * p + k, v - 1 - chunk))
            warmup = min(2 * (p - 1 - d) + (v - 1) * p, m * v)
        seq = [Action("F", *a) for a in fwd[:warmup]]
        for j in range(len(fwd) - warmup):
            seq += [Action("F", *fwd[warmup + j]), Action("B", *bwd[j])]
        seq += [Action("B", *a) for a in bwd[len(fwd) - warmup :]]
        out.append(seq)
    return out


def _zb_h1(d: int, p: int, m: int) -> list[Action]:
    """Stage d of ZB-H1 (Qi et al. 2024, arXiv:2401.10241, section 3.1): 1F1B's order with each
    backward split into B (input gradient) and W (weight gradient), stage d holding back d of its
    W's so that they fill the cool-down where 1F1B idles. At most p microbatches are in flight
    (forward done, W not yet) on any stage: 1F1B's peak on stage 0."""
    warmup = min(p - 1 - d, m)
    seq, pending = [Action("F", i) for i in range(warmup)], []
    for j in range(m):
        if warmup + j < m:
            seq.append(Action("F", warmup + j))
        seq.append(Action("B", j))
        pending.append(j)
        if len(pending) > d:
            seq.append(Action("W", pending.pop(0)))
    return seq + [Action("W", j) for j in pending]


def _zb_v(d: int, p: int, m: int) -> list[Action]:
    """Device d of ZB-V (Qi et al. 2024, section 6): chunk 0 is virtual stage d, chunk 1 virtual
    stage 2p-1-d, so the first and the last virtual stage share device 0. Warm-up: 2(p-d)-1
    forwards of chunk 0, then d pairs (F chunk 1, F chunk 0), then p-d rounds of F, B, W on chunk
    1; steady rounds of F, B, W on chunk 0 then on chunk 1; cool-down: d pairs of B (chunk 0, 1), p-d
    rounds of B and W on chunk 0, then the W's left. Built for max(m, 2p-1) microbatches (the count
    that fills the V), those past m dropped."""
    n = max(m, 2 * p - 1)
    count = {key: 0 for key in ("F0", "F1", "B0", "B1", "W0", "W1")}
    seq: list[Action] = []

    def act(kind: str, chunk: int) -> None:
        key = f"{kind}{chunk}"
        seq.append(Action(kind, count[key], chunk))
        count[key] += 1

    for _ in range(2 * (p - d) - 1):
        act("F", 0)
    for _ in range(d):
        act("F", 1)
        act("F", 0)
    for _ in range(p - d):
        act("F", 1), act("B", 1), act("W", 1)
    while count["F1"] < count["F0"] or count["F0"] < n:
        if count["F0"] < n:
            act("F", 0)
        act("B", 0), act("W", 0)
        act("F", 1), act("B", 1), act("W", 1)
    for _ in range(d):
        act("B", 0), act("B", 1)
    for _ in range(p - d):
        act("B", 0), act("W", 0)
    while count["W1"] < count["B1"]:
        act("W", 1)
    while count["W0"] < count["B0"]:
        act("W", 0)
    return [a for a in seq if a.microbatch < m]


def keeps_activations(layout: ParallelLayout) -> bool:
    """Whether 1F1B / interleaved keep each in-flight microbatch's residuals for its backward
    (:mod:`~jaxpar.parallel.pipeline.stash`) instead of recomputing the stage: unless ``parallel.recompute``
    is ``full``, which asks for the recomputation (GPipe's backward is JAX's transpose of its forward
    scan, which keeps the residuals of its own)."""
    return layout.pipeline_schedule != "gpipe" and layout.recompute != "full"


def splits_backward(schedule: str) -> bool:
    """Whether the schedule runs the input gradient (B) and the weight gradient (W) as separate
    actions (:data:`jaxpar.layout.SPLIT_BACKWARD`)."""
    return schedule in SPLIT_BACKWARD


def build_schedule(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1) -> ScheduleTable:
    """Simulate each stage's action sequence tick by tick; an action waits for its input.

    F(i, k) needs F(i, k-1) done on the previous stage at an earlier tick; B(i, k) needs B(i, k+1)
    (or, on the last virtual stage, F(i, k)). The arguments are a validated layout's
    (:meth:`jaxpar.layout.ParallelLayout.validate` holds the rules tying them together, e.g. the
    interleaved schedule's microbatches in groups of ``stages``); ``ValueError`` for a schedule name
    or a count below 1.
    """
    p, m, v = stages, microbatches, virtual_stages
    if schedule not in SCHEDULES or p < 1 or m < 1 or v < 1:
        raise ValueError(f"no schedule {schedule!r} with stages={p} microbatches={m} virtual_stages={v}")
    return _simulate(schedule, _sequences(schedule, p, m, v), p, m, v)


def build_eval_schedule(
    stages: int, microbatches: int, virtual_stages: int = 1, v_shape: bool = False
) -> ScheduleTable:
    """The forward-only table of pipelined evaluation: each stage runs its forwards in the order of
    the training schedules (with v chunks: groups of p microbatches, chunk by chunk), so microbatch
    i enters stage 0 at tick i and the stages work at once: p - 1 idle ticks per stage when m is a
    multiple of p, a bubble of (p-1)/(v*m + p-1) as for the interleaved schedule."""
    p, m, v = stages, microbatches, virtual_stages
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"no forward schedule with stages={p} microbatches={m} virtual_stages={v}")
    order = [(i, c) for g in range(0, m, p) for c in range(v) for i in range(g, min(g + p, m))]
    return _simulate(EVAL_V if v_shape else EVAL, [[Action("F", i, c) for i, c in order] for _ in range(p)], p, m, v)


def _simulate(schedule: str, seqs: list[list[Action]], p: int, m: int, v: int) -> ScheduleTable:
    """Tick by tick, each stage runs its next action once its input exists (module docstring)."""
    pos, done, grid = [0] * p, {}, []
    last = p * v - 1
    while any(pos[d] < len(seqs[d]) for d in range(p)):
        t, row = len(grid), [None] * p
        for d in range(p):
            if pos[d] == len(seqs[d]):
                continue
            a = seqs[d][pos[d]]
            k = virtual_stage(schedule, p, a.chunk, d)
            dep = ("F", a.microbatch, k - 1) if a.kind == "F" else ("B", a.microbatch, k + 1)
            if a.kind == "B" and k == last:
                dep = ("F", a.microbatch, k)
            if a.kind == "W":  # after its own stage's B (an earlier action of the same sequence)
                dep = ("B", a.microbatch, k)
            if (a.kind == "F" and k == 0) or done.get(dep, t) < t:
                row[d], pos[d] = a, pos[d] + 1
        for d, a in enumerate(row):
            if a:
                done[(a.kind, a.microbatch, virtual_stage(schedule, p, a.chunk, d))] = t
        grid.append(tuple(row))
        if t > 4 * (m * v + p) + 8:  # cannot happen for the orders above: a guard against edits
            raise RuntimeError(f"schedule {schedule} p={p} m={m} v={v} deadlocked")
    return ScheduleTable(schedule, p, m, v, tuple(grid))


def bubble_fraction(table: ScheduleTable) -> float:
    """Share of (tick, stage) slots in which a stage is idle."""
    idle = sum(a is None for row in table.grid for a in row)
    return idle / (table.ticks * table.stages)


def expected_bubble_fraction(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle share of the table's slots: (p-1)/(m+p-1) for gpipe and 1f1b, (p-1)/(v*m+p-1)
    interleaved (Narayanan et al. 2021), (p-1)/(3m+p-1) zb-h1, whose F, B and W take a slot each
    (Qi et al. 2024); zb-v, whose two half-stage chunks per device split each of those slots,
    (p-1)/(6m+p-1) once m >= 2p (its table's value there) and zb-h1's below, an upper bound: its
    table lies between the two for p <= m < 2p and equals zb-h1's at m = p. "Expected" names the
    published closed form that the table's counted bubble (:func:`bubble_fraction`) is held
    against, not a planner's estimate of a compiled number (those are ``estimated_*``)."""
    v = virtual_stages if schedule in ("interleaved", EVAL, EVAL_V) else 1
    if schedule == "zb-v" and microbatches >= 2 * stages:
        v = virtual_stages
    v *= 3 if splits_backward(schedule) else 1
    return (stages - 1) / (v * microbatches + stages - 1)


def render_schedule(table: ScheduleTable) -> str:
    """A text diagram: one row per stage, one column per tick (``F3`` forward of microbatch 3,
    ``B3:1`` backward on chunk 1, ``.`` idle), plus the bubble fraction."""
    p, v = table.stages, table.virtual_stages

    def cell(a: Action | None) -> str:
        return "." if a is None else f"{a.kind}{a.microbatch}" + (f":{a.chunk}" if v > 1 else "")

    cells = [[cell(row[d]) for row in table.grid] for d in range(p)]
    width = max(len(c) for r in cells for c in r) + 1
    head = f"{table.schedule}: p={p} m={table.microbatches}" + (f" v={v}" if v > 1 else "")
    lines = [
        f"{head}, {table.ticks} ticks, bubble {bubble_fraction(table):.1%} (formula "
        f"{expected_bubble_fraction(table.schedule, p, table.microbatches, v):.1%})",
        "tick    " + "".join(f"{t:>{width}}" for t in range(table.ticks)),
    ]
    lines += [f"stage {d:<2}" + "".join(f"{c:>{width}}" for c in cells[d]) for d in range(p)]
    return "\n".join(lines)


def boundary_sends(table: ScheduleTable) -> tuple[int, int]:
    """(activations sent forward, gradients sent backward) over all stage boundaries per step:
    m * (p*v - 1) each."""
    last = table.stages * table.virtual_stages - 1
    fwd = sum(1 for k in table.ticks_of() if k[0] == "F" and k[2] < last)
    bwd = sum(1 for k in table.ticks_of() if k[0] == "B" and k[2] > 0)
    return fwd, bwd


# --------------------------------------------------------------------------- executor program


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """The table lowered to the integer arrays the explicit executor scans over.

    ``per_stage[name]`` is ``(ticks, stages)``: ``kind`` (IDLE / FORWARD / BACKWARD as executed: the
    last virtual stage's F is idle, its work is done in its B), ``microbatch``, ``chunk``, and the
    slots read (``act_read``, ``grad_read``) and written at the end of the tick (``act_write``,
    ``grad_write``). Slot buffers hold stage inputs and arriving output gradients from their arrival
    to the backward that consumes them; the index ``act_slots`` / ``grad_slots`` (one past the last
    slot) means nothing is read or arrives (the executor keeps the buffer as is).
    ``pattern[dir]`` (ticks,) indexes ``pairs[dir]``, the distinct (src, dst) stage pairs sending
    at a tick (``"fwd"`` activations, ``"bwd"`` gradients, and zb-v's chunk 1 in ``"fwdv"`` /
    ``"bwdv"`` written to ``*_write_v``; pattern 0 sends nothing).
    """

    per_stage: dict[str, np.ndarray]
    pattern: dict[str, np.ndarray]
    pairs: dict[str, tuple[tuple[tuple[int, int], ...], ...]]
    act_slots: int
    grad_slots: int
    stash_slots: int = 0
    front_slots: int = 0


def _allocate(intervals: dict[tuple[int, int], tuple[int, int, int]]) -> tuple[dict[tuple[int, int], int], int]:
    """Slots for values alive from the end of tick ``start`` to tick ``end`` on ``device``: in order
    of start, each value takes the lowest slot of its device whose last value ended by its start,
    else a new one (greedy by start: as many slots as values ever alive at once on a device)."""
    slots, used = {}, 0
    busy: dict[int, list[tuple[int, int]]] = {}  # device -> heap of (end, slot) of the slots in use
    free: dict[int, list[int]] = {}  # device -> heap of the slots whose value ended
    count: dict[int, int] = {}  # device -> slots made
    for key, (device, start, end) in sorted(intervals.items(), key=lambda kv: kv[1][1]):
        taken, spare = busy.setdefault(device, []), free.setdefault(device, [])
        while taken and taken[0][0] <= start:
            heapq.heappush(spare, heapq.heappop(taken)[1])
        if spare:
            slot = heapq.heappop(spare)
        else:
            slot = count[device] = count.get(device, 0) + 1
            slot -= 1
        heapq.heappush(taken, (end, slot))
        slots[key], used = slot, max(used, slot + 1)
    return slots, used


def _live_intervals(table: ScheduleTable, stash: bool = False) -> tuple[dict, dict, dict, dict]:
    """Per (microbatch, virtual stage): (device, arrival tick, consuming tick) of the stage input
    (after F on the previous virtual stage, until B, or until F with a stash), of the output gradient
    (after B on the next one, until B), of the stashed activations (after F until B, or until W with
    a split backward; none on the last virtual stage without one, whose F runs in its B tick) and of
    the split backward's frontier (after B until W)."""
    p, m, last = table.stages, table.microbatches, table.stages * table.virtual_stages - 1
    when = table.ticks_of()

    def dev(k: int) -> int:
        return device_of(table.schedule, p, k)

    pairs_ik = [(i, k) for i in range(m) for k in range(last + 1)]
    if table.schedule in (EVAL, EVAL_V):  # forward only: a stage input lives until its forward, nothing else
        return {(i, k): (dev(k), when["F", i, k - 1], when["F", i, k]) for i, k in pairs_ik if k > 0}, {}, {}, {}
    split = splits_backward(table.schedule)
    stash = stash or split
    act = {
        (i, k): (dev(k), when["F", i, k - 1], when["F" if stash and (k < last or split) else "B", i, k])
        for i, k in pairs_ik
        if k > 0
    }
    grad = {(i, k): (dev(k), when["B", i, k + 1], when["B", i, k]) for i, k in pairs_ik if k < last}
    freed = "W" if split else "B"
    kept = {(i, k): (dev(k), when["F", i, k], when[freed, i, k]) for i, k in pairs_ik if stash and (k < last or split)}
    front = {(i, k): (dev(k), when["B", i, k], when["W", i, k]) for i, k in pairs_ik if split}
    return act, grad, kept, front


def slot_counts(table: ScheduleTable, stash: bool = False) -> tuple[int, int, int, int]:
    """``(act_slots, grad_slots, stash_slots, front_slots)`` of :func:`compile_program`, without
    building its arrays (what the memory estimate needs, for hundreds of schedules in one planner
    search)."""
    return tuple(_allocate(live)[1] for live in _live_intervals(table, stash))


SATURATION = 4  # slot counts are those of min(m, SATURATION * p) microbatches (1F1B, interleaved)


def steady_slot_counts(
    schedule: str, stages: int, microbatches: int, virtual_stages: int = 1, stash: bool = False
) -> tuple[int, int, int, int]:
    """:func:`slot_counts` of the schedule, simulated with at most ``SATURATION * stages``
    microbatches for 1F1B and interleaved: the planner prices schedules of up to thousands.

    Why the counts stop growing: a 1F1B stage d runs min(p - 1 - d, m) warm-up forwards and then
    alternates, so at most p - d stage inputs are ever alive (Narayanan et al. 2021, section 2.2);
    an interleaved stage's warm-up is 2(p - 1 - d) + (v - 1)p chunk forwards, fewer than 2p
    microbatches' worth, after which the same steady pattern repeats. Measured
    (``tests/test_pipeline.py::test_slot_counts_saturate``): 1F1B saturates at m = p, interleaved
    at m = 2p, for p up to 16 and v up to 4; the cap is twice that. GPipe keeps every microbatch,
    so it is simulated as given."""
    m = microbatches if schedule == "gpipe" else min(microbatches, SATURATION * stages)
    return slot_counts(build_schedule(schedule, stages, m, virtual_stages), stash)


def compile_program(table: ScheduleTable, stash: bool = False) -> Program:
    """Lower a table to a :class:`Program` (slot allocation and send patterns); ``stash``: the
    backward reads saved activations instead of recomputing the stage from its input (always with
    a split backward, whose W ticks read them too)."""
    p, ticks, last = table.stages, table.ticks, table.stages * table.virtual_stages - 1
    split, evaluates = splits_backward(table.schedule), table.schedule in (EVAL, EVAL_V)
    stash = stash or split
    (act, n_act), (grad, n_grad), (kept, n_kept), (front, n_front) = map(_allocate, _live_intervals(table, stash))
    arr = {name: np.zeros((ticks, p), np.int32) for name in ("kind", "microbatch", "chunk")}
    for name, n in (("act", n_act), ("grad", n_grad), ("stash", n_kept), ("front", n_front)):
        arr |= {f"{name}_read": np.full((ticks, p), n, np.int32), f"{name}_write": np.full((ticks, p), n, np.int32)}
    # zb-v: chunk 1's sends (the V's way back) in lanes of their own ("fwdv", "bwdv"), as a device may
    # receive one of each chunk in a tick; at the V's tip (virtual stages p-1 and p on one device) a
    # value is kept, not sent
    for name, n in (("act", n_act), ("grad", n_grad)):
        arr |= {f"{name}_self": np.full((ticks, p), n, np.int32), f"{name}_write_v": np.full((ticks, p), n, np.int32)}
    v_lanes = v_shaped(table.schedule)
    lanes = ("fwd", "bwd", "fwdv", "bwdv") if v_lanes else ("fwd", "bwd")
    pairs: dict[str, list] = {lane: [()] for lane in lanes}
    pattern = {lane: np.zeros(ticks, np.int32) for lane in lanes}
    for t, row in enumerate(table.grid):
        sends: dict[str, list[tuple[int, int]]] = {lane: [] for lane in lanes}
        for d, a in enumerate(row):
            i, k = (a.microbatch, virtual_stage(table.schedule, p, a.chunk, d)) if a else (0, 0)
            if a is None or (a.kind == "F" and k == last and not (evaluates or split)):
                continue  # without a split the last virtual stage runs its forward in its B tick
            arr["microbatch"][t, d], arr["chunk"][t, d] = i, a.chunk
            stashed = stash and (k < last or split)
            if a.kind == "F":
                arr["kind"][t, d] = FORWARD
                arr["act_read"][t, d] = act[i, k] if k > 0 else n_act
                if stashed:
                    arr["stash_write"][t, d] = kept[i, k]
                dst = device_of(table.schedule, p, k + 1)
                if k < last and dst == d:
                    arr["act_self"][t, d] = act[i, k + 1]
                elif k < last:
                    lane = "v" if v_lanes and a.chunk == 1 else ""
                    arr[f"act_write{'_v' if lane else ''}"][t, dst] = act[i, k + 1]
                    sends["fwd" + lane].append((d, dst))
            elif a.kind == "B":
                arr["kind"][t, d], arr["grad_read"][t, d] = BACKWARD, grad[i, k] if k < last else n_grad
                arr["act_read"][t, d] = act[i, k] if k > 0 and not stashed else n_act
                if stashed:
                    arr["stash_read"][t, d] = kept[i, k]
                if split:  # B rewrites its slot: the frontier in place of residuals only B read
                    arr["stash_write"][t, d], arr["front_write"][t, d] = kept[i, k], front[i, k]
                dst = device_of(table.schedule, p, k - 1)
                if k > 0 and dst == d:
                    arr["grad_self"][t, d] = grad[i, k - 1]
                elif k > 0:
                    lane = "v" if v_lanes and a.chunk == 1 else ""
                    arr[f"grad_write{'_v' if lane else ''}"][t, dst] = grad[i, k - 1]
                    sends["bwd" + lane].append((d, dst))
            else:
                arr["kind"][t, d] = WEIGHT
                arr["stash_read"][t, d], arr["front_read"][t, d] = kept[i, k], front[i, k]
        for direction, found in sends.items():
            key = tuple(sorted(found))
            if key not in pairs[direction]:
                pairs[direction].append(key)
            pattern[direction][t] = pairs[direction].index(key)
    return Program(arr, pattern, {k: tuple(v) for k, v in pairs.items()}, n_act, n_grad, n_kept, n_front)
