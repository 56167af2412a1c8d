"""Pipeline parallelism: the schedule is data, executed as a scan over ticks inside the step's shard_map.

**Schedules.** :func:`build_schedule` returns a :class:`ScheduleTable`: for every (tick, stage) the
action run there, ``F``/``B`` of microbatch ``i`` on virtual chunk ``c``, or idle. Each stage runs a
fixed sequence of actions (Megatron-LM's ``schedules.py`` order) and an action starts one tick after
its input was produced on the neighbouring stage, every action taking one tick:

* ``gpipe``: all m forwards, then all m backwards (last microbatch first); m activations alive;
* ``1f1b``: stage d runs p-1-d warm-up forwards, then alternates one forward and one backward; at
  most p stage inputs are alive per stage (PipeDream-Flush, Narayanan et al. 2021);
* ``interleaved``: v chunks per stage, forwards in groups of p microbatches per chunk, warm-up
  2(p-1-d) + (v-1)p forwards, then 1F1B (Narayanan et al. 2021, section 2.2).

:func:`bubble_fraction` counts idle (tick, stage) slots: (p-1)/(m+p-1) for gpipe and 1f1b,
(p-1)/(v*m+p-1) interleaved (FORMULAS.md section 4); :func:`render_schedule` prints the table.

**Layers on stages.** The stacked ``layers`` dim is split over the ``pipeline`` axis in blocks. With
v virtual stages device d runs chunks d, d+p, d+2p, ... (L/(p*v) layers each), so the stored order
of the layers is permuted (:func:`layer_order`): a plain block split then gives each device its
chunks; with v = 1 the order is the natural one.

**Embedding and output layer on their stages.** With an untied output layer the *stage form* of the
parameters (:func:`to_stage_form`; :func:`to_model_form` is its inverse, used for checkpoints)
packs the embedding [V, h] and the transposed output layer into one ``ends`` [p, V, h] split over
``pipeline``: the first stage holds the embedding, the last the output layer, each device one
table, and nothing is reduced over ``pipeline`` for them (Megatron's placement; with SPMD every
device holds the same shapes, so the stages between hold an unused zero slot). The final norm,
learned positions and a tied embedding (needed by the first and the last stage) stay replicated
over ``pipeline``; only their owners' gradients are non-zero and one ``psum`` over ``pipeline`` per
step adds them.

**Execution.** Inside the single shard_map step, a ``lax.scan`` runs the ticks. After each tick the
activations move to the next stage and the gradients to the previous one with ``lax.ppermute``
over ``pipeline``. A tick's sends are selected by ``lax.switch`` over the distinct send patterns of
the table (the index is the same on every device), each a ppermute naming exactly the stage pairs
that carry data, so bubbles move no bytes: every boundary carries b*s*h activations per microbatch
forward and the same backward.

* ``1f1b`` / ``interleaved`` (:func:`_explicit_loss_and_grads`): each tick every stage runs its
  action through ``lax.switch``; a backward calls ``jax.vjp`` on the stage and **recomputes the
  stage forward** from the stored stage input (the forward tick only produces the activation to
  send; the last stage does all its work in its backward tick). Stage inputs and arriving
  gradients live in slot buffers whose size is the table's largest number of live inputs (p for
  1F1B), not m, so activation memory does not grow with m (the program's "nothing arrives" index
  keeps a buffer as is: no trash slot). With full rematerialisation
  (``model.remat=full``) the backward also runs the microbatch one sequence at a time and the stage
  layer by layer (:func:`_stage_backward_by_layer`): the same flops, but the working set of one
  sequence through one layer, and each layer's weight gradient is added into the fp32 accumulator
  (the scan's carry) in place, with no stacked gradient of the stage's layers beside it.
* ZeRO-3 (``parallel.zero_stage=3``, FSDP + PP): block parameters and the stage's ``ends`` slot
  are stored sharded over ``data``; each tick that runs a layer gathers it (the data peers of a
  stage run the same branch of every tick, so the gathers inside the branches line up) and the
  gathers' transposes reduce-scatter the gradients into a sharded accumulator. ZeRO-2 (1F1B /
  interleaved): parameters stay replicated, each backward tick reduce-scatters its layer gradients
  (the first / last virtual stage also its embedding / head ones) into an accumulator sharded like
  the optimizer state: m reduce-scatters per step instead of one all-reduce, 1/n of the buffer.
  With ZeRO-2/3 the full-remat backward runs the whole microbatch at once (no per-sequence passes,
  which would repeat each collective b times).
* ``gpipe`` (:func:`_gpipe_loss_and_grads`): the forward ticks are a scan differentiated by JAX,
  whose transpose is the backward half of the table (reverse order, gradients permuted back); the
  residuals of all m microbatches stay alive, as in GPipe without recomputation.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.config import ConfigDict, ConfigError
from jaxpar.models import llama

SCHEDULES = ("gpipe", "1f1b", "interleaved")
AXIS = "pipeline"
ENDS = "ends"  # stage-form parameter: embedding on the first stage, output layer on the last
IDLE, FORWARD, BACKWARD = 0, 1, 2


# --------------------------------------------------------------------------- schedule tables


@dataclasses.dataclass(frozen=True)
class Action:
    """One unit of work: forward or backward of ``microbatch`` through the stage's chunk ``chunk``
    (virtual stage ``chunk * p + stage``)."""

    kind: str  # "F" | "B"
    microbatch: int
    chunk: int = 0


@dataclasses.dataclass(frozen=True)
class ScheduleTable:
    """``grid[tick][stage]``: the action a stage runs at a tick (``None``: idle)."""

    schedule: str
    stages: int
    microbatches: int
    virtual_stages: int
    grid: tuple[tuple[Action | None, ...], ...]

    @property
    def ticks(self) -> int:
        return len(self.grid)

    def ticks_of(self) -> dict[tuple[str, int, int], int]:
        """(kind, microbatch, virtual stage) -> tick."""
        return {
            (a.kind, a.microbatch, a.chunk * self.stages + d): t
            for t, row in enumerate(self.grid)
            for d, a in enumerate(row)
            if a
        }


def check_config(cfg: ConfigDict) -> None:
    """Raise a one-line :class:`ConfigError` for pipeline settings the step cannot run."""
    p, m, v, sched = cfg.mesh.pipeline, cfg.train.microbatches, cfg.pipeline.virtual_stages, cfg.pipeline.schedule
    if p == 1:
        return
    per_step, layers, zero = m * cfg.mesh.data, cfg.model.num_layers, cfg.parallel.zero_stage
    checks = [
        (sched in SCHEDULES, f"pipeline.schedule='{sched}': use one of {', '.join(SCHEDULES)}"),
        (sched != "interleaved" or v >= 2, f"pipeline.virtual_stages={v}: the interleaved schedule needs at least 2 "
         "chunks per stage; set --config.pipeline.virtual_stages=2 or --config.pipeline.schedule=1f1b"),
        (sched == "interleaved" or v == 1, f"pipeline.virtual_stages={v} is only used by the interleaved schedule; "
         "set --config.pipeline.schedule=interleaved or --config.pipeline.virtual_stages=1"),
        (layers % (p * v) == 0, f"model.num_layers={layers} is not divisible by mesh.pipeline*pipeline.virtual_stages="
         f"{p * v}; choose a pipeline size that divides the layers"),
        (sched != "1f1b" or m >= p, f"train.microbatches={m} < mesh.pipeline={p}: 1F1B needs at least one microbatch "
         f"per stage; set --config.train.microbatches={p} or more"),
        (sched != "interleaved" or m % p == 0, f"train.microbatches={m} is not a multiple of mesh.pipeline={p} "
         f"(interleaved runs microbatches in groups of p); set --config.train.microbatches={p * -(-m // p)}"),
        (cfg.train.global_batch % per_step == 0, f"train.global_batch={cfg.train.global_batch} is not divisible by "
         f"train.microbatches*mesh.data={per_step}; use a multiple of {per_step}"),
        (zero != 2 or sched != "gpipe", "parallel.zero_stage=2 with pipeline.schedule=gpipe is not supported "
         "(GPipe's gradient is the transpose of its whole forward scan, accumulated full size); use "
         "--config.pipeline.schedule=1f1b, or --config.parallel.zero_stage=1 or 3"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def _sequences(schedule: str, p: int, m: int, v: int) -> list[list[Action]]:
    """Each stage's ordered actions (Megatron-LM ``schedules.py`` order)."""
    out = []
    for d in range(p):
        if schedule == "gpipe":
            fwd, bwd, warmup = [(i, 0) for i in range(m)], [(i, 0) for i in reversed(range(m))], m
        elif schedule == "1f1b":
            fwd, bwd, warmup = [(i, 0) for i in range(m)], [(i, 0) for i in range(m)], min(p - 1 - d, m)
        else:  # interleaved: microbatches in groups of p, chunk by chunk (backward: chunks reversed)
            fwd, bwd = [], []
            for j in range(m * v):
                group, r = divmod(j, p * v)
                chunk, k = divmod(r, p)
                fwd.append((group * p + k, chunk))
                bwd.append((group * p + k, v - 1 - chunk))
            warmup = min(2 * (p - 1 - d) + (v - 1) * p, m * v)
        seq = [Action("F", *a) for a in fwd[:warmup]]
        for j in range(len(fwd) - warmup):
            seq += [Action("F", *fwd[warmup + j]), Action("B", *bwd[j])]
        seq += [Action("B", *a) for a in bwd[len(fwd) - warmup :]]
        out.append(seq)
    return out


def build_schedule(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1) -> ScheduleTable:
    """Simulate each stage's action sequence tick by tick; an action waits for its input.

    F(i, k) needs F(i, k-1) done on the previous stage at an earlier tick; B(i, k) needs B(i, k+1)
    (or, on the last virtual stage, F(i, k)). Raises ``ValueError`` for impossible arguments.
    """
    p, m, v = stages, microbatches, virtual_stages
    if schedule not in SCHEDULES or p < 1 or m < 1 or v < 1 or (schedule != "interleaved" and v != 1):
        raise ValueError(f"no schedule {schedule!r} with stages={p} microbatches={m} virtual_stages={v}")
    if schedule == "interleaved" and m % p:
        raise ValueError(f"interleaved needs microbatches ({m}) to be a multiple of stages ({p})")
    seqs, pos, done, grid = _sequences(schedule, p, m, v), [0] * p, {}, []
    last = p * v - 1
    while any(pos[d] < len(seqs[d]) for d in range(p)):
        t, row = len(grid), [None] * p
        for d in range(p):
            if pos[d] == len(seqs[d]):
                continue
            a = seqs[d][pos[d]]
            k = a.chunk * p + d
            dep = ("F", a.microbatch, k - 1) if a.kind == "F" else ("B", a.microbatch, k + 1)
            if a.kind == "B" and k == last:
                dep = ("F", a.microbatch, k)
            if (a.kind == "F" and k == 0) or done.get(dep, t) < t:
                row[d], pos[d] = a, pos[d] + 1
        for d, a in enumerate(row):
            if a:
                done[(a.kind, a.microbatch, a.chunk * p + d)] = t
        grid.append(tuple(row))
        if t > 4 * (m * v + p) + 8:  # cannot happen for the orders above: a guard against edits
            raise RuntimeError(f"schedule {schedule} p={p} m={m} v={v} deadlocked")
    return ScheduleTable(schedule, p, m, v, tuple(grid))


def bubble_fraction(table: ScheduleTable) -> float:
    """Share of (tick, stage) slots in which a stage is idle."""
    idle = sum(a is None for row in table.grid for a in row)
    return idle / (table.ticks * table.stages)


def expected_bubble_fraction(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """(p-1)/(m+p-1) for gpipe and 1f1b, (p-1)/(v*m+p-1) interleaved (Narayanan et al. 2021)."""
    v = virtual_stages if schedule == "interleaved" else 1
    return (stages - 1) / (v * microbatches + stages - 1)


def render_schedule(table: ScheduleTable) -> str:
    """A text diagram: one row per stage, one column per tick (``F3`` forward of microbatch 3,
    ``B3:1`` backward on chunk 1, ``.`` idle), plus the bubble fraction."""
    p, v = table.stages, table.virtual_stages

    def cell(a: Action | None) -> str:
        return "." if a is None else f"{a.kind}{a.microbatch}" + (f":{a.chunk}" if v > 1 else "")

    cells = [[cell(row[d]) for row in table.grid] for d in range(p)]
    width = max(len(c) for r in cells for c in r) + 1
    head = f"{table.schedule}: p={p} m={table.microbatches}" + (f" v={v}" if v > 1 else "")
    lines = [
        f"{head}, {table.ticks} ticks, bubble {bubble_fraction(table):.1%} (formula "
        f"{expected_bubble_fraction(table.schedule, p, table.microbatches, v):.1%})",
        "tick    " + "".join(f"{t:>{width}}" for t in range(table.ticks)),
    ]
    lines += [f"stage {d:<2}" + "".join(f"{c:>{width}}" for c in cells[d]) for d in range(p)]
    return "\n".join(lines)


def boundary_sends(table: ScheduleTable) -> tuple[int, int]:
    """(activations sent forward, gradients sent backward) over all stage boundaries per step:
    m * (p*v - 1) each."""
    last = table.stages * table.virtual_stages - 1
    fwd = sum(1 for k in table.ticks_of() if k[0] == "F" and k[2] < last)
    bwd = sum(1 for k in table.ticks_of() if k[0] == "B" and k[2] > 0)
    return fwd, bwd


# --------------------------------------------------------------------------- layer order


def layer_order(num_layers: int, stages: int, virtual_stages: int = 1) -> np.ndarray:
    """``order[j]``: the model layer stored at position j of the pipeline-sharded ``layers`` dim.

    Device d's block of L/p positions holds its chunks d, d+p, ..., d+(v-1)p in that order, each
    L/(p*v) consecutive layers; the identity when v = 1.
    """
    p, v = stages, virtual_stages
    per_chunk = num_layers // (p * v)
    return np.array([(c * p + d) * per_chunk + j for d in range(p) for c in range(v) for j in range(per_chunk)])


def _permute_blocks(params: dict, index: np.ndarray) -> dict:
    if np.array_equal(index, np.arange(len(index))):
        return params
    return {**params, "blocks": jax.tree.map(lambda a: a[index], params["blocks"])}


def has_ends(model_cfg: ConfigDict, stages: int) -> bool:
    """Whether the stage form places the embedding and output layer in ``ends`` (untied, p > 1)."""
    return stages > 1 and not model_cfg.tie_embeddings


def to_stage_form(params: dict, stages: int, virtual_stages: int = 1) -> dict:
    """Model form -> stage form: block parameters in the stored (pipeline) layer order, and with an
    untied output layer, ``embed`` [V, h] and ``lm_head`` [h, V] packed into one ``ends`` [p, V, h]
    split over ``pipeline``: slot 0 the embedding, slot p-1 the transposed output layer, the slots
    between zeros (they stay zero: their gradient is zero). Each device then holds one V x h table
    instead of two, as Megatron keeps the embedding on the first stage and the head on the last."""
    n = jax.tree.leaves(params["blocks"])[0].shape[0]
    out = _permute_blocks(params, layer_order(n, stages, virtual_stages))
    if stages > 1 and "lm_head" in out:
        embed, head = out["embed"], out["lm_head"]
        middle = [jnp.zeros_like(embed)] * (stages - 2)
        out = {k: val for k, val in out.items() if k not in ("embed", "lm_head")}
        out[ENDS] = jnp.stack([embed, *middle, jnp.transpose(head).astype(embed.dtype)])
    return out


def to_model_form(params: dict, stages: int, virtual_stages: int = 1) -> dict:
    """Stage form -> model form; inverse of :func:`to_stage_form`."""
    n = jax.tree.leaves(params["blocks"])[0].shape[0]
    out = _permute_blocks(params, np.argsort(layer_order(n, stages, virtual_stages)))
    if ENDS in out:
        ends = out[ENDS]
        out = {k: val for k, val in out.items() if k != ENDS}
        out["embed"], out["lm_head"] = ends[0], jnp.transpose(ends[-1])
    return out


def stage_form_logical_axes(logical: dict, stages: int) -> dict:
    """Logical dim names of the stage form (``ends``: stages x vocab x embed)."""
    if stages <= 1 or "lm_head" not in logical:
        return logical
    out = {k: val for k, val in logical.items() if k not in ("embed", "lm_head")}
    return {**out, ENDS: ("stages", *logical["embed"])}


# --------------------------------------------------------------------------- executor program


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """The table lowered to the integer arrays the explicit executor scans over.

    ``per_stage[name]`` is ``(ticks, stages)``: ``kind`` (IDLE / FORWARD / BACKWARD as executed: the
    last virtual stage's F is idle, its work is done in its B), ``microbatch``, ``chunk``, and the
    slots read (``act_read``, ``grad_read``) and written at the end of the tick (``act_write``,
    ``grad_write``). Slot buffers hold stage inputs and arriving output gradients from their arrival
    to the backward that consumes them; the index ``act_slots`` / ``grad_slots`` (one past the last
    slot) means nothing is read or arrives (the executor keeps the buffer as is).
    ``pattern[dir]`` (ticks,) indexes ``pairs[dir]``, the distinct (src, dst) stage pairs sending
    at a tick (``"fwd"`` activations, ``"bwd"`` gradients; pattern 0 sends nothing).
    """

    per_stage: dict[str, np.ndarray]
    pattern: dict[str, np.ndarray]
    pairs: dict[str, tuple[tuple[tuple[int, int], ...], ...]]
    act_slots: int
    grad_slots: int


def _allocate(intervals: dict[tuple[int, int], tuple[int, int, int]]) -> tuple[dict[tuple[int, int], int], int]:
    """Slots for values alive from the end of tick ``start`` to tick ``end`` on ``device``."""
    slots, used, busy = {}, 0, {}  # busy: device -> {slot: end}
    for key, (device, start, end) in sorted(intervals.items(), key=lambda kv: kv[1][1]):
        taken = busy.setdefault(device, {})
        slot = min([s for s, e in taken.items() if e <= start] or [len(taken)])
        taken[slot], slots[key], used = end, slot, max(used, slot + 1)
    return slots, used


def compile_program(table: ScheduleTable) -> Program:
    """Lower a table to a :class:`Program` (slot allocation and send patterns)."""
    p, m, ticks, last = table.stages, table.microbatches, table.ticks, table.stages * table.virtual_stages - 1
    when = table.ticks_of()
    # a stage input arrives after F on the previous virtual stage, an output gradient after B on the next one
    pairs_ik = [(i, k) for i in range(m) for k in range(last + 1)]
    act, n_act = _allocate({(i, k): (k % p, when["F", i, k - 1], when["B", i, k]) for i, k in pairs_ik if k > 0})
    grad, n_grad = _allocate({(i, k): (k % p, when["B", i, k + 1], when["B", i, k]) for i, k in pairs_ik if k < last})
    arr = {name: np.zeros((ticks, p), np.int32) for name in ("kind", "microbatch", "chunk")}
    arr |= {name: np.full((ticks, p), n_act, np.int32) for name in ("act_read", "act_write")}
    arr |= {name: np.full((ticks, p), n_grad, np.int32) for name in ("grad_read", "grad_write")}
    pairs: dict[str, list] = {"fwd": [()], "bwd": [()]}
    pattern = {"fwd": np.zeros(ticks, np.int32), "bwd": np.zeros(ticks, np.int32)}
    for t, row in enumerate(table.grid):
        sends: dict[str, list[tuple[int, int]]] = {"fwd": [], "bwd": []}
        for d, a in enumerate(row):
            i, k = (a.microbatch, a.chunk * p + d) if a else (0, 0)
            if a is None or (a.kind == "F" and k == last):
                continue
            arr["microbatch"][t, d], arr["chunk"][t, d] = i, a.chunk
            arr["act_read"][t, d] = act[i, k] if k > 0 else n_act
            if a.kind == "F":
                arr["kind"][t, d], arr["act_write"][t, (k + 1) % p] = FORWARD, act[i, k + 1]
                sends["fwd"].append((d, (k + 1) % p))
            else:
                arr["kind"][t, d], arr["grad_read"][t, d] = BACKWARD, grad[i, k] if k < last else n_grad
                if k > 0:
                    arr["grad_write"][t, (k - 1) % p] = grad[i, k - 1]
                    sends["bwd"].append((d, (k - 1) % p))
        for direction, found in sends.items():
            key = tuple(sorted(found))
            if key not in pairs[direction]:
                pairs[direction].append(key)
            pattern[direction][t] = pairs[direction].index(key)
    return Program(arr, pattern, {k: tuple(v) for k, v in pairs.items()}, n_act, n_grad)


# --------------------------------------------------------------------------- typing helpers


def _varying(x: Any) -> frozenset:
    """Mesh axes over which a traced value (or ShapeDtypeStruct) varies (shard_map check_vma)."""
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def _vary(x: jax.Array, axes: frozenset) -> jax.Array:
    """Mark ``x`` varying over ``axes`` (no-op for those it already varies over)."""
    missing = tuple(sorted(axes - _varying(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _branches_agree(branches: list[Callable], *args: Any) -> list[Callable]:
    """Wrap branches of a cond/switch so their outputs vary over the same mesh axes."""
    shapes = [jax.eval_shape(f, *args) for f in branches]
    target = jax.tree.map(lambda *s: frozenset().union(*map(_varying, s)), *shapes)

    def wrap(f):
        return lambda *a: jax.tree.map(_vary, f(*a), target)

    return [wrap(f) for f in branches]


def _switch(index: jax.Array, branches: list[Callable], *args: Any) -> Any:
    return jax.lax.switch(index, _branches_agree(branches, *args), *args)


def _cond(pred: jax.Array, true_fn: Callable, false_fn: Callable, *args: Any) -> Any:
    return jax.lax.switch(pred.astype(jnp.int32), _branches_agree([false_fn, true_fn], *args), *args)


# Named scopes on the schedule's branches: they appear in the op_name metadata of every collective
# inside (transposes included), so the compiled-HLO report can count each collective exactly per
# stage from the schedule table (jaxpar.analysis.compiled.pipeline_fraction) instead of bounding it.
SCOPE_FORWARD, SCOPE_BACKWARD, SCOPE_WORK = "pp_forward", "pp_backward", "pp_work"
SCOPE_FIRST, SCOPE_LAST, SCOPE_SEND = "pp_first", "pp_last", "pp_send"
SCOPE_ENDS = "pp_ends"  # the first or the last virtual stage


def _scoped(name: str, f: Callable) -> Callable:
    def run(*args: Any) -> Any:
        with jax.named_scope(name):
            return f(*args)

    return run


def _send(x: jax.Array, pattern: jax.Array, pairs: tuple, direction: str) -> jax.Array:
    """ppermute ``x`` over ``pipeline`` with this tick's pairs (pattern 0: nothing is sent)."""
    branches = [jnp.zeros_like] + [
        _scoped(f"{SCOPE_SEND}_{direction}_{k}", functools.partial(jax.lax.ppermute, axis_name=AXIS, perm=list(p)))
        for k, p in enumerate(pairs) if k
    ]
    return jax.lax.switch(pattern, branches, x) if len(branches) > 1 else jnp.zeros_like(x)


# --------------------------------------------------------------------------- the stage


def _split(params: dict) -> tuple[dict, dict]:
    """(embedding / final norm / head parameters, stacked block parameters)."""
    return {k: val for k, val in params.items() if k != "blocks"}, params["blocks"]


def _scatter(g: jax.Array, dim: int, dtype: Any) -> jax.Array:
    """ZeRO-2 inside the pipeline: reduce-scatter a gradient over ``data`` on ``dim`` in ``dtype``,
    back in fp32 for the accumulator (``dim`` -1: the parameter is not sharded, keep it)."""
    if dim < 0:
        return g
    return jax.lax.psum_scatter(g.astype(dtype), "data", scatter_dimension=dim, tiled=True).astype(jnp.float32)


def _scatter_shared(grads: dict, dims: dict, dtype: Any, owner: jax.Array) -> dict:
    """ZeRO-2: reduce-scatter the embedding / head / final-norm gradients only where a stage computed
    them (``owner``: the first or last virtual stage; its data peers take the same branch); the
    other stages' are zero and move nothing."""
    if all(dim < 0 for dim in jax.tree.leaves(dims)):
        return grads
    n = jax.lax.axis_size("data")

    def scatter(g):
        return jax.tree.map(lambda x, dim: _scatter(x, dim, dtype), g, dims)

    def skip(g):
        return jax.tree.map(lambda x, dim: jnp.zeros(tuple(k // n if i == dim else k for i, k in enumerate(x.shape)),
                                                     jnp.float32), g, dims)

    return _cond(owner, _scoped(SCOPE_ENDS, scatter), skip, grads)


def _view(shared: dict, ctx: llama.ShardContext) -> dict:
    """The model's view of a stage's non-block parameters: this stage's slot of ``ends`` (the
    embedding on the first stage, the transposed output layer on the last) serves as ``embed``,
    which :func:`llama.logits_local` uses as ``[vocab, embed]`` output layer when there is no
    ``lm_head`` (as for tied embeddings). With ZeRO-3 the shards are gathered over ``data`` here,
    inside the first / last stage's branch, so only those stages gather them."""
    shared = llama.gather_zero3(shared, ctx)
    if ENDS not in shared:
        return shared
    return {**{k: val for k, val in shared.items() if k != ENDS}, "embed": shared[ENDS][0]}


def _chunk(blocks: dict, chunk: jax.Array, virtual_stages: int) -> dict:
    """Chunk ``chunk`` of this device's stacked layers (all of them when v = 1)."""
    if virtual_stages == 1:
        return blocks
    size = jax.tree.leaves(blocks)[0].shape[0] // virtual_stages
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, chunk * size, size, 0), blocks)


def _stage(shared: dict, chunk: dict, x_in: jax.Array, tokens: jax.Array, first: jax.Array, last: jax.Array | None,
           ctx: llama.ShardContext, scale: float) -> tuple[jax.Array, jax.Array | None]:
    """One virtual stage on one microbatch: (embedding if ``first``) -> its blocks -> (scaled loss
    if ``last``, else 0). ``last=None``: forward only, no loss."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = _cond(first, _scoped(SCOPE_FIRST, lambda x: llama.embed_tokens(_view(shared, ctx), inputs, ctx)), lambda x: x, x_in)
    y = llama.run_blocks(x, chunk, jnp.arange(inputs.shape[1]), ctx)

    def loss(y):
        return llama.cross_entropy_sum(llama.logits_local(_view(shared, ctx), y, ctx), targets, ctx) * scale

    return y, None if last is None else _cond(last, _scoped(SCOPE_LAST, loss), lambda y: jnp.zeros((), jnp.float32), y)


def _stage_backward_by_layer(shared: dict, chunk: dict, x_in: jax.Array, tokens: jax.Array, first: jax.Array,
                             last: jax.Array, g_y: jax.Array, acc: dict, row: jax.Array, ctx: llama.ShardContext,
                             scale: float, dims: dict, dtype: Any) -> tuple[jax.Array, jax.Array, dict]:
    """The backward of :func:`_stage` layer by layer, for full rematerialisation: a forward scan keeps
    each layer's input, then a reverse scan recomputes one layer under ``jax.vjp`` and adds its
    weight gradient into rows ``row + l`` of ``acc["blocks"]`` in place, so no stacked gradient of
    the stage's layers exists beside the accumulator (ZeRO-2: each reduce-scattered first, ``dims``).
    Returns (scaled loss, input gradient, acc)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = jnp.arange(inputs.shape[1])

    def block(x, layer):
        return llama._block(x, llama.gather_zero3(layer, ctx, "['blocks']", 1), positions, ctx)

    def embed(sh, x):
        return _cond(first, _scoped(SCOPE_FIRST, lambda x: llama.embed_tokens(_view(sh, ctx), inputs, ctx)), lambda x: x, x)

    def head(sh, y):
        def loss(y):
            return llama.cross_entropy_sum(llama.logits_local(_view(sh, ctx), y, ctx), targets, ctx) * scale

        return _cond(last, _scoped(SCOPE_LAST, loss), lambda y: jnp.zeros((), jnp.float32), y)

    x0, embed_vjp = jax.vjp(embed, shared, x_in)
    y, xs = jax.lax.scan(lambda x, layer: (block(x, layer), x), x0, chunk)
    loss, head_vjp = jax.vjp(head, shared, y)
    d_head, d_y = head_vjp(jnp.ones_like(loss))
    g = _vary(d_y + jnp.where(last, jnp.zeros_like(g_y), g_y), _varying(y))

    def layer_backward(carry, j):
        g, acc_blocks = carry
        layer = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, j, 0, keepdims=False), chunk)
        x = jax.lax.dynamic_index_in_dim(xs, j, 0, keepdims=False)
        _, vjp = jax.vjp(block, x, layer)
        d_x, d_layer = vjp(g)

        def add(a, dw, dim):  # a scatter-add: in place, no copy of the old row beside the new one
            dw = _scatter(dw, dim - 1 if dim >= 0 else -1, dtype)  # one layer: its dims shift by one
            return a.at[row + j].add(_vary(dw, _varying(a)), mode="promise_in_bounds")

        return (_vary(d_x, _varying(g)), jax.tree.map(add, acc_blocks, d_layer, dims_blocks)), None

    n = jax.tree.leaves(chunk)[0].shape[0]
    acc_shared, acc_blocks = _split(acc)
    dims_shared, dims_blocks = _split(dims)
    (g, acc_blocks), _ = jax.lax.scan(layer_backward, (g, acc_blocks), jnp.arange(n - 1, -1, -1))
    d_embed, d_x = embed_vjp(g)
    d_shared = _scatter_shared(jax.tree.map(jnp.add, d_head, d_embed), dims_shared, dtype, first | last)
    acc_shared = jax.tree.map(lambda a, g: a + _vary(g, _varying(a)), acc_shared, d_shared)
    return loss, d_x, {**acc_shared, "blocks": acc_blocks}


def _boundary_types(shared: dict, blocks: dict, batch: jax.Array, ctx: llama.ShardContext, v: int,
                    scale: float) -> tuple[jax.ShapeDtypeStruct, frozenset, frozenset]:
    """(activation shape/dtype, its varying axes, the loss's varying axes), traced abstractly."""
    emb = jax.eval_shape(lambda: llama.embed_tokens(_view(shared, ctx), batch[0][:, :-1], ctx))
    axes = _varying(emb) | {AXIS}  # blocks vary over pipeline: so does every stage's output
    true, x = jnp.bool_(True), _zeros(emb.shape, emb.dtype, axes)
    y, loss = jax.eval_shape(lambda: _stage(shared, _chunk(blocks, 0, v), x, batch[0], true, true, ctx, scale))
    return emb, axes | _varying(y), _varying(loss)


def _zeros(shape: tuple, dtype: Any, axes: frozenset) -> jax.Array:
    return _vary(jnp.zeros(shape, dtype), axes)


def _reduce_shared(loss: jax.Array, grads: dict) -> tuple[jax.Array, dict]:
    """Sum the loss (last stage) and the gradients of parameters every stage holds (final norm,
    positions, a tied embedding) over stages; ``ends`` slots are each their own stage's."""
    shared, blocks = _split(grads)
    summed = {k: g if k == ENDS else jax.lax.psum(g, AXIS) for k, g in shared.items()}
    return jax.lax.psum(loss, AXIS), {**summed, "blocks": blocks}


# --------------------------------------------------------------------------- executors


def _store(buf: jax.Array, x: jax.Array, slot: jax.Array) -> jax.Array:
    """Write ``x`` into ``buf[slot]``; ``slot == len(buf)`` (the program's "nothing arrived") is out
    of bounds and dropped, so the slot buffers need no trash slot (an in-place scatter: a select
    against the old slot would keep a copy of it alive through the tick)."""
    return buf.at[slot].set(x, mode="drop")


def _explicit_loss_and_grads(params: dict, batch: jax.Array, ctx: llama.ShardContext, table: ScheduleTable,
                             prog: Program, scale: float, scatter: tuple[dict, Any] | None) -> tuple[jax.Array, dict]:
    """1F1B / interleaved: one scan over the table's ticks, explicit ``jax.vjp`` per backward.
    ``scatter`` (ZeRO-2): (dims tree like ``params``, reduce dtype); each backward tick
    reduce-scatters its gradients over ``data`` into an accumulator sharded like the optimizer."""
    p, v = table.stages, table.virtual_stages
    d = jax.lax.axis_index(AXIS)
    shared, blocks = _split(params)
    act, act_axes, loss_axes = _boundary_types(shared, blocks, batch, ctx, v, scale)
    zeros_act = functools.partial(_zeros, act.shape, act.dtype, act_axes)
    # Full rematerialisation trades compute for memory: there the backward also runs the microbatch's
    # sequences one at a time (the same flops; the working set of one sequence) and layer by layer;
    # not with ZeRO-2/3, where each pass would gather or scatter every layer again (b times the traffic).
    by_layer = ctx.remat == "full"
    splits = act.shape[0] if by_layer and not (ctx.zero3 or scatter) else 1
    dims, dtype = scatter or (jax.tree.map(lambda _: -1, params), jnp.float32)
    n_data = jax.lax.axis_size("data")

    def acc_zeros(a, dim):  # ZeRO-2: sharded like the optimizer state
        shape = tuple(size // n_data if k == dim else size for k, size in enumerate(a.shape))
        return _zeros(shape, jnp.float32, _varying(a))

    def run(kind, mb, chunk, act_buf, grad_buf, act_slot, grad_slot, acc, loss):
        # the stage input and output gradient are read from their slots inside the branches: read
        # before the switch they would be copies alive through the whole tick
        def act_in(start=0, n=act.shape[0]):
            return jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_index_in_dim(act_buf, act_slot, 0, False), start, n, 0)

        def grad_in(start=0, n=act.shape[0]):
            return jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_index_in_dim(grad_buf, grad_slot, 0, False), start, n, 0)

        first, last = (chunk == 0) & (d == 0), (chunk == v - 1) & (d == p - 1)
        tokens = jax.lax.dynamic_index_in_dim(batch, mb, 0, keepdims=False)

        def idle(acc, loss):
            return zeros_act(), zeros_act(), acc, loss

        def forward(acc, loss):
            y, _ = _stage(shared, _chunk(blocks, chunk, v), act_in(), tokens, first, None, ctx, scale)
            return y, zeros_act(), acc, loss

        def backward(acc, loss):
            rows = act.shape[0] // splits
            size = jax.tree.leaves(blocks)[0].shape[0] // v

            def one(carry, j):  # rows [j * rows, (j + 1) * rows) of the microbatch
                acc, loss, d_in = carry

                def part(a):
                    return jax.lax.dynamic_slice_in_dim(a, j * rows, rows, 0)

                x_in, g_y = act_in(j * rows, rows), grad_in(j * rows, rows)
                if by_layer:
                    stage_loss, d_x, acc = _stage_backward_by_layer(
                        shared, _chunk(blocks, chunk, v), x_in, part(tokens), first, last, g_y, acc, chunk * size,
                        ctx, scale, dims, dtype
                    )
                else:
                    def f(sh, ch, x):
                        return _stage(sh, ch, x, part(tokens), first, last, ctx, scale)

                    (y, stage_loss), vjp = jax.vjp(f, shared, _chunk(blocks, chunk, v), x_in)
                    g_y = jnp.where(last, jnp.zeros_like(y), g_y)
                    d_shared, d_chunk, d_x = vjp((_vary(g_y, _varying(y)), jnp.ones_like(stage_loss)))
                    acc_shared, acc_blocks = _split(acc)
                    dims_shared, dims_blocks = _split(dims)

                    def add(a, g, dim):  # into this chunk's rows of the stage's stacked layers
                        old = jax.lax.dynamic_slice_in_dim(a, chunk * size, size, 0)
                        return jax.lax.dynamic_update_slice_in_dim(a, old + _scatter(g, dim, dtype), chunk * size, 0)

                    d_shared = _scatter_shared(d_shared, dims_shared, dtype, first | last)
                    acc = {**jax.tree.map(lambda a, g: a + _vary(g, _varying(a)), acc_shared, d_shared),
                           "blocks": jax.tree.map(add, acc_blocks, d_chunk, dims_blocks)}
                d_in = jax.lax.dynamic_update_slice_in_dim(d_in, _vary(d_x, _varying(d_in)), j * rows, 0)
                out = (acc, loss + stage_loss, d_in)
                return jax.tree.map(lambda new, old: _vary(new, _varying(old)), out, carry), None

            (acc, loss, d_in), _ = jax.lax.scan(one, (acc, loss, zeros_act()), jnp.arange(splits))
            return zeros_act(), d_in, acc, loss

        return _switch(kind, [idle, _scoped(SCOPE_FORWARD, forward), _scoped(SCOPE_BACKWARD, backward)], acc, loss)

    def tick(carry, xs):
        act_buf, grad_buf, acc, loss = carry
        row = {name: column[d] for name, column in xs["per_stage"].items()}
        send_f, send_b, acc, loss = run(row["kind"], row["microbatch"], row["chunk"], act_buf, grad_buf,
                                        row["act_read"], row["grad_read"], acc, loss)
        recv_f = _send(send_f, xs["fwd"], prog.pairs["fwd"], "fwd")
        recv_b = _send(send_b, xs["bwd"], prog.pairs["bwd"], "bwd")
        act_buf = _store(act_buf, recv_f, row["act_write"])
        grad_buf = _store(grad_buf, recv_b, row["grad_write"])
        return (act_buf, grad_buf, acc, loss), None

    xs = {"per_stage": prog.per_stage, **prog.pattern}
    carry = (
        _zeros((prog.act_slots, *act.shape), act.dtype, act_axes),
        _zeros((prog.grad_slots, *act.shape), act.dtype, act_axes),
        jax.tree.map(acc_zeros, params, dims),
        _zeros((), jnp.float32, loss_axes),
    )
    (_, _, grads, loss), _ = jax.lax.scan(tick, carry, jax.tree.map(jnp.asarray, xs))
    return _reduce_shared(loss, grads)


def _gpipe_loss_and_grads(params: dict, batch: jax.Array, ctx: llama.ShardContext, table: ScheduleTable,
                          prog: Program, scale: float) -> tuple[jax.Array, dict]:
    """GPipe: the forward ticks as a differentiated scan; JAX's transpose runs the backward ticks."""
    p, m = table.stages, table.microbatches
    d = jax.lax.axis_index(AXIS)
    forward_ticks = m + p - 1

    def forward(params):
        shared, blocks = _split(params)
        act, act_axes, loss_axes = _boundary_types(shared, blocks, batch, ctx, 1, scale)

        def tick(carry, xs):
            x, loss = carry
            t, pattern = xs
            mb = t - d
            tokens = jax.lax.dynamic_index_in_dim(batch, jnp.clip(mb, 0, m - 1), 0, keepdims=False)

            def work(x):
                return _stage(shared, blocks, x, tokens, d == 0, d == p - 1, ctx, scale)

            def skip(x):
                return x, jnp.zeros((), jnp.float32)

            y, stage_loss = _cond((mb >= 0) & (mb < m), _scoped(SCOPE_WORK, work), skip, x)
            return (_send(y, pattern, prog.pairs["fwd"], "fwd"), loss + stage_loss), None

        init = (_zeros(act.shape, act.dtype, act_axes), _zeros((), jnp.float32, loss_axes))
        xs = (jnp.arange(forward_ticks), jnp.asarray(prog.pattern["fwd"][:forward_ticks]))
        (_, loss), _ = jax.lax.scan(tick, init, xs)
        return loss

    loss, grads = jax.value_and_grad(forward)(params)
    return _reduce_shared(loss, grads)


def eval_loss_sum(params: dict, tokens: jax.Array, ctx: llama.ShardContext, stages: int,
                  virtual_stages: int) -> jax.Array:
    """Summed loss of ``tokens`` (b, s+1) through the pipeline, forward only: the microbatch walks
    the p*v virtual stages in order (one stage busy at a time); the loss is summed over stages."""
    p, v = stages, virtual_stages
    d = jax.lax.axis_index(AXIS)
    shared, blocks = _split(params)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = jnp.arange(inputs.shape[1])
    x = llama.embed_tokens(_view(shared, ctx), inputs, ctx)
    x = _vary(x, _varying(x) | {AXIS})
    ring = [(j, (j + 1) % p) for j in range(p)]

    def run(x, k):
        return _cond(d == k % p, lambda x: llama.run_blocks(x, _chunk(blocks, k // p, v), positions, ctx),
                     lambda x: x, x)

    def step(x, k):
        return jax.lax.ppermute(run(x, k), AXIS, ring), None

    x, _ = jax.lax.scan(step, x, jnp.arange(p * v - 1))
    x = run(x, p * v - 1)  # the last virtual stage is on the last device, which holds the head

    def loss(x):
        return llama.cross_entropy_sum(llama.logits_local(_view(shared, ctx), x, ctx), targets, ctx)

    return jax.lax.psum(_cond(d == p - 1, loss, lambda x: jnp.zeros((), jnp.float32), x), AXIS)


@dataclasses.dataclass(frozen=True, eq=False)
class Pipeline:
    """A layout's pipeline: the schedule table, its lowered program, and the executors."""

    table: ScheduleTable
    program: Program

    @classmethod
    def from_config(cls, cfg: ConfigDict) -> Pipeline:
        """Validate the pipeline settings (:func:`check_config`) and build the schedule."""
        check_config(cfg)
        table = build_schedule(
            cfg.pipeline.schedule, cfg.mesh.pipeline, cfg.train.microbatches, cfg.pipeline.virtual_stages
        )
        return cls(table, compile_program(table))

    def loss_and_grads(self, params: dict, batch: jax.Array, ctx: llama.ShardContext, scale: float,
                       scatter: tuple[dict, Any] | None = None) -> tuple[jax.Array, dict]:
        """Inside the shard_map: the scaled loss summed over stages and microbatches, and the local
        gradients (block gradients of this stage's layers; embedding / head gradients summed over
        stages). ``params`` must vary over ``pipeline`` (and over ``data`` unless ZeRO-sharded).
        ``scatter`` (ZeRO-2, 1F1B / interleaved): (zero dim per parameter, -1 for none; reduce
        dtype): those gradients come back reduce-scattered over ``data``."""
        if self.table.schedule == "gpipe":
            return _gpipe_loss_and_grads(params, batch, ctx, self.table, self.program, scale)
        return _explicit_loss_and_grads(params, batch, ctx, self.table, self.program, scale, scatter)

    def eval_loss_sum(self, params: dict, tokens: jax.Array, ctx: llama.ShardContext) -> jax.Array:
        return eval_loss_sum(params, tokens, ctx, self.table.stages, self.table.virtual_stages)
