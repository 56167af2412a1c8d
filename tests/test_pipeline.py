"""Pipeline parallelism: schedules as data, equivalence with one device, compiled permutes, memory, bad input.

Equivalence runs in fp32 on the simulated devices: every schedule, with data and tensor axes, gives
the single-device loss, gradients (Adam's first moment after one step is 0.1 * gradient) and the
parameters after a step, to a relative error below 1e-5. The default run covers a representative
subset; ``JAXPAR_SLOW=1`` runs the whole grid (schedule x p in {2, 4} x m in {p, 2p, 4p} x
{plain, data=2, tensor=2}).
"""

from __future__ import annotations

import functools
import itertools
import os
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.cli import main
from jaxpar.config import ConfigError
from jaxpar.layout import ParallelLayout
from jaxpar.mesh import make_mesh
from jaxpar.models import llama
from jaxpar.optim.optimizers import adamw
from jaxpar.parallel import pipeline
from jaxpar.train.state import Setup
from tests.helpers import TINY, make_setup, max_rel_error, tiny_config

try:
    from jaxpar.analysis.compiled import analyze_compiled
except ImportError:  # the HLO analysis module is optional here: the regex below suffices
    analyze_compiled = None

RUN_SLOW = os.environ.get("JAXPAR_SLOW") == "1"
STEPS = 2  # step 1 runs at lr 0 (warm-up): its Adam moment is the gradient; step 2 moves the parameters
TOL = 1e-5
# The tiny model of these tests: 8 layers of width 64, sequence 32, 16 sequences per step, fp32.
SMALL = [
    "--config.model.embed_dim=64",
    "--config.model.num_layers=8",
    "--config.model.num_heads=4",
    "--config.model.num_kv_heads=2",
    "--config.model.head_dim=16",
    "--config.model.mlp_dim=128",
    "--config.model.max_seq_len=32",
    "--config.train.seq_len=32",
    "--config.train.global_batch=16",
    "--config.mesh.tensor=1",
]


def pytest_configure(config):  # effective only where pytest loads it as a plugin (conftest.py)
    config.addinivalue_line("markers", "slow: long pipeline grid; runs with JAXPAR_SLOW=1")


slow = [pytest.mark.slow, pytest.mark.skipif(not RUN_SLOW, reason="set JAXPAR_SLOW=1 to run the full grid")]


def small_config(*overrides: str):
    return tiny_config(*SMALL, *overrides)


def layout(schedule: str, p: int, m: int, data: int = 1, tensor: int = 1, *extra: str) -> list[str]:
    v = 2 if schedule in ("interleaved", "zb-v") else 1
    return [
        f"--config.parallel.pipeline_schedule={schedule}",
        f"--config.parallel.virtual_stages={v}",
        f"--config.mesh.pipeline={p}",
        f"--config.mesh.data={data}",
        f"--config.mesh.tensor={tensor}",
        f"--config.parallel.microbatches={m}",
        *extra,
    ]


@functools.cache
def compiled(*overrides: str):
    """(Setup, AOT-compiled train step) of the tiny model with ``overrides``: each layout compiles
    once per session, shared by the equivalence, permute and memory tests."""
    setup = make_setup(small_config(*overrides))
    return setup, setup.lower_train_step().compile()


@functools.cache
def _host_params(model: tuple[str, ...] = ()):
    return jax.device_get(llama.init_params(small_config(*model).model, jax.random.key(0)))


def train(overrides: list[str], model: tuple[str, ...] = (), steps: int = STEPS):
    """Train from the same host-initialised parameters (no init compile); returns the per-step
    metrics, the gradient (Adam's first moment after step 1 over 1 - b1) and the final parameters,
    block parameters back in model layer order."""
    setup, step_fn = compiled(*model, *overrides)
    cfg = setup.cfg
    p, v, vs = cfg.mesh.pipeline, cfg.parallel.virtual_stages, pipeline.v_shaped(cfg.parallel.pipeline_schedule)
    host = _host_params(model)
    staged = pipeline.to_stage_form(host, p, v, v_shape=vs) if p > 1 else host
    params = jax.device_put(staged, setup.train_form.param_shardings)
    opt = jax.device_put(adamw.init_state(staged), setup.train_form.opt_shardings)
    rng = np.random.default_rng(0)
    history, grads = [], None
    for step in range(steps):
        rows = rng.integers(0, cfg.model.vocab_size, size=(cfg.train.global_batch, cfg.train.seq_len + 1))
        params, opt, metrics = step_fn(params, opt, setup.feed.make_batch(rows), NO_GUARD(setup))
        history.append({k: float(x) for k, x in jax.device_get(metrics).items()})
        if step == 0:
            grads = jax.tree.map(lambda mu: mu / (1 - cfg.optim.b1), jax.device_get(opt["mu"]))
    params = jax.device_get(params)
    if p > 1:
        params, grads = (
            pipeline.to_model_form(params, p, v, v_shape=vs),
            pipeline.to_model_form(grads, p, v, v_shape=vs),
        )
    return history, grads, params


def NO_GUARD(setup):  # noqa: N802 - the step's guard argument: never skip, no loss offset
    return jax.device_put(np.array([np.inf, 0.0], np.float32), NamedSharding(setup.mesh, P()))


@functools.cache
def reference_run(model: tuple[str, ...] = ()):
    """The single-device, single-microbatch run of the same model and batches."""
    return train(["--config.mesh.data=1", "--config.parallel.microbatches=1"], model)


@pytest.fixture(scope="module")
def reference():
    return reference_run()


def assert_matches(reference, got, name):
    ref_history, ref_grads, ref_params = reference
    history, grads, params = got
    for mine, want in zip(history, ref_history, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(mine[key] - want[key]) / abs(want[key]) < TOL, (name, key, mine, want)
    assert max_rel_error(grads, ref_grads) < TOL, name
    assert max_rel_error(params, ref_params) < TOL, name


# Default layouts: every schedule; p = 2 and 4; m = p, 2p and 4p; data=2 (ZeRO-0 and 1); tensor=2 (with
# and without sequence parallelism); the default run trains those in TRAINED. The p=2 m=8 layouts are also the permute and memory tests' programs.
DEFAULT = {
    "gpipe_p2_m8": layout("gpipe", 2, 8),
    "gpipe_p4_m16_t2": layout("gpipe", 4, 16, 1, 2),
    "1f1b_p2_m8": layout("1f1b", 2, 8),
    "1f1b_p4_m4_d2_zero1": layout("1f1b", 4, 4, 2, 1, "--config.parallel.zero_stage=1"),
    "1f1b_p2_m4_d2_t2_sp": layout("1f1b", 2, 4, 2, 2, "--config.parallel.sequence_parallel=true"),
    "interleaved_p2_m4_t2": layout("interleaved", 2, 4, 1, 2),
    "interleaved_p4_m8_d2": layout("interleaved", 4, 8, 2),
    # ZeRO-3 inside the pipeline: every stage gathers its layers (and the first / last stage their
    # ends slot) over data inside the ticks; the gathers' transposes reduce-scatter the gradients
    "1f1b_p2_m4_d2_zero3": layout("1f1b", 2, 4, 2, 1, "--config.parallel.zero_stage=3"),
    "interleaved_p2_m4_d2_t2_zero3_remat": layout(
        "interleaved", 2, 4, 2, 2, "--config.parallel.zero_stage=3", "--config.parallel.recompute=full"
    ),
    "gpipe_p2_m4_d4_zero3": layout("gpipe", 2, 4, 4, 1, "--config.parallel.zero_stage=3"),
    # ZB-H1: the input gradient (B) and the weight gradient (W) as separate ticks (more in the slow grid)
    "zbh1_p2_m4_d2_t2_zero3": layout("zb-h1", 2, 4, 2, 2, "--config.parallel.zero_stage=3"),
    # ZB-V: two chunks per device in V order (the first and the last virtual stage on device 0)
    "zbv_p4_m8": layout("zb-v", 4, 8),
    # ZeRO-2: each backward tick reduce-scatters its gradients over data into a sharded accumulator
    "1f1b_p2_m4_d2_zero2": layout("1f1b", 2, 4, 2, 1, "--config.parallel.zero_stage=2"),
    "interleaved_p2_m4_d2_t2_zero2_remat": layout(
        "interleaved", 2, 4, 2, 2, "--config.parallel.zero_stage=2", "--config.parallel.recompute=full"
    ),
}
AXES = {"plain": (1, 1), "d2": (2, 1), "t2": (1, 2)}
GRID = {
    f"{s}_p{p}_m{m}_{extra}": layout(s, p, m, *AXES[extra])
    for s in pipeline.SCHEDULES
    for p in (2, 4)
    for m in (p, 2 * p, 4 * p)
    for extra in AXES
    if 16 % (m * AXES[extra][0]) == 0
}
# 1F1B without recomputation and ZB-H1 with data=2 (and tensor=2 where 8 devices allow) under ZeRO-1 and 3
GRID |= {
    f"{s}_p{p}_m{m}_d2_t{t}_zero{z}": layout(s, p, m, 2, t, f"--config.parallel.zero_stage={z}")
    for s in ("1f1b", "zb-h1", "zb-v")
    for p, t in ((2, 2), (4, 1))
    for m in (p, 2 * p, 4 * p)
    for z in (1, 3)
    if 16 % (2 * m) == 0
}
# Their schedule trains in the default run at other sizes; the first three stay there as the permute and
# memory tests' programs (compile only), and their training equivalence runs in the slow grid. The last
# three went there in session 28 and the last two in session 29 (the default suite's time): GPipe trains at
# p = 2 with ZeRO-3, 1F1B at p = 2 with SP, the interleaved schedule at p = 2 with ZeRO-3 and full
# recomputation, ZB-V at p = 4, ZeRO-2 inside a pipeline in the interleaved ZeRO-2 layout.
TRAINED_SLOW = (
    "gpipe_p2_m8",
    "1f1b_p2_m8",
    "interleaved_p2_m4_t2",
    "gpipe_p4_m16_t2",
    "1f1b_p4_m4_d2_zero1",
    "1f1b_p2_m4_d2_zero2",
    "1f1b_p2_m4_d2_zero3",
    "interleaved_p4_m8_d2",
)
TRAINED = {name: o for name, o in DEFAULT.items() if name not in TRAINED_SLOW}
SLOW_GRID = {name: o for name, o in GRID.items() if o not in TRAINED.values()}
SLOW_GRID |= {n: DEFAULT[n] for n in TRAINED_SLOW if DEFAULT[n] not in SLOW_GRID.values()}


@pytest.mark.parametrize("name", list(TRAINED))
def test_pipeline_matches_single_device(reference, name):
    assert_matches(reference, train(DEFAULT[name]), name)


@pytest.mark.parametrize("name", list(SLOW_GRID))
@slow[0]
@slow[1]
def test_pipeline_grid_matches_single_device(reference, name):
    assert_matches(reference, train(SLOW_GRID[name]), name)


MODEL_VARIANTS = {
    "tied_1f1b_p2_m4_t2": (("--config.model.tie_embeddings=true",), layout("1f1b", 2, 4, 1, 2)),
    "gpt_interleaved_p2_m4_t2_sp": (
        ("--config.model.position=learned", "--config.model.mlp_activation=gelu", "--config.model.norm=layernorm"),
        layout("interleaved", 2, 4, 1, 2, "--config.parallel.sequence_parallel=true"),
    ),
    "remat_gpipe_p2_m4_d2": (("--config.parallel.recompute=full",), layout("gpipe", 2, 4, 2)),
}
# Full remat: the 1F1B / interleaved backward runs one sequence at a time, layer by layer, adding each
# layer's weight gradient into the accumulator in place (jaxpar.parallel.pipeline.executor._stage_backward_by_layer).
REMAT = ("--config.parallel.recompute=full",)
REMAT_LAYOUTS = {
    "remat_1f1b_p2_m4_d2_t2": layout("1f1b", 2, 4, 2, 2),
    "remat_interleaved_p2_m4_t2_sp": layout("interleaved", 2, 4, 1, 2, "--config.parallel.sequence_parallel=true"),
}


@pytest.mark.parametrize("name", list(MODEL_VARIANTS))
@slow[0]
@slow[1]
def test_model_variants_match_single_device(name):
    """Tied embeddings (gradient from the first and the last stage), learned positions, GeLU,
    LayerNorm, full remat."""
    model, overrides = MODEL_VARIANTS[name]
    assert_matches(reference_run(model), train(overrides, model), name)


@pytest.mark.parametrize("name", list(REMAT_LAYOUTS))
def test_full_remat_layer_by_layer_backward_matches_single_device(name):
    assert_matches(reference_run(REMAT), train(REMAT_LAYOUTS[name], REMAT), name)


@pytest.mark.parametrize(
    "name,rows",
    [
        ("interleaved_p2_t2", 4),
        ("1f1b_p4", 8),
        pytest.param("1f1b_p4_rows6", 6, marks=slow),
        pytest.param("interleaved_p4_d2", 16, marks=slow),
        ("zbv_p2", 4),
    ],
)
def test_eval_step_matches_single_device(name, rows):
    """Pipelined evaluation (a forward-only table, interleaved layer order, tensor=2, p=4) gives the
    one-device loss; with 8 rows on p=4 the table has ticks where all 4 stages work at once."""
    pipelined = {
        "interleaved_p2_t2": layout("interleaved", 2, 4, 1, 2),
        "1f1b_p4": layout("1f1b", 4, 8),
        "1f1b_p4_rows6": layout("1f1b", 4, 4),
        "interleaved_p4_d2": layout("interleaved", 4, 8, 2),
        "zbv_p2": layout("zb-v", 2, 4),
    }[name]
    host = _host_params()
    rows = np.random.default_rng(1).integers(0, 256, size=(rows, 33))
    losses = []
    for overrides in (["--config.mesh.data=1"], pipelined):
        cfg = small_config(*overrides)
        setup = make_setup(cfg)
        staged = pipeline.to_stage_form(
            host,
            cfg.mesh.pipeline,
            cfg.parallel.virtual_stages,
            v_shape=pipeline.v_shaped(cfg.parallel.pipeline_schedule),
        )
        params = jax.device_put(staged, setup.train_form.param_shardings)
        losses.append(float(setup.eval_step(params, setup.feed.make_eval_batch(rows))))
    assert abs(losses[1] - losses[0]) / losses[0] < TOL, losses
    p, m = cfg.mesh.pipeline, cfg.parallel.microbatches
    local = len(rows) // cfg.mesh.data
    table = pipeline.build_eval_schedule(
        p,
        pipeline.eval_microbatches(local, p, m),
        cfg.parallel.virtual_stages,
        pipeline.v_shaped(cfg.parallel.pipeline_schedule),
    )
    busy = max(sum(a is not None for a in tick) for tick in table.grid)
    assert busy == (3 if name == "1f1b_p4_rows6" else p)  # 6 rows: 3 microbatches of 2


# --------------------------------------------------------------------------- schedules as data


def _check_table(table: pipeline.ScheduleTable) -> None:
    """Every (microbatch, virtual stage) runs F then B (then W, split) once, after its inputs
    were produced."""
    p, v, m = table.stages, table.virtual_stages, table.microbatches
    when = table.ticks_of()
    split = pipeline.splits_backward(table.schedule)
    assert len(when) == (3 if split else 2) * m * p * v
    last = p * v - 1
    for i in range(m):
        for k in range(p * v):
            if k > 0:
                assert when[("F", i, k)] > when[("F", i, k - 1)]
            assert when[("B", i, k)] > (when[("B", i, k + 1)] if k < last else when[("F", i, k)])
            if split:
                assert when[("W", i, k)] > when[("B", i, k)]


CASES = [
    (s, p, m, v)
    for s, vs in (("gpipe", (1,)), ("1f1b", (1,)), ("interleaved", (2, 3)))
    for v in vs
    for p in (2, 3, 4, 8)
    for m in sorted({p, 2 * p, 4 * p, p + 1})
    if not (s == "interleaved" and m % p)
]


@pytest.mark.parametrize("schedule, p, m, v", CASES)
def test_bubble_fraction_matches_formula(schedule, p, m, v):
    table = pipeline.build_schedule(schedule, p, m, v)
    _check_table(table)
    assert table.ticks == 2 * (v * m + p - 1)  # unit-time forward and backward
    assert pipeline.bubble_fraction(table) == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert pipeline.bubble_fraction(table) == pytest.approx(pipeline.expected_bubble_fraction(schedule, p, m, v))
    assert pipeline.boundary_sends(table) == (m * (p * v - 1),) * 2


@pytest.mark.parametrize("p, m", [(2, 8), (4, 4), (4, 16), (8, 32)])
def test_1f1b_keeps_at_most_p_microbatches_in_flight(p, m):
    prog = pipeline.compile_program(pipeline.build_schedule("1f1b", p, m))
    assert prog.act_slots <= p and prog.grad_slots <= 1
    gpipe = pipeline.compile_program(pipeline.build_schedule("gpipe", p, m))
    assert gpipe.act_slots == m  # GPipe: every microbatch's stage input is alive before the first backward


def test_render_schedule():
    text = pipeline.render_schedule(pipeline.build_schedule("1f1b", 4, 8))
    print("\n" + text)
    lines = text.splitlines()
    assert lines[0].startswith("1f1b: p=4 m=8, 22 ticks, bubble 27.3% (formula 27.3%)")
    assert len(lines) == 2 + 4 and lines[2].split()[2:5] == ["F0", "F1", "F2"]
    interleaved = pipeline.render_schedule(pipeline.build_schedule("interleaved", 2, 4, 2))
    print(interleaved)
    assert "v=2" in interleaved.splitlines()[0] and "F0:1" in interleaved


def test_layer_order_round_trip():
    order = pipeline.layer_order(8, 2, 2)
    assert order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]  # device 0: chunks 0 and 2; device 1: chunks 1 and 3
    assert pipeline.layer_order(8, 4, 1).tolist() == list(range(8))
    tree = {"embed": np.zeros(3), "blocks": {"w": np.arange(8)}}
    staged = pipeline.to_stage_form(tree, 2, 2)
    assert staged["blocks"]["w"].tolist() == order.tolist()
    assert pipeline.to_model_form(staged, 2, 2)["blocks"]["w"].tolist() == list(range(8))


@pytest.mark.parametrize("stages", [2, 3])
def test_stage_form_places_embedding_first_and_head_last(stages):
    """Untied: one [p, V, h] table split over pipeline, embedding in slot 0, the transposed output
    layer in slot p-1, zeros between; the round trip is exact. Tied: nothing is packed."""
    rng = np.random.default_rng(0)
    tree = {
        "embed": rng.normal(size=(6, 4)),
        "lm_head": rng.normal(size=(4, 6)),
        "final_norm": {"scale": np.ones(4)},
        "blocks": {"w": np.arange(6.0)},
    }
    tree = jax.tree.map(lambda a: a.astype(np.float32), tree)
    staged = pipeline.to_stage_form(tree, stages)
    assert set(staged) == {"ends", "final_norm", "blocks"} and staged["ends"].shape == (stages, 6, 4)
    np.testing.assert_array_equal(staged["ends"][0], tree["embed"])
    np.testing.assert_array_equal(staged["ends"][-1], tree["lm_head"].T)
    assert not np.any(np.asarray(staged["ends"][1:-1]))
    back = pipeline.to_model_form(staged, stages)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree), strict=True):
        np.testing.assert_array_equal(a, b)
    tied = {k: v for k, v in tree.items() if k != "lm_head"}
    assert set(pipeline.to_stage_form(tied, stages)) == set(tied)


# --------------------------------------------------------------------------- compiled program


_PERMUTE = re.compile(
    r"=\s*(\w+)\[([\d,]*)\]\S*\s+collective-permute(?:-start)?\(.*?source_target_pairs=(\{[\d,{}]*\})"
)
_BYTES = {"f32": 4, "bf16": 2, "f16": 2}


def pipeline_permutes(text: str, setup: Setup) -> list[tuple[int, frozenset]]:
    """(payload bytes, stage pairs) of each collective-permute in the compiled HLO."""
    stride = setup.mesh.devices.size // setup.mesh.shape["pipeline"]  # device order: pipeline outermost
    out = []
    for dtype, dims, pairs in _PERMUTE.findall(text):
        size = int(np.prod([int(x) for x in dims.split(",") if x])) * _BYTES[dtype]
        stage_pairs = frozenset((int(a) // stride, int(b) // stride) for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs))
        out.append((size, stage_pairs))
    return out


@pytest.mark.parametrize("name", ["gpipe_p2_m8", "1f1b_p2_m8", "interleaved_p2_m4_t2"])
def test_permutes_carry_bsh_per_microbatch_per_boundary(name):
    """Each permute over ``pipeline`` carries one microbatch's b*s*h activations (or their
    gradient); the compiled program holds exactly the table's send patterns, chosen per tick by
    ``lax.switch``, so a link carries v*b*s*h bytes per microbatch each way (Narayanan et al. 2021, arXiv:2104.04473)."""
    setup, comp = compiled(*DEFAULT[name])
    cfg = setup.cfg
    schedule, p, m = cfg.parallel.pipeline_schedule, cfg.mesh.pipeline, cfg.parallel.microbatches
    b, s, h = cfg.train.global_batch // (m * cfg.mesh.data), cfg.train.seq_len, cfg.model.embed_dim
    formula = b * s * h * 4  # fp32 activations
    permutes = pipeline_permutes(comp.as_text(), setup)
    assert permutes and all(size == formula for size, _ in permutes), permutes
    if analyze_compiled is not None:  # the shared HLO analysis agrees on the payloads
        ops = [op for op in analyze_compiled(comp, setup.mesh).ops if op.kind == "collective-permute"]
        assert len(ops) == len(permutes) and all(op.axes == ("pipeline",) and op.size_bytes == formula for op in ops)
    prog = setup.pipeline.program
    patterns = {frozenset(pairs) for pairs in prog.pairs["fwd"][1:] + prog.pairs["bwd"][1:]}
    assert {pairs for _, pairs in permutes} == patterns
    v = cfg.parallel.virtual_stages
    for direction in ("fwd", "bwd"):
        link_sends = {}
        for t in prog.pattern[direction]:
            for pair in prog.pairs[direction][t]:
                link_sends[pair] = link_sends.get(pair, 0) + 1
        for (src, dst), sends in sorted(link_sends.items()):
            per_microbatch = sends * formula / m
            wraps = (src == p - 1) if direction == "fwd" else (src == 0)
            expected = (v - 1 if wraps else v) * formula  # the ring's wrap link skips one chunk crossing
            print(f"{schedule} {direction} {src}->{dst}: {per_microbatch:.0f} B per microbatch (formula {expected})")
            assert abs(per_microbatch - expected) <= 0.1 * expected


def test_static_permute_count_bounds_the_table_sends():
    """The report counts a conditional once per execution, as its largest branch. A tick's sends are
    ``lax.switch(pattern[t], [nothing, ppermute(pairs_1), ...])`` whose index is read from the table
    inside the tick loop: data the HLO does not show. So on 1F1B p=2 (one pair per direction per tick)
    the static count is exactly one permute per direction per tick, an upper bound on the table's
    boundary sends (forward + backward); the bubble ticks and the ticks sending nothing make the gap."""
    setup, comp = compiled(*DEFAULT["1f1b_p2_m8"])
    table = setup.pipeline.table
    report = analyze_compiled(comp, setup.mesh)
    counted = report.count("collective-permute", "pipeline")
    fwd, bwd = pipeline.boundary_sends(table)
    assert fwd == bwd == table.microbatches * (table.stages - 1)
    assert counted == 2 * table.ticks >= fwd + bwd, (counted, table.ticks, fwd, bwd)
    b, s, h = 2, setup.cfg.train.seq_len, setup.cfg.model.embed_dim
    assert report.bytes("collective-permute", "pipeline") == counted * b * s * h * 4


def test_conditional_counts_its_largest_branch_once():
    """``lax.switch`` with a 1 KiB and a 4 KiB all-reduce run 3 times: 3 all-reduces of 4 KiB, not 6."""
    mesh = make_mesh(ParallelLayout(data=2), jax.devices()[:2])

    def body(x, i):
        small = lambda x: x.at[:256].add(jax.lax.psum(x[:256], "data"))  # noqa: E731
        big = lambda x: x + jax.lax.psum(x, "data")  # noqa: E731
        return jax.lax.switch(i % 2, [small, big], x), None

    def step(x):
        return jax.lax.scan(body, x, jax.numpy.arange(3))[0]

    spec = jax.sharding.PartitionSpec("data")
    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec))
    comp = fn.lower(jax.ShapeDtypeStruct((2048,), np.float32)).compile()
    report = analyze_compiled(comp, mesh)
    assert report.count("all-reduce", "data") == 3, report.ops
    assert report.bytes("all-reduce", "data") == 3 * 1024 * 4  # 2(n-1)/n * S with n = 2, S = 4 KiB


def test_1f1b_memory_is_flat_in_m_gpipe_grows():
    """Microbatch size fixed (2 sequences), m = p -> 4p with p = 2: 1F1B keeps at most p stage inputs
    (recomputing the stage forward), GPipe keeps the residuals of every microbatch."""
    temp = {}
    for schedule in ("1f1b", "gpipe"):
        for m in (2, 8):
            batch = [] if m == 8 else ["--config.train.global_batch=4"]  # 16 by default: b = 2 either way
            comp = compiled(*layout(schedule, 2, m), *batch)[1]
            temp[schedule, m] = comp.memory_analysis().temp_size_in_bytes
    print(
        f"\ntemp bytes per device (m=2 -> m=8): 1f1b {temp['1f1b', 2]} -> {temp['1f1b', 8]}, "
        f"gpipe {temp['gpipe', 2]} -> {temp['gpipe', 8]}"
    )
    assert temp["1f1b", 8] <= 1.3 * temp["1f1b", 2]
    assert temp["gpipe", 8] >= 2 * temp["gpipe", 2]
    assert temp["gpipe", 8] > temp["1f1b", 8]


# --------------------------------------------------------------------------- bad input


def _cli(capsys, *overrides: str) -> tuple[int, str]:
    code = main(["train", "--config", TINY, *overrides])
    return code, capsys.readouterr().err.strip()


P2 = ["--config.mesh.pipeline=2", "--config.mesh.data=2", "--config.mesh.tensor=2"]


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["--config.parallel.microbatches=1"], "parallel.microbatches=1 < mesh.pipeline=2: 1F1B needs"),
        (
            ["--config.parallel.pipeline_schedule=interleaved", "--config.parallel.microbatches=2"],
            "parallel.virtual_stages=1: the interleaved schedule needs at least 2",
        ),
        (
            ["--config.parallel.virtual_stages=2", "--config.parallel.microbatches=2"],
            "parallel.virtual_stages=2 is only used by the interleaved and zb-v schedules",
        ),
        (
            [
                "--config.parallel.pipeline_schedule=interleaved",
                "--config.parallel.virtual_stages=2",
                "--config.parallel.microbatches=3",
                "--config.train.global_batch=24",
            ],
            "parallel.microbatches=3 is not a multiple of mesh.pipeline=2",
        ),
        (
            ["--config.parallel.microbatches=3"],
            "train.global_batch=16 is not divisible by parallel.microbatches*mesh.data",
        ),
        (
            [
                "--config.parallel.pipeline_schedule=interleaved",
                "--config.parallel.virtual_stages=4",
                "--config.parallel.microbatches=2",
            ],
            "model.num_layers=4 is not divisible by mesh.pipeline*parallel.virtual",
        ),
        (
            [
                "--config.parallel.zero_stage=2",
                "--config.parallel.microbatches=2",
                "--config.parallel.pipeline_schedule=gpipe",
            ],
            "parallel.zero_stage=2 with parallel.pipeline_schedule=gpipe is not supported",
        ),
    ],
)
def test_bad_pipeline_input_is_one_line_exit_2(capsys, overrides, needle):
    code, err = _cli(capsys, *P2, *overrides)
    assert code == 2, err
    assert needle in err and "\n" not in err and "Traceback" not in err


def test_check_config_direct():
    with pytest.raises(ConfigError, match="1F1B needs at least one microbatch per stage"):
        make_setup(small_config(*layout("1f1b", 4, 2)))


def test_slot_counts_are_the_programs():
    """The planner's shortcut (``slot_counts``: no arrays built) counts the slots ``compile_program``
    allocates, on every schedule, for small and large microbatch counts."""
    from jaxpar.parallel.pipeline.schedule import build_schedule, compile_program, slot_counts

    checked = 0
    for schedule, p, m, v in itertools.product(
        ("gpipe", "1f1b", "interleaved"), (1, 2, 4, 8), (1, 2, 8, 64), (1, 2, 4)
    ):
        if (schedule != "interleaved" and v > 1) or (schedule == "interleaved" and m % p):
            continue
        table = build_schedule(schedule, p, m, v)
        for stash in (False, True):
            prog = compile_program(table, stash)
            got = slot_counts(table, stash)
            want = (prog.act_slots, prog.grad_slots, prog.stash_slots, prog.front_slots)
            assert got == want, (schedule, p, m, v, stash)
        checked += 1
    assert checked == 65


def test_slot_counts_saturate():
    """``steady_slot_counts`` caps 1F1B and interleaved at ``SATURATION * p`` microbatches: the full
    simulation gives the same counts for every m up to 8p, twice the cap (1F1B saturates at m = p,
    interleaved at m = 2p), and GPipe, which keeps every microbatch, is never capped."""
    from jaxpar.parallel.pipeline.schedule import SATURATION, build_schedule, slot_counts, steady_slot_counts

    cases = [("1f1b", p, 1) for p in (2, 3, 4, 8)] + [("interleaved", p, v) for p in (2, 4, 8) for v in (2, 4)]
    checked = capped = 0
    for schedule, p, v in cases:
        for m in range(p, 8 * p + 1, 1 if schedule == "1f1b" else p):
            for stash in (False, True):
                want = slot_counts(build_schedule(schedule, p, m, v), stash)
                assert steady_slot_counts(schedule, p, m, v, stash) == want, (schedule, p, m, v, stash)
            checked, capped = checked + 1, capped + (m > SATURATION * p)
    assert (checked, capped) == (171, 92)
    assert steady_slot_counts("gpipe", 2, 64) == (64, 1, 0, 0)


def test_stash_holds_the_in_flight_microbatches():
    """Without recomputation a stage keeps each in-flight microbatch's residuals from its forward to
    its backward: at most p on stage 0 under 1F1B (PipeDream-Flush's bound), and a stage input is
    then alive only until its forward (2 slots instead of p)."""
    from jaxpar.parallel.pipeline.schedule import build_schedule, slot_counts

    assert slot_counts(build_schedule("1f1b", 4, 8)) == (4, 1, 0, 0)
    assert slot_counts(build_schedule("1f1b", 4, 8), stash=True) == (2, 1, 4, 0)
    assert slot_counts(build_schedule("1f1b", 4, 32), stash=True) == (2, 1, 4, 0)
    assert slot_counts(build_schedule("interleaved", 4, 8, 2), stash=True) == (2, 2, 11, 0)


def _executed_flops(*overrides: str) -> float:
    from jaxpar.analysis.executed_flops import executed_dot_flops

    setup, step = compiled(*overrides)
    if setup.pipeline is None:
        return executed_dot_flops(step.as_text())
    return sum(executed_dot_flops(step.as_text(), setup.pipeline, s) for s in range(setup.pipeline.table.stages))


def test_pipeline_runs_each_forward_once():
    """Dot FLOPs the compiled step executes (loop trip counts and the schedule's branch shares, all
    pipeline ranks summed), p=2 m=4 (p=4 m=8 until session 29, at twice the compile time; measured: 1.0 and
    2.41 at p=2 m=4, 1.0 and 2.23 at p=4 m=8):
    1F1B with ``parallel.recompute=none`` runs exactly the unpipelined step's matmuls (the backward reads
    the stashed residuals); with ``full`` it recomputes forwards, as asked (its layer-by-layer backward
    runs each layer's forward twice more)."""
    base = _executed_flops("--config.parallel.microbatches=4", "--config.mesh.data=1")
    assert _executed_flops(*layout("1f1b", 2, 4)) / base == pytest.approx(1.0, abs=1e-9)
    recomputed = _executed_flops(*layout("1f1b", 2, 4), "--config.parallel.recompute=full") / base
    assert recomputed > 1.5


def test_zb_h1_table_bubble_and_memory():
    """ZB-H1's table under equal F, B, W times has the bubble rate Qi et al. state, (p-1)/(3m), a
    third of 1F1B's (p-1)/m, with at most p microbatches in flight on any stage (1F1B's peak)."""
    from jaxpar.parallel.pipeline.timing import timed

    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 4 * p, 4 * p + 1):
            zb, one = timed(pipeline.build_schedule("zb-h1", p, m)), timed(pipeline.build_schedule("1f1b", p, m))
            assert zb.bubble == pytest.approx((p - 1) / (3 * m)), (p, m)
            assert one.bubble == pytest.approx((p - 1) / m), (p, m)
            assert max(zb.in_flight) == max(one.in_flight) == p, (p, m)
            _check_table(pipeline.build_schedule("zb-h1", p, m))
    # with a W half as long as B, the saving is (p-1)(T_F + T_B - T_W) per stage (Qi et al.)
    slow_b = timed(pipeline.build_schedule("zb-h1", 4, 8), {"F": 1.0, "B": 1.0, "W": 0.5})
    assert slow_b.makespan - slow_b.work == pytest.approx(3 * (1 + 1 - 0.5))


def test_zb_h1_runs_each_matmul_once():
    """The split backward runs every dot once: B's equations and W's partition the pullback (p=2 m=4, the
    forward-once test's unpipelined step; p=4 m=8 until session 31, at about twice the compile time)."""
    base = _executed_flops("--config.parallel.microbatches=4", "--config.mesh.data=1")
    assert _executed_flops(*layout("zb-h1", 2, 4)) / base == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--config.parallel.recompute=full"], "parallel.recompute=none"),
        (["--config.parallel.recompute=selective"], "parallel.recompute=none"),
        (["--config.parallel.microbatches=2"], "at least one microbatch per stage"),
    ],
)
def test_zb_h1_refusals(extra, match):
    with pytest.raises(ConfigError, match=match):
        make_setup(small_config(*layout("zb-h1", 4, 4), *extra))


def test_zb_v_table_bubble_and_memory():
    """ZB-V's table (two chunks per device in V order) under equal costs: a bubble rate at most
    ZB-H1's (Qi et al. 2024 report it near zero once m >= 2p), at most 2p half-stage chunks in flight
    per device (1F1B's p stages of activations), and the table's sends: the first and the last
    virtual stage on device 0."""
    from jaxpar.parallel.pipeline.timing import timed

    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 4 * p):
            table = pipeline.build_schedule("zb-v", p, m, 2)
            _check_table(table)
            zbv, zbh1 = timed(table), timed(pipeline.build_schedule("zb-h1", p, m))
            assert zbv.bubble <= zbh1.bubble + 1e-12, (p, m)
            assert max(zbv.in_flight) <= 2 * p, (p, m)
    assert timed(pipeline.build_schedule("zb-v", 4, 8, 2)).bubble == pytest.approx(3 / 48)
    assert pipeline.device_of("zb-v", 4, 0) == pipeline.device_of("zb-v", 4, 7) == 0


def test_zb_v_runs_each_matmul_once():
    base = _executed_flops("--config.parallel.microbatches=4", "--config.mesh.data=1")
    assert _executed_flops(*layout("zb-v", 2, 4)) / base == pytest.approx(1.0, abs=1e-9)


def test_zb_v_needs_two_chunks():
    with pytest.raises(ConfigError, match="virtual_stages=2"):
        make_setup(small_config(*layout("zb-v", 2, 4), "--config.parallel.virtual_stages=4"))


def test_frontier_packs_into_residuals_only_b_read():
    """stash.pack: first fit by decreasing size into usable bins of the same dtype, with room; what
    fits nowhere is None; put then take gives each item back and leaves the rest of its bin."""
    from jaxpar.parallel.pipeline import stash

    f32, bf16 = np.float32, jax.numpy.bfloat16
    bins = [jax.ShapeDtypeStruct((4, 8), f32), jax.ShapeDtypeStruct((16,), f32), jax.ShapeDtypeStruct((64,), bf16)]
    items = [
        jax.ShapeDtypeStruct((2, 4), f32),  # 8
        jax.ShapeDtypeStruct((20,), f32),  # 20: only the first bin has room
        jax.ShapeDtypeStruct((4, 4), bf16),
        jax.ShapeDtypeStruct((8,), np.int32),  # no int32 bin
    ]
    places = stash.pack(items, bins, [True, True, True])
    assert places == [(0, 20), (0, 0), (2, 0), None]
    assert stash.pack(items, bins, [False, True, False]) == [(1, 0), None, None, None]
    rng = np.random.default_rng(0)
    bin_values = [jax.numpy.asarray(rng.normal(size=(3, *b.shape)), b.dtype) for b in bins]  # 3 layers stacked
    item_values = [jax.numpy.asarray(rng.normal(size=(3, *a.shape)), a.dtype) for a in items]
    out = stash.put(bin_values, item_values, places)
    for a, value, place in zip(items, item_values, places):
        if place is not None:
            np.testing.assert_array_equal(stash.take(out, place, a), value)
    np.testing.assert_array_equal(out[1], bin_values[1])  # nothing placed there
    np.testing.assert_array_equal(out[0].reshape(3, -1)[:, 28:], bin_values[0].reshape(3, -1)[:, 28:])


def test_the_pipeline_splits_the_models_stacked_subtree_and_refuses_another():
    """The stage forms and the executors name the stacked layers through ``Model.stacked``; a family
    whose layers stack elsewhere (or in two subtrees) is refused in one line, not mis-split."""
    layout = ParallelLayout(data=1, pipeline=2, microbatches=2)
    model = llama.LlamaModel(tiny_config("--config.mesh.data=1", "--config.mesh.tensor=1").model)
    assert pipeline.forms.STACKED == model.stacked
    pipeline.Pipeline.from_layout(layout, model)

    class Elsewhere(llama.LlamaModel):
        stacked = "layers"

    with pytest.raises(ConfigError, match=r"layers stack in \['layers'\].*mesh.pipeline=1"):
        pipeline.Pipeline.from_layout(layout, Elsewhere(model.cfg))
