"""Batches on the mesh: their shapes and shardings, and which rows of each batch a process feeds.

A training batch is ``(microbatches, sequences, seq_len + 1)`` int32 tokens, its sequences split
over ``data`` (replicated over ``tensor`` and ``pipeline``); an evaluation batch is
``(sequences, seq_len + 1)``, split the same way. Each process builds only the rows of the ``data``
shards its devices hold (:attr:`BatchFeed.data_split`) and
``jax.make_array_from_process_local_data`` assembles the global array.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.axes import MeshAxis
from jaxpar.config import ConfigDict, ConfigError

BATCH_SPEC = P(None, MeshAxis.DATA, None)  # (microbatches, sequences, seq_len + 1)
EVAL_SPEC = P(MeshAxis.DATA, None)  # (sequences, seq_len + 1)


class BatchFeed:
    """The batch shapes and shardings of one layout, and this process's share of the rows."""

    def __init__(self, mesh: Mesh, train_cfg: ConfigDict):
        self.mesh = mesh
        self.microbatches, self.global_batch, self.seq_len = (
            train_cfg.microbatches,
            train_cfg.global_batch,
            train_cfg.seq_len,
        )
        self.batch_sharding = NamedSharding(mesh, BATCH_SPEC)
        self.eval_sharding = NamedSharding(mesh, EVAL_SPEC)

    @functools.cached_property
    def data_split(self) -> tuple[int, int]:
        """(index, count): which contiguous share of every batch's rows this process feeds. A process
        feeds the rows of the ``data`` shards its devices hold; processes that hold the same ones
        (e.g. different pipeline stages of one data shard: pipeline is the outermost axis, so it
        is what splits over hosts first) feed the same rows."""
        axis = self.mesh.axis_names.index(MeshAxis.DATA)
        groups: dict[int, set[int]] = {}
        for index, device in np.ndenumerate(self.mesh.devices):
            groups.setdefault(device.process_index, set()).add(index[axis])
        shares = sorted({tuple(sorted(g)) for g in groups.values()})
        sizes = {len(share) for share in shares}
        data = self.mesh.shape[MeshAxis.DATA]
        if len(sizes) != 1 or sum(sizes) * len(shares) != data:
            raise ConfigError(
                f"mesh.data={data} does not split evenly over the {len(groups)} "
                "processes; choose a mesh whose data shards divide among the hosts"
            )
        return shares.index(tuple(sorted(groups[jax.process_index()]))), len(shares)

    def batch_shape(self) -> tuple[int, int, int]:
        return (self.microbatches, self.global_batch // self.microbatches, self.seq_len + 1)

    def make_batch(self, local_rows: np.ndarray) -> jax.Array:
        """Global (microbatches, sequences, seq+1) array from this process's rows."""
        local = np.asarray(local_rows, dtype=np.int32)
        local = local.reshape(self.microbatches, local.shape[0] // self.microbatches, local.shape[1])
        return jax.make_array_from_process_local_data(self.batch_sharding, local, self.batch_shape())

    def make_eval_batch(self, local_rows: np.ndarray) -> jax.Array:
        """Global (sequences, seq+1) array from this process's rows."""
        local = np.asarray(local_rows, dtype=np.int32)
        global_shape = (local.shape[0] * self.data_split[1], local.shape[1])
        return jax.make_array_from_process_local_data(self.eval_sharding, local, global_shape)
