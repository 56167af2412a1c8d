"""Shard-local kernels with explicit collectives, below the models: attention (dot-product,
blockwise, cuDNN), the context-parallel exchange, ``dense``, dropout, ZeRO-3's parameter gathers
and the remat policy. They name mesh axes only through the arguments they are given and import
nothing from :mod:`jaxpar.models` or :mod:`jaxpar.parallel`."""
