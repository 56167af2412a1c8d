"""Uneven pipeline stages (``parallel.layers_per_stage``, ``first_stage_layers`` / ``last_stage_layers``,
the balanced split): the resolved split, one-line errors, fp32 equivalence with one device (padding
rows stay exactly zero, their gradient too), and checkpoints uneven -> even -> uneven.

The default run: 4 layers on p=3 (1/2/1) with 1F1B, data=2 and ZeRO-1 (about 50 s on 2 shared
cores: one compile of the layout and one of the reference); ``JAXPAR_SLOW=1`` adds 5 layers on p=2
(balanced 2/3) with GPipe, tensor=2 and ZeRO-3, the other schedule for each, ZeRO-2, tensor=2 on
p=3, context=2, full recompute (the layer-by-layer backward) and dropout (masks as on one device).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxpar.checkpoint import Checkpointer
from jaxpar.config import ConfigError, validate
from jaxpar.layout import ParallelLayout, balanced_split, resolve_stage_layers
from jaxpar.mesh import make_mesh
from jaxpar.optim.optimizers.adamw import init_state as init_opt_state
from jaxpar.parallel import pipeline
from jaxpar.train.state import Setup
from tests.helpers import ROOT, TINY, child_env, max_rel_error, tiny_config
from tests.test_pipeline import NO_GUARD, SMALL

SLOW = os.environ.get("JAXPAR_SLOW") == "1"
TOL = 1e-5
P3 = ("--config.mesh.pipeline=3", "--config.parallel.layers_per_stage=1,2,1", "--config.model.num_layers=4")
P2 = ("--config.mesh.pipeline=2", "--config.model.num_layers=5")


def _cfg(*overrides: str):
    return tiny_config(*SMALL, *overrides)


# --------------------------------------------------------------------------- the split


@pytest.mark.parametrize(
    "overrides, want, source",
    [
        (P3, (1, 2, 1), "parallel.layers_per_stage"),
        (P2, (2, 3), "balanced"),
        (("--config.mesh.pipeline=4", "--config.model.num_layers=6"), (1, 2, 2, 1), "balanced"),
        (("--config.mesh.pipeline=2", "--config.model.num_layers=8"), (), ""),  # even: nothing stored
        (
            ("--config.mesh.pipeline=4", "--config.model.num_layers=8", "--config.parallel.first_stage_layers=1"),
            None,  # 7 over 3: refused below
            None,
        ),
        (
            (
                "--config.mesh.pipeline=4",
                "--config.model.num_layers=9",
                "--config.parallel.first_stage_layers=1",
                "--config.parallel.last_stage_layers=2",
            ),
            (1, 3, 3, 2),
            "parallel.first_stage_layers/last_stage_layers",
        ),
        (
            ("--config.mesh.pipeline=3", "--config.model.num_layers=7", "--config.parallel.last_stage_layers=1"),
            (3, 3, 1),
            "parallel.last_stage_layers",
        ),
    ],
)
def test_the_resolved_split(overrides, want, source):
    if want is None:
        with pytest.raises(ConfigError, match=r"^parallel.first_stage_layers: the remaining 7 of model.num_layers=8"):
            _cfg("--config.mesh.data=1", "--config.parallel.microbatches=4", *overrides)
        return
    cfg = _cfg("--config.mesh.data=1", "--config.parallel.microbatches=4", *overrides)
    layout = validate(cfg)
    assert (layout.stage_layers, layout.stage_split) == (want, source)
    assert layout.stage_layer_counts(cfg.model.num_layers) == (want or (4, 4))
    assert layout.layers_per_stage(cfg.model.num_layers) == (max(want) if layout.uneven else 4)


def test_balanced_split_puts_the_extra_layers_on_the_middle_stages_first():
    assert balanced_split(70, 12) == (5, *[6] * 10, 5)  # BLOOM-176B: 70 layers on 12 stages
    assert balanced_split(5, 2) == (2, 3)
    assert balanced_split(7, 4) == (1, 2, 2, 2)
    assert balanced_split(8, 4) == (2, 2, 2, 2)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ("--config.parallel.layers_per_stage=1,2", "--config.mesh.pipeline=3", "--config.model.num_layers=4"),
            "parallel.layers_per_stage: 2 stage counts (1,2) for mesh.pipeline=3; give one count per stage",
        ),
        (
            ("--config.parallel.layers_per_stage=1,2,2", "--config.mesh.pipeline=3", "--config.model.num_layers=4"),
            "parallel.layers_per_stage: the split 1,2,2 sums to 5, not model.num_layers=4; make the counts add up to 4",
        ),
        (
            ("--config.parallel.layers_per_stage=0,3,1", "--config.mesh.pipeline=3", "--config.model.num_layers=4"),
            "parallel.layers_per_stage: the split 0,3,1 leaves a stage without layers",
        ),
        (
            ("--config.parallel.layers_per_stage=1;2;1", "--config.mesh.pipeline=3", "--config.model.num_layers=4"),
            "parallel.layers_per_stage='1;2;1': give one layer count per stage, comma-separated, e.g. 1,2,1",
        ),
        (
            (
                "--config.parallel.layers_per_stage=1,2,1",
                "--config.parallel.first_stage_layers=1",
                "--config.mesh.pipeline=3",
                "--config.model.num_layers=4",
            ),
            "parallel.layers_per_stage='1,2,1' with parallel.first_stage_layers=1",
        ),
        (
            ("--config.parallel.first_stage_layers=-1", "--config.mesh.pipeline=3", "--config.model.num_layers=4"),
            "parallel.first_stage_layers=-1: must be >= 0 (0: not set)",
        ),
        (
            ("--config.parallel.first_stage_layers=3", "--config.mesh.pipeline=3", "--config.model.num_layers=4"),
            "parallel.first_stage_layers: the remaining 1 of model.num_layers=4 do not split evenly over the 2",
        ),
        (
            ("--config.mesh.pipeline=3", "--config.model.num_layers=2"),
            "model.num_layers=2 is not divisible by mesh.pipeline*parallel.virtual_stages=3",
        ),
        (
            (
                "--config.parallel.layers_per_stage=1,3",
                "--config.mesh.pipeline=2",
                "--config.model.num_layers=4",
                "--config.parallel.pipeline_schedule=interleaved",
                "--config.parallel.virtual_stages=2",
            ),
            "parallel.layers_per_stage: uneven stages (1,3) with parallel.virtual_stages=2 are not supported",
        ),
        (
            (
                "--config.mesh.pipeline=2",
                "--config.model.num_layers=5",
                "--config.parallel.pipeline_schedule=interleaved",
                "--config.parallel.virtual_stages=2",
            ),
            "model.num_layers=5 is not divisible by mesh.pipeline*parallel.virtual_stages=4",
        ),
        (
            ("--config.mesh.pipeline=1", "--config.parallel.layers_per_stage=2,2"),
            "parallel.layers_per_stage='2,2' has no effect here: it acts only when mesh.pipeline > 1",
        ),
    ],
)
def test_bad_splits_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(_cfg("--config.mesh.data=1", "--config.parallel.microbatches=4", *overrides))
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_the_cli_exits_2_naming_the_field():
    proc = subprocess.run(
        [sys.executable, "-m", "jaxpar", "inspect", "--config", TINY, "--config.mesh.pipeline=2",
         "--config.parallel.layers_per_stage=1,1"],
        capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "parallel.layers_per_stage: the split 1,1 sums to 2" in lines[0], proc.stderr


def test_layout_validate_checks_a_split_given_directly():
    import json

    back = ParallelLayout(
        **json.loads(json.dumps(dataclasses.asdict(ParallelLayout(pipeline=3, stage_layers=(1, 2, 1)))))
    )
    assert back.stage_layers == (1, 2, 1) and hash(back) == hash(ParallelLayout(pipeline=3, stage_layers=(1, 2, 1)))
    model = {**dict(_cfg().model), "num_layers": 4}
    with pytest.raises(ConfigError, match=r"^parallel.layers_per_stage: the split 1,1,1 sums to 3"):
        ParallelLayout(pipeline=3, microbatches=3, stage_layers=(1, 1, 1)).validate(model)


# --------------------------------------------------------------------------- stage form


def test_stage_form_pads_each_stage_and_the_model_form_drops_the_padding():
    order = pipeline.stored_order(4, 3, 1, (1, 2, 1))
    assert order.tolist() == [0, 4, 1, 2, 3, 4]  # 4: a padding row
    assert pipeline.model_index(4, 3, 1, (1, 2, 1)).tolist() == [0, 2, 3, 4]
    blocks = {"blocks": {"w": np.arange(4.0)[:, None] + 1}}
    staged = pipeline.to_stage_form(blocks, 3, 1, (1, 2, 1))
    assert np.asarray(staged["blocks"]["w"])[:, 0].tolist() == [1, 0, 2, 3, 4, 0]
    back = pipeline.to_model_form(staged, 3, 1, (1, 2, 1))
    assert np.asarray(back["blocks"]["w"])[:, 0].tolist() == [1, 2, 3, 4]


# --------------------------------------------------------------------------- equivalence


@functools.cache
def _compiled(*overrides: str):
    cfg = _cfg(*overrides)
    layout = validate(cfg)
    setup = Setup(cfg, layout, make_mesh(layout, jax.devices()[: layout.devices]))
    return setup, setup.lower_train_step().compile()


@functools.cache
def _host_params(num_layers: str):
    cfg = _cfg(num_layers)
    from jaxpar.models import get_model

    return jax.device_get(get_model(cfg.model).init(jax.random.key(0)))


def _train(overrides: tuple[str, ...], steps: int = 2):
    """(losses and grad norms, gradient of step 1, final parameters in model form, padding rows of
    the final stage-form parameters / optimizer moments)."""
    setup, step_fn = _compiled(*overrides)
    cfg, lay = setup.cfg, setup.layout
    p = lay.pipeline
    host = _host_params(f"--config.model.num_layers={cfg.model.num_layers}")
    staged = pipeline.to_stage_form(host, p, 1, lay.stage_layers) if p > 1 else host
    params = jax.device_put(staged, setup.train_form.param_shardings)
    opt = jax.device_put(init_opt_state(staged), setup.train_form.opt_shardings)
    rng = np.random.default_rng(0)
    history, grads = [], None
    for step in range(steps):
        rows = rng.integers(0, cfg.model.vocab_size, size=(cfg.train.global_batch, cfg.train.seq_len + 1))
        params, opt, metrics = step_fn(params, opt, setup.feed.make_batch(rows), NO_GUARD(setup))
        history.append({k: float(x) for k, x in jax.device_get(metrics).items()})
        if step == 0:
            grads = jax.tree.map(lambda mu: mu / (1 - cfg.optim.b1), jax.device_get(opt["mu"]))
    params, opt = jax.device_get(params), jax.device_get(opt)
    padding = []
    if lay.uneven:
        pad = pipeline.stored_order(cfg.model.num_layers, p, 1, lay.stage_layers) >= cfg.model.num_layers
        padding = [a[pad] for tree in (params, opt["mu"], opt["nu"]) for a in jax.tree.leaves(tree["blocks"])]
        params = pipeline.to_model_form(params, p, 1, lay.stage_layers)
        grads = pipeline.to_model_form(grads, p, 1, lay.stage_layers)
    return history, grads, params, padding


@functools.cache
def _reference(num_layers: int, *model: str):
    return _train(
        (f"--config.model.num_layers={num_layers}", "--config.mesh.data=1", "--config.parallel.microbatches=1", *model)
    )


CASES = [
    pytest.param((*P3, "--config.parallel.pipeline_schedule=1f1b", "--config.mesh.data=2", "--config.parallel.zero_stage=1"),
                 id="p3_1-2-1_1f1b_data2_zero1"),
    *[
        pytest.param(case, id=name, marks=pytest.mark.skipif(not SLOW, reason="JAXPAR_SLOW=1"))
        for name, case in {
            "p2_5layers_gpipe_tensor2_zero3": (*P2, "--config.parallel.pipeline_schedule=gpipe", "--config.mesh.tensor=2",
                                               "--config.parallel.zero_stage=3", "--config.mesh.data=2"),
            "p3_1-2-1_gpipe_data2_zero3": (*P3, "--config.parallel.pipeline_schedule=gpipe", "--config.mesh.data=2",
                                           "--config.parallel.zero_stage=3"),
            "p3_1-2-1_1f1b_tensor2": (*P3, "--config.parallel.pipeline_schedule=1f1b", "--config.mesh.tensor=2",
                                      "--config.mesh.data=1"),
            "p3_1-2-1_1f1b_data2_zero2": (*P3, "--config.parallel.pipeline_schedule=1f1b", "--config.mesh.data=2",
                                          "--config.parallel.zero_stage=2"),
            "p2_5layers_1f1b_tensor2_zero1": (*P2, "--config.parallel.pipeline_schedule=1f1b", "--config.mesh.tensor=2",
                                              "--config.parallel.zero_stage=1", "--config.mesh.data=2"),
            "p2_5layers_1f1b_data2_zero3_full_remat": (*P2, "--config.parallel.pipeline_schedule=1f1b", "--config.mesh.data=2",
                                                       "--config.parallel.zero_stage=3", "--config.parallel.recompute=full"),
            "p2_5layers_1f1b_context2": (*P2, "--config.parallel.pipeline_schedule=1f1b", "--config.mesh.context=2",
                                         "--config.parallel.context_exchange=all_gather",
                                         "--config.model.attention=blockwise", "--config.model.attention_block=8",
                                         "--config.mesh.data=1"),
            "p3_1-2-1_1f1b_data2_full_remat": (*P3, "--config.parallel.pipeline_schedule=1f1b", "--config.mesh.data=2",
                                               "--config.parallel.recompute=full"),
        }.items()
    ],
]  # fmt: skip


@pytest.mark.parametrize("overrides", CASES)
def test_uneven_stages_match_one_device(overrides):
    num_layers = int(next(o for o in overrides if "num_layers" in o).split("=")[1])
    got = _train((*overrides, "--config.parallel.microbatches=4"))
    ref_history, ref_grads, ref_params, _ = _reference(num_layers)
    history, grads, params, padding = got
    for mine, want in zip(history, ref_history, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(mine[key] - want[key]) / abs(want[key]) < TOL, (key, mine, want)
    assert max_rel_error(grads, ref_grads) < TOL
    assert max_rel_error(params, ref_params) < TOL
    assert padding and all(not np.any(a) for a in padding)  # never moved: parameters and moments exactly 0


@pytest.mark.skipif(not SLOW, reason="JAXPAR_SLOW=1")
def test_uneven_stages_with_dropout_draw_one_devices_masks():
    drop = ("--config.model.dropout=0.1", "--config.model.attention_dropout=0.1")
    got = _train((*P3, "--config.parallel.pipeline_schedule=1f1b", "--config.mesh.data=2", "--config.parallel.microbatches=4",
                  *drop))  # fmt: skip
    ref_history, ref_grads, ref_params, _ = _reference(4, *drop)
    assert max_rel_error(got[1], ref_grads) < TOL
    assert max_rel_error(got[2], ref_params) < TOL


# --------------------------------------------------------------------------- checkpoints


def _setup(*overrides: str) -> Setup:
    cfg = tiny_config(*overrides)
    layout = validate(cfg)
    return Setup(cfg, layout, make_mesh(layout, jax.devices()[: layout.devices]))


def test_checkpoint_uneven_to_even_and_back(tmp_path):
    """An uneven layout's checkpoint (model form) restores onto an even pipeline layout, whose
    checkpoint restores onto the uneven one again: parameters and optimizer state unchanged."""
    common = (
        "--config.model.num_layers=4",
        "--config.mesh.data=2",
        "--config.mesh.tensor=1",
        "--config.parallel.microbatches=4",
    )
    uneven = _setup(*common, "--config.mesh.pipeline=3", "--config.parallel.layers_per_stage=1,2,1")
    even = _setup(*common, "--config.mesh.pipeline=2")
    params, opt = uneven.init(5)
    opt = jax.tree.map(lambda a: a + 1 if a.ndim else a, opt)  # moments away from zero
    want = jax.device_get(uneven.to_model_order(params, opt))
    ckpt = Checkpointer(str(tmp_path / "a"), 1, 2)
    ckpt.save(1, *uneven.to_model_order(params, opt), {"step": 1}, uneven.cfg)
    ckpt.wait()
    p, o, _ = even.abstract_state(model_form=True)
    _, state, _ = ckpt.restore({"params": p, "opt_state": o})
    e_params, e_opt = even.from_model_order(state["params"], state["opt_state"])
    ckpt.close()
    ckpt = Checkpointer(str(tmp_path / "b"), 1, 2)
    ckpt.save(1, *even.to_model_order(e_params, e_opt), {"step": 1}, even.cfg)
    ckpt.wait()
    p, o, _ = uneven.abstract_state(model_form=True)
    _, state, _ = ckpt.restore({"params": p, "opt_state": o})
    back = jax.device_get(uneven.from_model_order(state["params"], state["opt_state"]))
    ckpt.close()
    # the stage-form parameters come back exactly (padding rows zero, as init made them); the moments
    # were moved off zero everywhere above, so compare them in model form (padding rows are not saved)
    for a, b in zip(jax.tree.leaves(back[0]), jax.tree.leaves(jax.device_get(params)), strict=True):
        np.testing.assert_array_equal(a, b)
    got = jax.device_get(uneven.to_model_order(*back))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------- importers


def _split(cfg) -> tuple[int, ...]:
    return resolve_stage_layers(cfg.model.num_layers, cfg.mesh.pipeline, cfg.parallel)[0]


def _megatron(*flags: str, world: int = 8) -> str:
    lines = ["# flags", f"--nproc_per_node {world}", "--num-layers 32", "--hidden-size 4096",
             "--num-attention-heads 32", "--seq-length 1024", "--lr 1e-4", "--train-iters 100",
             "--global-batch-size 64", *flags]  # fmt: skip
    return "\n".join(lines)


def test_megatron_first_and_last_stage_layers():
    from jaxpar.port.megatron import port_megatron

    cfg, report = port_megatron(
        _megatron(
            "--pipeline-model-parallel-size 4",
            "--decoder-first-pipeline-num-layers 6",
            "--decoder-last-pipeline-num-layers 6",
        )
    )
    assert (cfg.parallel.first_stage_layers, cfg.parallel.last_stage_layers) == (6, 6)
    assert _split(cfg) == (6, 10, 10, 6)  # Megatron: the other 20 evenly over the 2 middle stages
    assert report.find("--decoder-first-pipeline-num-layers").status == "mapped"
    cfg, _ = port_megatron(
        _megatron(
            "--pipeline-model-parallel-size 4",
            "--decoder-first-pipeline-num-layers 5",
            "--decoder-last-pipeline-num-layers 6",
        )
    )
    with pytest.raises(ConfigError, match=r"^parallel.first_stage_layers/last_stage_layers: the remaining 21"):
        _split(cfg)


@pytest.mark.parametrize(
    "layout, want",
    [
        ("Et*7|(t*8|)*2,t*9L", (7, 8, 8, 9)),
        ("'Ettttttt|tttttttt|tttttttt|tttttttttL'", (7, 8, 8, 9)),
        ("E(t|)*3t*29L", None),  # 4 stages of 1, 1, 1, 29: fine for the flag, one stage per rank
    ],
)
def test_megatron_pipeline_layout_strings(layout, want):
    from jaxpar.port.megatron import pipeline_layout_counts, port_megatron

    if want is None:
        assert pipeline_layout_counts(layout, 4) == [1, 1, 1, 29]
        return
    cfg, report = port_megatron(
        _megatron("--pipeline-model-parallel-size 4", f"--pipeline-model-parallel-layout {layout}")
    )
    assert cfg.parallel.layers_per_stage == ",".join(map(str, want))
    assert _split(cfg) == want
    assert report.find("--pipeline-model-parallel-layout").status == "mapped"


@pytest.mark.parametrize(
    "layout, message",
    [
        ("Et*3|(tt|)*14,m|L", "a multi-token-prediction layer ('m') has no jaxpar counterpart"),
        ("Et*4|(t*4|)*6,t*4L", "8 stages for --pipeline-model-parallel-size 4"),
        ("t*8|Et*8|t*8|t*8L", "jaxpar keeps the embedding (E) on the first stage and the loss (L) on the last"),
    ],
)
def test_megatron_pipeline_layouts_jaxpar_cannot_run_are_refused_by_name(layout, message):
    from jaxpar.port.megatron import pipeline_layout_counts

    with pytest.raises(ConfigError) as err:
        pipeline_layout_counts(layout, 4)
    text = str(err.value)
    assert text.startswith("megatron: --pipeline-model-parallel-layout") and message in text and "\n" not in text


def test_torchtitan_split_matches_generate_llm_fqn_per_model_part():
    from jaxpar.port.torchtitan import torchtitan_stage_layers

    assert torchtitan_stage_layers(32, 4) == [8, 9, 8, 7]  # 34 units: 9, 9, 8, 8 less embedding and output
    assert torchtitan_stage_layers(32, 2) == [16, 16]
    assert torchtitan_stage_layers(32, 4, 0, 0) == [8, 8, 8, 8]
    assert torchtitan_stage_layers(126, 8, 1, 1) == [15, 16, 16, 16, 16, 16, 16, 15]  # Llama 3 405B on 8 stages


@pytest.mark.parametrize(
    "extra, want, status",
    [
        ("", "8,9,8,7", "default"),  # the defaults 1 / 1 make torchtitan's split uneven: said as (default)
        ("pipeline_parallel_first_stage_less_layers = 0\npipeline_parallel_last_stage_less_layers = 0\n", "", None),
        ("pipeline_parallel_first_stage_less_layers = 2\n", "7,9,9,7", "mapped"),
    ],
)
def test_torchtitan_stage_split_maps_to_layers_per_stage(tmp_path, extra, want, status):
    from jaxpar.port.torchtitan import port_torchtitan

    text = (ROOT / "tests/fixtures/recipes/corpus/torchtitan/llama3_8b.toml").read_text()
    text = text.replace("pipeline_parallel_degree = 1\n", "pipeline_parallel_degree = 4\n" + extra)
    path = tmp_path / "pp4.toml"
    path.write_text(text)
    cfg, report = port_torchtitan(path, world_size=8)
    assert cfg.mesh.pipeline == 4 and cfg.parallel.layers_per_stage == want
    assert _split(cfg) == (tuple(int(x) for x in want.split(",")) if want else ())
    if status == "default":
        row = report.find("parallelism.pipeline_parallel_first_stage_less_layers (default)")
        assert row.status == "mapped" and "8,9,8,7" in row.note
    elif status:
        assert report.find("parallelism.pipeline_parallel_first_stage_less_layers").status == status


def test_bloom_176b_split_from_its_recipe():
    """BLOOM-176B (bigscience tr11-176B-ml, the corpus fixture): 70 layers on 12 stages with
    Megatron-DeepSpeed's ``--pp-partition-method 'type:transformer|embedding'`` (the tied embedding
    counted as a layer at each end): 5 layers on the first and last stage, 6 on the others. The
    numbers are read from the verbatim script (its launcher form is read by the bash reader of
    issue 28; the corpus test keeps that expectation)."""
    import re

    from jaxpar.port.megatron import port_megatron

    text = (ROOT / "tests/fixtures/recipes/corpus/megatron_deepspeed/bloom_tr11_176B_ml.slurm").read_text()
    layers, pp = (int(re.search(rf"^{name}=(\d+)", text, re.M).group(1)) for name in ("NLAYERS", "PP_SIZE"))
    method = re.search(r"--pp-partition-method (\S+)", text).group(1)
    assert (layers, pp, method) == (70, 12, "'type:transformer|embedding'")
    cfg, report = port_megatron(
        _megatron(f"--pipeline-model-parallel-size {pp}", f"--pp-partition-method {method}", world=96).replace(
            "--num-layers 32", f"--num-layers {layers}"
        )
    )
    assert _split(cfg) == (5, *[6] * 10, 5)
    assert report.find("--pp-partition-method").status == "mapped"
    model = {**dict(_cfg().model), "num_layers": layers}
    split = ParallelLayout(pipeline=pp, microbatches=pp, seq_len=32, stage_layers=_split(cfg), stage_split="x")
    assert split.validate(model).stored_layers(layers) == 6
    assert balanced_split(layers, pp) == _split(cfg)  # and the same split when nothing is said


def test_the_planner_prices_a_balanced_split_by_its_largest_stage():
    """A pipeline size that does not divide the layers is a candidate with the balanced split; the
    stage with the most layers sets its memory (70 layers on 12 stages stores 6 per stage, the same
    as 72 layers would)."""
    from jaxpar.analysis import plan
    from jaxpar.analysis.clusters import get_cluster

    model = _cfg("--config.model.num_layers=70").model
    found = plan.search_layouts(model, get_cluster("h100-80g"), 12, 12, 32, fixed={"pipeline": 12}, keep_unfit=True)
    assert found and all(e.layout.stage_layers == (5, *[6] * 10, 5) for e in found)
    assert all(e.layout.pipeline_schedule in ("1f1b", "gpipe") and e.layout.virtual_stages == 1 for e in found)
    assert "layers=5/6/6/6/6/6/6/6/6/6/6/5" in plan.describe(found[0].layout)
    even = _cfg("--config.model.num_layers=72").model
    lay = found[0].layout
    same = plan.evaluate_layout(even, get_cluster("h100-80g"), ParallelLayout(**{
        **{f: getattr(lay, f) for f in ("data", "tensor", "pipeline", "zero_stage", "microbatches", "microbatch_size",
                                        "seq_len", "recompute", "pipeline_schedule")}}))  # fmt: skip
    assert found[0].memory.total_bytes == same.memory.total_bytes


def test_megatron_embedding_and_loss_counted_as_layers():
    from jaxpar.port.megatron import port_megatron

    flags = ("--pipeline-model-parallel-size 4", "--account-for-embedding-in-pipeline-split")
    cfg, report = port_megatron(_megatron(*flags, "--account-for-loss-in-pipeline-split").replace("32", "30", 1))
    assert _split(cfg) == (7, 8, 8, 7)  # 30 + 2 = 32 units, 8 per stage, one of them the embedding / the loss
    assert report.find("--account-for-loss-in-pipeline-split").status == "mapped"
    with pytest.raises(ConfigError, match=r"^megatron: --num-layers 32 plus the embedding / loss counted as layers"):
        port_megatron(_megatron(*flags))


def test_train_states_the_split_once_at_the_start(monkeypatch, capsys):
    import argparse

    from jaxpar.cli import train as train_cli
    from jaxpar.train import loop

    class Idle:  # the run itself is not what is tested
        def __init__(self, *args, **kwargs):
            pass

        def run(self):
            return None

    monkeypatch.setattr(loop, "Trainer", Idle)
    args = argparse.Namespace(
        config=TINY, overrides=["--config.mesh.pipeline=2", "--config.model.num_layers=5", "--config.mesh.data=2",
                                "--config.parallel.microbatches=2"], no_progress=True,
    )  # fmt: skip
    assert train_cli.run_train(args) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "pipeline stages hold 2,3 layers (model.num_layers=5 does not divide mesh.pipeline=2: a balanced split, the "
        "extra layers on the middle stages first; set parallel.layers_per_stage to choose)"
    ]


def test_inspect_reports_the_split():
    from jaxpar.cli.inspect import pipeline_schedule

    layout = validate(_cfg(*P3, "--config.mesh.data=1", "--config.parallel.microbatches=4"))
    pipe = pipeline_schedule(layout)
    assert pipe["layers_per_stage"] == [1, 2, 1]
    assert pipe["stage_split"] == "pipeline stages hold 1,2,1 layers (parallel.layers_per_stage)"
    even = pipeline_schedule(validate(_cfg("--config.mesh.pipeline=2", "--config.mesh.data=1",
                                           "--config.parallel.microbatches=2")))  # fmt: skip
    assert (even["layers_per_stage"], even["stage_split"]) == ([], "")


def test_a_planned_layout_carries_its_split_into_the_config_it_compiles():
    from jaxpar.analysis.aot import layout_run

    cfg = _cfg(*P3, "--config.mesh.data=1", "--config.parallel.microbatches=4")  # asks for 1,2,1 on 3 stages
    even = ParallelLayout(pipeline=2, microbatches=4, microbatch_size=2, seq_len=32)
    out, layout = layout_run(cfg, even)
    assert (out.parallel.layers_per_stage, layout.stage_layers) == ("", ())
    uneven = dataclasses.replace(even, pipeline=3, stage_layers=(2, 1, 1), stage_split="x")
    out, layout = layout_run(cfg, uneven)
    assert (out.parallel.layers_per_stage, layout.stage_layers) == ("2,1,1", (2, 1, 1))


def test_pp_partition_method_that_does_not_divide_is_approximated():
    """The hand-written BLOOM-style 104B fixture: 66 layers + 2 embeddings do not divide 8 stages:
    approximated, and jaxpar's balanced split (the extra two layers on middle stages)."""
    from jaxpar.port.megatron import port_megatron

    cfg, report = port_megatron(ROOT / "tests/fixtures/recipes/megatron/bloom_style_104b_slurm.args",
                                variables={"SLURM_NNODES": "32"})  # fmt: skip
    assert report.find("--pp-partition-method").status == "approximated"
    assert (cfg.parallel.first_stage_layers, cfg.parallel.last_stage_layers, cfg.parallel.layers_per_stage) == (
        0,
        0,
        "",
    )
    assert _split(cfg) == (8, 9, 9, 8, 8, 8, 8, 8) == balanced_split(66, 8)
