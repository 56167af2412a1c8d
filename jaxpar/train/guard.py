"""Bad-step handling: the spike threshold of each step and the skip counters.

An update is skipped (:meth:`jaxpar.train.step.StepBuilder.local_step`) when its loss or gradient
norm is not finite or its loss exceeds ``spike_factor`` x the median of the last ``WINDOW`` good
losses (once there are ``MIN_HISTORY``; no threshold before, or with ``spike_factor`` 0).
``train.max_bad_steps`` skipped steps in a row roll back to the last checkpoint and skip the
offending data (:meth:`jaxpar.train.loop.Trainer.rollback`), PaLM's remedy for loss spikes
(Chowdhery et al. 2022, section 5.1).

Step n+1's threshold depends on step n's loss, but the loop reads step n's metrics only after
dispatching step n+1, so the history lives on the device (:class:`SpikeThreshold`), updated by a
small jitted function without a device-to-host transfer. :class:`BadStepGuard` is the host side:
the same rule on host floats (the reference the device is tested against) and the skip counters.
Both compute in float32 (median of an even count ``(a + b) * 0.5``, threshold
``float32(spike_factor) * median``), so host and device agree bit for bit.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

WINDOW, MIN_HISTORY = 64, 10  # good losses kept; how many before a threshold applies


class BadStepGuard:
    """Host side of bad-step handling: the threshold rule on host floats (:meth:`max_loss`) and the
    skip counters (``consecutive``, ``total``) of the steps observed so far."""

    WINDOW, MIN_HISTORY = WINDOW, MIN_HISTORY

    def __init__(self, spike_factor: float):
        self.spike_factor = spike_factor
        self.history: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.consecutive = 0
        self.total = 0

    def max_loss(self) -> float:
        """``spike_factor`` x the median of the good losses kept, in float32; inf when off or too few."""
        if not self.spike_factor or len(self.history) < MIN_HISTORY:
            return float("inf")
        data = sorted(np.float32(x) for x in self.history)
        mid = len(data) // 2
        median = data[mid] if len(data) % 2 else (data[mid - 1] + data[mid]) * np.float32(0.5)
        return float(np.float32(self.spike_factor) * median)

    def observe(self, loss: float, skipped: bool, overflow: bool = False) -> None:
        """``overflow``: an fp16 step skipped for a gradient overflow (:mod:`jaxpar.train.loss_scale`):
        counted in ``total`` but not in ``consecutive`` (the scale, not a rollback, is the remedy)."""
        if overflow:
            self.total += 1
        elif skipped:
            self.consecutive += 1
            self.total += 1
        else:
            self.consecutive = 0
            self.history.append(loss)


def _advance(
    history: jax.Array, count: jax.Array, loss: jax.Array, skipped: jax.Array, *, spike_factor: float, inject: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fold one step's (loss, skipped) into the ring ``history`` (``count`` good losses seen so far),
    then the next step's guard ``[max_loss, loss_offset]``: :meth:`BadStepGuard.max_loss` on device."""
    good = skipped == 0
    history = jnp.where(good, history.at[count % WINDOW].set(loss), history)
    count = count + good.astype(count.dtype)
    kept = jnp.minimum(count, WINDOW)  # the ring's first `kept` slots are filled
    data = jnp.sort(jnp.where(jnp.arange(WINDOW) < kept, history, jnp.inf))
    lo, hi = data[(kept - 1) // 2], data[kept // 2]
    median = jnp.where(kept % 2 == 1, hi, (lo + hi) * jnp.float32(0.5))
    threshold = jnp.where(kept >= MIN_HISTORY, jnp.float32(spike_factor) * median, jnp.inf)
    if not spike_factor:
        threshold = jnp.float32(jnp.inf)
    offset = jnp.float32(np.nan if inject else 0.0)
    return history, count, jnp.stack([threshold, offset]).astype(jnp.float32)


def _replicated(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


class SpikeThreshold:
    """The loss history on the device and each step's guard, computed without reading any metrics.

    :meth:`guard` folds the metrics of the step dispatched last (device arrays, :meth:`dispatched`)
    into the history and returns the next step's ``[max_loss, loss_offset]`` guard, replicated over
    the mesh; :meth:`discard` forgets a dispatched step whose result was thrown away (a rollback)."""

    def __init__(self, spike_factor: float, replicated: NamedSharding):
        self.history = _replicated(np.full((WINDOW,), np.inf, np.float32), replicated)
        self.count = _replicated(np.array(0, np.int32), replicated)
        self._nothing = {
            "loss": _replicated(np.array(np.nan, np.float32), replicated),
            "skipped": _replicated(np.array(1, np.int32), replicated),
        }  # folds as "no good loss"
        self._unfolded: dict[str, Any] | None = None
        shardings = (replicated, replicated, replicated)
        self._advance = {
            inject: jax.jit(
                functools.partial(_advance, spike_factor=float(spike_factor), inject=inject), out_shardings=shardings
            )
            for inject in (False, True)
        }

    def guard(self, inject: bool = False) -> jax.Array:
        """The next step's guard; ``inject`` makes its loss NaN (``train.inject_bad_steps``)."""
        metrics = self._unfolded or self._nothing
        self.history, self.count, guard = self._advance[inject](
            self.history, self.count, metrics["loss"], metrics["skipped"]
        )
        self._unfolded = None
        return guard

    def dispatched(self, metrics: dict[str, Any]) -> None:
        """The metrics (device arrays) of the step just dispatched: folded in by the next :meth:`guard`."""
        self._unfolded = metrics

    def discard(self) -> None:
        self._unfolded = None
