"""The planner's estimates against the compiled train step (``jaxpar plan --aot``).

For every layout of the tiny model (configs/tiny.py) and of the ~1B model (configs/llama_1b.py) on
the 8 simulated CPU devices of tests/conftest.py, the train step is compiled ahead of time from
abstract arrays (:func:`jaxpar.analysis.compiled.analyze_layout`, the one compile path) and:

* the estimated model-state arguments (``memory_estimate(..., "jaxpar")`` parameters + Adam state,
  plus the int32 batch and step count the step also takes) are within 5% of the compiled
  ``memory_analysis().argument_size_in_bytes``;
* the estimated ring bytes per device per step on each mesh axis (``communication(...,
  convention="jaxpar")``) are within 10% of the compiled collectives on that axis.

Compute is fp32 (XLA:CPU runs bf16 collectives in fp32). The 1B model compiles at seq 256 with
one or two sequences per data shard: the formulas scale with b*s, the compile time does not.
Each layout compiles once (module-scoped cache); ``pytest -s`` prints every measured ratio.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import time
from collections.abc import Callable

import jax
import pytest

from jaxpar.analysis import aot as A
from jaxpar.analysis import plan as P
from jaxpar.analysis.compiled import analyze_layout
from jaxpar.analysis.estimate import ParallelLayout, communication, memory_estimate
from jaxpar.cli import plan as plan_cli
from jaxpar.config import ConfigDict, ConfigError, load_config
from tests.helpers import MEMORY_OPTIONS

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = {"tiny": ROOT / "configs" / "tiny.py", "1b": ROOT / "configs" / "llama_1b.py"}
SEQ = 256
MEMORY_TOLERANCE, COMM_TOLERANCE = 0.05, 0.10
AXES = ("data", "tensor", "pipeline", "context")


def _lay(
    data: int,
    tensor: int,
    pipeline: int,
    virtual: int,
    zero: int,
    m: int,
    b: int,
    seq: int,
    recompute: str = "none",
    sp: bool = False,
    schedule: str = "1f1b",
) -> ParallelLayout:
    """A layout (no context axis) from its fields in the order these tables list them."""
    return ParallelLayout(
        data=data,
        tensor=tensor,
        pipeline=pipeline,
        virtual_stages=virtual,
        zero_stage=zero,
        microbatches=m,
        microbatch_size=b,
        seq_len=seq,
        recompute=recompute,
        sequence_parallel=sp,
        pipeline_schedule=schedule,
    )


def _tiny(tensor: int, zero: int, recompute: str = "none", sp: bool = False) -> ParallelLayout:
    """Tiny model, 8 devices, global batch 16 in 2 microbatches."""
    data = 8 // tensor
    return _lay(data, tensor, 1, 1, zero, 2, 16 // (2 * data), SEQ, recompute, sp)


def _1b(tensor: int, zero: int, recompute: str = "none", sp: bool = False) -> ParallelLayout:
    """~1B model, 8 devices, one sequence per data shard per microbatch; 2 microbatches at ZeRO-2/3
    (their reductions run every microbatch)."""
    return _lay(8 // tensor, tensor, 1, 1, zero, 2 if zero >= 2 else 1, 1, SEQ, recompute, sp)


# name -> (model, layout). Recompute varies across the grid to cover the remat collectives too.
RECOMPUTE = {0: "none", 1: "selective", 2: "full", 3: "none"}
LAYOUTS: dict[str, tuple[str, ParallelLayout]] = {
    **{f"tiny_t{t}_z{z}": ("tiny", _tiny(t, z, RECOMPUTE[(z + t) % 4])) for t in (1, 2) for z in range(4)},
    "tiny_t2_z1_sp": ("tiny", _tiny(2, 1, "full", sp=True)),
    **{f"1b_t{t}_z{z}": ("1b", _1b(t, z, RECOMPUTE[z], sp=t == 4)) for t in (1, 2, 4) for z in range(4)},
    "1b_t8_z0": ("1b", _1b(8, 0, "selective")),  # data = 1: ZeRO has nothing to shard over
    # Pipeline layouts: the compiled report counts each collective exactly per stage from the
    # schedule table; the busiest stage on each axis is compared with the estimate's.
    "tiny_p2_1f1b": ("tiny", _lay(2, 2, 2, 1, 1, 4, 2, SEQ, "full")),
    "tiny_p2_interleaved_sp": ("tiny", _lay(2, 2, 2, 2, 0, 2, 4, SEQ, "selective", True, "interleaved")),
    "tiny_p4_gpipe": ("tiny", _lay(2, 1, 4, 1, 1, 4, 2, SEQ, "none", False, "gpipe")),
    "tiny_p4_1f1b_sp": ("tiny", _lay(1, 2, 4, 1, 0, 4, 4, SEQ, "full", True)),
    "1b_p2_1f1b_sp": ("1b", _lay(2, 2, 2, 1, 1, 2, 1, SEQ, "selective", True)),
    "1b_p4_interleaved": ("1b", _lay(1, 2, 4, 2, 0, 4, 1, SEQ, "full", False, "interleaved")),
    # ZeRO-3 inside the pipeline: layers gathered over data in every tick that runs them
    "tiny_p2_zero3": ("tiny", _lay(2, 2, 2, 1, 3, 2, 4, SEQ, "none")),
    "tiny_p2_zero3_interleaved": ("tiny", _lay(2, 2, 2, 2, 3, 2, 4, SEQ, "selective", False, "interleaved")),
    "1b_p2_zero3_remat": ("1b", _lay(4, 1, 2, 1, 3, 2, 1, SEQ, "full")),
    # ZeRO-2 inside the pipeline: each backward tick reduce-scatters into a sharded accumulator
    "tiny_p4_zero2": ("tiny", _lay(2, 1, 4, 1, 2, 4, 2, SEQ, "full")),
    "1b_p2_zero2_interleaved": ("1b", _lay(2, 2, 2, 2, 2, 4, 1, SEQ, "selective", True, "interleaved")),
    # Context parallelism: the ring's permutes / the all-gather exchange on `context`, the gradient
    # all-reduce over (data, context) on `data` (ZeRO 0: the memory estimate shards over data only)
    "tiny_c4_ring_full": (
        "tiny",
        ParallelLayout(
            data=2,
            context=4,
            microbatches=2,
            microbatch_size=4,
            seq_len=SEQ,
            recompute="full",
            attention="blockwise",
            attention_block=32,
        ),
    ),
    "tiny_c2_t2_gather_sp": (
        "tiny",
        ParallelLayout(
            data=2,
            tensor=2,
            context=2,
            microbatches=2,
            microbatch_size=4,
            seq_len=SEQ,
            recompute="selective",
            sequence_parallel=True,
            attention="blockwise",
            attention_block=32,
            context_exchange="all_gather",
        ),
    ),
}
# ~2.5-20 s of compile per layout on 2 cores: these layouts run only with JAXPAR_SLOW=1. The default
# suite keeps the ~1B model at TP-4 + SP + ZeRO-3, at data = 1 and in an interleaved pipeline; the tiny
# model with tensor = 2 at ZeRO-3 and at ZeRO-1 + SP (ZeRO-0's data bytes: the ring row; ZeRO-2's: the ZeRO-2
# pipeline row), and each pipeline feature once (1F1B with SP, interleaved with ZeRO-3, ZeRO-2); the ring
# exchange. The other ZeRO stages at tensor = 2, interleaved with SP and the ~1B two-stage 1F1B went under
# JAXPAR_SLOW=1 in session 28, GPipe in session 29 (the default suite's time on a 2-core host): GPipe's
# permutes are counted by tests/test_pipeline.py and its memory by tests/test_memory_estimate.py.
SLOW = {
    "tiny_p4_gpipe",
    "tiny_t2_z0",
    "tiny_t2_z1",
    "tiny_t2_z2",
    "tiny_p2_interleaved_sp",
    "1b_p2_1f1b_sp",
    "tiny_t1_z0",
    "tiny_t1_z1",
    "tiny_t1_z2",
    "tiny_t1_z3",
    "tiny_p2_1f1b",
    "tiny_p2_zero3",
    "1b_t1_z0",
    "1b_t1_z1",
    "1b_t1_z2",
    "1b_t1_z3",
    "1b_t2_z0",
    "1b_t2_z1",
    "1b_t2_z2",
    "1b_t2_z3",
    "1b_t4_z0",
    "1b_t4_z1",
    "1b_t4_z2",
    "1b_p2_zero3_remat",
    "1b_p2_zero2_interleaved",
    "tiny_c2_t2_gather_sp",
}  # the all-gather exchange's compiled bytes: also tests/test_context_hlo.py
slow = pytest.mark.skipif(os.environ.get("JAXPAR_SLOW") != "1", reason="slow: set JAXPAR_SLOW=1")


def _config(model: str) -> ConfigDict:
    return load_config(
        str(CONFIGS[model]), [f"--config.{k}=float32" for k in ("model.compute_dtype", "parallel.grad_reduce_dtype")]
    )


@pytest.fixture(scope="module")
def compiled() -> Callable[[str], tuple[ConfigDict, A.AotComparison]]:
    """name -> (the layout's fp32 config, its AotComparison), each layout compiled once per module."""
    cache: dict[str, tuple[ConfigDict, A.AotComparison]] = {}

    def get(name: str) -> tuple[ConfigDict, A.AotComparison]:
        if name not in cache:
            model, layout = LAYOUTS[name]
            cfg = _config(model)
            # the buffers users' compiles get (tests/helpers.py)
            result = A.aot_compare(cfg, layout, "jaxpar", compiler_options=MEMORY_OPTIONS)
            assert not result.skipped, result.skipped
            cache[name] = (A.layout_config(cfg, layout), result)
            _print(name, result)
        return cache[name]

    return get


def _print(name: str, r: A.AotComparison) -> None:
    parts = [f"args {r.argument_bytes / 2**20:9.2f} MiB est {r.estimated_argument_bytes / 2**20:9.2f} "
             f"ratio {r.argument_ratio:.4f}"]  # fmt: skip
    for axis in AXES:
        ratio = r.ratio(axis)
        parts.append(
            f"{axis} {r.compiled_bytes[axis] / 1e6:10.3f} MB est {r.estimated_bytes[axis] / 1e6:10.3f} "
            f"ratio {'-' if ratio is None else f'{ratio:.4f}'}"
        )
    print(f"\n[{name}] {P.describe(r.layout)}; compiled in {r.compile_s:.1f} s\n  " + "\n  ".join(parts))


@pytest.mark.parametrize("name", [pytest.param(n, marks=slow) if n in SLOW else n for n in LAYOUTS])
def test_estimates_match_compiled_step(compiled, name):
    cfg, r = compiled(name)
    _, layout = LAYOUTS[name]
    model = cfg.model  # fp32 compute, like the compile
    mem = memory_estimate(model, layout, "jaxpar")
    batch = layout.microbatches * layout.microbatch_size * (layout.seq_len + 1) * 4
    states = mem.params_bytes + mem.optimizer_bytes  # the gradients are not step arguments
    assert r.estimated_argument_bytes == states + batch + 4
    assert r.argument_bytes == pytest.approx(states + batch + 4, rel=MEMORY_TOLERANCE)
    comm = communication(model, layout, None, grad_reduce_bytes=4, convention="jaxpar")
    for axis in AXES:
        measured, estimated = r.compiled_bytes[axis], comm[axis].bytes
        assert estimated == r.estimated_bytes[axis]
        if getattr(layout, axis) == 1:
            assert measured == estimated == 0, axis
        else:
            assert measured == pytest.approx(estimated, rel=COMM_TOLERANCE), axis


def test_plan_compiler_options_do_not_change_the_numbers(compiled):
    """plan --aot skips LLVM optimisation (AOT_COMPILER_OPTIONS); the default options measure the same."""
    cfg, r = compiled("tiny_t2_z3")
    full = analyze_layout(cfg)
    assert full.memory.argument_bytes == r.argument_bytes
    assert {axis: full.total_bytes(axis) for axis in AXES} == {axis: r.compiled_bytes[axis] for axis in AXES}


def test_layout_config_carries_the_layout():
    cfg = load_config(str(CONFIGS["1b"]))
    layout = _lay(4, 2, 1, 1, 1, 4, 2, 4096, "full", True)
    out = A.layout_config(cfg, layout, "bfloat16")
    assert (out.mesh.data, out.mesh.tensor, out.mesh.pipeline) == (4, 2, 1)
    parallel = out.parallel
    assert (parallel.zero_stage, parallel.sequence_parallel, parallel.grad_reduce_dtype) == (1, True, "bfloat16")
    assert (out.parallel.microbatches, out.train.global_batch, out.train.seq_len) == (4, 32, 4096)
    assert out.parallel.recompute == "full" and out.model.max_seq_len == 4096  # RoPE: raised to the sequence
    assert cfg.mesh.data == 8 and cfg.train.seq_len == 2048  # the loaded config is untouched
    zero3 = A.layout_config(cfg, ParallelLayout(8, 1, zero_stage=3, seq_len=256), "float32")
    assert zero3.parallel.grad_reduce_dtype == zero3.model.compute_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="not divisible by mesh.tensor"):
        A.layout_config(cfg, ParallelLayout(1, 3, seq_len=256))


def test_run_plan_aot_json(capsys):
    parser = argparse.ArgumentParser()
    plan_cli.add_plan_arguments(parser)
    ns = parser.parse_args(["--config", str(CONFIGS["tiny"]), "--devices", "8", "--top", "2", "--aot", "--aot-top", "1",
                          "--layout", "data=4,tensor=2,pipeline=1", "--zero", "1", "--recompute", "none",
                          "--no-sequence-parallel", "--json"])  # fmt: skip
    ns.overrides = ["--config.model.compute_dtype=float32"]
    start = time.perf_counter()
    assert plan_cli.run_plan(ns) == 0
    doc = json.loads(capsys.readouterr().out)
    print(f"\nplan --aot (1 layout): {time.perf_counter() - start:.1f} s, aot_s {doc['aot_s']:.1f}")
    first, *rest = doc["layouts"]
    aot = first["aot"]
    assert aot["platform"] == "cpu" and aot["compute_dtype"] == "float32"
    assert aot["argument_ratio"] == pytest.approx(1, rel=MEMORY_TOLERANCE)
    for axis in ("data", "tensor"):
        assert aot["collectives"][axis]["ratio"] == pytest.approx(1, rel=COMM_TOLERANCE), axis
    assert aot["collectives"]["pipeline"] == {"bytes": 0.0, "estimated_bytes": 0.0, "ratio": None}
    assert all("aot" not in row for row in rest)  # only the top --aot-top layouts are compiled


def test_aot_needs_a_fresh_process_for_more_devices():
    assert len(jax.devices()) == 8  # JAX has started with the 8 devices of conftest.py
    with pytest.raises(ConfigError, match="fresh process") as e:
        A.ensure_aot_devices(16)
    assert "\n" not in str(e.value)


def test_unbuildable_layout_is_skipped_with_its_reason():
    result = A.aot_compare(_config("tiny"), ParallelLayout(2, 4, seq_len=SEQ))  # 2 kv heads over tensor=4
    assert "num_kv_heads=2 is not divisible by mesh.tensor=4" in result.skipped
    assert result.to_dict() == {"skipped": result.skipped}


def test_render_aot_table(compiled):
    from rich.console import Console

    _, done = compiled("tiny_t2_z1_sp")
    skipped = A.AotComparison(ParallelLayout(2, 4, seq_len=SEQ), skipped="layout: tensor=4 does not divide 2 kv heads")
    out = io.StringIO()
    plan_cli.render_aot([done, skipped], [1, 2], Console(file=out, width=300), budget_bytes=1.0)
    text = out.getvalue()
    assert "args GiB: est -> AOT (ratio)" in text and "tensor bytes: est -> AOT (ratio)" in text and "(1.000)" in text
    assert "temp GiB: est -> AOT" in text and "peak GiB: est -> AOT" in text
    assert f"({done.temp_ratio:.3f})" in text and "does not fit (compiled)" in text  # a 1-byte budget
    assert "#2 not compiled: layout: tensor=4" in text and "float32" in text
    # the estimated peak's three largest terms, named (estimate.peak_terms)
    assert len(done.peak_terms) == 3 and "#1 estimated peak" in text and "largest terms: " in text
    assert all(name in text for name, _ in done.peak_terms)
    assert done.to_dict()["memory"]["peak_terms"][0]["term"] == done.peak_terms[0][0]


def test_pipeline_stages_are_counted_from_the_schedule(compiled):
    """Each stage's sends, counted from the HLO with the schedule's branch shares, are exactly what
    the table says that stage sends: m(v - [last]) activations and m(v - [first]) gradients; the
    ends of the pipeline send less than the middle stages. Each stage's tensor bytes equal the
    estimate for that stage."""
    from jaxpar.analysis.estimate import jaxpar_stage_traffic

    cfg, r = compiled("1b_p4_interleaved")
    layout = LAYOUTS["1b_p4_interleaved"][1]
    p, m, v, h = layout.pipeline, layout.microbatches, layout.virtual_stages, cfg.model.embed_dim
    bsh = layout.microbatch_size * layout.seq_len * h * 4
    assert [st["stage"] for st in r.stage_bytes] == list(range(p))
    for stage, measured in enumerate(r.stage_bytes):
        est = jaxpar_stage_traffic(cfg.model, layout, stage)
        sends = m * (v - (stage == p - 1)) + m * (v - (stage == 0))
        # plus the loss and the final norm's gradient, all-reduced over pipeline once per step
        extra = 2 * (p - 1) / p * (4 + 4 * h)
        assert est["pipeline"] == (pytest.approx(sends * bsh + extra), sends + 1)
        assert measured["pipeline"] == pytest.approx(sends * bsh + extra, abs=128)  # + tiny (pipeline, tensor) sums
        assert measured["tensor"] == pytest.approx(est["tensor"][0], rel=1e-4)
    assert r.stage_bytes[1]["pipeline"] > r.stage_bytes[0]["pipeline"]  # a middle stage sends 2mv


def test_compare_aot_compiles_every_layout(capsys):
    """`jaxpar compare --aot`: each given layout compiled beside its estimate, in the order given."""
    from jaxpar.cli import main

    argv = [
        "compare",
        "--config",
        str(CONFIGS["tiny"]),
        "--layout",
        "data=8,zero=1,microbatches=2,recompute=none",
        "--layout",
        "data=2,tensor=2,pipeline=2,zero=3,microbatches=2,recompute=none",
        "--aot",
        "--json",
        "--config.model.compute_dtype=float32",
        "--config.parallel.grad_reduce_dtype=float32",
    ]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert [(r["data"], r["pipeline"], r["zero_stage"]) for r in rows] == [(8, 1, 1), (2, 2, 3)]
    for row in rows:
        aot = row["aot"]
        assert aot["argument_ratio"] == pytest.approx(1, rel=MEMORY_TOLERANCE)
        for axis in ("data", "tensor", "pipeline"):
            if aot["collectives"][axis]["estimated_bytes"]:
                assert aot["collectives"][axis]["ratio"] == pytest.approx(1, rel=COMM_TOLERANCE), axis


def test_inspect_prints_the_largest_peak_terms(capsys):
    """``jaxpar inspect`` names the three largest terms of the estimated peak, as text and in --json."""
    from jaxpar.cli.inspect import run_inspect

    small = [
        "--config.mesh.data=2",
        "--config.mesh.tensor=1",
        "--config.model.num_layers=1",
        "--config.train.seq_len=32",
    ]
    assert run_inspect(argparse.Namespace(config=str(CONFIGS["tiny"]), overrides=small, json=False, ops=False)) == 0
    text = capsys.readouterr().out
    assert "estimated peak" in text and "largest terms: " in text and "residual stack" in text
    assert run_inspect(argparse.Namespace(config=str(CONFIGS["tiny"]), overrides=small, json=True, ops=False)) == 0
    terms = json.loads(capsys.readouterr().out)["peak_terms"]
    assert len(terms) == 3 and terms[0]["bytes"] >= terms[1]["bytes"] >= terms[2]["bytes"] > 0


@slow
def test_plan_aot_compiles_a_zero_bubble_row(capsys):
    """The planner's best ZB-H1 layout of the tiny model (p = 2, data = tensor = 2) compiles, and its
    estimated arguments and collective bytes per axis are within the bounds the grid above holds."""
    parser = argparse.ArgumentParser()
    plan_cli.add_plan_arguments(parser)
    ns = parser.parse_args(["--config", str(CONFIGS["tiny"]), "--devices", "8", "--top", "1", "--aot", "--aot-top", "1",
                          "--layout", "data=2,tensor=2,pipeline=2", "--schedule", "zb-h1", "--recompute", "none",
                          "--zero", "1", "--no-sequence-parallel", "--json"])  # fmt: skip
    ns.overrides = ["--config.model.compute_dtype=float32"]
    assert plan_cli.run_plan(ns) == 0
    (row,) = json.loads(capsys.readouterr().out)["layouts"]
    assert (row["pipeline_schedule"], row["pipeline"], row["recompute"]) == ("zb-h1", 2, "none")
    assert row["bubble_fraction"] == pytest.approx(1 / (3 * row["microbatches"] + 1))
    aot = row["aot"]
    assert aot["argument_ratio"] == pytest.approx(1, rel=MEMORY_TOLERANCE)
    for axis in ("data", "tensor", "pipeline"):
        assert aot["collectives"][axis]["ratio"] == pytest.approx(1, rel=COMM_TOLERANCE), axis
