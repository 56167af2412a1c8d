"""Small shims over JAX: API differences between the supported releases (0.10 to 0.12), and the
tracing helpers the step and the pipeline executors build on."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jaxpar.versions import jax_release


def all_gather_invariant(x: jax.Array, axis_name: str, *, axis: int) -> jax.Array:
    """Tiled all-gather whose result is typed *invariant* over ``axis_name`` (same on every rank).

    Used for ZeRO-1/2 parameter gathers after the sharded update, so the parameters leave the
    ``shard_map`` as replicated over ``data``.
    """
    for to in ("invarying", "invariant"):
        try:
            return jax.lax.all_gather(x, axis_name, axis=axis, tiled=True, to=to)
        except ValueError as e:
            if "to" not in str(e):
                raise
    from jax._src.lax.parallel import all_gather_invariant as _agi  # older releases

    return _agi(x, axis_name, axis=axis, tiled=True)


def varying_axes(x: Any) -> frozenset:
    """Mesh axes over which a traced value (or ShapeDtypeStruct, or abstract value) varies (shard_map
    check_vma)."""
    aval = x if isinstance(x, (jax.ShapeDtypeStruct, jax.core.ShapedArray)) else jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def vma_union(*xs: Any) -> frozenset:
    """The mesh axes any of ``xs`` varies over."""
    return frozenset().union(*(varying_axes(x) for x in xs))


def vary(x: jax.Array, axes: frozenset) -> jax.Array:
    """Mark ``x`` varying over ``axes`` (no-op for those it already varies over)."""
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def trace_once(f: Callable, *args: Any) -> tuple[Any, Callable]:
    """(``f``'s output types, ``replay``): ``f`` traced once on ``args``, and a function that evaluates
    that trace on new arguments of the same types. For a caller that needs the output types before it
    places ``f`` (a switch's branches made to vary alike, a loop's zero carry): ``jax.eval_shape`` then
    the real call traces the Python function twice, and twice again at each level of nesting (the
    pipeline tick's switch holds conds holding layer conds). The replay binds the recorded equations
    (name scopes kept), so the program is the same."""
    closed, shapes = jax.make_jaxpr(f, return_shape=True)(*args)
    tree = jax.tree.structure(shapes)

    def replay(*new_args: Any) -> Any:
        flat = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *jax.tree.leaves(new_args))
        return jax.tree.unflatten(tree, flat)

    return shapes, replay


def cached_pipelines_are_wrong() -> bool:
    """Whether this JAX's XLA:CPU reads pipeline executables back from the persistent compilation
    cache wrong (:func:`persistent_cache_skipped`): jax 0.10.x (not seen on 0.11.2)."""
    return jax_release() < (0, 11)


def cached_collectives_hang() -> bool:
    """Whether this JAX's XLA:CPU hangs running an executable with collectives across processes (gloo)
    that it read back from the persistent compilation cache: jax 0.12.1. Two local processes
    (``scripts/launch_local.sh 2 jaxpar train``) sharing one cache folder: the first run compiles and
    trains; the second reads the train step back and never finishes its first step (its init program,
    which has no collective, reads back fine). Not seen on 0.12.0.1 or 0.10.2 (the same two runs
    pass, as does the SLURM resume test, whose second job reads the first's step back)."""
    return jax_release() >= (0, 12, 1)


def _set_persistent_cache(on: bool) -> None:
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_enable_compilation_cache", on)
    compilation_cache.reset_cache()  # JAX decides once per process whether to use the cache


@contextlib.contextmanager
def persistent_cache_skipped(skip: bool = True) -> Iterator[None]:
    """Compile what runs inside without JAX's persistent compilation cache (nothing read or written;
    compiles before and after keep it); a no-op when ``skip`` is false or the cache is off.

    Why: on XLA:CPU of jax 0.10.2 a pipeline layout's executable read back from the cache computes
    wrong losses that differ from run to run, while the process that compiled it computes right
    (docs/performance.md, "Sweeps"). :class:`jaxpar.train.state.Setup` runs a pipeline layout's
    programs inside this on CPU (:func:`cached_pipelines_are_wrong`); other layouts keep the cache.
    """
    if not (skip and jax.config.jax_compilation_cache_dir and jax.config.jax_enable_compilation_cache):
        yield
        return
    _set_persistent_cache(False)
    try:
        yield
    finally:
        _set_persistent_cache(True)


class Uncached:
    """A jitted function whose compiles skip the persistent cache (:func:`persistent_cache_skipped`):
    calling it, and ``lower(...).compile(...)``; anything else is the jitted function's. Every call
    enters the guard, not only the one that compiles (a call with new shapes compiling outside it
    would read the cache back); it costs microseconds a call (docs/performance.md).
    """

    def __init__(self, jitted: Any):
        self.jitted = jitted

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with persistent_cache_skipped():
            return self.jitted(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> _UncachedLowered:
        return _UncachedLowered(self.jitted.lower(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.jitted, name)


class _UncachedLowered:
    def __init__(self, lowered: Any):
        self.lowered = lowered

    def compile(self, *args: Any, **kwargs: Any) -> Any:
        with persistent_cache_skipped():
            return self.lowered.compile(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lowered, name)


def dce_jaxpr(jaxpr: Any, used_outputs: list[bool]) -> Any:
    """``jaxpr`` pruned to the outputs marked in ``used_outputs`` (JAX's dead-code elimination, which
    also prunes the carries and outputs of loops; every input stays an input). JAX exposes it only
    internally (``jax._src.interpreters.partial_eval.dce_jaxpr``, 0.10 to 0.12)."""
    from jax._src.interpreters import partial_eval as pe

    return pe.dce_jaxpr(jaxpr, used_outputs, instantiate=True)[0]
