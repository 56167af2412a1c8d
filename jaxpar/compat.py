"""Small shims over JAX API differences between the supported releases (0.10 to 0.12)."""

from __future__ import annotations

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
