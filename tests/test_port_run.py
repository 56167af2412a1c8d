"""Ported recipes and shipped configs run: every ``jaxpar port -o`` output and every configs/*.py trains one step.

User path: ``jaxpar port KIND FILE ... -o out.py`` writes a config file, ``load_config(out.py)`` loads and
validates it at full size, and ``load_config(out.py, shrink overrides)`` is what a user gets with
``jaxpar train --config out.py --config.model.embed_dim=32 ...``. That shrunk config then trains one step
(``Setup`` + ``init`` + ``train_step``, tests/helpers.run_steps) and must give a finite loss near
ln(vocab) -- the loss of a freshly initialised model, so a step that scales or sums the loss wrongly
(per microbatch, per shard) fails too.

How a recipe is shrunk (:func:`shrink`), keeping what the recipe chose for the layout:

* mesh: each axis rounded down to a power of two, then the largest axis halved (data first on ties)
  until data*tensor*pipeline <= 8, the simulated device count; an axis > 1 stays >= 2, so every
  collective the recipe's layout needs still appears (3 axes > 1 end at 2x2x2 at most);
* kept as ported: ZeRO stage, sequence parallelism, pipeline schedule and virtual stages, recompute
  policy, and the model family (activation, norm, positions, tied embeddings, grouped-query attention);
* microbatches: with a pipeline, as many as stages (the least 1F1B and interleaved accept); without,
  2 if the recipe accumulates gradients (any count > 1), else 1; one sequence per data shard and
  microbatch, so ``global_batch = microbatches * data``;
* model: 32 wide, 2*tensor heads of 8 (kv heads = tensor when the recipe uses GQA), MLP 64, vocabulary
  128, one layer per pipeline chunk (one in all without a pipeline), sequence 16, fp32 compute.

Cost: one step compiles an init and a train step, ~7-14 s of CPU per layout. The 28 recipes and 11
configs shrink to 31 distinct layouts (:func:`layout_key`: mesh, ZeRO, sequence parallelism, schedule,
virtual stages, microbatches, recompute, model family). With ``JAXPAR_SLOW=1`` each of them trains one
step, once. By default a covering subset trains (the ``plan`` fixture, greedy): every *feature*
(:func:`features`) of every layout -- ZeRO stage, alone, with or without tensor and with or without
pipeline; pipeline schedule; sequence parallelism; recompute policy; MLP, norm, positions, tied
embeddings; GQA; gradient accumulation -- appears in at least one layout that runs (7 layouts).
Every other recipe and config still ports, writes, loads, shrinks and builds its ``Setup`` (layout
validation, parameter shardings, the ZeRO-3 sharding guard), and its test asserts that each of its
features is covered by a layout that ran.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pathlib

import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.config import default_config, load_config
from jaxpar.layout import ParallelLayout
from tests.helpers import make_setup, run_steps

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures" / "recipes"
DEVICES = 8
HF = [
    "--set",
    "lr=3e-4",
    "--set",
    "weight_decay=0.1",
    "--set",
    "betas=[0.9, 0.95]",
    "--set",
    "eps=1e-8",
    "--set",
    "warmup_num_steps=100",
    "--set",
    "total_num_steps=1000",
    "--set",
    "gradient_clipping=1.0",
    "--set",
    "train_micro_batch_size_per_gpu=1",
    "--set",
    "gradient_accumulation_steps=2",
    "--set",
    "fp16=false",
    "--set",
    "bf16=true",
]
# recipe -> the extra `jaxpar port` arguments a user needs for it (world size, shell variables, "auto" values;
# --approximate where jaxpar would train another model than the recipe's: REFUSED says which)
RECIPES = {
    "deepspeed/hf_zero3_offload_fp16.json": ["--world-size", "8", *HF, "--approximate"],
    "deepspeed/hf_zero3_all_auto.json": ["--world-size", "8", *HF, "--approximate"],
    "deepspeed/hf_zero2_fp16.json": ["--world-size", "8", *HF, "--approximate"],
    "deepspeed/finetune_zero3_offload_bf16_auto.json": ["--world-size", "4", "--allow-unresolved", "--approximate"],
    "deepspeed/vision_fp16_zero1.json": ["--world-size", "8", "--approximate"],
    "deepspeed/pipe_module_typo.json": ["--world-size", "2", "--approximate"],
    "deepspeed/pipeline_parallel_micro.json": ["--world-size", "8", "--pipeline", "2", "--approximate"],
    "deepspeed/smoke_bf16_zero0.json": ["--world-size", "8", "--approximate"],
    "deepspeed/megatron_ds_bf16_zero1.json": [
        "--world-size",
        "256",
        "--tensor",
        "4",
        "--pipeline",
        "8",
        "--set",
        "model.num_layers=48",
        "--approximate",
    ],
    "deepspeed/zeropp_hpz_qwz_qgz.json": ["--world-size", "8", "--approximate"],
    "deepspeed/mics_zero3.json": ["--world-size", "8", "--approximate"],
    "deepspeed/adam_l2_cosine_autocast.json": ["--world-size", "8", "--approximate"],
    "megatron/gpt3_13b_distributed.args": ["--var", "NUM_NODES=4", "--approximate"],
    "megatron/llama3_8b_fp8_single_node.args": ["--set", "model.vocab_size=128256"],
    "megatron/mixtral_8x22b_moe.args": ["--var", "SLURM_NNODES=4"],  # EP 8 x PP 4 needs 32 GPUs
    "megatron/sweep_CONFIG.args": [
        *(f"--var={kv}" for kv in ("TP=2", "PP=2", "MBS=1", "GBS=32", "NLS=24", "HS=1024", "NAH=16", "WORLD_SIZE=8")),
        "--approximate",
    ],
    "megatron/bloom_style_104b_slurm.args": [
        "--var",
        "SLURM_NNODES=32",
        "--set",
        "model.num_layers=64",
        "--set",
        "model.head_dim=144",
        "--approximate",
    ],  # ALiBi unsupported: RoPE, even dims
    "megatron/megatron_ds_llama2_tp2_pp2.args": ["--set", "model.vocab_size=32000"],
    "megatron/gpt_1b_interleaved_sp.args": ["--approximate"],
    "torchtitan/llama3_8b_32gpu.toml": ["--world-size", "32"],
    "torchtitan/llama3_70b_tp8_64gpu.toml": ["--world-size", "64"],
    "torchtitan/llama3_405b_fp8_128gpu.toml": ["--world-size", "128"],
    "torchtitan/llama4_moe_pp4_tp8.toml": [
        "--world-size",
        "64",
        "--set",
        "model.num_heads=8",
        "--set",
        "model.num_kv_heads=8",
        "--set",
        "parallel.microbatches=4",
        "--set",
        "train.global_batch=8",
        "--approximate",
    ],
    "torchtitan/deepseek_v3_moe_ep8.toml": ["--world-size", "16"],
    "torchtitan/llama3_8b_pp2_interleaved_16gpu.toml": [],
    "fsdp/accelerate_fsdp_full_shard.yaml": ["--approximate"],
    "fsdp/accelerate_fsdp_hybrid_2nodes.yaml": ["--approximate"],
    "fsdp/accelerate_fsdp2_no_reshard.yaml": ["--approximate"],
}
# what each --approximate above stands for: without it the port exits 2 naming this model change (the
# layouts are what these tests train; the model is shrunk to a stand-in anyway)
_NO_MODEL = "(model): a DeepSpeed config does not describe the model"
REFUSED = {
    **{r: _NO_MODEL for r in RECIPES if r.startswith("deepspeed/")},
    **{r: "(model): an accelerate config does not describe the model" for r in RECIPES if r.startswith("fsdp/")},
    "megatron/gpt3_13b_distributed.args": "--add-bias-linear (default) = true",
    "megatron/gpt_1b_interleaved_sp.args": "--add-bias-linear (default) = true",
    "megatron/sweep_CONFIG.args": "--add-bias-linear (default) = true",
    "megatron/bloom_style_104b_slurm.args": "--position-embedding-type = alibi",
    "torchtitan/llama4_moe_pp4_tp8.toml": "model.name = llama4: a mixture-of-experts model",
}
MAXTEXT_PRESETS = ("fsdp8", "fsdp4_tp2", "dp2_tp2_pp2")  # configs/maxtext_tiny.py:<preset>, beyond its default
SPECS = [*sorted(p.name for p in (ROOT / "configs").glob("*.py")), *(f"maxtext_tiny.py:{p}" for p in MAXTEXT_PRESETS)]


def shrunk_mesh(sizes: tuple[int, ...], limit: int = DEVICES) -> tuple[int, ...]:
    """Mesh sizes (data, tensor, pipeline, expert) scaled to at most ``limit`` devices, as the module
    docstring says."""
    out = [1 << (s.bit_length() - 1) for s in sizes]  # round down to a power of two
    order = tuple(i for i in (0, 3, 2, 1) if i < len(out))  # ties: halve data, expert, pipeline, then tensor
    while math.prod(out) > limit:
        big = max(order, key=lambda i: (out[i], -order.index(i)))
        if out[big] <= 2:
            raise AssertionError(f"mesh {sizes} cannot shrink to {limit} devices keeping every axis > 1")
        out[big] //= 2
    return tuple(out)


def shrink(cfg) -> list[str]:
    """``--config.`` overrides turning ``cfg`` (a full-size, validated config) into the tiny stand-in."""
    data, tensor, pipeline, expert = shrunk_mesh((cfg.mesh.data, cfg.mesh.tensor, cfg.mesh.pipeline, cfg.mesh.expert))
    virtual = cfg.parallel.virtual_stages if pipeline > 1 else 1
    if pipeline > 1:
        micro = pipeline
    else:
        micro = 2 if cfg.parallel.microbatches > 1 else 1
    heads = 2 * tensor
    kv = heads if cfg.model.num_kv_heads == cfg.model.num_heads else tensor
    values = {
        "mesh.data": data,
        "mesh.tensor": tensor,
        "mesh.pipeline": pipeline,
        "mesh.expert": expert,
        "parallel.virtual_stages": virtual,
        "parallel.microbatches": micro,
        "train.global_batch": micro * data * expert,
        "train.seq_len": 16,
        "model.embed_dim": 32,
        "model.num_heads": heads,
        "model.num_kv_heads": kv,
        "model.head_dim": 8,
        "model.mlp_dim": 64,
        "model.vocab_size": 128,
        "model.max_seq_len": 32,
        "model.num_layers": pipeline * virtual if pipeline > 1 else 1,
        "model.compute_dtype": "float32",
        "model.param_dtype": "float32",
        "train.init_from": "",
        # fp16 recipes' loss scale does nothing in float32: back to the defaults (validation refuses it set)
        **{f"train.loss_scale.{k}": v for k, v in default_config().train.loss_scale.items()},
    }
    if cfg.model.name == "deepseek_v3":  # MLA's dims, smaller experts, one dense layer before one MoE layer
        values |= {
            "model.qk_nope_head_dim": 4,
            "model.qk_rope_head_dim": 4,
            "model.v_head_dim": 8,
            "model.kv_lora_rank": 16,
            "model.q_lora_rank": 16 if cfg.model.q_lora_rank else 0,
            "model.moe_mlp_dim": 16,
            "model.shared_expert_dim": 16 * (cfg.model.shared_expert_dim // cfg.model.moe_mlp_dim),
            "model.num_layers": 2,
            "model.first_dense_layers": 1 if cfg.model.first_dense_layers else 0,
        }
    if cfg.model.attention_mask == "block_causal":  # the separator inside the shrunk vocabulary
        values["model.eos_token_id"] = 2
    return [f"--config.{k}={v}" for k, v in values.items()]


def layout_key(cfg) -> tuple:
    """What decides the compiled step: mesh, ZeRO, pipeline, batch split, recompute, model family."""
    m = cfg.model
    return (
        cfg.mesh.data,
        cfg.mesh.tensor,
        cfg.mesh.pipeline,
        cfg.mesh.expert,
        cfg.parallel.zero_stage,
        cfg.parallel.sequence_parallel,
        cfg.parallel.pipeline_schedule if cfg.mesh.pipeline > 1 else "-",
        cfg.parallel.virtual_stages,
        cfg.parallel.microbatches,
        cfg.parallel.recompute,
        m.mlp_activation,
        m.norm,
        m.position,
        m.tie_embeddings,
        m.num_kv_heads < m.num_heads,
        m.num_experts > 0,
    )


SLOW = bool(os.environ.get("JAXPAR_SLOW"))


def features(key: tuple) -> set[str]:
    """The code paths a layout exercises, for the covering subset that runs by default."""
    data, tensor, pipeline, expert, zero, sp, schedule, virtual, micro, remat, act, norm, pos, tie, gqa, moe = key
    out = {f"zero:{zero}", f"remat:{remat}", f"mlp:{act}", f"norm:{norm}", f"position:{pos}", f"tied:{tie}"}
    out |= {f"zero:{zero}/tensor" if tensor > 1 else f"zero:{zero}/no tensor"}
    out |= {f"zero:{zero}/pipeline", f"schedule:{schedule}"} if pipeline > 1 else {f"zero:{zero}/no pipeline"}
    out |= {"sequence_parallel"} if sp else set()
    out |= {"gqa"} if gqa else set()
    out |= {"moe"} if moe else set()
    out |= {"accumulation"} if micro > 1 and pipeline == 1 else set()
    return out


def _port(recipe: str, out: pathlib.Path) -> None:
    argv = ["port", recipe.split("/")[0], str(FIX / recipe), *RECIPES[recipe], "-o", str(out)]
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    assert code == 0, f"jaxpar {' '.join(argv)} exited {code}"


def _config_path(spec: str) -> str:
    return str(ROOT / "configs" / spec)


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> set[tuple]:
    """Layout keys that train one step this session: all of them (JAXPAR_SLOW=1) or a greedy cover of
    every feature (default). Porting and loading everything takes about a second."""
    keys: list[tuple] = []
    folder = tmp_path_factory.mktemp("plan")
    for i, recipe in enumerate(sorted(RECIPES)):
        _port(recipe, folder / f"r{i}.py")
        full = load_config(str(folder / f"r{i}.py"))
        keys.append(layout_key(load_config(str(folder / f"r{i}.py"), shrink(full))))
    for spec in SPECS:
        keys.append(layout_key(load_config(_config_path(spec), shrink(load_config(_config_path(spec))))))
    if SLOW:
        return set(keys)
    chosen: set[tuple] = set()
    covered: set[str] = set()
    candidates = sorted(set(keys), key=str)  # deterministic tie-break
    while True:
        best = max(candidates, key=lambda k: len(features(k) - covered))
        if not features(best) - covered:
            return chosen
        chosen.add(best)
        covered |= features(best)


_RUNS: dict[tuple, dict] = {}


def _check(cfg, plan: set[tuple]) -> None:
    """Train one step of ``cfg`` if its layout is in ``plan`` (once per layout); else build its Setup and
    check that every feature of its layout is exercised by a layout in the plan."""
    n = ParallelLayout.from_config(cfg).devices
    assert n <= DEVICES
    key = layout_key(cfg)
    if key not in plan:
        make_setup(cfg)  # validates, shards, guards
        missing = features(key) - set().union(*(features(k) for k in plan))
        assert not missing, f"{missing} run nowhere by default; the plan must cover them"
        return
    if key not in _RUNS:
        history, _, _ = run_steps(cfg, 1)
        _RUNS[key] = history[0]
    metrics = _RUNS[key]
    assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    # a fresh model predicts ~uniformly: loss ~ ln(vocab); a loss summed or averaged wrongly is far off
    assert abs(metrics["loss"] - math.log(cfg.model.vocab_size)) < 0.1, metrics
    assert metrics["skipped"] == 0


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_ported_recipe_file_loads_and_trains_one_step(recipe, plan, tmp_path):
    out = tmp_path / "ported.py"
    _port(recipe, out)
    full = load_config(str(out))  # the written file loads and validates at full size
    cfg = load_config(str(out), shrink(full))
    kept = (
        "parallel.zero_stage",
        "parallel.sequence_parallel",
        "parallel.pipeline_schedule",
        "parallel.virtual_stages",
        "parallel.recompute",
        "model.mlp_activation",
        "model.norm",
        "model.position",
        "model.tie_embeddings",
    )
    assert {k: cfg[k] for k in kept} == {k: full[k] for k in kept}
    assert [n > 1 for n in (cfg.mesh.data, cfg.mesh.tensor, cfg.mesh.pipeline)] == [
        n > 1 for n in (full.mesh.data, full.mesh.tensor, full.mesh.pipeline)
    ]
    _check(cfg, plan)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_approximate_stands_for_a_named_model_change(recipe, capsys):
    """Each recipe ported with --approximate is refused without it (exit 2, one line naming the change);
    the others port with exit 0 and the recipe's model."""
    argv = ["port", recipe.split("/")[0], str(FIX / recipe), *(a for a in RECIPES[recipe] if a != "--approximate")]
    assert ("--approximate" in RECIPES[recipe]) == (recipe in REFUSED)
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    if recipe not in REFUSED:
        assert code == 0 and "model: the recipe's" in out.splitlines()[-1], err
        return
    assert code == 2 and len(err.strip().splitlines()) == 1 and REFUSED[recipe] in err, err
    assert "pass --approximate" in err


def test_every_fixture_recipe_is_listed():
    # corpus/: verbatim public recipes with their own manifest (tests/test_recipe_corpus.py)
    files = {str(p.relative_to(FIX)) for p in FIX.glob("*/*") if p.is_file() and p.parent.name != "corpus"}
    unported = {f for f in files if "TEMPLATE" in f}  # not strict JSON: the port refuses it (tested elsewhere)
    assert files - unported == set(RECIPES)


@pytest.mark.parametrize("spec", SPECS)
def test_shipped_config_trains_one_step(spec, plan):
    full = load_config(_config_path(spec))
    _check(load_config(_config_path(spec), shrink(full)), plan)


@pytest.mark.parametrize(
    "sizes, want",
    [
        ((8, 1, 1), (8, 1, 1)),
        ((64, 1, 1), (8, 1, 1)),
        ((8, 8, 1), (2, 4, 1)),
        ((16, 8, 8), (2, 2, 2)),
        ((1, 8, 16), (1, 4, 2)),
        ((6, 1, 1), (4, 1, 1)),
        ((2, 4, 8), (2, 2, 2)),
        ((1, 1, 4, 8), (1, 1, 4, 2)),
    ],
)
def test_shrunk_mesh(sizes, want):
    assert shrunk_mesh(sizes) == want
