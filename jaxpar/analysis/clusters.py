"""Cluster presets: the few hardware numbers the estimators need, and nothing else.

A :class:`Cluster` is a peak (dense bf16) FLOP rate, a memory size and two link bandwidths: the
fast link inside a node (NVLink, or ICI for TPU) and the per-device network link between nodes
(:func:`jaxpar.analysis.traffic.axis_link` picks one per collective). Numbers are vendor data
sheets (NVIDIA A100 / H100 / H200, Google TPU v5p): dense peaks (the 1,979 TFLOP/s quoted for
H100/H200 is 2:4-sparse; MFU is against dense), memory in decimal GB, slightly below what the GPUs
report, so it errs safe. JAX preallocates 75% of GPU memory by default: raise
``XLA_PYTHON_CLIENT_MEM_FRACTION`` before trusting a layout planned near the full memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxpar.config import ConfigDict, ConfigError

GB = 1e9  # decimal gigabyte: bandwidths and memory sizes below use it
GIB = 2**30  # binary gibibyte: every memory figure jaxpar prints per device is in GiB (links stay in GB/s)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """One kind of accelerator and how its devices are wired.

    Attributes:
        name: preset name (or a user's label).
        peak_tflops: dense bf16 peak per device, TFLOP/s (the MFU denominator).
        memory_bytes: device memory (HBM), bytes.
        hbm_gbps: HBM bandwidth, GB/s (reported, not used by the step-time model).
        devices_per_node: devices sharing the fast link (8 GPUs per server, 4 TPU chips per host).
        intra_node_gbps: fast-link bandwidth per device per direction, GB/s (NVLink / ICI).
        inter_node_gbps: network bandwidth per device per direction between nodes, GB/s.
        description: free text shown by the planner.
    """

    name: str
    peak_tflops: float
    memory_bytes: float
    hbm_gbps: float
    devices_per_node: int
    intra_node_gbps: float
    inter_node_gbps: float
    description: str = ""

    def __post_init__(self) -> None:
        for field in ("peak_tflops", "memory_bytes", "hbm_gbps", "intra_node_gbps", "inter_node_gbps"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"cluster '{self.name}': {field}={value!r} must be a positive number")
        if not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
            raise ConfigError(f"cluster '{self.name}': devices_per_node={self.devices_per_node!r} must be an int >= 1")

    @property
    def peak_flops(self) -> float:
        """Dense bf16 peak per device, FLOP/s."""
        return self.peak_tflops * 1e12

    @property
    def memory_gb(self) -> float:
        return self.memory_bytes / GB

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Vendor data sheets. NVLink numbers are per GPU per direction (A100 NVLink3 600 GB/s
# bidirectional, H100/H200 NVLink4 900 GB/s bidirectional); the network is one NIC per GPU
# (HDR 200 Gb/s = 25 GB/s, NDR 400 Gb/s = 50 GB/s).
# TPU v5p (cloud.google.com/tpu/docs/v5p): 1,200 GB/s bidirectional ICI per chip over 6 torus
# links = 100 GB/s per link per direction; a ring along one torus axis drives 2 links, so
# 200 GB/s. A v5p slice is ICI-connected across hosts, so "inter-node" is ICI too; the data-center
# network (50 Gb/s = 6.25 GB/s per chip) only joins separate slices (multislice), not modelled here.
PRESETS: dict[str, Cluster] = {
    c.name: c
    for c in (
        Cluster("a100-80g", 312.0, 80 * GB, 2039.0, 8, 300.0, 25.0, "NVIDIA A100 SXM 80GB, NVLink3, HDR InfiniBand"),
        Cluster("h100-80g", 989.0, 80 * GB, 3350.0, 8, 450.0, 50.0, "NVIDIA H100 SXM 80GB, NVLink4, NDR InfiniBand"),
        Cluster("h200-141g", 989.0, 141 * GB, 4800.0, 8, 450.0, 50.0, "NVIDIA H200 SXM 141GB, NVLink4, NDR InfiniBand"),
        Cluster("tpu-v5p", 459.0, 95 * GB, 2765.0, 4, 200.0, 200.0, "Google TPU v5p, 3D-torus ICI within a slice"),
    )
}


def get_cluster(name: str) -> Cluster:
    """The preset called ``name``; a one-line :class:`ConfigError` listing the presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"--cluster '{name}': unknown cluster; use one of {', '.join(PRESETS)}") from None


_FIELDS = tuple(f.name for f in dataclasses.fields(Cluster))
_REQUIRED = ("peak_tflops", "memory_bytes", "devices_per_node", "intra_node_gbps", "inter_node_gbps")


def cluster_from_dict(spec: Mapping[str, Any] | ConfigDict, name: str = "custom") -> Cluster:
    """A user-defined cluster from a dict or ConfigDict with the :class:`Cluster` fields; ``memory_gb``
    may replace ``memory_bytes``, and ``base`` names a preset filling the fields not given
    (``{"base": "h100-80g", "inter_node_gbps": 25}``); without one ``hbm_gbps`` defaults to 1.0
    (reported only, never used in an estimate)."""
    data = dict(spec.to_dict() if isinstance(spec, ConfigDict) else spec)
    base = data.pop("base", None)
    values: dict[str, Any] = dataclasses.asdict(get_cluster(base)) if base else {"hbm_gbps": 1.0}
    values["name"] = f"{base}-custom" if base and name == "custom" else name
    if "memory_gb" in data:
        data["memory_bytes"] = float(data.pop("memory_gb")) * GB
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"cluster '{name}': unknown field(s) {', '.join(unknown)}; use {', '.join(_FIELDS)}")
    values.update(data)
    missing = [f for f in _REQUIRED if f not in values]
    if missing:
        raise ConfigError(f"cluster '{name}': missing field(s) {', '.join(missing)}; give them or a 'base' preset")
    return Cluster(**values)
