"""Recipe files for the importer tests: the project's own fixtures, plus an optional extra folder.

``tests/fixtures/recipes/{deepspeed,megatron,torchtitan,fsdp}`` hold hand-written recipes in the
shapes real projects ship (HF ``"auto"`` values, templates, shell-variable launch scripts, ...);
every importer test runs on them, so a plain clone runs every test.

Optional extra check: a folder of real upstream recipes laid out the same way -- ``$JAXPAR_EXTRA_RECIPES``,
or else ``../shared/recipes`` beside the repository when it exists -- adds its files to the generic
"every recipe ports or fails with one line" and "every key is reported" tests. This module is the only
place that knows about it; ``EXTRA_EXPECTED`` holds what those upstream files are known to do.
"""

from __future__ import annotations

import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "recipes"
EXTRA = pathlib.Path(os.environ.get("JAXPAR_EXTRA_RECIPES") or ROOT.parent / "shared" / "recipes")

_WORLD = r"world_size \(needed to split the batch"
# Known behaviour of the upstream files in the extra folder, with no side inputs: None = ports; else a regex of
# the one-line error. Files not listed may do either (checked: one line, no crash).
EXTRA_EXPECTED = {
    "deepspeed": {
        "DeepSpeed-docs__mics_zero3_rst_snippet_CONVERTED.json": None,
        "DeepSpeed-docs__zeropp_tutorial_snippet.json": None,
        "DeepSpeed-tests__test_pipe_config_dict_CONVERTED.json": _WORLD,
        "DeepSpeedExamples__imagenet_ds_fp16_z1_config.json": _WORLD,
        "DeepSpeedExamples__pipeline_parallelism_ds_config.json": _WORLD,
        "Megatron-DeepSpeed__offload_pp_ds_config_gpt_TEMPLATE.json": r"not strict JSON: placeholder\(s\) "
        "CONFIG_BATCH_SIZE, CONFIG_BF16_ENABLED, CONFIG_FP16_ENABLED, CONFIG_MBSIZE, LOG_INTERVAL",
        "bigscience-Megatron-DeepSpeed__tests_ds_config_bf16.json": _WORLD,
        "bigscience__tr11-176B-ml_ds_config_EXTRACTED.json": _WORLD,
        "hf-accelerate__tests_ds_config_zero3.json": r"bf16\.enabled .*fp16\.enabled .*optimizer\.params\.lr",
        "hf-accelerate__zero_stage2_config.json": r"scheduler\.params\.total_num_steps",
        "hf-accelerate__zero_stage3_offload_config.json": r"optimizer\.params\.weight_decay",
        "stanford_alpaca__configs_default_offload_opt_param.json": r"optimizer\.params\.betas",
    },
    "megatron": {
        "NVIDIA-Megatron-LM__examples_academic_paper_scripts_sc21_CONFIG.args": r"unresolved shell variables: TP .*PP .*MBS .*GBS .*WORLD_SIZE .*NLS .*HS .*NAH ",
        "NVIDIA-Megatron-LM__examples_gpt3_train_gpt3_175b_distributed.args": r"world size 8 \(--nproc_per_node 8 \* --nnodes 1\) is not divisible by TP\*PP\*CP = 8\*16\*1 = 128",
        "NVIDIA-Megatron-LM__examples_llama_train_llama3_8b_h100_fp8.args": None,
        "NVIDIA-Megatron-LM__examples_mixtral_train_mixtral_8x7b_distributed.args": r"--expert-model-parallel-size 8 does not divide DP",
        "bigscience__train_tr11-176B-ml_tr11-176B-ml.args": r"NNODES \(needs SLURM_NNODES; used by --nnodes\)",
        "microsoft-Megatron-DeepSpeed__examples_deepspeed_pretrain_llama2_distributed.args": None,
    },
}
# world sizes the extra torchtitan presets were written for (their comments); others: 64
EXTRA_WORLD = {
    "llama3_8b.toml": 64,
    "llama3_70b.toml": 64,
    "llama3_405b.toml": 128,
    "llama4_17bx128e.toml": 64,
    "deepseek_v3_16b.toml": 8,
    "DeepSpeed-tests__test_pipe_config_dict_CONVERTED.json": 4,
}


def recipe_params(
    kind: str, suffixes: tuple[str, ...], fixture_expected: dict | None = None, keep=lambda name: True
) -> list:
    """``pytest.param(path, expected)`` for every ``kind`` recipe: the fixtures (ids ``fixtures/NAME``),
    then the extra folder's files when it exists (ids ``extra/NAME``). ``expected``: None (ports), a
    regex of its one-line error, or "any"."""
    params = []
    for origin, folder, table in (
        ("fixtures", FIXTURES, fixture_expected or {}),
        ("extra", EXTRA, EXTRA_EXPECTED.get(kind, {})),
    ):
        path = folder / kind
        if not path.is_dir():
            continue
        for file in sorted(p for p in path.iterdir() if p.suffix in suffixes and keep(p.name)):
            expected = (
                table[file.name]
                if origin == "fixtures" and fixture_expected is not None
                else table.get(file.name, "any")
            )  # a fixture without an expectation is a KeyError at collection
            params.append(pytest.param(file, expected, id=f"{origin}/{file.name}"))
    return params
