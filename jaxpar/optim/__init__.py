"""Optimizers and learning-rate schedules.

* :mod:`jaxpar.optim.registry`: ``optim.name`` -> optimizer (build, fields read, state formula).
* :mod:`jaxpar.optim.state`: the state's shardings and its move between the pipeline's forms.
* :mod:`jaxpar.optim.transforms`: per-tensor application (stacked layers as batch dims), decoupled decay.
* :mod:`jaxpar.optim.lr`: the learning-rate schedules.

Where the update runs, and why. jaxpar's AdamW (the default) runs inside the step's ``shard_map``
on each device's shard: elementwise, so exact on shards, and its bad-step skip multiplies by exactly
1 and adds 0, which keeps the update in place in the donated buffers. Every optax optimizer runs
after the gradient ``shard_map``, in the same jit, on the global arrays under GSPMD
(:meth:`jaxpar.train.step.StepBuilder.global_step`): Adafactor's factored second moments are means
over a parameter dim, its update clipping and parameter scale are RMS over the tensor, Muon's
Newton-Schulz multiplies whole matrices; on local shards split over ``data`` or ``tensor`` each of
those would be wrong, while under GSPMD XLA inserts the reductions the sharding needs, for any
transformation, including user-supplied ones. Gradients (reduced and clipped inside the
``shard_map``) arrive laid out like the optimizer state; parameters are read under their optimizer
spec and written under their storage spec. A bad step (non-finite loss or gradient norm, loss above
the guard) keeps parameters and state bitwise through a select of old values (its cost, measured in
tests/test_optim.py, is below one parameter-sized temporary). The stacked ``layers`` dim (and the
pipeline's ``stages`` dim of ``ends``) are batch dims for per-tensor statistics
(:func:`jaxpar.optim.transforms.per_tensor` for Adafactor, Muon's dimension numbers), as PyTorch
holds one tensor per layer; so the stage form and the model form of the parameters see the same
statistics.
"""
