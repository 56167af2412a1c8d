"""The axes table (jaxpar.axes.AXIS_ROLES) is where the sharding, the batch split, ZeRO-3's gather
groups and the model's ShardContext take their per-axis facts: each test reads the groups those
modules build and checks them against the table, then changes the table and checks they follow."""

import dataclasses

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar import axes
from jaxpar.axes import AXIS_ROLES, MESH_AXES, MeshAxis, group_axes
from jaxpar.config import load_config
from jaxpar.ops import zero3
from jaxpar.sharding import is_placement
from jaxpar.train.batches import BatchFeed, batch_spec
from tests.helpers import FP32_SMALL, ROOT, make_setup

MOE = [
    *FP32_SMALL,
    "--config.model.num_layers=2",
    "--config.model.num_experts=4",
    "--config.train.seq_len=32",
    "--config.mesh.data=2",
    "--config.mesh.expert=2",
    "--config.mesh.context=2",
    "--config.model.attention=blockwise",
    "--config.model.attention_block=8",
    "--config.mesh.tensor=1",
    "--config.parallel.zero_stage=3",
    "--config.train.global_batch=8",
]


@pytest.fixture(scope="module")
def setup():
    return make_setup(load_config(str(ROOT / "configs" / "tiny_mixtral.py"), MOE))


def _table_group(sizes, split=()):
    """The gradient group as the table defines it, written out: batch axes, then sequence axes."""
    rows = [a for a in MESH_AXES if AXIS_ROLES[a].splits_batch] + [
        a for a in MESH_AXES if AXIS_ROLES[a].splits_sequence
    ]
    return tuple(a for a in rows if (AXIS_ROLES[a].at_size_one or sizes.get(a, 1) > 1) and a not in split)


def test_every_axis_has_a_row_and_the_real_table():
    assert set(AXIS_ROLES) == set(MeshAxis)
    sizes = {MeshAxis.DATA: 2, MeshAxis.EXPERT: 2, MeshAxis.CONTEXT: 2}
    assert axes.batch_axes(sizes) == (MeshAxis.DATA, MeshAxis.EXPERT)
    assert axes.data_group(sizes) == (MeshAxis.DATA, MeshAxis.EXPERT, MeshAxis.CONTEXT)
    assert axes.data_group(sizes, split={MeshAxis.EXPERT}) == (MeshAxis.DATA, MeshAxis.CONTEXT)
    assert axes.batch_axes({}) == MeshAxis.DATA and axes.data_group({}) == MeshAxis.DATA
    assert axes.axis_rules({})["experts"] == MeshAxis.EXPERT and "layers" not in axes.axis_rules({})
    assert axes.axis_rules({MeshAxis.PIPELINE: 2})["layers"] == MeshAxis.PIPELINE


def _groups_built(setup):
    """What sharding, zero3, batches and step build for ``setup``'s layout."""
    placements = setup.train_form.placements
    by_param = {
        jax.tree_util.keystr(path): group_axes(lay.zero_axes)
        for path, lay in jax.tree_util.tree_leaves_with_path(placements, is_leaf=is_placement)
    }
    gathers = zero3.zero3_groups(placements)
    gathered = [group_axes(g) for g in jax.tree.leaves(gathers, is_leaf=zero3.is_group)]
    ctx = setup.builder.shard_context()
    bound = {f: getattr(ctx, f) for f in ("data_axis", "tensor_axis", "context_axis", "expert_axis")}
    return by_param, gathered, batch_spec(setup.mesh), BatchFeed(setup.mesh, setup.layout).data_split, bound


def test_modules_take_their_groups_from_the_table(setup, monkeypatch):
    sizes = setup.layout.mesh
    by_param, gathered, spec, split, bound = _groups_built(setup)
    compute = {
        jax.tree_util.keystr(path): {a for a in lay.compute if a is not None}
        for path, lay in jax.tree_util.tree_leaves_with_path(setup.train_form.placements, is_leaf=is_placement)
    }
    # sharding: each parameter's group is the table's group less the axes it is split over
    assert by_param == {k: _table_group(sizes, compute[k]) for k in by_param}
    assert by_param["['blocks']['moe']['w_up']"] == ("data", "context")  # the experts': no `expert`
    assert by_param["['embed']"] == ("data", "expert", "context")
    # ZeRO-3 gathers each parameter over its group
    assert gathered == list(by_param.values())
    # the batch split and the ShardContext
    assert spec == P(None, ("data", "expert"), None) and split == (0, 1)
    assert bound == {
        "data_axis": _table_group(sizes),
        "tensor_axis": "tensor",
        "context_axis": "context",
        "expert_axis": "expert",
    }

    # A changed table: `pipeline` (size 1 here) splits the batch at every size, `context` stops
    # splitting the sequence and is bound at size 1, `expert` is no longer bound at size 1.
    roles = dict(AXIS_ROLES)
    roles[MeshAxis.PIPELINE] = dataclasses.replace(roles[MeshAxis.PIPELINE], splits_batch=True, at_size_one=True)
    roles[MeshAxis.CONTEXT] = dataclasses.replace(roles[MeshAxis.CONTEXT], splits_sequence=False)
    roles[MeshAxis.TENSOR] = dataclasses.replace(roles[MeshAxis.TENSOR], bound_at_size_one=False)
    monkeypatch.setattr(axes, "AXIS_ROLES", roles)
    changed = make_setup(load_config(str(ROOT / "configs" / "tiny_mixtral.py"), MOE))
    by_param, gathered, spec, split, bound = _groups_built(changed)
    assert by_param["['blocks']['moe']['w_up']"] == ("data", "pipeline")
    assert by_param["['embed']"] == ("data", "pipeline", "expert")
    assert gathered == list(by_param.values())
    assert spec == P(None, ("data", "pipeline", "expert"), None)
    assert bound["data_axis"] == ("data", "pipeline", "expert") and bound["tensor_axis"] is None
