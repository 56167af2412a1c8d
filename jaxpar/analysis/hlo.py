"""Reading optimized HLO text: shapes, instructions, replica groups, and how often each computation runs.

The text layer under :mod:`jaxpar.analysis.compiled`: :func:`parse_hlo` splits a module's text into
computations of :class:`Instr`; :func:`executions` walks the call graph (calls, fusions, async
wrappers, while loops with their trip counts, conditionals) to count how many times each
computation runs per call of the entry. A collective's device groups are read by
:mod:`jaxpar.analysis.hlo_groups` (re-exported here).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

from jaxpar.analysis.hlo_groups import (  # noqa: F401 - re-exported for callers
    parse_replica_groups,
    replica_groups,
    source_target_pairs,
)

HLO_DTYPE_BYTES = {  # element types of HLO shapes
    **dict.fromkeys(("s4", "u4"), 0.5),
    **dict.fromkeys(("pred", "s8", "u8"), 1),
    **dict.fromkeys(("s16", "u16", "f16", "bf16"), 2),
    **dict.fromkeys(("s32", "u32", "f32"), 4),
    **dict.fromkeys(("s64", "u64", "f64", "c64"), 8),
    "c128": 16,
    "token": 0,
}

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_OPCODE = re.compile(r"^([a-z][a-z0-9\-]*)\(")
CALLEES = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
CALLEE_LISTS = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
OP_NAME = re.compile(r'op_name="([^"]*)"')
_COMMENT = re.compile(r"/\*.*?\*/")


# --------------------------------------------------------------------------- HLO parsing


def shape_bytes(type_text: str) -> float:
    """Bytes of an HLO type: an array ``f32[2,3]{1,0}`` or a tuple of them."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(type_text):
        size = HLO_DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else None)
        if size is None:
            raise ValueError(f"unknown HLO element type '{dtype}' in '{type_text}'")
        total += size * math.prod(_dims(dims))
    return total


def array_dims(type_text: str) -> list[int]:
    """The dims of an HLO array type (``f32[2,3]{1,0}`` -> ``[2, 3]``; a tuple: its first array)."""
    arrays = _ARRAY.findall(type_text)
    return _dims(arrays[0][1]) if arrays else []


def _dims(text: str) -> list[int]:
    return [int(d.replace("<=", "")) for d in text.split(",") if d.strip()]


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis group opening at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


@dataclasses.dataclass
class Instr:
    """One instruction: its name, result type text, opcode, operand texts and the attributes after them."""

    name: str
    type_text: str
    opcode: str
    operands: list[str]
    attrs: str


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    name, rest = m.group(1), m.group(2)
    if rest.startswith("("):
        end = _balanced(rest, 0)
        type_text, rest = rest[:end], rest[end:].lstrip()
    else:
        type_text, _, rest = rest.partition(" ")
    op = _OPCODE.match(rest)
    if not op:
        return None
    open_at = op.end() - 1
    close_at = _balanced(rest, open_at)
    operands = [o.strip() for o in _split_top(rest[open_at + 1 : close_at - 1]) if o.strip()]
    return Instr(name, type_text, op.group(1), operands, rest[close_at:])


def _split_top(text: str) -> list[str]:
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return out


def parse_hlo(text: str) -> tuple[str, dict[str, list[Instr]]]:
    """(entry computation name, {computation: instructions}) of an HLO module's text."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        line = _COMMENT.sub("", line)
        header = _HEADER.match(line)
        if header and "=" not in line.split("(", 1)[0]:
            current = header.group(2)
            comps[current] = []
            if header.group(1):
                entry = current
            continue
        if current is None:
            continue
        if line.strip() == "}":
            current = None
            continue
        instr = _parse_instr(line)
        if instr is not None:
            comps[current].append(instr)
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return entry, comps


_FUSION_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")


def fused_computations(comps: dict[str, list[Instr]]) -> set[str]:
    """Names of the computations a ``fusion`` instruction calls: their instructions run inside one
    kernel (XLA:CPU: a generated loop, or a library call such as YNNPACK's), not as ops of their own."""
    return {
        c
        for instrs in comps.values()
        for ins in instrs
        if ins.opcode == "fusion"
        for c in _FUSION_CALLS.findall(ins.attrs)
    }


def executions(
    entry: str,
    comps: dict[str, list[Instr]],
    warnings: list[str],
    cost: dict[str, float] | None = None,
    all_branches: bool = False,
) -> dict[str, int]:
    """How many times each computation runs per call of ``entry`` (while bodies x trip count).

    A ``conditional`` runs one branch per execution, which the HLO does not show: each execution
    goes to the branch whose collectives (``cost``: ring bytes of a computation's own collectives per
    run, callees included) move the most bytes, ties to the first. That bounds the bytes from above
    (exact when branches agree), never sums branches, and leaves the other branches' collectives at
    0 executions. ``all_branches``: every branch runs once per execution; the pipeline report then
    scales each collective by the share of ticks that take its branch.

    A while loop whose trip count is neither annotated nor read from its condition (a bound in the
    loop state, as blockwise attention's) counts once, with a warning only when a collective runs
    inside it (``cost``).
    """
    cost = cost or {}
    edges: dict[str, list[tuple[str, int]]] = defaultdict(list)
    branches: dict[str, list[list[str]]] = defaultdict(list)  # caller -> branch lists of its conditionals
    unknown: list[tuple[str, list[str], str]] = []  # (while, its callees, the warning) of unknown trip counts
    for comp, instrs in comps.items():
        for ins in instrs:
            if ins.opcode.endswith("-done") or ins.opcode == "async-update":
                continue  # the -start already accounts for the async computation
            callees = CALLEES.findall(ins.attrs)
            for group in CALLEE_LISTS.findall(ins.attrs):
                callees += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
            callees = [c for c in callees if c in comps]
            if ins.opcode == "conditional":
                if callees:
                    branches[comp].append(callees)
                continue
            found: list[str] = []
            trips = _trip_count(ins, comps, found) if ins.opcode == "while" else 1
            unknown += [(ins.name, callees, line) for line in found]
            edges[comp] += [(callee, trips) for callee in callees]
    order, seen = [], set()

    def visit(c: str) -> None:  # post-order DFS; HLO call graphs are acyclic
        seen.add(c)
        for callee in [e for e, _ in edges[c]] + [b for group in branches[c] for b in group]:
            if callee not in seen:
                visit(callee)
        order.append(c)

    visit(entry)
    total: dict[str, float] = {}  # bytes of one run of a computation, callees included
    for comp in order:  # callees first
        if all_branches:
            chosen = [b for group in branches[comp] for b in group]
        else:
            chosen = [max(group, key=lambda b: total[b]) for group in branches[comp]]  # first of the largest
        edges[comp] += [(b, 1) for b in chosen]
        total[comp] = cost.get(comp, 0.0) + sum(total[c] * n for c, n in edges[comp])
    warnings += [line for _, callees, line in unknown if any(total.get(c, 0.0) for c in callees)]
    runs = defaultdict(int, {entry: 1})
    for comp in reversed(order):
        for callee, trips in edges[comp]:
            runs[callee] += runs[comp] * trips
    return dict(runs)


def _trip_count(ins: Instr, comps: dict[str, list[Instr]], warnings: list[str]) -> int:
    m = _TRIP.search(ins.attrs)
    if m:
        return int(m.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", ins.attrs)
    body = comps.get(cond.group(1), []) if cond else []
    consts = [int(i.operands[0]) for i in body if i.opcode == "constant" and i.operands and i.operands[0].isdigit()]
    if len(consts) == 1 and any("direction=LT" in i.attrs for i in body if i.opcode == "compare"):
        return consts[0]
    warnings.append(f"while '{ins.name}': trip count unknown, counted once")
    return 1
