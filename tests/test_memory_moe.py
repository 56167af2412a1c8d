"""The planner's MoE figures against the compiled step: argument memory, bytes over ``expert``,
temporaries and peak of a tiny Mixtral (``configs/tiny_mixtral.py``, fp32, s=128).

Nine layouts (expert=4 x data=2; expert=2 x tensor=2 x data=2 ZeRO-3; expert=2 x pipeline=2 x data=2
1F1B; expert=2 x context=2 x data=2; expert=8, with JAXPAR_SLOW=1 only; expert=4 x data=2 with capacity
1.25; expert=4 x data=2 of a Mixtral wider than its experts, 32 of them, under ``full`` and, with
JAXPAR_SLOW=1 only, without recompute; expert=4 x data=2 ``full`` of the tiny DeepSeek-V3) are AOT-compiled
on the 8 simulated CPU devices (:func:`jaxpar.analysis.compiled.analyze_layout`, as
tests/test_memory_estimate.py does) and held against :func:`jaxpar.analysis.estimate.estimated_argument_bytes`
(within 1e-4: the parameter, optimizer-state and batch bytes are exact), the expected rows over
``expert`` (:func:`jaxpar.analysis.traffic.moe_dispatch_arrays`; per pipeline stage
:func:`jaxpar.analysis.traffic.expert_traffic`) within 1%, and the temporaries
(:mod:`jaxpar.analysis.moe_activations`) within 15%, the peak within 10%. ``pytest -s`` prints the ratios.
"""

from __future__ import annotations

import os

import pytest

from jaxpar.analysis.aot import layout_config
from jaxpar.analysis.compiled import analyze_layout, mesh_for
from jaxpar.analysis.estimate import estimated_argument_bytes
from jaxpar.axes import MeshAxis
from jaxpar.config import load_config
from jaxpar.layout import ParallelLayout
from tests.helpers import MEMORY_OPTIONS, ROOT

PEAK_BOUND, TEMP_BOUND, EXPERT_BOUND, ARGUMENT_BOUND = 0.10, 0.15, 0.01, 1e-4
S = 128


def _lay(**kw) -> ParallelLayout:
    return ParallelLayout(**{"seq_len": S, "microbatch_size": 2, **kw})


WIDE = {"mlp_dim": 32, "num_experts": 32, "experts_per_token": 4}
# name -> (layout, model overrides; "config": another config than tiny_mixtral)
GRID = {
    "e4_d2": (_lay(data=2, expert=4), {}),
    "e2_t2_d2_zero3": (_lay(data=2, expert=2, tensor=2, zero_stage=3), {}),
    "e2_p2_d2_1f1b": (_lay(data=2, expert=2, pipeline=2, microbatches=4, microbatch_size=1), {}),
    "e2_c2_d2": (_lay(data=2, expert=2, context=2, attention="blockwise", attention_block=32), {}),
    "e8": (_lay(expert=8), {}),
    "e4_d2_capacity": (_lay(data=2, expert=4), {"moe_capacity_factor": 1.25}),
    # wider than its experts (h = 128 > f = 32, 8 local experts): the phase with the (G, N, h) rows sets the
    # peak (moe_activations.moe_wide_rows_bytes; temp 1.624 and 1.315 of the estimate without it)
    "e4_d2_wide_full": (_lay(data=2, expert=4, recompute="full"), WIDE),
    "e4_d2_wide": (_lay(data=2, expert=4), WIDE),
    # DeepSeek-V3's experts are model.moe_mlp_dim wide, not mlp_dim (its dense layers'): temp 0.600 of the
    # estimate with mlp_dim
    "deepseek_e4_d2_full": (_lay(data=2, expert=4, recompute="full"), {"config": "tiny_deepseek_v3"}),
}
_CACHE: dict[str, tuple] = {}


def _compiled(name: str):
    """(config, layout, compiled report) of one grid layout, compiled once per module."""
    if name not in _CACHE:
        layout, model = GRID[name]
        model = dict(model)
        cfg = load_config(str(ROOT / "configs" / f"{model.pop('config', 'tiny_mixtral')}.py"))
        for key, value in model.items():
            cfg.model[key] = value
        cfg = layout_config(cfg, layout)
        cfg.model.compute_dtype = cfg.parallel.grad_reduce_dtype = "float32"  # what plan --aot compiles on CPU
        _CACHE[name] = cfg, layout, analyze_layout(cfg, mesh_for(layout), compiler_options=MEMORY_OPTIONS)
    return _CACHE[name]


# expert = 8 alone holds the same terms as expert = 4 x data = 2: JAXPAR_SLOW=1 only (session 28, the
# default suite's time)
SLOW_ONLY = {"e8", "e4_d2_wide"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            n, marks=pytest.mark.skipif(os.environ.get("JAXPAR_SLOW") != "1", reason="slow: set JAXPAR_SLOW=1")
        )
        if n in SLOW_ONLY
        else n
        for n in GRID
    ],
)
def test_moe_estimates_match_compiled(name):
    cfg, layout, report = _compiled(name)
    mem = report.memory
    arguments = mem.argument_bytes / estimated_argument_bytes(cfg.model, layout, "jaxpar", cfg.optim)
    if report.stages:  # a pipeline: the expert bytes of every stage beside its estimate
        expert = [st[MeshAxis.EXPERT] / st["estimated"][MeshAxis.EXPERT] for st in report.stages]
    else:
        expert = [r.ratio for r in report.rows if r.axes == (MeshAxis.EXPERT,) and r.kind != "all-reduce"]
    print(
        f"\n  {name}: arguments {arguments:.5f}, expert {', '.join(f'{x:.4f}' for x in expert)}, temp "
        f"{mem.temp_bytes / 2**20:.2f} MiB est {mem.estimated_temp_bytes / 2**20:.2f} (ratio {mem.temp_ratio:.3f}), "
        f"peak {mem.peak_ratio:.3f}"
    )
    assert arguments == pytest.approx(1, abs=ARGUMENT_BOUND)
    assert len(expert) >= 2 and all(x == pytest.approx(1, abs=EXPERT_BOUND) for x in expert), expert
    assert mem.temp_ratio == pytest.approx(1, abs=TEMP_BOUND)
    assert mem.peak_ratio == pytest.approx(1, abs=PEAK_BOUND)


def test_capacity_moves_what_dropless_moves():
    """Capacity dropping keeps every row (a dropped choice weighs 0): the same collectives and bytes,
    besides the dropped-choice metric's one all-reduce of 2 fp32 counts per step over data x expert
    (8 ranks: 2 * 7/8 * 8 bytes a device; jaxpar.models.moe.count_drops)."""
    dropless, capacity = _compiled("e4_d2")[2], _compiled("e4_d2_capacity")[2]
    counts = {("all-reduce", ("data", "expert")): 2 * 7 / 8 * 8}
    assert [(r.kind, r.axes, r.bytes_per_device) for r in capacity.rows] == [
        (r.kind, r.axes, r.bytes_per_device + counts.get((r.kind, r.axes), 0)) for r in dropless.rows
    ]


def test_inspect_prints_the_expert_rows_with_their_ratios(capsys):
    """``jaxpar inspect`` of the tiny Mixtral (fp32): every row over ``expert`` beside its formula, within 1%."""
    import argparse

    from jaxpar.cli.inspect import run_inspect

    fp32 = ["--config.model.compute_dtype=float32", "--config.parallel.grad_reduce_dtype=float32"]
    config = str(ROOT / "configs" / "tiny_mixtral.py")
    assert run_inspect(argparse.Namespace(config=config, overrides=fp32, json=False, ops=False)) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "│ expert " in line]
    kinds = {line.split("│")[1].strip() for line in lines}
    assert {"all-gather", "reduce-scatter"} <= kinds, lines
    for line in lines:
        ratio = float(line.split("│")[-2])
        assert ratio == pytest.approx(1, abs=EXPERT_BOUND), line
