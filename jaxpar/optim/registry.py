"""The optimizer registry: ``optim.name`` -> how to build it and its state size.

A built-in optimizer is one module of :mod:`jaxpar.optim.optimizers` (its contract there), found by
``pkgutil.iter_modules`` and imported here when first asked for (:func:`optimizers`): ``build``
``(optim_cfg, schedule, placements) -> optax.GradientTransformation`` and ``state``, the formula of
its per-parameter state leaves, which the planner prices (:func:`state_leaves`). Built in:
``adamw`` (default; jaxpar's own, inside the step's ``shard_map``), ``lion``, ``sgd``,
``adafactor``, ``muon`` (where optax has it).

Any other optax transformation: ``optim.name = "path/to/file.py:fn"`` (or ``"package.module:fn"``),
``fn(optim_cfg, learning_rate, weight_decay_mask) -> optax.GradientTransformation`` with the
schedule (:mod:`jaxpar.optim.lr`) and a tree of bools like the parameters (False for norms). It sees
the stored tree (stacked layers as one tensor), may read any field, and its state is not priced.
``optim.clip_norm`` clips the global norm before every optimizer, mesh-aware.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import math
import pathlib
from collections.abc import Callable
from typing import Any

import optax

from jaxpar import files
from jaxpar.config import ConfigDict, ConfigError
from jaxpar.optim.fields import PACKAGE, is_custom, optimizer_fields
from jaxpar.optim.state import StateLeaf, local_size, spec_for
from jaxpar.optim.transforms import decay_mask


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """One registry entry (see the module docstring)."""

    name: str
    build: Callable[[ConfigDict, Callable, Any], optax.GradientTransformation]
    state: Callable[[ConfigDict, tuple[int, ...], tuple[str, ...]], list[StateLeaf]]
    in_shard_map: bool = False  # jaxpar's own update inside the step's shard_map (adamw)


def optimizers() -> dict[str, Optimizer]:
    """Every built-in optimizer the installed optax offers, by ``optim.name``."""
    return _imported(tuple(optimizer_fields()))


@functools.cache
def _imported(names: tuple[str, ...]) -> dict[str, Optimizer]:
    out = {}
    for name in names:
        module = importlib.import_module(f"{PACKAGE}.{name}")
        if getattr(module, "available", lambda: True)():  # muon: only where optax has it
            out[name] = Optimizer(name, module.build, module.state, getattr(module, "IN_SHARD_MAP", False))
    return out


# --------------------------------------------------------------------------- custom factories


def _load_factory(spec: str) -> Callable:
    where, _, fn = spec.rpartition(":")
    if where.endswith(".py"):
        path = pathlib.Path(where)
        source = files.read_bytes(path, "optimizer file", f"optim.name='{spec}'", "give path/to/file.py:function")
        module_spec = importlib.util.spec_from_file_location(f"jaxpar_optimizer_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            exec(compile(source, str(path), "exec"), module.__dict__)  # the bytes read above, not a second open
        except Exception as e:
            raise ConfigError(f"optim.name='{spec}': '{where}' failed to load ({type(e).__name__}: {e})") from e
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise ConfigError(f"optim.name='{spec}': cannot import '{where}' ({e})") from e
    if not callable(getattr(module, fn, None)):
        raise ConfigError(f"optim.name='{spec}': '{where}' defines no function '{fn}'")
    return getattr(module, fn)


def _custom(spec: str) -> Optimizer:
    factory = _load_factory(spec)

    def build(o: ConfigDict, schedule: Callable, placements: Any) -> optax.GradientTransformation:
        tx = factory(o, learning_rate=schedule, weight_decay_mask=decay_mask(placements))
        if not isinstance(tx, optax.GradientTransformation):
            raise ConfigError(f"optim.name='{spec}': returned {type(tx).__name__}, not an optax.GradientTransformation")
        return tx

    return Optimizer(spec, build, state=lambda o, shape, logical: [])


# --------------------------------------------------------------------------- public


def get(name: str) -> Optimizer:
    """The registry entry (or a custom factory's) for ``optim.name``; unknown -> ConfigError."""
    if is_custom(name):
        return _custom(name)
    offered = optimizers()
    if name not in offered:  # muon without optax.contrib.muon, or an unknown name
        raise ConfigError(
            f"optim.name='{name}': this optax offers {', '.join(offered)}; use one of them or "
            "path/to/file.py:function returning an optax.GradientTransformation"
        )
    return offered[name]


def state_leaves(optim_cfg: ConfigDict, shape: tuple[int, ...], logical: tuple[str, ...]) -> list[StateLeaf]:
    """The formula: fp32 state leaves one parameter adds (shapes, kept parameter dims)."""
    return get(optim_cfg.name).state(optim_cfg, tuple(shape), tuple(logical))


def state_elements_per_param(optim_cfg: ConfigDict, shape: tuple[int, ...], logical: tuple[str, ...]) -> float:
    """State elements per parameter element (2 for AdamW; ~0 for factored Adafactor leaves)."""
    total = sum(math.prod(s) for s, _ in state_leaves(optim_cfg, shape, logical))
    return total / max(math.prod(shape), 1)


def local_state_bytes(optim_cfg: ConfigDict, shape: tuple[int, ...], layout: Any, mesh_shape: dict) -> int:
    """Bytes of one parameter's fp32 state on one device: each leaf of :func:`state_leaves` under the
    spec :mod:`jaxpar.optim.state` derives from the parameter's optimizer spec."""
    return sum(
        local_size(s, spec_for(kept, layout.optimizer), mesh_shape) * 4
        for s, kept in state_leaves(optim_cfg, shape, layout.logical)
    )


def state_elements_ratio(optim_cfg: ConfigDict, model_cfg: ConfigDict) -> float:
    """State elements per parameter over the whole model (AdamW 2.0; Adafactor far less), from the
    model's parameter inventory (a stacked layer tensor counts as ``num_layers`` separate tensors,
    as :func:`state_leaves` treats the ``layers`` dim)."""
    from jaxpar.models.inventory import param_tensors

    state = params = 0
    for tensor in param_tensors(model_cfg):
        copies = model_cfg.num_layers if tensor.place == "layer" else 1
        shape, logical = tuple(n for _, n in tensor.dims), tuple(name for name, _ in tensor.dims)
        state += copies * sum(math.prod(s) for s, _ in state_leaves(optim_cfg, shape, logical))
        params += copies * math.prod(shape)
    return state / params
