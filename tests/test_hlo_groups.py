"""Every replica-group form XLA prints, read into device groups and mesh axes
(:mod:`jaxpar.analysis.hlo_groups`), and the one-line refusal of a form it does not know.

The strings are verbatim from compiled programs' ``as_text()`` on 8 simulated CPU devices, with jax
0.10.2 and jax 0.12.0.1: each pair is the same collective of the same program, printed by the two
releases in different forms, and must give the same groups (in the same order).
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.analysis import compiled as ca
from jaxpar.analysis.hlo_groups import parse_replica_groups, replica_groups, source_target_pairs

# (program, collective, jax 0.10.2's text, jax 0.12's text, groups). Programs (mesh data=4 x tensor=2
# of jax.devices() in order unless named): shard_map of f32[16,8] with P("data", "tensor") and psum
# over "tensor" / "data" / ("data", "tensor") / ("tensor", "data"), all_gather and all_to_all over
# "data", psum_scatter over "tensor"; shard_map on a 2x2x2 mesh (a, b, c), psum over ("c", "a") and "b";
# jit with in/out shardings, partitioned by XLA: (x @ w).sum(0) with x P("data", "tensor"), w
# P("tensor", None); x.sum(1) with x P("tensor", "data"); x.sum(0) with x P(("tensor", "data"));
# x * 2 resharded P("data", "tensor") -> P("tensor", "data"); on a mesh x=8, f32[8,4] P("x")
# reshaped to (2, 4, 4) and summed over dim 1.
SAME_COLLECTIVE = [
    ("shard_map psum tensor", "all-reduce",
     "{{0,1},{2,3},{4,5},{6,7}}", "mesh['data'=4,'tensor'=2] {'tensor'}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("shard_map psum data", "all-reduce",
     "{{0,2,4,6},{1,3,5,7}}", "mesh['data'=4,'tensor'=2] {'data'}", [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("shard_map psum data,tensor", "all-reduce",
     "{{0,1,2,3,4,5,6,7}}", "mesh['data'=4,'tensor'=2] {'data','tensor'}", [[0, 1, 2, 3, 4, 5, 6, 7]]),
    ("shard_map psum tensor,data", "all-reduce",
     "{{0,2,4,6,1,3,5,7}}", "mesh['data'=4,'tensor'=2] {'tensor','data'}", [[0, 2, 4, 6, 1, 3, 5, 7]]),
    ("shard_map all_gather data", "all-gather",
     "{{0,2,4,6},{1,3,5,7}}", "mesh['data'=4,'tensor'=2] {'data'}", [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("shard_map psum_scatter tensor", "reduce-scatter",
     "{{0,1},{2,3},{4,5},{6,7}}", "mesh['data'=4,'tensor'=2] {'tensor'}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("shard_map all_to_all data", "all-to-all",
     "{{0,2,4,6},{1,3,5,7}}", "mesh['data'=4,'tensor'=2] {'data'}", [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("shard_map abc psum c,a", "all-reduce",
     "{{0,4,1,5},{2,6,3,7}}", "mesh['a'=2,'b'=2,'c'=2] {'c','a'}", [[0, 4, 1, 5], [2, 6, 3, 7]]),
    ("shard_map abc psum b", "all-reduce",
     "{{0,2},{1,3},{4,6},{5,7}}", "mesh['a'=2,'b'=2,'c'=2] {'b'}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ("jit matmul, tensor partial sums", "all-reduce",
     "{{0,1},{2,3},{4,5},{6,7}}", "[4,2]<=[8]", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("jit matmul, the sum over data", "all-reduce",
     "mesh['axis_0'=4,'axis_1'=1,'axis_2'=2] {'axis_0'}", "mesh['axis_0'=4,'axis_1'=2] {'axis_0'}",
     [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("jit sum(1) of P(tensor, data)", "all-reduce",
     "mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_1'}", "mesh['data'=4,'tensor'=2] {'data'}",
     [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("jit sum(1) of P(tensor, data)", "all-gather",
     "mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_0'}", "mesh['data'=4,'tensor'=2] {'tensor'}",
     [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("jit sum(0) of P((tensor, data))", "all-reduce",
     "mesh['axis_0'=8,'axis_1'=1], device_ids=([4,2]T(1,0)) {'axis_0'}", "mesh['data'=4,'tensor'=2] {'tensor','data'}",
     [[0, 2, 4, 6, 1, 3, 5, 7]]),
    ("jit reshard to P(tensor, data)", "all-to-all",
     "mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(0,2,1)) {'axis_1':(2)2}", "mesh['data'=4,'tensor'=2] {'data':(2)2}",
     [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ("jit reshape, mesh x=8", "all-reduce",
     "mesh['axis_0'=2,'axis_1'=4,'axis_2'=1] {'axis_1'}", "mesh['x'=8] {'x':(2)4}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("jit reshape, mesh x=8", "all-gather",
     "mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}", "mesh['x'=8] {'x':(1)2}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
]  # fmt: skip

# Forms XLA's printer writes (jax 0.12: jaxlib's hlo_module_from_text, then to_string, prints them
# back as given) but no compile above printed: empty axes (each device alone), an explicit device
# order, two sub-axes of one axis in either order, a maximal mesh.
PRINTER_ONLY = [
    ("mesh['x'=4,'y'=2] {}", [[0], [1], [2], [3], [4], [5], [6], [7]]),
    ("mesh['x'=4,'y'=2], device_ids=(3,1,7,5,0,2,4,6) {'x'}", [[3, 7, 0, 4], [1, 5, 2, 6]]),
    ("mesh['x'=8] {'x':(1)2,'x':(4)2}", [[0, 1, 4, 5], [2, 3, 6, 7]]),
    ("mesh['x'=8] {'x':(4)2,'x':(1)2}", [[0, 4, 1, 5], [2, 6, 3, 7]]),
    ("single_device[device_id=3] {}", [[3]]),
]

# The train step of configs/tiny.py (experiments/compiled_numbers.py's small overrides; the context
# layout: tests/test_context_hlo.py's): (layout, mesh sizes pipeline/data/context/tensor, jax 0.10.2's
# text, jax 0.12's text, the mesh axes jaxpar attributes the collective to).
MESH = ("pipeline", "data", "context", "tensor")
TRAIN_STEP = [
    ("z1_d4t2 tensor", (1, 4, 1, 2), "{{0,1},{2,3},{4,5},{6,7}}",
     "mesh['pipeline'=1,'data'=4,'context'=1,'tensor'=2] {'tensor'}", ("tensor",)),
    ("z1_d4t2 loss", (1, 4, 1, 2), "{{0,2,4,6,1,3,5,7}}",
     "mesh['pipeline'=1,'data'=4,'context'=1,'tensor'=2] {'tensor','data'}", ("data", "tensor")),
    ("pp_int data,pipeline", (2, 2, 1, 2), "{{0,4,2,6},{1,5,3,7}}",
     "mesh['pipeline'=2,'data'=2,'context'=1,'tensor'=2] {'data','pipeline'}", ("pipeline", "data")),
    ("pp_int loss", (2, 2, 1, 2), "{{0,4,2,6,1,5,3,7}}",
     "mesh['pipeline'=2,'data'=2,'context'=1,'tensor'=2] {'tensor','data','pipeline'}", ("pipeline", "data", "tensor")),
    ("gather_c4_t2 grads (data=1)", (1, 1, 4, 2), "{{0,2,4,6},{1,3,5,7}}",
     "mesh['pipeline'=1,'data'=1,'context'=4,'tensor'=2] {'data','context'}", ("context",)),
    ("mt_dp8 tensor=1", (1, 8, 1, 1), "{{0},{1},{2},{3},{4},{5},{6},{7}}",
     "mesh['pipeline'=1,'data'=8,'context'=1,'tensor'=1] {'tensor'}", ()),
]  # fmt: skip


@pytest.mark.parametrize(
    "old, new, groups", [c[2:] for c in SAME_COLLECTIVE], ids=[f"{c[0]}-{c[1]}" for c in SAME_COLLECTIVE]
)
def test_both_releases_forms_give_the_same_groups(old, new, groups):
    assert parse_replica_groups(old) == groups
    assert parse_replica_groups(new) == groups


@pytest.mark.parametrize("text, groups", PRINTER_ONLY)
def test_printer_only_forms(text, groups):
    assert parse_replica_groups(text) == groups


def test_explicit_and_iota_forms():
    assert parse_replica_groups("{}") is None  # one group of every device
    assert parse_replica_groups("[2,4]<=[8]") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert parse_replica_groups("[4,2]<=[2,4]T(1,0)") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def _one_collective(attr: str, opcode: str = "all-reduce") -> str:
    """A module whose entry runs one collective with the attribute text ``attr``."""
    to_apply = ", to_apply=%add" if opcode == "all-reduce" else ""
    return f"""HloModule m

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

ENTRY %main (x: f32[8]) -> f32[8] {{
  %x = f32[8]{{0}} parameter(0)
  ROOT %c = f32[8]{{0}} {opcode}(%x), channel_id=1, {attr}, use_global_device_ids=true{to_apply}
}}
"""


def _analyze(text: str, sizes: tuple[int, ...], names: tuple[str, ...] = MESH) -> ca.CompiledReport:
    fake = types.SimpleNamespace(as_text=lambda: text, memory_analysis=lambda: None, cost_analysis=dict)
    return ca.analyze_compiled(fake, types.SimpleNamespace(axis_names=names, devices=np.empty(sizes)))


@pytest.mark.parametrize("sizes, old, new, axes", [c[1:] for c in TRAIN_STEP], ids=[c[0] for c in TRAIN_STEP])
def test_train_step_collectives_get_the_same_axes(sizes, old, new, axes):
    for text in (old, new):
        r = _analyze(_one_collective(f"replica_groups={text}"), sizes)
        assert [row.axes for row in r.rows] == ([axes] if axes else []) and r.trivial_ops == (0 if axes else 1), text


def test_source_target_pairs():
    """jax 0.10.2 and 0.12 print pairs alike: the context ring of tests/test_context_hlo.py."""
    pairs = source_target_pairs("channel_id=3, source_target_pairs={{0,2},{2,0},{1,3},{3,1}}, metadata={}")
    assert pairs == [[0, 2], [2, 0], [1, 3], [3, 1]]
    r = _analyze(_one_collective("source_target_pairs={{0,2},{2,0},{1,3},{3,1}}", "collective-permute"), (1, 2, 2, 2))
    assert [row.axes for row in r.rows] == [("context",)]


@pytest.mark.parametrize("attrs", [
    "replica_groups=mesh[data=4,tensor=2] {data}",  # unquoted names
    "replica_groups=mesh['data'=4,'tensor'=2] {'pipeline'}",  # an axis the mesh lacks
    "replica_groups=mesh['x'=8] {'x':(1)4,'x':(2)2}",  # overlapping sub-axes
    "replica_groups=mesh['x'=8] {'x','x':(1)2}",  # a whole axis and a part of it
    "replica_groups=mesh['x'=8] {'x':(0)2}",  # a sub-axis after nothing
    "replica_groups=mesh['x'=8] {'x',,'x'}",  # an empty axis
    "replica_groups=mesh['x'=4], device_ids=(0,1,2,2) {'x'}",  # not a permutation
    "replica_groups=mesh['x'=4] {'x'} extra, use_global_device_ids=true",  # trailing text
    "replica_groups=devices=[2,4]<=[8], use_global_device_ids=true",  # a sharding, not groups
    "replica_groups=[8]<=[8]",  # iota without groups x size
    "use_global_device_ids=true",  # no replica_groups at all
])  # fmt: skip
def test_unknown_forms_are_refused_in_one_line(attrs):
    with pytest.raises(ValueError, match="unrecognised replica_groups") as e:
        replica_groups(attrs)
    assert "\n" not in str(e.value)


def test_unknown_pairs_and_the_instruction_are_named():
    with pytest.raises(ValueError, match="unrecognised source_target_pairs"):
        source_target_pairs("source_target_pairs={{0,1,2}}")
    with pytest.raises(ValueError, match=r"^c: unrecognised replica_groups 'mesh\['x'=8\] \{'y'\}': axis"):
        _analyze(_one_collective("replica_groups=mesh['x'=8] {'y'}"), (8,), ("data",))
    with pytest.raises(ValueError, match="outside the 4-device mesh"):
        _analyze(_one_collective("replica_groups=mesh['x'=8] {'x'}"), (4,), ("data",))


def test_this_jax_compiles_read_right():
    """Whatever form the installed jax prints, a shard_map program's collectives get their axes."""
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), devices=jax.devices()[:8])

    def local(x):
        return jax.lax.psum(x, "tensor") + jax.lax.psum(x, "data") + jax.lax.psum(x, ("tensor", "data"))

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("data", "tensor"), out_specs=P("data", "tensor")))
    arg = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=jax.NamedSharding(mesh, P("data", "tensor")))
    r = ca.analyze_compiled(fn.lower(arg).compile(), mesh)
    assert {row.axes: row.count for row in r.rows} == {("data",): 1, ("tensor",): 1, ("data", "tensor"): 1}
