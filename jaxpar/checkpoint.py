"""Checkpoints on orbax ``CheckpointManager``: asynchronous, keep-N, atomic, restorable on any layout.

A checkpoint holds the parameters, the optimizer state, the data reader's position, the seed and
the config. Orbax writes each step into a temporary directory and renames it when complete, so an
interrupted checkpoint is never listed. Restoring passes abstract arrays with the *current*
layout's shardings, so a checkpoint written at one layout restores at another with identical
values, each device reading only its shard. A checkpoint that fails to restore (truncated file,
missing item, shapes that do not fit) is reported in one line and the previous one tried; with
none left, a :class:`ConfigError` (exit 2). When an older one restores, the damaged newer ones are
removed (one line says which), else they would stay newest and keep-N retention would delete the
good ones. A checkpoint of another model (a ``model`` shape field differs in its saved config) is
not damaged: it is refused in one line naming the field, and nothing is removed.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxpar import files, write_guard
from jaxpar.config import ConfigDict, ConfigError


def _one_writer_per_shard() -> None:
    """Have orbax write each shard from its first replica (its default on GPUs), not split across a
    replicated array's replicas, which on CPU slices every array by a fresh ``jit`` at each save
    (docs/performance.md). Set on orbax's global handler registry; the files are the same."""
    global _ONE_WRITER
    if _ONE_WRITER:
        return
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # orbax warns of every override, this intended one included
    try:
        ocp.type_handlers.register_type_handler(
            jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True
        )
    finally:
        absl.setLevel(level)
    _ONE_WRITER = True


_ONE_WRITER = False


class Checkpointer:
    """Save / restore the training state under ``<workdir>/checkpoints``."""

    def __init__(
        self,
        workdir: str,
        every: int,
        keep: int,
        echo: Callable[[str], None] = print,
        model: ConfigDict | None = None,
        optimizer: str | None = None,
    ):
        """``model`` / ``optimizer`` (``optim.name``): a checkpoint saved with other values is refused by name
        (it is another run's, not damaged: nothing is deleted)."""
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        self.every, self.echo, self.model, self.optimizer = every, echo, model, optimizer
        _one_writer_per_shard()
        if os.path.isdir(self.directory):  # orbax reads each step's metadata as the manager starts
            for name in sorted(os.listdir(self.directory)):
                if name.isdigit():
                    self.check_files(int(name))
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def should_save(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, params: Any, opt_state: Any, data_state: dict, cfg: ConfigDict) -> None:
        """Start an asynchronous save; training continues while it is written."""
        meta = {"step": step, "data": data_state, "config": json.loads(cfg.to_json())}
        with self._disk_errors():
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
        with self._disk_errors():
            self.manager.wait_until_finished()

    @contextlib.contextmanager
    def _disk_errors(self) -> Iterator[None]:
        """A full disk under a save (raised here, or by orbax's writer thread at the next wait) is an
        OSError naming the checkpoint folder: one line; the earlier checkpoints stay (orbax renames a
        step's folder into place only when it is complete)."""
        try:
            yield
        except Exception as e:
            full = write_guard.disk_full(e, self.directory)
            if full is None:
                raise
            raise full from e

    def restore(
        self, abstract_state: dict, step: int | None = None, prune_damaged: bool = True
    ) -> tuple[int, dict, dict] | None:
        """Restore ``step`` (default: the newest that restores cleanly) onto ``abstract_state``'s
        shardings. Returns (step, state, meta), or None when there is no checkpoint at all. With
        ``prune_damaged``, damaged checkpoints newer than the one restored are deleted."""
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
        damaged: list[int] = []
        for candidate in reversed(candidates):
            self.check_files(candidate)
            try:
                self._check_model(candidate)
                restored = self.manager.restore(
                    candidate,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
                    ),
                )
                _check_shapes(restored["state"], abstract_state, candidate)
            except ConfigError:  # another model's checkpoint: the user's, not damaged
                raise
            except Exception as e:  # damaged: report, fall back to an older one
                _quiet_failed_reads()
                self.echo(
                    f"checkpoint {candidate} in {self.directory} is unusable ({_first_line(e)}); trying an older one"
                )
                damaged.append(candidate)
                continue
            if damaged and prune_damaged:
                for bad in damaged:
                    self.manager.delete(bad)
                self.echo(
                    f"removed damaged checkpoint(s) {sorted(damaged)} from {self.directory} (resumed from "
                    f"step {candidate}; keep-N retention counts only restorable ones now)"
                )
            return candidate, restored["state"], restored["meta"]
        raise ConfigError(
            f"no usable checkpoint in {self.directory} (tried {candidates}); "
            "remove the directory or set --config.train.resume=restart to start over"
        )

    def check_files(self, step: int) -> None:
        """ConfigError unless every file of checkpoint ``step`` is a regular one (a FIFO would block orbax's
        read for good) and its metadata (``meta/``, ``_CHECKPOINT_METADATA``) within the cap of its kind;
        nothing is deleted: a checkpoint holding such a file is not jaxpar's damage."""

        def kind(relative: str) -> str:
            metadata = relative.startswith("meta" + os.sep) or relative == "_CHECKPOINT_METADATA"
            return "checkpoint metadata" if metadata else "checkpoint arrays"

        folder = os.path.join(self.directory, str(step))
        what, fix = (
            f"checkpoint {step} in {self.directory}",
            "move it out of the checkpoint or point train.workdir elsewhere",
        )
        files.check_tree(folder, what, fix, kind)
        for name in ("_CHECKPOINT_METADATA", os.path.join("meta", "metadata")):  # files, not folders
            if os.path.lexists(os.path.join(folder, name)):
                files.check(os.path.join(folder, name), "checkpoint metadata", what, fix)

    def _check_model(self, step: int) -> None:
        """ConfigError naming the first model field whose saved value (the checkpoint's config) differs
        from this run's; reading the small meta item first spares a failing restore of every array."""
        if self.model is None and self.optimizer is None:
            return
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        config = (meta.get("config") or {}) if isinstance(meta, dict) else {}
        optim = config.get("optim") if isinstance(config.get("optim"), dict) else {}
        if self.optimizer is not None and "name" in optim and optim["name"] != self.optimizer:
            raise ConfigError(
                f"checkpoint {step} in {self.directory} holds the state of optimizer optim.name={optim['name']!r} but "
                f"the config has {self.optimizer!r}; set --config.optim.name={optim['name']} to resume it, "
                "train.resume=restart to start over, or point train.workdir at another folder"
            )
        if self.model is None:
            return
        saved = config.get("model") or {}
        for field in MODEL_SHAPE_FIELDS:
            if field in saved and saved[field] != self.model[field]:
                raise ConfigError(
                    f"checkpoint {step} in {self.directory} was written with model.{field}={saved[field]!r} but the "
                    f"config has {self.model[field]!r}; set --config.model.{field}={saved[field]} to use it, or "
                    "point train.workdir at another folder"
                )

    def restore_params(self, abstract_params: Any, step: int | None = None) -> tuple[int, Any] | None:
        """Only the parameters of ``step`` (default: the newest), onto ``abstract_params``'
        shardings; the optimizer state is not read (exports need a third of the memory). None when
        there is no checkpoint. Without ``step``, damaged checkpoints are reported (``echo``) and skipped;
        a damaged ``step`` is a ConfigError naming it."""
        candidates = self.steps()
        if step is not None and step not in candidates:
            raise ConfigError(
                f"--step {step}: no checkpoint at step {step} in {self.directory} (available: "
                f"{candidates or 'none'}); pick one of those"
            )
        if not candidates:
            return None
        tried = candidates[::-1] if step is None else [step]
        item = {"params": abstract_params}
        args = jax.tree.map(
            lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape, dtype=a.dtype), item
        )
        # a read-only manager of its own: a partial restore needs the PyTree handler for "state"
        reader = ocp.CheckpointManager(self.directory, item_names=("state", "meta"))
        try:
            for candidate in tried:
                self.check_files(candidate)
                try:
                    self._check_model(candidate)
                    restored = reader.restore(
                        candidate,
                        args=ocp.args.Composite(
                            state=ocp.args.PyTreeRestore(item, restore_args=args, partial_restore=True)
                        ),
                    )
                    _check_shapes(restored["state"], item, candidate)
                except ConfigError:
                    raise
                except Exception as e:  # damaged: name it; without --step, fall back to an older one
                    _quiet_failed_reads()
                    if step is not None:
                        raise ConfigError(
                            f"--step {step}: checkpoint {step} in {self.directory} is damaged "
                            f"({_first_line(e)}); pick another step"
                        ) from e
                    self.echo(
                        f"checkpoint {candidate} in {self.directory} is unusable ({_first_line(e)}); "
                        "trying an older one"
                    )
                    continue
                return candidate, restored["state"]["params"]
        finally:
            reader.close()
        raise ConfigError(
            f"no usable checkpoint in {self.directory} (tried {tried}, all damaged); "
            "pass --step with a good one or train again"
        )

    def discard_after(self, step: int) -> None:
        """Delete the checkpoints newer than ``step`` (a rollback makes them history)."""
        for newer in [s for s in self.steps() if s > step]:
            self.manager.delete(newer)

    def close(self) -> None:
        with self._disk_errors():
            self.manager.wait_until_finished()
        self.manager.close()


# model fields that fix the parameter shapes (a checkpoint of another value cannot be restored)
MODEL_SHAPE_FIELDS = (
    "vocab_size",
    "embed_dim",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "mlp_dim",
    "tie_embeddings",
    "norm",
    "mlp_activation",
    "position",
    "max_seq_len",
)


def _quiet_failed_reads() -> None:
    """After a failed restore, orbax's pending reads of the other arrays end as dozens of "Exception
    ignored in ..." tracebacks that say nothing the one-line note has not: dropped (hook installed
    once per process); every other unraisable exception still reaches the previous hook."""
    previous = sys.unraisablehook
    if getattr(previous, "jaxpar_quiet", False):
        return

    def hook(unraisable: Any) -> None:
        text = f"{unraisable.exc_value!r} {unraisable.object!r}"
        if "Event loop is closed" in text or "_read_array_index_and_device_put" in text:
            return
        previous(unraisable)

    hook.jaxpar_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
    gc.collect()  # finalise the abandoned reads now, under the hook


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def _check_shapes(state: Any, abstract: Any, step: int) -> None:
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(abstract), strict=True):
        if tuple(got.shape) != tuple(want.shape):
            raise ConfigError(
                f"checkpoint {step}: {jax.tree_util.keystr(path)} has shape {tuple(got.shape)}, this model needs "
                f"{tuple(want.shape)}; train this config in another train.workdir"
            )
