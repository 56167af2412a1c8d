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
(p-1)/(v*m+p-1) interleaved (Narayanan et al. 2021, arXiv:2104.04473; Huang et al. 2019, GPipe); :func:`render_schedule` prints the table.

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

**Execution.** Inside the single shard_map step, a ``lax.scan`` runs the ticks (one loop,
:func:`~jaxpar.parallel.pipeline.ticks.scan_table`, for every explicit-backward executor: each brings the
action a row of the table runs and the slot groups it keeps). After each tick the
activations move to the next stage and the gradients to the previous one with ``lax.ppermute``
over ``pipeline``. A tick's sends are selected by ``lax.switch`` over the distinct send patterns of
the table (the index is the same on every device), each a ppermute naming exactly the stage pairs
that carry data, so bubbles move no bytes: every boundary carries b*s*h activations per microbatch
forward and the same backward.

* ``1f1b`` / ``interleaved`` (:func:`_explicit_loss_and_grads`): each tick every stage runs its
  action through ``lax.switch``. A forward tick runs the stage under ``jax.vjp`` and writes the
  residuals that depend on the microbatch into a stash slot (:mod:`~jaxpar.parallel.pipeline.stash`);
  its backward tick rebuilds the pullback from the slot, recomputing only what depends on the
  parameters alone (casts, ZeRO-3 gathers), so each forward runs once, as in Megatron-LM. The last
  virtual stage runs its forward and backward in one tick. Stage inputs, arriving gradients and
  stashes live in slot buffers whose size is the table's largest number of live values (p stashes
  on stage 0 for 1F1B), not m (the program's "nothing arrives" index keeps a buffer as is: no
  trash slot). ``parallel.recompute=full`` asks for recomputation instead: the backward tick recomputes
  the stage from its stored input, one sequence at a time and layer by layer (:func:`_stage_backward_by_layer`): the same flops, but the working set of one
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
* ``zb-h1`` / ``zb-v`` (:mod:`~jaxpar.parallel.pipeline.split_executor`): F, B and W are separate
  actions; the helpers every executor's ticks share are in :mod:`~jaxpar.parallel.pipeline.ticks`.

**Evaluation** (:func:`eval_loss_sum`) runs a forward-only table
(:func:`build_eval_schedule`): the rows of a data shard split into microbatches that flow
through the stages at once, the last virtual stage adding the loss.
"""

import importlib

from jaxpar.parallel.pipeline.schedule import (
    BACKWARD,
    FORWARD,
    IDLE,
    SCHEDULES,
    WEIGHT,
    Action,
    Program,
    ScheduleTable,
    boundary_sends,
    bubble_fraction,
    build_eval_schedule,
    build_schedule,
    compile_program,
    device_of,
    expected_bubble_fraction,
    keeps_activations,
    render_schedule,
    splits_backward,
    v_shaped,
    virtual_stage,
)

# The executors, stage forms and tick helpers run JAX: imported on first use, so that the planner and
# the command line, which read only the schedule tables above, do not start by importing JAX.
_LAZY = {
    "Pipeline": "executor",
    "eval_loss_sum": "executor",
    "eval_microbatches": "executor",
    **dict.fromkeys(
        (
            "ENDS",
            "has_ends",
            "layer_order",
            "model_index",
            "stage_form_logical_axes",
            "stored_order",
            "to_model_form",
            "to_stage_form",
        ),
        "forms",
    ),
    **dict.fromkeys(
        (
            "AXIS",
            "SCOPE_BACKWARD",
            "SCOPE_ENDS",
            "SCOPE_FIRST",
            "SCOPE_FORWARD",
            "SCOPE_KEPT",
            "SCOPE_LAST",
            "SCOPE_SEND",
            "SCOPE_WEIGHT",
            "SCOPE_WORK",
        ),
        "ticks",
    ),
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The eager names above, then every lazy one: _LAZY is the one list of the names imported on first use.
__all__ = [
    "BACKWARD",
    "FORWARD",
    "IDLE",
    "SCHEDULES",
    "WEIGHT",
    "Action",
    "Program",
    "ScheduleTable",
    "boundary_sends",
    "bubble_fraction",
    "build_eval_schedule",
    "build_schedule",
    "compile_program",
    "device_of",
    "expected_bubble_fraction",
    "keeps_activations",
    "render_schedule",
    "splits_backward",
    "v_shaped",
    "virtual_stage",
    *_LAZY,
]
