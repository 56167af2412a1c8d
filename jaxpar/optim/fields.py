"""Which ``optim`` fields each optimizer reads: plain data, no optax import, so the config schema
(:func:`jaxpar.config.validate`) refuses a field the chosen optimizer would ignore without loading
JAX. The optimizers themselves: :mod:`jaxpar.optim.registry`."""

from __future__ import annotations

import ast
import importlib.util
from typing import Any

from jaxpar import files
from jaxpar.errors import ConfigError

# fields every optimizer reads: the learning-rate schedule (jaxpar.optim.lr) and clipping
COMMON_FIELDS = frozenset(
    {
        "name",
        "lr",
        "min_lr_ratio",
        "warmup_steps",
        "decay_steps",
        "schedule",
        "warmup_type",
        "warmup_init_lr",
        "schedule_offset",
        "decay_start_step",
        "clip_norm",
    }
)
ADAM_FIELDS = frozenset({"b1", "b2", "eps", "weight_decay", "decoupled_weight_decay"})
# optim.name -> the fields it reads beyond COMMON_FIELDS
OPTIMIZER_FIELDS: dict[str, frozenset[str]] = {
    "adamw": ADAM_FIELDS,
    "lion": frozenset({"b1", "b2", "weight_decay"}),
    "sgd": frozenset({"momentum", "nesterov", "weight_decay", "decoupled_weight_decay"}),
    "adafactor": frozenset({"momentum", "weight_decay"}),
    "muon": frozenset({"momentum", "nesterov", "b1", "b2", "eps", "weight_decay"}),  # when optax has it
}


def is_custom(name: str) -> bool:
    """``path/to/file.py:fn`` or ``package.module:fn``: a user's optax factory."""
    return ":" in name


def check_fields(o: Any, defaults: Any) -> None:
    """``optim.name`` is known (or a custom factory), and every optim field the chosen optimizer
    does not read keeps its default: a one-line :class:`ConfigError` otherwise."""
    if is_custom(o.name):
        _check_factory(o.name)  # it reads whichever fields it likes; it runs when the step is built
        return
    if o.name not in OPTIMIZER_FIELDS:
        raise ConfigError(
            f"optim.name='{o.name}': use one of {', '.join(OPTIMIZER_FIELDS)} or path/to/file.py:"
            "function returning an optax.GradientTransformation"
        )
    fields = OPTIMIZER_FIELDS[o.name]
    for key in sorted(defaults.keys()):
        if key in COMMON_FIELDS or key in fields or o[key] == defaults[key]:
            continue
        used = ", ".join(sorted(fields)) or "none"
        raise ConfigError(
            f"optim.{key}={o[key]!r} has no effect with optim.name='{o.name}' (it reads {used}); "
            f"remove it or keep the default {defaults[key]!r}"
        )
    if o.name in ("lion", "adafactor") and o.weight_decay < 0:
        raise ConfigError(f"optim.weight_decay={o.weight_decay}: must be >= 0")
    if o.name in ("sgd", "adafactor", "muon") and not (o.momentum == -1 or 0 <= o.momentum < 1):
        raise ConfigError(f"optim.momentum={o.momentum}: use a value in [0, 1) or -1 (the optimizer's default)")


def _check_factory(spec: str) -> None:
    """``path/to/file.py:fn`` names a file defining ``fn`` (read, not run), ``package.module:fn`` an
    importable module: a one-line :class:`ConfigError` otherwise."""
    where, _, fn = spec.rpartition(":")
    if not where.endswith(".py"):
        try:
            found = importlib.util.find_spec(where) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ConfigError(
                f"optim.name='{spec}': cannot import '{where}'; give path/to/file.py:function or "
                "package.module:function"
            )
        return
    source = files.read_bytes(where, "optimizer file", f"optim.name='{spec}'", "give path/to/file.py:function")
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError) as e:
        raise ConfigError(f"optim.name='{spec}': '{where}' is not valid Python ({e}); fix the file") from None
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    if fn not in names:
        raise ConfigError(f"optim.name='{spec}': '{where}' defines no function '{fn}'")
