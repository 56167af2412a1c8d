"""The ``jax.checkpoint`` policy of ``parallel.recompute``: which residuals the backward pass keeps.

Its keys are the names the kernels give their outputs: :data:`jaxpar.ops.matmul.DENSE_NAME` (a
weight matmul's output, kept by ``selective``) and :data:`jaxpar.ops.zero3.ZERO3_NAME` (a gathered
ZeRO-3 parameter, never kept: the backward pass gathers again).
"""

from __future__ import annotations

from typing import Any

import jax

from jaxpar.axes import MeshAxis
from jaxpar.ops.matmul import DENSE_NAME
from jaxpar.ops.zero3 import ZERO3_NAME


def _is_zero3_gather(prim: Any, params: dict) -> bool:
    if prim.name == "name":
        return params.get("name") == ZERO3_NAME
    if "all_gather" in prim.name:  # over data: a gathered parameter (the experts' all-gather of
        # tokens runs over `expert` alone)
        axes = params.get("axis_name", ())
        return MeshAxis.DATA in (axes if isinstance(axes, tuple) else (axes,))
    return False


def _save_all_but_zero3_gathers(prim: Any, *_: Any, **params: Any) -> bool:
    """Remat policy for ZeRO-3 without recomputation: keep every residual except gathered
    parameters (the all-gather over ``data`` and its named output), which are gathered again."""
    return not _is_zero3_gather(prim, params)


def remat_policy(remat: str) -> Any:
    """The ``jax.checkpoint`` policy of ``parallel.recompute`` (``none`` with ZeRO-3: keep all but the gathers)."""
    policies = jax.checkpoint_policies
    if remat == "full":
        return policies.nothing_saveable
    if remat == "selective":  # keep weight-matmul outputs, recompute the attention core
        # dense's dot sits inside a custom_vjp the dot policy does not see into: its output is named
        return policies.save_from_both_policies(
            policies.dots_with_no_batch_dims_saveable, policies.save_only_these_names(DENSE_NAME)
        )
    return _save_all_but_zero3_gathers
