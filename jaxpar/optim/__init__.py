"""Optimizers and learning-rate schedules.

* :mod:`jaxpar.optim.optimizers`: one module per built-in optimizer (fields read, build, state
  formula); ``optimizers/adamw.py``: jaxpar's AdamW, the default, inside the step's ``shard_map``.
* :mod:`jaxpar.optim.registry`: ``optim.name`` -> optimizer (those modules, or a custom factory).
* :mod:`jaxpar.optim.fields`: the ``optim`` fields each optimizer reads (read with ``ast``, no optax import).
* :mod:`jaxpar.optim.state`: the state's shardings and its move between the pipeline's forms.
* :mod:`jaxpar.optim.transforms`: per-tensor application (stacked layers as batch dims), decoupled decay.
* :mod:`jaxpar.optim.lr`: the learning-rate schedules.

Where the update runs, and why. jaxpar's AdamW (the default) runs inside the step's ``shard_map``:
elementwise, so exact on shards, and its bad-step skip (multiply by exactly 1, add 0) updates the
donated buffers in place. Optax optimizers run after the gradient ``shard_map``, in the same jit,
on global arrays under GSPMD (:meth:`jaxpar.train.step.StepBuilder.global_step`), because factored
moments, RMS clipping and Newton-Schulz need whole tensors and GSPMD inserts the reductions any
transformation needs; gradients arrive laid out like the state, parameters are read under their
optimizer spec and written under their storage spec, and a bad step keeps both through a select.
Stacked layer dims are batch dims for per-tensor statistics, as PyTorch holds a tensor per layer.
"""
