"""Collectives that XLA:CPU may run concurrently with a loop's collectives: the hazard this module finds.

XLA:CPU's thunk executor orders one computation's collectives by *scheduling* edges only
(``xla/backends/cpu/runtime/thunk_executor.cc``): a collective may start once its predecessor has
*started*. A ``while`` (or ``conditional``) thunk whose body runs asynchronously returns before its
last iteration is done, so the next collective starts while the loop's are still running, unless it
reads the loop's result (a data edge waits for completion). JAX gives every collective
``channel_id=1``, so its in-process rendezvous key (run, group, kind, channel) equals that of a
same-kind collective over the same group inside the loop: devices pair different operations and
the step hangs, aborts ("Check failed: id < num_threads") or crashes.

:func:`unordered_collectives` reads optimized HLO (printed in schedule order) and lists every
collective-bearing instruction scheduled after such a loop in the same computation that does not
depend on its result (an element the body passes through unchanged is no dependency). The train
step keeps this list empty: under ZeRO-3 or SP the head's parameters are carried through the layer
scan (:meth:`jaxpar.models.base.Model.loss_sum`), and every microbatch runs inside the accumulation
loop (:mod:`jaxpar.train.step`).
"""

from __future__ import annotations

import dataclasses
import re

from jaxpar.analysis.hlo import CALLEE_LISTS, CALLEES, Instr, parse_hlo

COLLECTIVE_OPCODES = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "ragged-all-to-all",
    "collective-broadcast",
)
NESTED_EXECUTORS = ("while", "conditional")  # thunks that run a nested thunk sequence, possibly asynchronously
_NAME = re.compile(r"%?([\w.\-]+)\s*$")


@dataclasses.dataclass(frozen=True)
class UnorderedCollective:
    """``collective`` (in ``computation``) is scheduled after ``loop`` but does not read its result."""

    computation: str
    loop: str
    collective: str


def _callees(ins: Instr, comps: dict[str, list[Instr]]) -> list[str]:
    names = CALLEES.findall(ins.attrs)
    for group in CALLEE_LISTS.findall(ins.attrs):
        names += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
    return [n for n in names if n in comps]


_INDEX = re.compile(r"\bindex=(\d+)")


def _passed_through(ins: Instr, by_name: dict[str, Instr], comps: dict[str, list[Instr]]) -> str | None:
    """For ``get-tuple-element(while), index=k`` where the body returns element k of its parameter
    unchanged (directly or through bitcasts, which alias): the while's operand, the value's real
    producer. XLA:CPU orders thunks by the buffers they touch, and no thunk of the body touches
    that element, so reading it does not wait for the loop. Otherwise None."""
    if ins.opcode != "get-tuple-element" or not ins.operands:
        return None
    loop = by_name.get(_NAME.search(ins.operands[0]).group(1))
    index = _INDEX.search(ins.attrs)
    body = re.search(r"\bbody=%?([\w.\-]+)", loop.attrs) if loop is not None and loop.opcode == "while" else None
    if body is None or index is None or body.group(1) not in comps:
        return None
    body_instrs = comps[body.group(1)]
    names = {i.name: i for i in body_instrs}
    root = body_instrs[-1]
    k = int(index.group(1))
    if root.opcode != "tuple" or k >= len(root.operands):
        return None
    value = names.get(_NAME.search(root.operands[k]).group(1))
    while value is not None and value.opcode == "bitcast":
        value = names.get(_NAME.search(value.operands[0]).group(1))
    if (
        value is None
        or value.opcode != "get-tuple-element"
        or _INDEX.search(value.attrs) is None
        or int(_INDEX.search(value.attrs).group(1)) != k
    ):
        return None
    source = names.get(_NAME.search(value.operands[0]).group(1))
    if source is None or source.opcode != "parameter":
        return None
    return _NAME.search(loop.operands[0]).group(1)


def _is_collective(ins: Instr) -> bool:
    return ins.opcode.removesuffix("-start") in COLLECTIVE_OPCODES


def unordered_collectives(hlo_text: str) -> list[UnorderedCollective]:
    """Every collective-bearing instruction (a collective, or a call / loop / conditional that holds
    one) scheduled after a ``while`` / ``conditional`` holding collectives in the same computation,
    without a data path from it. Empty: XLA:CPU runs each computation's collectives in one order."""
    return unordered_in(parse_hlo(hlo_text)[1])


def unordered_in(comps: dict[str, list[Instr]]) -> list[UnorderedCollective]:
    """:func:`unordered_collectives` of parsed computations (:func:`jaxpar.analysis.hlo.parse_hlo`)."""
    bearing: dict[str, bool] = {}

    def holds_collectives(comp: str) -> bool:
        if comp not in bearing:
            bearing[comp] = False  # HLO call graphs are acyclic; this only guards the recursion
            bearing[comp] = any(
                _is_collective(i) or any(holds_collectives(c) for c in _callees(i, comps)) for i in comps[comp]
            )
        return bearing[comp]

    found = []
    for comp, instrs in comps.items():
        ancestors: dict[str, frozenset[str]] = {}
        by_name = {i.name: i for i in instrs}
        loops: list[str] = []
        for ins in instrs:
            operands = [m.group(1) for o in ins.operands if (m := _NAME.search(o)) and m.group(1) in ancestors]
            looped = _passed_through(ins, by_name, comps)
            if looped is not None:  # an element the loop body never writes: no edge from the loop at run time
                operands = [looped]
            ancestors[ins.name] = frozenset(operands).union(*(ancestors[o] for o in operands))
            bears = _is_collective(ins) or any(holds_collectives(c) for c in _callees(ins, comps))
            if not bears:
                continue
            found += [UnorderedCollective(comp, loop, ins.name) for loop in loops if loop not in ancestors[ins.name]]
            if ins.opcode in NESTED_EXECUTORS:
                loops.append(ins.name)
    return found
