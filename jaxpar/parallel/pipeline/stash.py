"""A stage's saved activations, kept from its forward tick to its backward tick (no recomputation).

``jax.vjp`` returns its pullback as a pytree whose leaves are the residuals (the values the backward
reads) and whose structure is static, so a residual can be written into a slot buffer in the scan's
carry at the forward tick and the pullback rebuilt from the slot at the backward tick, as Megatron-LM
and ``torch.distributed.pipelining`` keep each in-flight microbatch's saved tensors.

Not every residual belongs in a slot: the layers' weights (forwarded inputs), their casts to the
compute dtype, rotary tables and masks do not depend on the microbatch, and one copy per in-flight
microbatch would cost a multiple of the parameters. :func:`split` traces the residuals as a jaxpr and
keeps, by dead-code elimination, only those that depend on the microbatch's data (the stage input and
its tokens); the backward recomputes the others from the parameters with the pruned jaxpr (casts,
ZeRO-3 gathers: what the backward without a stash would compute as well).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import Literal

from jaxpar.compat import dce_jaxpr, varying_axes


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
    """The residuals of ``jax.vjp(fn, *args)``: the pullback's structure, which leaves are kept per
    microbatch (``kept[i]``), the jaxpr of all leaves and its part computing the recomputed ones."""

    treedef: Any
    kept: tuple[bool, ...]
    jaxpr: Any  # ClosedJaxpr: args -> all residual leaves
    recompute: Any  # Jaxpr: args -> the leaves not kept

    @property
    def kept_avals(self) -> list[Any]:
        """Abstract values (shape, dtype, varying mesh axes) of the kept leaves."""
        return [v.aval for v, k in zip(self.jaxpr.jaxpr.outvars, self.kept, strict=True) if k]

    @property
    def kept_bytes(self) -> int:
        """Bytes of one microbatch's kept residuals on one device."""
        return sum(a.size * a.dtype.itemsize for a in self.kept_avals)


def split(fn: Callable, args: Sequence[Any], data: Sequence[int], kept: Sequence[bool] | None = None) -> Split:
    """Trace ``jax.vjp(fn, *args)`` and split its residual leaves into those depending on the
    arguments at positions ``data`` (kept) and the others (recomputed). ``kept``: the split of an
    earlier trace of the same function (the same structure), not searched again."""
    box: dict[str, Any] = {}

    def leaves(*a: Any) -> list[jax.Array]:
        _, pullback = jax.vjp(fn, *a)
        out, box["treedef"] = jax.tree.flatten(pullback)
        return out

    closed = jax.make_jaxpr(leaves)(*args)
    if kept is not None:
        return Split(box["treedef"], tuple(kept), closed, dce_jaxpr(closed.jaxpr, [not k for k in kept]))
    flat_in = [len(jax.tree.leaves(a)) for a in args]
    starts = [sum(flat_in[:i]) for i in range(len(args))]
    data_vars = {id(v) for i in data for v in closed.jaxpr.invars[starts[i] : starts[i] + flat_in[i]]}
    n = len(closed.jaxpr.outvars)
    found = [bool(_inputs_used(dce_jaxpr(closed.jaxpr, [j == i for j in range(n)])) & data_vars) for i in range(n)]
    return Split(box["treedef"], tuple(found), closed, dce_jaxpr(closed.jaxpr, [not k for k in found]))


def _inputs_used(jaxpr: Any) -> set[int]:
    """ids of the variables a (pruned) jaxpr reads at its top level or returns."""
    used = {id(v) for eqn in jaxpr.eqns for v in eqn.invars if not isinstance(v, Literal)}
    return used | {id(v) for v in jaxpr.outvars if not isinstance(v, Literal)}


def forward(fn: Callable, args: Sequence[Any], plan: Split) -> tuple[Any, list[jax.Array]]:
    """``fn(*args)`` and the residual leaves ``plan`` keeps (in leaf order)."""
    out, pullback = jax.vjp(fn, *args)
    leaves = jax.tree.leaves(pullback)
    return out, [leaf for leaf, k in zip(leaves, plan.kept, strict=True) if k]


def pullback(args: Sequence[Any], kept: Sequence[jax.Array], plan: Split) -> Callable:
    """The pullback of ``fn`` at ``args`` from the kept leaves (read back from the stash) and the
    others recomputed from ``args`` (only their parameter parts are read)."""
    flat = jax.tree.leaves(list(args))
    others = iter(jax.core.eval_jaxpr(plan.recompute, plan.jaxpr.consts, *flat))
    stored = iter(kept)
    leaves = [next(stored) if k else next(others) for k in plan.kept]
    return jax.tree.unflatten(plan.treedef, leaves)


def pack(items: Sequence[Any], bins: Sequence[Any], usable: Sequence[bool]) -> list[tuple[int, int] | None]:
    """Where each of ``items`` (abstract values) can wait inside a kept residual that is no longer
    read (``bins[k]`` with ``usable[k]``): (bin, element offset), first fit by decreasing size, or
    None. An item fits a bin of its dtype and varying mesh axes with room for its elements, so a
    value needed later can take the place of one needed no more in the same stash slot."""
    room = [b.size if u else 0 for b, u in zip(bins, usable, strict=True)]
    places: list[tuple[int, int] | None] = [None] * len(items)
    for i in sorted(range(len(items)), key=lambda i: -items[i].size):
        a = items[i]
        for k, b in enumerate(bins):
            if room[k] >= a.size and b.dtype == a.dtype and varying_axes(b) == varying_axes(a):
                places[i], room[k] = (k, b.size - room[k]), room[k] - a.size
                break
    return places


def put(bins: Sequence[jax.Array], items: Sequence[jax.Array], places: Sequence[Any]) -> list[jax.Array]:
    """``bins`` with each placed item written at its offset (all stacked over a leading dim)."""
    out = list(bins)
    for item, place in zip(items, places, strict=True):
        if place is not None:
            k, off = place
            flat = out[k].reshape(out[k].shape[0], -1).at[:, off : off + item[0].size].set(item.reshape(len(item), -1))
            out[k] = flat.reshape(out[k].shape)
    return out


def take(bins: Sequence[jax.Array], place: tuple[int, int], aval: Any) -> jax.Array:
    """The item of shape ``aval.shape`` (per leading index) placed at ``place`` by :func:`put`."""
    k, off = place
    flat = bins[k].reshape(bins[k].shape[0], -1)
    return flat[:, off : off + aval.size].reshape(bins[k].shape[0], *aval.shape)
