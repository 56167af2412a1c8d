"""The optimizer registry: ``optim.name`` -> how to build it, which fields it reads, its state size.

An optimizer is one :class:`Optimizer` in :data:`OPTIMIZERS`: ``build`` ``(optim_cfg, schedule,
placements) -> optax.GradientTransformation`` and ``state``, the formula of its per-parameter state
leaves, which the planner prices (:func:`state_leaves`). Built in:

* ``adamw`` (default): jaxpar's own AdamW inside the step's ``shard_map``, all of it in
  :mod:`jaxpar.optim.adamw`; ``build`` gives ``optax.adamw``, its reference in tests/test_optim.py.
* ``lion``: ``optax.lion`` (Chen et al. 2023, arXiv:2302.06675).
* ``sgd``: ``optax.sgd``, ``optim.momentum`` (default 0.9), ``optim.nesterov``; decoupled weight
  decay, or L2 on the gradient (``torch.optim.SGD``) with ``decoupled_weight_decay=False``.
* ``adafactor``: ``optax.adafactor`` (Shazeer & Stern 2018, arXiv:1804.04235) per tensor
  (:func:`jaxpar.optim.transforms.per_tensor`), optax's defaults (factored when the second-largest
  dim is >= 128, update clipping 1.0, parameter scale); ``optim.momentum`` > 0 adds momentum;
  decoupled weight decay ``lr(k) * weight_decay * p``.
* ``muon``: ``optax.contrib.muon`` (Jordan et al. 2024; Liu et al. 2025, arXiv:2502.16982) where
  optax has it: Newton-Schulz orthogonalised momentum (``optim.momentum``, default 0.95,
  ``optim.nesterov``) for the block weight matrices (:func:`muon_dims`), AdamW (``b1``, ``b2``,
  ``eps``) for the rest; decoupled weight decay where the ParamPlacement decays.

Any other optax transformation: ``optim.name = "path/to/file.py:fn"`` (or ``"package.module:fn"``),
``fn(optim_cfg, learning_rate, weight_decay_mask) -> optax.GradientTransformation`` with the
schedule (:mod:`jaxpar.optim.lr`) and a tree of bools like the parameters (False for norms). It sees
the stored tree (stacked layers as one tensor), may read any field, and its state is not priced.
``optim.clip_norm`` clips the global norm before every optimizer, mesh-aware.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from jaxpar import files
from jaxpar.config import ConfigDict, ConfigError
from jaxpar.optim import adamw
from jaxpar.optim.fields import is_custom
from jaxpar.optim.state import StateLeaf, local_size, same_shape, spec_for
from jaxpar.optim.transforms import decay_mask, decoupled_weight_decay, per_tensor
from jaxpar.sharding import is_placement

STACKED = ("layers", "stages")  # leading stacked dims: batch dims of per-tensor statistics
ADAFACTOR_MIN_DIM_TO_FACTOR = 128  # optax.adafactor's default


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """One registry entry (see the module docstring)."""

    name: str
    build: Callable[[ConfigDict, Callable, Any], optax.GradientTransformation]
    state: Callable[[ConfigDict, tuple[int, ...], tuple[str, ...]], list[StateLeaf]]
    in_shard_map: bool = False  # jaxpar's own update inside the step's shard_map (adamw)


def batch_dims(logical: tuple[str, ...]) -> int:
    """Number of leading stacked dims (``layers``, ``stages``)."""
    n = 0
    while n < len(logical) and logical[n] in STACKED:
        n += 1
    return n


def _scalar_per_batch(shape: tuple[int, ...], b: int) -> StateLeaf:
    return tuple(shape[:b]), tuple(range(b))


# --------------------------------------------------------------------------- lion


def _build_lion(o: ConfigDict, schedule: Callable, placements: Any) -> optax.GradientTransformation:
    return optax.lion(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, mask=decay_mask(placements))


def _state_momentum(o: ConfigDict, shape: tuple[int, ...], logical: tuple[str, ...]) -> list[StateLeaf]:
    return [same_shape(shape)]


# --------------------------------------------------------------------------- sgd


DEFAULT_MOMENTUM = {"sgd": 0.9, "muon": 0.95, "adafactor": 0.0}  # optim.momentum = -1 picks these


def momentum(o: ConfigDict) -> float:
    return DEFAULT_MOMENTUM[o.name] if o.momentum < 0 else o.momentum


def _build_sgd(o: ConfigDict, schedule: Callable, placements: Any) -> optax.GradientTransformation:
    momentum_ = momentum(o) or None
    decay = optax.add_decayed_weights(o.weight_decay, decay_mask(placements))
    if not o.decoupled_weight_decay:  # L2: torch.optim.SGD's weight_decay
        return optax.chain(decay, optax.sgd(schedule, momentum=momentum_, nesterov=o.nesterov))
    parts = [optax.trace(decay=momentum_, nesterov=o.nesterov)] if momentum_ else []
    return optax.chain(*parts, decay, optax.scale_by_learning_rate(schedule))


def _state_sgd(o: ConfigDict, shape: tuple[int, ...], logical: tuple[str, ...]) -> list[StateLeaf]:
    return [same_shape(shape)] if momentum(o) else []


# --------------------------------------------------------------------------- adafactor


def _build_adafactor(o: ConfigDict, schedule: Callable, placements: Any) -> optax.GradientTransformation:
    # optax.adafactor adds weight_decay_rate * p after the learning rate: a schedule makes it lr(k) * wd.
    inner = lambda wd: optax.adafactor(  # noqa: E731
        schedule,
        momentum=momentum(o) or None,
        weight_decay_rate=(lambda k: schedule(k) * o.weight_decay) if wd else None,
    )
    dims = jax.tree.map(lambda lay: batch_dims(lay.logical), placements, is_leaf=is_placement)
    labels = jax.tree.map(
        lambda lay: "decay" if lay.weight_decay and o.weight_decay else "plain", placements, is_leaf=is_placement
    )
    return per_tensor({"decay": inner(True), "plain": inner(False)}, labels, dims)


def _state_adafactor(o: ConfigDict, shape: tuple[int, ...], logical: tuple[str, ...]) -> list[StateLeaf]:
    """optax.scale_by_factored_rms per layer: factored over the two largest dims d1 (second) and d0
    (largest) of the per-layer tensor when d1 >= 128: v_row drops d0, v_col drops d1; else a full v."""
    b = batch_dims(logical)
    inner = shape[b:]
    batch = tuple(range(b))
    one = (tuple(shape[:b]) + (1,), batch + (None,))  # optax's (1,) placeholder, per layer
    out = [_scalar_per_batch(shape, b)]  # factored-rms count
    order = np.argsort(inner) if len(inner) >= 2 else None
    if order is not None and inner[order[-2]] >= ADAFACTOR_MIN_DIM_TO_FACTOR:
        d1, d0 = b + int(order[-2]), b + int(order[-1])
        for drop in (d0, d1):
            kept = tuple(i for i in range(len(shape)) if i != drop)
            out.append((tuple(shape[i] for i in kept), kept))
        out.append(one)
    else:
        out += [one, one, same_shape(shape)]
    out.append(_scalar_per_batch(shape, b))  # scale_by_learning_rate's count
    if momentum(o):
        out += [_scalar_per_batch(shape, b), same_shape(shape)]  # ema count, ema
    return out


# --------------------------------------------------------------------------- muon


def muon_dims(logical: tuple[str, ...]) -> Any:
    """optax.contrib.muon's dimension numbers for one parameter, None where AdamW applies: weight
    matrices of the blocks (>= 2 dims besides the stacked ones, which are batch dims; no vocabulary
    dim). Input dims: ``embed``, or all but the last; output dims: the rest."""
    from optax.contrib import MuonDimensionNumbers

    b = batch_dims(logical)
    rest = logical[b:]
    if len(rest) < 2 or "vocab" in rest:
        return None
    n = len(logical)
    if rest[0] == "embed":  # input features first: x @ W
        return MuonDimensionNumbers(reduction_axis=(b,), output_axis=tuple(range(b + 1, n)))
    return MuonDimensionNumbers(reduction_axis=tuple(range(b, n - 1)), output_axis=(n - 1,))


def _build_muon(o: ConfigDict, schedule: Callable, placements: Any) -> optax.GradientTransformation:
    from optax.contrib import muon

    dims = jax.tree.map(lambda lay: muon_dims(lay.logical), placements, is_leaf=is_placement)
    tx = muon(
        schedule,
        beta=momentum(o),
        eps=o.eps,
        nesterov=o.nesterov,
        adam_b1=o.b1,
        adam_b2=o.b2,
        muon_weight_dimension_numbers=dims,
    )
    if not o.weight_decay:
        return tx
    return optax.chain(tx, decoupled_weight_decay(schedule, o.weight_decay, decay_mask(placements)))


def _state_muon(o: ConfigDict, shape: tuple[int, ...], logical: tuple[str, ...]) -> list[StateLeaf]:
    if muon_dims(logical) is not None:
        return [same_shape(shape)]  # momentum
    return [same_shape(shape), same_shape(shape)]  # AdamW mu, nu


def has_muon() -> bool:
    try:
        from optax.contrib import muon  # noqa: F401
    except ImportError:
        return False
    return True


# The optim fields each one reads are listed once, in jaxpar.optim.fields.OPTIMIZER_FIELDS (checked
# with the config, without loading optax).
OPTIMIZERS: dict[str, Optimizer] = {
    "adamw": Optimizer("adamw", adamw.build, adamw.state_leaves, in_shard_map=True),
    "lion": Optimizer("lion", _build_lion, _state_momentum),
    "sgd": Optimizer("sgd", _build_sgd, _state_sgd),
    "adafactor": Optimizer("adafactor", _build_adafactor, _state_adafactor),
}
if has_muon():
    OPTIMIZERS["muon"] = Optimizer("muon", _build_muon, _state_muon)


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
    if name not in OPTIMIZERS:  # muon without optax.contrib.muon, or an unknown name
        raise ConfigError(
            f"optim.name='{name}': this optax offers {', '.join(OPTIMIZERS)}; use one of them or {', '.join(OPTIMIZERS)} or path/to/file.py:function "
            "returning an optax.GradientTransformation"
        )
    return OPTIMIZERS[name]


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
