"""Keys that moved: :data:`MOVED_KEYS` (an old key -> its name under ``parallel``, the layout's own
names) and :func:`moved_key_error`, the one line a config file or an override that sets one gets."""

from __future__ import annotations

from typing import Any

# Keys that moved into the `parallel` group (the layout's own names); setting one is an error naming the new key.
MOVED_KEYS = {  # rename_keys: keep
    "model.remat": "parallel.recompute",  # rename_keys: keep
    "train.microbatches": "parallel.microbatches",  # rename_keys: keep
    "pipeline.schedule": "parallel.pipeline_schedule",  # rename_keys: keep
    "pipeline.virtual_stages": "parallel.virtual_stages",  # rename_keys: keep
    "pipeline.layers_per_stage": "parallel.layers_per_stage",  # rename_keys: keep
    "pipeline.first_stage_layers": "parallel.first_stage_layers",  # rename_keys: keep
    "pipeline.last_stage_layers": "parallel.last_stage_layers",  # rename_keys: keep
}
REMOVED_SECTIONS = ("pipeline",)  # sections whose fields all moved (to `parallel`)


def moved_key_error(key: str, value: Any, origin: str) -> str | None:
    """The one-line error for an old ``key`` (:data:`MOVED_KEYS`, or a field of a removed section) set
    to ``value`` from ``origin`` (a config file, ``--config.<key>``, or ``jaxpar port``'s ``--set <key>``:
    the fix then names the same flag); None for a current key."""
    section = key.partition(".")[0]
    new = MOVED_KEYS.get(key)
    if new is None and section not in REMOVED_SECTIONS:
        return None
    if new is None:
        return (
            f"{origin}: the {section} section is gone (its fields moved to parallel: "
            f"{', '.join(v for k, v in MOVED_KEYS.items() if k.startswith(section + '.'))}); "
            f"'{key}' is not one of them: see jaxpar/config/schema.py for the fields"
        )
    for flag in ("--config.", "--set "):
        if origin.startswith(flag):
            return f"{key} moved to {new}: use {flag}{new}={value}"
    return f"{origin}: {key} moved to {new}: set c.{new} = {value!r} (or --config.{new}={value})"
