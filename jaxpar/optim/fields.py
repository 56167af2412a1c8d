"""Which ``optim`` fields each optimizer reads, so the config schema (:func:`jaxpar.config.validate`)
refuses a field the chosen optimizer would ignore without loading JAX or optax: each module of
:mod:`jaxpar.optim.optimizers` declares its ``FIELDS``, read here with ``ast`` (nothing imported).
The optimizers themselves: :mod:`jaxpar.optim.registry`."""

from __future__ import annotations

import ast
import functools
import importlib.util
import pathlib
import pkgutil
import sys
from typing import Any

from jaxpar import files
from jaxpar.errors import ConfigError

# schedule fields a config written before them may lack, with the value that keeps its old curve
# (jaxpar.optim.lr reads them; the port report names them without loading JAX)
OPTIONAL_FIELDS: dict[str, Any] = {"decay_start_step": -1, "schedule_offset": 0}
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
PACKAGE = "jaxpar.optim.optimizers"  # one module per built-in optimizer, named like it


def optimizer_fields() -> dict[str, frozenset[str]]:
    """``optim.name`` -> the fields it reads beyond :data:`COMMON_FIELDS`: the ``FIELDS`` of every
    module of :data:`PACKAGE` (found on its ``__path__``, read with ``ast``, not imported)."""
    package = sys.modules.get(PACKAGE)  # once imported, its __path__ is where imports look
    folders = package.__path__ if package else importlib.util.find_spec(PACKAGE).submodule_search_locations
    return _declared(tuple(folders))


@functools.cache
def _declared(folders: tuple[str, ...]) -> dict[str, frozenset[str]]:
    out = {}
    for info in pkgutil.iter_modules(list(folders)):
        if not info.name.startswith("_") and not info.ispkg:
            out[info.name] = _fields_of(pathlib.Path(info.module_finder.find_spec(info.name).origin))
    return out


def _fields_of(path: pathlib.Path) -> frozenset[str]:
    for node in ast.parse(path.read_bytes(), str(path)).body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == "FIELDS" for t in targets):
            try:
                value = ast.literal_eval(node.value)
            except (ValueError, TypeError):  # not a literal
                value = None
            if isinstance(value, (set, frozenset, tuple, list)) and all(isinstance(f, str) for f in value):
                return frozenset(value)
            break
    raise TypeError(f"{path}: declare FIELDS = {{...}}, a literal set of the optim field names it reads")


def momentum(o: Any, default: float) -> float:
    """``optim.momentum``, -1 standing for the optimizer's ``default``."""
    return default if o.momentum < 0 else o.momentum


def is_custom(name: str) -> bool:
    """``path/to/file.py:fn`` or ``package.module:fn``: a user's optax factory."""
    return ":" in name


def check_fields(o: Any, defaults: Any) -> None:
    """``optim.name`` is known (or a custom factory), and every optim field the chosen optimizer
    does not read keeps its default: a one-line :class:`ConfigError` otherwise."""
    if is_custom(o.name):
        _check_factory(o.name)  # it reads whichever fields it likes; it runs when the step is built
        return
    declared = optimizer_fields()
    if o.name not in declared:
        raise ConfigError(
            f"optim.name='{o.name}': use one of {', '.join(declared)} or path/to/file.py:"
            "function returning an optax.GradientTransformation"
        )
    fields = declared[o.name]
    unknown = sorted(fields - set(defaults.keys()))
    if unknown:  # a module's mistake, not the config's
        raise TypeError(f"{PACKAGE}.{o.name}: FIELDS names {unknown}, not optim fields; fix its FIELDS")
    for key in sorted(defaults.keys()):
        if key in COMMON_FIELDS or key in fields or o[key] == defaults[key]:
            continue
        used = ", ".join(sorted(fields)) or "none"
        raise ConfigError(
            f"optim.{key}={o[key]!r} has no effect with optim.name='{o.name}' (it reads {used}); "
            f"remove it or keep the default {defaults[key]!r}"
        )
    if "momentum" in fields and not (o.momentum == -1 or 0 <= o.momentum < 1):
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
