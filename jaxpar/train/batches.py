"""Batches on the mesh: their shapes and shardings, and which rows of each batch a process feeds.

A training batch is ``(microbatches, sequences, seq_len + 1)`` int32 tokens, an evaluation batch
``(sequences, seq_len + 1)``, sequences split over ``data`` (replicated over ``tensor`` and
``pipeline``). Each process builds only the rows of its devices' ``data`` shards
(:attr:`BatchFeed.data_split`); ``jax.make_array_from_process_local_data`` assembles the array.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.axes import batch_axes, group_axes
from jaxpar.config import ConfigError
from jaxpar.layout import ParallelLayout


def batch_spec(mesh: Mesh) -> P:
    """A training batch's spec: (microbatches, sequences, seq_len + 1), sequences split over the
    batch axes of the axes table (``data``, x ``expert`` where it is split: :func:`jaxpar.axes.batch_axes`)."""
    return P(None, _rows(mesh), None)


def eval_spec(mesh: Mesh) -> P:
    """An evaluation batch's spec: (sequences, seq_len + 1), split like the training rows."""
    return P(_rows(mesh), None)


def _rows(mesh: Mesh):
    return batch_axes(dict(mesh.shape))


class BatchFeed:
    """The batch shapes and shardings of one layout, and this process's share of the rows."""

    def __init__(self, mesh: Mesh, layout: ParallelLayout):
        self.mesh = mesh
        self.microbatches, self.global_batch, self.seq_len = layout.microbatches, layout.global_batch, layout.seq_len
        self.batch_sharding = NamedSharding(mesh, batch_spec(mesh))
        self.eval_sharding = NamedSharding(mesh, eval_spec(mesh))

    @functools.cached_property
    def data_split(self) -> tuple[int, int]:
        """(index, count): which contiguous share of every batch's rows this process feeds: the rows
        of the ``data`` shards its devices hold; processes holding the same ones (pipeline stages
        of one data shard: pipeline, outermost, splits over hosts first) feed the same rows."""
        axes = [self.mesh.axis_names.index(a) for a in group_axes(_rows(self.mesh))]
        sizes_of = [self.mesh.devices.shape[a] for a in axes]
        groups: dict[int, set[int]] = {}
        for index, device in np.ndenumerate(self.mesh.devices):  # the row shard: data-major, as P((data, expert))
            groups.setdefault(device.process_index, set()).add(
                int(np.ravel_multi_index([index[a] for a in axes], sizes_of))
            )
        shares = sorted({tuple(sorted(g)) for g in groups.values()})
        sizes = {len(share) for share in shares}
        data = int(np.prod(sizes_of))
        if len(sizes) != 1 or sum(sizes) * len(shares) != data:
            what = "*".join(f"mesh.{a}" for a in group_axes(_rows(self.mesh)))
            raise ConfigError(
                f"{what}={data} does not split evenly over the {len(groups)} "
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
