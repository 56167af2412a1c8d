"""``jaxpar sweep``: the layout grid, a 2-layout run with its checks, the files and the figures."""

import csv
import json
import math
import os

import pytest

from jaxpar import host_memory
from jaxpar.analysis import sweep as sweep_lib
from jaxpar.analysis.estimate import ParallelLayout
from jaxpar.analysis.sweep import passes
from jaxpar.analysis.sweep import report as sweep_report
from jaxpar.cli import main
from jaxpar.cli.sweep import SWEEP_DEFAULTS
from jaxpar.config import ConfigError
from tests.helpers import TINY, tiny_config

SLOW = os.environ.get("JAXPAR_SLOW") == "1"


def _grid():
    cfg = tiny_config(*SWEEP_DEFAULTS)
    cluster = sweep_lib.cpu_cluster(8, 1e10, 10.0)
    return cfg, sweep_lib.sweep_layouts(cfg.model, 8, cfg.train.global_batch, cfg.train.seq_len, cluster)


def test_grid_covers_every_parallelism_the_planner_allows():
    _, layouts = _grid()
    names = [sweep_lib.layout_name(lay) for lay in layouts]
    assert len(names) == len(set(names)) == 56
    assert names[0] == "d8t1p1-z0-m1"  # the reference: plain data parallelism
    assert {
        "d8t1p1-z1-m1",
        "d8t1p1-z2-m1",
        "d8t1p1-z3-m1",
        "d4t2p1-z1-sp-m1",
        "d4t1p2-z0-gpipe-m4",
        "d4t1p2v2-z1-interleaved-m4",
        "d2t2p2v2-z3-sp-interleaved-m4",
        "d1t2p4-z0-sp-1f1b-m8",
    } <= set(names)
    assert all(lay.tensor <= 2 for lay in layouts)  # tiny's 2 kv heads allow no TP 4/8
    assert not any("gpipe" in n and "-z2" in n for n in names)  # jaxpar's GPipe refuses ZeRO-2
    assert all(lay.microbatches == (1 if lay.pipeline == 1 else 2 * lay.pipeline) for lay in layouts)
    assert [sweep_lib.layout_name(x) for x in sweep_lib.select(layouts, ["^d2t1p4-z3"])] == [
        "d2t1p4-z3-1f1b-m8",
        "d2t1p4-z3-gpipe-m8",
    ]
    with pytest.raises(ConfigError, match="--only"):
        sweep_lib.select(layouts, ["nothing-matches"])


def test_loss_check_marks_a_mismatch_and_keeps_crashes():
    records = [
        sweep_lib.SweepRecord("a", {}, losses=[2.0, 1.0]),
        sweep_lib.SweepRecord("b", {}, losses=[2.0, 1.0 + 5e-6]),
        sweep_lib.SweepRecord("c", {}, losses=[2.0, 1.001]),
        sweep_lib.SweepRecord("d", {}, status="crashed"),
    ]
    assert sweep_lib.check_losses(records, 1e-5).name == "a"
    assert [r.status for r in records] == ["ok", "ok", "mismatch", "crashed"]
    assert records[2].loss_rel_diff == pytest.approx(1e-3) and "1.00e-03" in records[2].error


@pytest.fixture(scope="module")
def two_layouts(tmp_path_factory):
    """A real sweep through the CLI, 3 steps per layout and a second pass of 2: ZeRO-0 DP and TP=2 + SP run; with
    JAXPAR_SLOW=1, between them a ZeRO-3 layout whose worker process aborts (the crash drill: two
    process deaths and three process starts), so the sweep must go on."""
    out = tmp_path_factory.mktemp("sweep")
    if SLOW:
        os.environ[sweep_lib.ABORT_ENV] = "d8t1p1-z3-m1"
    try:
        code = main(
            [
                "sweep",
                "--config",
                TINY,
                "--devices",
                "8",
                "--steps",
                "3",
                "--warmup",
                "1",
                "--no-progress",
                "--repeats",
                "2",
                "--pass-steps",
                "2",
                "--only",
                "^d8t1p1-z[03]" if SLOW else "^d8t1p1-z0",
                "--only",
                "^d4t2p1-z1-sp",
                "-o",
                str(out),
            ]
        )
    finally:
        os.environ.pop(sweep_lib.ABORT_ENV, None)
    doc = json.loads((out / "results.json").read_text())
    crashed = [r for r in doc["layouts"] if r["status"] == "crashed"]
    doc["layouts"] = [r for r in doc["layouts"] if r["status"] != "crashed"]
    return code, out, doc, crashed


@pytest.mark.skipif(not SLOW, reason="JAXPAR_SLOW=1: a worker abort and its retry (~20 s)")
def test_a_process_abort_is_recorded_and_the_sweep_goes_on(two_layouts):
    code, out, _, crashed = two_layouts
    assert code == 1  # not every layout is ok
    assert [r["name"] for r in crashed] == ["d8t1p1-z3-m1"]
    assert crashed[0]["error"] == "the process died (exit code -6): Fatal: JAXPAR_SWEEP_ABORT drill aborts this process"
    assert crashed[0]["retried"] == crashed[0]["error"]  # tried twice, in two processes
    report = (out / "report.md").read_text()
    assert "2 ok, 0 loss mismatches, 1 crashed" in report and "| d8t1p1-z3-m1 | **crashed** |" in report


def test_two_layout_sweep_measures_and_agrees(two_layouts):
    code, out, doc, _ = two_layouts
    assert code == (1 if SLOW else 0)  # the aborted layout is a failure
    rows = {r["name"]: r for r in doc["layouts"]}
    assert list(rows) == ["d8t1p1-z0-m1", "d4t2p1-z1-sp-m1"] and doc["meta"]["reference"] == "d8t1p1-z0-m1"
    probe = doc["meta"]["host_probe"]
    if host_memory.steady_malloc(apply=False).startswith("glibc"):
        assert doc["meta"]["allocator"].startswith("glibc") and "(jaxpar.host_memory)" in doc["meta"]["allocator"]
    assert probe["layout"] == "d8t1p1-z0-m1" and probe["steps_per_layout_and_pass"] == sweep_lib.PROBE_STEPS
    for r in rows.values():
        assert r["status"] == "ok" and len(r["losses"]) == 3 and r["loss_rel_diff"] <= 1e-5
        assert r["step_time_min_s"] <= r["step_time_median_s"] <= r["step_time_max_s"]
        # two passes, pooled: the statistics are those of pass 1's and pass 2's steady steps together
        assert len(r["step_times_s"]) == 3 and [len(t) for t in r["repeat_step_times_s"]] == [2]
        steady = r["step_times_s"][1:] + r["repeat_step_times_s"][0][1:]
        assert (r["step_time_min_s"], r["step_time_median_s"], r["step_time_max_s"]) == tuple(sorted(steady))
        assert r["pass_medians_s"] == pytest.approx([sum(r["step_times_s"][1:]) / 2, r["repeat_step_times_s"][0][1]])
        assert r["argument_bytes"] == pytest.approx(r["est_argument_bytes"], rel=0.01)  # planner vs compiler
        assert r["compile_s"] > 0 and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 5
        assert len(r["host_probe_s"]) == 2 and all(0 < p < 60 for p in r["host_probe_s"])  # one per pass
        # the worker process's minor page faults, per pass and step; the statistic pools the steady steps
        assert [len(f) for f in r["minor_faults"]] == [3, 2] and min(min(f) for f in r["minor_faults"]) >= 0
        assert r["minor_faults_per_step"] == sorted(r["minor_faults"][0][1:] + r["minor_faults"][1][1:])[1]
    dp, tp = rows["d8t1p1-z0-m1"], rows["d4t2p1-z1-sp-m1"]
    assert dp["collective_bytes"]["tensor"] == 0 and tp["collective_bytes"]["tensor"] > 0
    assert tp["argument_bytes"] < dp["argument_bytes"] / 3  # TP halves, ZeRO-1 over 4 splits the Adam moments
    for r in rows.values():
        for axis in ("data", "tensor"):
            assert r["collective_bytes"][axis] == pytest.approx(r["est_collective_bytes"][axis], rel=0.02, abs=1)
    with open(out / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert [t["name"] for t in table] == ["d8t1p1-z0-m1", *(["d8t1p1-z3-m1"] if SLOW else []), "d4t2p1-z1-sp-m1"]
    assert math.isclose(float(table[0]["final_loss"]), dp["final_loss"], rel_tol=1e-12)


def test_report_references_the_figures(two_layouts):
    _, out, _, _ = two_layouts
    report = (out / "report.md").read_text()
    for name in sweep_report.PLOTS:
        assert f"]({name}.png)" in report and (out / f"{name}.png").stat().st_size > 10_000
    assert "| d4t2p1-z1-sp-m1 | ok |" in report


def test_figures_render_with_labelled_axes(two_layouts, tmp_path):
    _, _, doc, _ = two_layouts
    fields = {f for f in sweep_lib.SweepRecord.__dataclass_fields__}
    records = [sweep_lib.SweepRecord(**{k: v for k, v in r.items() if k in fields}) for r in doc["layouts"]]
    plots = sweep_report.render_plots(records, str(tmp_path))
    assert set(plots) == set(sweep_report.PLOTS)
    for name, (path, fig) in plots.items():
        assert path == str(tmp_path / f"{name}.png") and (tmp_path / f"{name}.png").stat().st_size > 10_000
        for ax in fig.axes:
            assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title(), name
    labels = [t.get_text() for t in plots["memory_vs_bytes"][1].axes[0].texts]
    assert labels == ["d8t1p1-z0-m1", "d4t2p1-z1-sp-m1"]  # one labelled point per layout
    bars = plots["step_time"][1].axes[0].patches
    assert [b.get_height() for b in bars] == pytest.approx([r.step_time_median_s * 1e3 for r in records])
    est_ax = plots["estimate_vs_measured"][1].axes
    assert any(line.get_label() == "y = x" for ax in est_ax for line in ax.get_lines())


def test_rerun_comparison(two_layouts):
    _, _, doc, _ = two_layouts
    fields = {f for f in sweep_lib.SweepRecord.__dataclass_fields__}
    records = [sweep_lib.SweepRecord(**{k: v for k, v in r.items() if k in fields}) for r in doc["layouts"]]
    assert sweep_report.compare_runs(doc, records)[0] == "2 of 2 layouts have identical memory and collective bytes"
    records[1].temp_bytes += 1
    lines = sweep_report.compare_runs(doc, records)
    assert (
        lines[0].startswith("1 of 2")
        and "d4t2p1-z1-sp-m1: memory or collective bytes differ from the earlier run" in lines
    )


def _timed(name: str, median: float, low: float, high: float, probes: list[float]) -> sweep_lib.SweepRecord:
    return sweep_lib.SweepRecord(
        name, {}, step_time_median_s=median, step_time_min_s=low, step_time_max_s=high, host_probe_s=probes
    )


def test_rerun_comparison_divides_out_the_host_speed():
    """Run 1's probes have median 100 ms; run 2's 120 ms (a host 20% slower), pooled over every
    layout and pass. A median of 1.32 s against run 1's [1.0, 1.2] s spread is outside as measured
    and inside host-corrected (1.1 s); a layout that slowed beyond the host (3.6 s / 1.2 = 3.0 s
    against [1.9, 2.1] s) stays outside."""
    then = [_timed("a", 1.1, 1.0, 1.2, [0.10, 0.09]), _timed("b", 2.0, 1.9, 2.1, [0.10, 0.11])]
    previous = {"meta": {"host_probe": {"layout": "a"}}, "layouts": [r.to_dict() for r in then]}
    now = [_timed("a", 1.32, 1.2, 1.4, [0.12, 0.50]), _timed("b", 3.6, 3.4, 3.8, [0.11, 0.12])]
    assert sweep_report.host_factor(previous, now) == pytest.approx(1.2)  # medians of all probes: robust to 0.50
    lines = sweep_report.compare_runs(previous, now)
    assert lines == [
        "2 of 2 layouts have identical memory and collective bytes",
        "0 of 2 median step times fall inside the earlier run's min-max spread",
        "1 of 2 host-corrected median step times fall inside it (the host probe, a, took x1.200 its earlier median "
        "time: each median divided by that)",
        "b: median 3600 ms, host-corrected 3000 ms, outside the earlier spread [1900, 2100] ms",
    ]
    # a different probe layout (e.g. another --only): no correction, said so
    previous["meta"]["host_probe"]["layout"] = "other"
    lines = sweep_report.compare_runs(previous, now)
    assert lines[2] == "no host correction: the earlier run's probe layout (other) is not this run's (a)"
    assert lines[3] == "a: median 1320 ms outside the earlier spread [1000, 1200] ms"


def test_later_passes_pool_their_times_and_must_repeat_the_losses():
    lay = ParallelLayout(data=8)
    cfg = tiny_config(*SWEEP_DEFAULTS)
    record = sweep_lib.SweepRecord("d8", {}, step_times_s=[9.0, 0.10, 0.12], losses=[5.0, 4.0])
    sweep_lib.summarize_times(record, cfg, lay, warmup=1, peak_flops=1e10)
    assert (record.step_time_median_s, record.pass_medians_s) == (pytest.approx(0.11), [pytest.approx(0.11)])
    passes._add_pass(record, {"times": [8.0, 0.20, 0.30], "losses": [5.0, 4.0]}, 2, cfg, lay, 1, 1e10)
    assert record.status == "ok" and record.pass_medians_s == pytest.approx([0.11, 0.25])
    assert (record.step_time_min_s, record.step_time_median_s, record.step_time_max_s) == pytest.approx(
        (0.10, 0.16, 0.30)
    )
    assert record.tokens_per_s == pytest.approx(lay.tokens_per_step / 0.16)
    passes._add_pass(record, {"times": [7.0, 0.40], "losses": [5.0]}, 3, cfg, lay, 1, 1e10)  # a shorter pass
    assert record.status == "ok" and record.pass_medians_s == pytest.approx([0.11, 0.25, 0.40])
    assert (record.step_time_min_s, record.step_time_median_s, record.step_time_max_s) == pytest.approx(
        (0.10, 0.20, 0.40)
    )
    passes._add_pass(record, {"times": [1.0, 1.0, 1.0], "losses": [5.0, 4.0 + 4e-7]}, 3, cfg, lay, 1, 1e10)
    assert (
        record.status == "mismatch"
        and record.error == "pass 3 losses differ from pass 1 by 1.00e-07 relative (not deterministic)"
    )
    crashed = sweep_lib.SweepRecord("d8", {}, step_times_s=[0.1], losses=[5.0])
    passes._add_pass(crashed, {"error": "ValueError: boom"}, 2, cfg, lay, 0, 1e10)
    assert (crashed.status, crashed.error) == ("crashed", "pass 2: ValueError: boom")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--repeats", "0"], "--repeats 0: use a pass count in [1, 20]"),
        (["--list", "--repeats", "4"], "sweep --repeats has no effect with --list"),
        (["--steps", "4", "--pass-steps", "5"], "--pass-steps 5: use a value in (2, 4]: more than --warmup"),
        (["--pass-steps", "2"], "--pass-steps 2: use a value in (2, 8]"),
        (["--list", "--pass-steps", "4"], "sweep --pass-steps has no effect with --list"),
    ],
)
def test_repeats_flag_is_checked(argv, message, capsys):
    assert main(["sweep", "--config", TINY, *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_crashing_layout_is_recorded_and_the_sweep_goes_on():
    cfg = tiny_config(*SWEEP_DEFAULTS)
    bad = ParallelLayout(tensor=3, seq_len=64, microbatch_size=16)  # 3 does not divide the 4 heads
    record = sweep_lib.run_layout(
        cfg, bad, [], steps=1, warmup=0, peak_flops=1e10, cluster=sweep_lib.cpu_cluster(8, 1e10, 10.0)
    )
    assert record.status == "crashed" and record.error.startswith("ConfigError:") and "\n" not in record.error


def test_plan_sweep_picks_fitting_layouts_and_plots(tmp_path):
    import importlib.util

    from tests.helpers import ROOT

    spec = importlib.util.spec_from_file_location("plan_sweep", ROOT / "experiments" / "plan_sweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # three searches (the 64-device 7B one, ~14 s, adds nothing the 64-device 70B one does not check)
    rows = mod.best_layouts(("llama2_7b",), ("h100-80g",), (8,)) + mod.best_layouts(
        ("llama2_70b",), ("h100-80g",), (8, 64)
    )
    by = {(r["model"], r["devices"]): r for r in rows}
    assert not by[("llama2_70b", 8)]["fits"] and "does not fit" in by[("llama2_70b", 8)]["why"]
    for key in (("llama2_7b", 8), ("llama2_70b", 64)):
        r = by[key]
        assert (
            r["fits"]
            and r["memory_gb"] <= 72
            and 0 < r["comm_share"] < 1
            and r["data"] * r["tensor"] * r["pipeline"] * r["context"] == key[1]
        )
    paths = mod.write(rows, str(tmp_path))
    assert os.path.getsize(paths["png"]) > 10_000
    fig = mod.plot(rows)
    assert all(ax.get_xlabel() == "devices" and ax.get_ylabel() for ax in fig.axes)
