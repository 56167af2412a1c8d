"""Context parallelism in the compiled step: the ring's collective-permutes and the all-gather variant's
collectives over ``context`` equal the formulas of :mod:`jaxpar.ops.context_parallel`, per layer, forward and
backward, and ``inspect`` lists them under the ``context`` axis (tiny model, fp32, seq 64)."""

from __future__ import annotations

import argparse
import io
import json
import pathlib

import pytest

from jaxpar.analysis import compiled as ca
from jaxpar.cli.inspect import render, run_inspect
from jaxpar.config import load_config
from jaxpar.ops.context_parallel import ring_bytes_per_layer

TINY = str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny.py")
SMALL = [
    "--config.model.compute_dtype=float32",
    "--config.train.global_batch=4",
    "--config.train.seq_len=64",
    "--config.model.num_layers=2",
    "--config.model.attention=blockwise",
    "--config.model.attention_block=16",
]
LAYOUTS = {
    "ring_c2_d2_t2": ["--config.mesh.data=2", "--config.mesh.context=2", "--config.mesh.tensor=2"],
    # full remat: the ring (a custom VJP whose residuals remat keeps) is not re-run in the backward
    "ring_c4_d2_full_z1": ["--config.mesh.data=2", "--config.mesh.context=4", "--config.mesh.tensor=1",
                           "--config.parallel.recompute=full", "--config.parallel.zero_stage=1"],
    "gather_c4_t2_m2": ["--config.mesh.data=1", "--config.mesh.context=4", "--config.mesh.tensor=2",
                        "--config.parallel.context_exchange=all_gather", "--config.parallel.microbatches=2"],
}  # fmt: skip
CONTEXT = ("context",)


@pytest.fixture(scope="module")
def compiled():
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            cfg = load_config(TINY, SMALL + LAYOUTS[name])
            cache[name] = (cfg, ca.analyze_layout(cfg))
        return cache[name]

    return get


def _kv_block_bytes(cfg) -> float:
    """One context rank's keys and values of one microbatch (fp32): 2 * b * s/c * kv_heads/t * head_dim * 4."""
    b = cfg.train.global_batch // (cfg.parallel.microbatches * cfg.mesh.data)
    heads = cfg.model.num_kv_heads // cfg.mesh.tensor
    return 2 * b * cfg.train.seq_len // cfg.mesh.context * heads * cfg.model.head_dim * 4


def _per_layer(report: ca.CompiledReport, cfg, kind: str) -> tuple[float, float]:
    """(forward, backward) bytes per device per layer and microbatch of ``kind`` over ``context``; the
    backward ops are those under JAX's ``transpose(...)`` in their source op_name."""
    runs = cfg.model.num_layers * cfg.parallel.microbatches
    ops = [op for op in report.ops if op.kind == kind and op.axes == CONTEXT]
    fwd = sum(op.bytes_per_device for op in ops if "transpose(" not in op.op_name)
    bwd = sum(op.bytes_per_device for op in ops if "transpose(" in op.op_name)
    return fwd / runs, bwd / runs


@pytest.mark.parametrize("name", ["ring_c2_d2_t2", "ring_c4_d2_full_z1"])
def test_ring_permutes_per_layer_match_the_formula(compiled, name):
    cfg, r = compiled(name)
    fwd, bwd = _per_layer(r, cfg, "collective-permute")
    want_fwd, want_bwd = ring_bytes_per_layer(_kv_block_bytes(cfg), cfg.mesh.context)
    assert 0.98 <= fwd / want_fwd <= 1.02 and 0.98 <= bwd / want_bwd <= 1.02, (fwd, want_fwd, bwd, want_bwd)
    c, layers = cfg.mesh.context, cfg.model.num_layers
    # keys and values separately: 2(c-1) sends forward, 2(c-1) + 2c backward, per layer
    assert r.count("collective-permute", CONTEXT) == layers * (2 * (c - 1) + 2 * (c - 1) + 2 * c)
    assert [row.axes for row in r.rows if row.kind == "collective-permute"] == [CONTEXT]  # nothing else permutes


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_row_matches_expected_collectives(compiled, name):
    """Gradients and loss over (data, context), tensor collectives on s/c tokens, the exchange over context."""
    cfg, r = compiled(name)
    for row in r.rows:
        assert row.ratio is not None and 0.98 <= row.ratio <= 1.02, (
            row.kind,
            row.axes,
            row.bytes_per_device,
            row.estimated_bytes,
        )
    group = ("data", "context") if cfg.mesh.data > 1 else CONTEXT
    reduce_kind = "all-reduce" if cfg.parallel.zero_stage == 0 else "reduce-scatter"
    assert r.bytes(reduce_kind, group) > 0 and r.bytes(reduce_kind, ("data",)) == 0


def test_all_gather_exchange_bytes(compiled):
    cfg, r = compiled("gather_c4_t2_m2")
    c, kvb = cfg.mesh.context, _kv_block_bytes(cfg)
    gather_fwd, gather_bwd = _per_layer(r, cfg, "all-gather")
    scatter_fwd, scatter_bwd = _per_layer(r, cfg, "reduce-scatter")
    assert 0.98 <= gather_fwd / ((c - 1) * kvb) <= 1.02 and gather_bwd == 0  # no remat: gathered once
    assert 0.98 <= scatter_bwd / ((c - 1) * kvb) <= 1.02 and scatter_fwd == 0
    assert r.count("collective-permute", CONTEXT) == 0


def test_inspect_lists_the_ring_under_context(compiled, capsys, monkeypatch):
    cfg, r = compiled("ring_c2_d2_t2")
    monkeypatch.setattr(ca, "analyze_layout", lambda c, layout: r if c == cfg else pytest.fail("another config"))
    text = io.StringIO()
    from rich.console import Console

    render(r, console=Console(file=text, width=160))
    assert any(
        line.split("│")[1:3] == [" collective-permute ", " context      "] for line in text.getvalue().splitlines()
    )
    overrides = SMALL + LAYOUTS["ring_c2_d2_t2"]
    assert run_inspect(argparse.Namespace(config=TINY, overrides=overrides, json=True, ops=False)) == 0
    out = json.loads(capsys.readouterr().out)
    row = next(c for c in out["collectives"] if c["kind"] == "collective-permute")
    assert row["axes"] == ["context"] and row["bytes_per_device"] == r.bytes("collective-permute", CONTEXT)
    assert out["layout"]["context"] == 2 and row["ratio"] == pytest.approx(1.0)
    assert out["layout"]["recompute"] == cfg.parallel.recompute and "remat" not in out["layout"]
    assert run_inspect(argparse.Namespace(config=TINY, overrides=overrides, json=False, ops=False)) == 0
    title = " ".join(capsys.readouterr().out.split("┏")[0].split())  # the table's title, as wrapped
    assert title.endswith(f"ZeRO-{cfg.parallel.zero_stage}, 1 microbatch(es), recompute {cfg.parallel.recompute}")


def test_handwritten_hlo_context_attribution_and_unknown_trip_counts():
    """Device ids over a (pipeline, data, context, tensor) mesh: a pair that differs in the third
    coordinate is a context permute, groups are named in device order. A loop
    with a bound carried in its state (blockwise attention's causal loops) warns only if a
    collective runs inside it."""
    import types

    import numpy as np

    from tests.test_compiled import HANDWRITTEN_HLO

    mesh = types.SimpleNamespace(axis_names=("pipeline", "data", "context", "tensor"), devices=np.empty((1, 2, 2, 2)))
    text = HANDWRITTEN_HLO.replace(
        "source_target_pairs={{0,4},{4,0},{1,5},{5,1}}", "source_target_pairs={{0,2},{2,0},{1,3},{3,1}}"
    )
    r = ca.analyze_compiled(
        types.SimpleNamespace(as_text=lambda: text, memory_analysis=lambda: None, cost_analysis=dict), mesh
    )
    assert r.bytes("collective-permute", CONTEXT) == 32 and not r.warnings
    assert r.count("all-gather", ("context", "tensor")) == 1  # [2,4]<=[8]: ids 0-3 and 4-7 at data 0 and 1
    assert r.count("all-reduce", ("data",)) == 3  # {0,4},{1,5},...: pairs that differ in data only
    dynamic = text.replace("%n = s32[] constant(3)", "%n = s32[] get-tuple-element(%p), index=0")
    quiet = dynamic.replace(
        "%ars = f32[8]{0} all-reduce-start(%x), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), "
        "use_global_device_ids=true, to_apply=%add\n",
        "",
    ).replace("%ard = f32[8]{0} all-reduce-done(%ars)", "%ard = f32[8]{0} negate(%x)")
    for hlo, warned in ((dynamic, True), (quiet, False)):
        r = ca.analyze_compiled(
            types.SimpleNamespace(as_text=lambda h=hlo: h, memory_analysis=lambda: None, cost_analysis=dict), mesh
        )
        assert bool(r.warnings) == warned and all("trip count unknown" in w for w in r.warnings)
