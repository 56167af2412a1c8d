"""Optimizers and learning-rate schedules.

* :mod:`jaxpar.optim.registry`: ``optim.name`` -> optimizer (build, fields read, state formula).
* :mod:`jaxpar.optim.state`: the state's shardings and its move between the pipeline's forms.
* :mod:`jaxpar.optim.transforms`: per-tensor application (stacked layers as batch dims), decoupled decay.
* :mod:`jaxpar.optim.lr`: the learning-rate schedules.

Where the update runs, and why. jaxpar's AdamW (the default) runs inside the step's ``shard_map`` on
each device's shard: it is elementwise, so exact on shards, and its bad-step skip (multiply by
exactly 1, add 0) keeps the update in place in the donated buffers. Every optax optimizer runs after
the gradient ``shard_map``, in the same jit, on global arrays under GSPMD
(:meth:`jaxpar.train.step.StepBuilder.global_step`): Adafactor's factored moments and RMS clipping
and Muon's Newton-Schulz need whole tensors, which local shards are not, and GSPMD inserts the
reductions any transformation needs. Gradients arrive laid out like the optimizer state; parameters
are read under their optimizer spec and written under their storage spec; a bad step keeps both
bitwise through a select of old values. The stacked ``layers`` dim (and the pipeline's ``stages``
dim of ``ends``) are batch dims for per-tensor statistics, as PyTorch holds one tensor per layer,
so the stage and model forms of the parameters see the same statistics.
"""
