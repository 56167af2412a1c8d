"""Checkpoints on orbax ``CheckpointManager``: asynchronous, keep-N, atomic, restorable on any layout.

A checkpoint holds the parameters, the optimizer state (Adam moments and step count), the data
reader's position, the seed and the config. Orbax writes each step into a temporary directory
and renames it when complete, so a checkpoint interrupted by a crash is never listed: a
checkpoint is either complete or ignored.

Restoring passes abstract arrays that carry the *current* layout's shardings, so a checkpoint
written at one layout (say data=8, ZeRO-3) restores at another (data=2, tensor=2) with identical
values, each device reading only its own shard. A checkpoint that fails to restore (truncated
file, missing item, shapes that do not fit this model) is reported in one line and the previous
one is tried; with none left, a :class:`ConfigError` (exit code 2).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxpar.config import ConfigDict, ConfigError


class Checkpointer:
    """Save / restore the training state under ``<workdir>/checkpoints``."""

    def __init__(self, workdir: str, every: int, keep: int, echo: Callable[[str], None] = print):
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        self.every, self.echo = every, echo
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def should_save(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, params: Any, opt_state: Any, data_state: dict, cfg: ConfigDict) -> None:
        """Start an asynchronous save; training continues while it is written."""
        meta = {"step": step, "data": data_state, "config": json.loads(cfg.to_json())}
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
                meta=ocp.args.JsonSave(meta),
            ),
            force=True,
        )

    def wait(self) -> None:
        """Block until every started save is durable on disk."""
        self.manager.wait_until_finished()

    def restore(self, abstract_state: dict, step: int | None = None) -> tuple[int, dict, dict] | None:
        """Restore ``step`` (default: the newest that restores cleanly) onto ``abstract_state``'s
        shardings. Returns (step, state, meta), or None when there is no checkpoint at all."""
        candidates = self.steps()
        if step is not None:
            if step not in candidates:
                raise ConfigError(
                    f"train.resume={step}: no checkpoint at step {step} in {self.directory} "
                    f"(available: {candidates or 'none'}); use auto or one of those steps"
                )
            candidates = [step]
        if not candidates:
            return None
        for candidate in reversed(candidates):
            try:
                restored = self.manager.restore(
                    candidate,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
                    ),
                )
                _check_shapes(restored["state"], abstract_state)
                return candidate, restored["state"], restored["meta"]
            except Exception as e:  # damaged or incompatible: report, fall back to an older one
                first_line = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                self.echo(f"checkpoint {candidate} in {self.directory} is unusable ({first_line}); trying an older one")
        raise ConfigError(
            f"no usable checkpoint in {self.directory} (tried {candidates}); "
            "remove the directory or set --config.train.resume=never"
        )

    def restore_params(self, abstract_params: Any, step: int | None = None) -> tuple[int, Any] | None:
        """Only the parameters of ``step`` (default: the newest), onto ``abstract_params``'
        shardings; the optimizer state is not read (exports need a third of the memory). None when
        there is no checkpoint."""
        candidates = self.steps()
        if step is not None and step not in candidates:
            raise ConfigError(f"--step {step}: no checkpoint at step {step} in {self.directory} (available: "
                              f"{candidates or 'none'}); pick one of those")
        if not candidates:
            return None
        step = candidates[-1] if step is None else step
        item = {"params": abstract_params}
        args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape, dtype=a.dtype),
                            item)
        # a read-only manager of its own: a partial restore needs the PyTree handler for "state"
        reader = ocp.CheckpointManager(self.directory, item_names=("state", "meta"))
        try:
            restored = reader.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(item, restore_args=args, partial_restore=True)))
        finally:
            reader.close()
        _check_shapes(restored["state"], item)
        return step, restored["state"]["params"]

    def discard_after(self, step: int) -> None:
        """Delete the checkpoints newer than ``step`` (a rollback makes them history)."""
        for newer in [s for s in self.steps() if s > step]:
            self.manager.delete(newer)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _check_shapes(state: Any, abstract: Any) -> None:
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(abstract), strict=True):
        if tuple(got.shape) != tuple(want.shape):
            raise ValueError(
                f"{jax.tree_util.keystr(path)} has shape {tuple(got.shape)}, this model needs {tuple(want.shape)}"
            )
