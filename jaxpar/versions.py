"""Installed package versions, read from the distributions' metadata. Nothing is imported, so the planner
(:mod:`jaxpar.analysis.temporaries`, whose counts differ between jax releases) and the CLI's error handler
can ask without loading JAX."""

from __future__ import annotations

import importlib.metadata


def installed(distribution: str) -> str | None:
    """The installed version of ``distribution`` (``"0.10.2"``), or None where it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def jax_release() -> tuple[int, ...]:
    """The installed jax's release as numbers, ``(0, 12, 0, 1)`` for 0.12.0.1 (a pre-release or local
    suffix is dropped); ``()`` where jax is not installed."""
    version = installed("jax") or ""
    return tuple(int(part) for part in version.split("+")[0].split(".") if part.isdigit())
