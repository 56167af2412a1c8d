"""Throughput, model FLOPs, MFU and the per-step metrics log.

Training FLOPs per token = 6 * N + 12 * L * h * s, N = parameters doing matmul work (not the input
embedding lookup), the attention term non-causal as in PaLM (Chowdhery et al. 2022, appendix B;
nanoGPT's ``estimate_mfu``). MFU = achieved model FLOP/s per device / peak FLOP/s per device;
recomputation is not counted (that would be HFU). Every step's row goes to
``<workdir>/metrics.jsonl`` and, as scalars, to TensorBoard event files in the workdir
(:class:`TensorBoardWriter`); :func:`read_event_scalars` reads them back.
"""

from __future__ import annotations

import json
import os
import statistics
import struct
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import files
from jaxpar.config import ConfigDict
from jaxpar.models.flops import flops_per_token

# Dense bf16 peaks per device, TFLOP/s (NVIDIA A100 / H100 / H200 and Google TPU v5p data sheets, dense, no sparsity).
PEAK_TFLOPS = {"a100": 312.0, "h100": 989.0, "h200": 989.0, "tpu v5p": 459.0, "tpu v5": 459.0}


def model_flops_per_token(model_cfg: ConfigDict, seq_len: int) -> float:
    """Training FLOPs per token: 6N + 12*L*h*s (the planner's formula, non-causal convention)."""
    return flops_per_token(model_cfg, seq_len, causal=False)


_CPU_PEAK_CACHE: dict[int, float] = {}


def measure_cpu_peak_flops(num_devices: int) -> float:
    """Peak FLOP/s per simulated CPU device, measured once with a fp32 matmul: the host's rate over
    the number of devices (they share its cores). A measurement, not a data sheet, as the MFU printed
    on CPU says."""
    if num_devices in _CPU_PEAK_CACHE:
        return _CPU_PEAK_CACHE[num_devices]
    n = 1024
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    reps, start = 10, time.perf_counter()
    for _ in range(reps):
        out = mm(a)
    out.block_until_ready()
    rate = 2 * n**3 * reps / (time.perf_counter() - start)
    _CPU_PEAK_CACHE[num_devices] = rate / num_devices
    return _CPU_PEAK_CACHE[num_devices]


def device_peak_flops(num_devices: int) -> tuple[float, str]:
    """(peak FLOP/s per device, where the number comes from)."""
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", "").lower()
    for name, tflops in PEAK_TFLOPS.items():
        if name in kind:
            return tflops * 1e12, f"{dev.device_kind} data sheet, dense bf16"
    if dev.platform == "cpu":
        return measure_cpu_peak_flops(num_devices), "measured fp32 matmul on this host / simulated devices"
    return float("nan"), f"unknown device kind '{dev.device_kind}'"


class MetricsLog:
    """Per-step metrics: appends one JSON object per step to ``<workdir>/metrics.jsonl`` and keeps
    the steady-state figures (steps after ``warmup_excluded`` and excluding evaluation: a step's
    time runs from the end of the step before it or its own dispatch, whichever is later)."""

    def __init__(
        self,
        workdir: str,
        flops_per_token: float,
        peak_flops: float,
        num_devices: int,
        warmup_excluded: int,
        write: bool = True,
        tensorboard: bool = True,
    ):
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.tensorboard = TensorBoardWriter(workdir) if write and tensorboard else None
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.num_devices = num_devices
        self.warmup_excluded = warmup_excluded
        self.step_times: list[float] = []
        self.tokens: list[int] = []
        self.write = write
        if write:
            os.makedirs(workdir, exist_ok=True)
            _end_partial_line(self.path)

    def record(self, step: int, step_time_s: float, tokens: int, values: dict[str, Any]) -> dict[str, Any]:
        tokens_per_s = tokens / step_time_s
        tflops = tokens_per_s * self.flops_per_token / self.num_devices / 1e12
        row = {
            "step": step,
            **{k: float(v) for k, v in values.items()},
            "step_time_s": step_time_s,
            "tokens_per_s": tokens_per_s,
            "tflops_per_device": tflops,
            "mfu": tflops * 1e12 / self.peak_flops,
            "time": time.time(),
        }
        self.step_times.append(step_time_s)
        self.tokens.append(tokens)
        if self.write:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.scalars(step, row, "train/")
        return row

    def record_event(self, row: dict[str, Any]) -> None:
        if self.write:
            with open(self.path, "a") as f:
                f.write(json.dumps({**row, "time": time.time()}) + "\n")
        if self.tensorboard is not None and "val_bits" in row:
            unit = str(row.get("unit", "bits")).replace("/", "_per_")
            self.tensorboard.scalars(row["step"], {unit: row["val_bits"]}, "val/")

    def close(self) -> None:
        """Flush and close the TensorBoard writer (metrics.jsonl is written line by line)."""
        if self.tensorboard is not None:
            self.tensorboard.close()

    def steady_state(self) -> dict[str, float]:
        """Median step time and mean throughput over the steps after warm-up: the first
        ``warmup_excluded`` steps this log recorded, and never the first one (the step that compiled,
        also after a resume); with too few steps, all but the first."""
        first = max(self.warmup_excluded, 1)
        times = self.step_times[first:] or self.step_times[1:]
        tokens = self.tokens[first:] or self.tokens[1:]
        if not times:
            return {}
        tokens_per_s = float(np.sum(tokens) / np.sum(times))
        tflops = tokens_per_s * self.flops_per_token / self.num_devices / 1e12
        return {
            "steps": len(times),
            "median_step_time_s": statistics.median(times),
            "tokens_per_s": tokens_per_s,
            "tflops_per_device": tflops,
            "mfu": tflops * 1e12 / self.peak_flops,
        }


class TensorBoardWriter:
    """Scalars of each step into TensorBoard event files in ``logdir`` (tensorboardX's
    ``SummaryWriter``), tagged ``train/<metric>`` and ``val/<unit>``."""

    SKIP = frozenset({"step", "time"})

    def __init__(self, logdir: str):
        self.writer = _summary_writer_class()(logdir=logdir, flush_secs=10)

    def scalars(self, step: int, row: dict[str, Any], prefix: str) -> None:
        for key, value in row.items():
            if key not in self.SKIP and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(prefix + key, float(value), global_step=int(step))

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


def _summary_writer_class() -> type:
    """tensorboardX's ``SummaryWriter``, imported without PyTorch: tensorboardX imports an installed
    ``torch`` only to accept torch tensors, which costs seconds at every start; jaxpar writes floats,
    so a torch not yet imported is hidden for the duration of the import."""
    import sys

    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def read_event_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files of ``logdir``: tag -> [(step, value)] in file
    order. Reads the TFRecord framing (length, CRC, record, CRC) and parses each record with
    tensorboardX's ``Event`` protocol buffer; values are float32 as stored."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    names = sorted(f for f in os.listdir(logdir) if f.startswith("events.out.tfevents"))
    for name in names:
        data = files.read_bytes(
            os.path.join(logdir, name), "metrics log", "metrics", "point at a run's tensorboard folder"
        )
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            record = data[pos + 12 : pos + 12 + length]
            pos += 12 + length + 4
            if len(record) < length:
                break  # a record cut short by a crash
            event = Event.FromString(record)
            for value in event.summary.value:
                number = (
                    value.simple_value
                    if value.HasField("simple_value")
                    else (value.tensor.float_val[0] if value.tensor.float_val else float("nan"))
                )
                out.setdefault(value.tag, []).append((int(event.step), float(number)))
    return out


def _end_partial_line(path: str) -> None:
    """A run killed mid-write leaves a line without its newline: end it so appends stay parseable."""
    if os.path.exists(path) and os.path.getsize(path):
        with open(path, "rb+") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")


def read_metrics(path: str) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl, skipping a line cut short by a crash."""
    rows = []
    text = files.read_bytes(path, "metrics log", "metrics", "point train.workdir at a run's folder")  # no FIFO's hang
    for line in text.decode("utf-8", errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
