"""Small shims over JAX API differences between the supported releases (0.10 to 0.12)."""

from __future__ import annotations

from typing import Any

import jax


def all_gather_invariant(x: jax.Array, axis_name: str, *, axis: int) -> jax.Array:
    """Tiled all-gather whose result is typed *invariant* over ``axis_name`` (same on every rank).

    Used for ZeRO-1/2 parameter gathers after the sharded update, so the parameters leave the
    ``shard_map`` as replicated over ``data``.
    """
    for to in ("invarying", "invariant"):
        try:
            return jax.lax.all_gather(x, axis_name, axis=axis, tiled=True, to=to)
        except ValueError as e:
            if "to" not in str(e):
                raise
    from jax._src.lax.parallel import all_gather_invariant as _agi  # older releases

    return _agi(x, axis_name, axis=axis, tiled=True)


def varying_axes(x: Any) -> frozenset:
    """Mesh axes over which a traced value (or ShapeDtypeStruct) varies (shard_map check_vma)."""
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def vary(x: jax.Array, axes: frozenset) -> jax.Array:
    """Mark ``x`` varying over ``axes`` (no-op for those it already varies over)."""
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x
