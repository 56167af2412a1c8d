"""Ring bytes on the wire per collective (nccl-tests PERFORMANCE.md): all-reduce 2(n-1)/n * S,
all-gather / reduce-scatter (n-1)/n * S, collective-permute S; one axis's bytes and time per step
(:class:`AxisComm`), the link a ring over an axis uses, and the size of the gradient-reduction group.
The primitives :mod:`jaxpar.analysis.traffic` builds on."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpar.analysis.clusters import Cluster
from jaxpar.axes import MeshAxis
from jaxpar.models.inventory import ParallelLayout


def all_reduce_bytes(size_bytes: float, n: int) -> float:
    """Ring all-reduce traffic per device: 2(n-1)/n * S (nccl-tests PERFORMANCE.md)."""
    return 2 * (n - 1) / n * size_bytes


def all_gather_bytes(size_bytes: float, n: int) -> float:
    """Ring all-gather or reduce-scatter traffic per device: (n-1)/n * S (S = the full array)."""
    return (n - 1) / n * size_bytes


def ring_bytes(kind: str, n: int, size_bytes: float) -> float:
    """Ring bytes one device sends for a collective over ``n`` devices on an array of ``size_bytes``."""
    if kind == "collective-permute":
        return size_bytes
    return all_reduce_bytes(size_bytes, n) if kind == "all-reduce" else all_gather_bytes(size_bytes, n)


@dataclasses.dataclass(frozen=True)
class AxisComm:
    """Traffic one device sends over one mesh axis per optimizer step; link is intra | inter | none."""

    axis: str
    size: int
    bytes: float
    collectives: int
    link: str
    time_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def axis_link(layout: ParallelLayout, axis: str, cluster: Cluster) -> str:
    """The link a ring over ``axis`` uses. With devices ordered tensor, context, expert, data,
    pipeline (innermost first, :data:`jaxpar.axes.DEVICE_ORDER`), a ring stays in a node when the
    span of device ids it touches (t, t*c, t*c*e, t*c*e*N, all) fits in one; else it crosses the
    NIC. ``data`` is the gradient reduction over (data, expert, context): its span includes the
    expert and context ranks."""
    t, c, e = layout.tensor, layout.context, layout.expert
    span = {
        MeshAxis.TENSOR: t,
        MeshAxis.CONTEXT: t * c,
        MeshAxis.EXPERT: t * c * e,
        MeshAxis.DATA: t * c * e * layout.data,
        MeshAxis.PIPELINE: layout.devices,
    }[axis]
    return "intra" if span <= cluster.devices_per_node else "inter"
