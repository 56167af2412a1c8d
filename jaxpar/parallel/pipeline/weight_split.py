"""A layer's backward split into its input gradient (B) and its weight gradient (W).

Zero-bubble schedules (Qi et al. 2024, arXiv:2401.10241) run B on the critical path and defer W.
Splitting must not redo work: W needs, besides the forward's residuals, the cotangents B computes
at each weight's use (the output gradient of every weight matmul). Here the split is read off the
pullback itself: its jaxpr is flattened (nested ``jit`` calls inlined), every equation needed for
the input gradient goes to B, the equations needed only for weight gradients go to W, and the
values B computes that W reads (the *frontier*) are returned by B and handed to W. Each equation
runs exactly once across the two; an equation JAX does not open (a loop, a rematerialised call)
that feeds the input gradient runs whole in B.

The zero-bubble executor (:mod:`~jaxpar.parallel.pipeline.split_executor`) traces the split once,
typed as inside a tick, and runs its B part in the B tick and its W part in the W tick; only a
pullback whose constants are values of that trace is traced again in each (the same flattened
equations in the same order, so the frontier is matched by position).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Literal

_INLINED = ("pjit", "jit", "closed_call", "core_call")


@dataclasses.dataclass(eq=False)
class _Eqn:
    eqn: Any  # the jaxpr equation (primitive and params)
    ins: list[Any]  # atoms: _Var or a Literal
    outs: list[_Var]


class _Var:
    """A value of the flattened pullback."""

    __slots__ = ("aval",)

    def __init__(self, aval: Any):
        self.aval = aval


@dataclasses.dataclass(eq=False)
class Split:
    """A traced pullback, flattened and partitioned: ``inputs`` (atoms of the flat arguments),
    ``outputs`` (atoms of the flat results), the B and W equations, the frontier, and the values of
    the jaxpr's constants (``bound``)."""

    inputs: list[_Var]
    outputs: list[Any]
    is_input_grad: list[bool]
    b_eqns: list[_Eqn]
    w_eqns: list[_Eqn]
    frontier: list[_Var]
    bound: dict[int, Any]

    @property
    def frontier_avals(self) -> list[Any]:
        return [v.aval for v in self.frontier]

    def weight_reads(self) -> list[bool]:
        """For each flat argument: whether W reads it (else only B does, or nothing)."""
        used = {id(a) for e in self.w_eqns for a in e.ins}
        used |= {id(o) for o, b in zip(self.outputs, self.is_input_grad, strict=True) if not b}
        return [id(v) in used for v in self.inputs]


def _flatten(jaxpr: Any, consts: Sequence[Any], args: list[Any], eqns: list[_Eqn], bound: dict[int, Any]) -> list:
    env: dict[Any, Any] = {}
    for var, value in zip(jaxpr.constvars, consts, strict=True):
        atom = _Var(var.aval)
        bound[id(atom)] = value
        env[var] = atom
    for var, atom in zip(jaxpr.invars, args, strict=True):
        env[var] = atom

    def read(v: Any) -> Any:
        return v if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if eqn.primitive.name in _INLINED:
            inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
            closed_consts = getattr(inner, "consts", ())
            inner = getattr(inner, "jaxpr", inner)
            outs = _flatten(inner, closed_consts, ins, eqns, bound)
        else:
            outs = [_Var(v.aval) for v in eqn.outvars]
            eqns.append(_Eqn(eqn, ins, outs))
        for var, atom in zip(eqn.outvars, outs, strict=True):
            env[var] = atom
    return [read(v) for v in jaxpr.outvars]


def _needed(eqns: list[_Eqn], wanted: Sequence[Any]) -> set[int]:
    """Indices of the equations the ``wanted`` atoms depend on."""
    live = {id(a) for a in wanted if isinstance(a, _Var)}
    out = set()
    for k in range(len(eqns) - 1, -1, -1):
        if any(id(o) in live for o in eqns[k].outs):
            out.add(k)
            live |= {id(a) for a in eqns[k].ins if isinstance(a, _Var)}
    return out


def split(pullback: Callable, args: Sequence[Any], is_input_grad: Sequence[bool], available: int) -> Split:
    """Trace ``pullback(*args)`` and partition it. ``is_input_grad[i]``: flat output i is an input
    gradient (computed by B); the others are weight gradients (W). The first ``available`` flat
    arguments (the residuals) are at hand in the W tick as well; the rest (the cotangent) only
    through the frontier."""
    closed = jax.make_jaxpr(pullback)(*args)
    inputs = [_Var(v.aval) for v in closed.jaxpr.invars]
    eqns: list[_Eqn] = []
    bound: dict[int, Any] = {}
    outputs = _flatten(closed.jaxpr, closed.consts, list(inputs), eqns, bound)
    grads_in = [o for o, b in zip(outputs, is_input_grad, strict=True) if b]
    grads_w = [o for o, b in zip(outputs, is_input_grad, strict=True) if not b]
    b_idx = _needed(eqns, grads_in)
    w_idx = _needed(eqns, grads_w) - b_idx
    produced_w = {id(o) for k in w_idx for o in eqns[k].outs}
    known = produced_w | {id(v) for v in inputs[:available]} | set(bound)
    frontier, seen = [], set()
    for atom in [a for k in sorted(w_idx) for a in eqns[k].ins] + grads_w:
        if isinstance(atom, _Var) and id(atom) not in known and id(atom) not in seen:
            seen.add(id(atom))
            frontier.append(atom)
    return Split(
        inputs,
        outputs,
        list(is_input_grad),
        [eqns[k] for k in sorted(b_idx)],
        [eqns[k] for k in sorted(w_idx)],
        frontier,
        bound,
    )


def _run(eqns: list[_Eqn], env: dict[int, Any]) -> None:
    for e in eqns:
        params = e.eqn.primitive.get_bind_params(e.eqn.params)  # jax 0.10-0.12: the params alone
        vals = [a.val if isinstance(a, Literal) else env[id(a)] for a in e.ins]
        with e.eqn.ctx.manager:
            out = e.eqn.primitive.bind(*vals, **params)
        out = out if e.eqn.primitive.multiple_results else [out]
        for atom, value in zip(e.outs, out, strict=True):
            env[id(atom)] = value


def _value(atom: Any, env: dict[int, Any]) -> Any:
    if isinstance(atom, Literal):
        return jnp.broadcast_to(jnp.asarray(atom.val, atom.aval.dtype), atom.aval.shape)
    return env[id(atom)]


def run_input_grad(plan: Split, flat_args: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """B: (the input-gradient outputs, the frontier values)."""
    env = dict(plan.bound) | {id(v): x for v, x in zip(plan.inputs, flat_args, strict=True)}
    _run(plan.b_eqns, env)
    grads = [_value(o, env) for o, b in zip(plan.outputs, plan.is_input_grad, strict=True) if b]
    return grads, [env[id(v)] for v in plan.frontier]


def run_weight_grad(plan: Split, available: Sequence[Any], frontier: Sequence[Any]) -> list[Any]:
    """W: the weight-gradient outputs from the residuals (``available``) and B's frontier."""
    env = dict(plan.bound) | {id(v): x for v, x in zip(plan.inputs, available, strict=False)}
    env |= {id(v): x for v, x in zip(plan.frontier, frontier, strict=True)}
    _run(plan.w_eqns, env)
    return [_value(o, env) for o, b in zip(plan.outputs, plan.is_input_grad, strict=True) if not b]
