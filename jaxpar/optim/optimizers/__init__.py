"""The built-in optimizers, one module each: a file ``NAME.py`` here is ``optim.name='NAME'``.

A module declares, in one place:

* ``FIELDS``: a literal set of the ``optim.*`` fields it reads beyond
  :data:`jaxpar.optim.fields.COMMON_FIELDS` (schedule, clipping). :mod:`jaxpar.optim.fields` reads it
  with ``ast``, so a config is checked without importing the module, optax or JAX: any other field
  set away from its default is refused by name. ``optim.momentum`` in it: -1 picks the module's
  default (:func:`jaxpar.optim.fields.momentum`), anything else must lie in [0, 1).
* ``build(optim_cfg, schedule, placements) -> optax.GradientTransformation``.
* ``state(optim_cfg, shape, logical) -> list[StateLeaf]``: the fp32 state leaves one parameter adds
  (:mod:`jaxpar.optim.state`), the formula the planner prices.
* optionally ``available() -> bool`` (False where the installed optax lacks it) and
  ``IN_SHARD_MAP = True`` (jaxpar's own update inside the step's ``shard_map``: adamw only).

Both :mod:`jaxpar.optim.fields` and :mod:`jaxpar.optim.registry` list this package's modules with
``pkgutil.iter_modules`` over its ``__path__`` (names starting with ``_`` skipped), so a test adds
an optimizer by appending a folder holding one such file to ``__path__`` (tests/test_optim.py).
"""
