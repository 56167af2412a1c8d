"""A real Megatron recipe with ``--decoder-first-pipeline-num-layers`` ports and trains: Pai-Megatron-Patch's
Qwen3 launcher (tests/fixtures/recipes/corpus/megatron/pai_qwen3_run_mcore_qwen3.sh, alibaba/Pai-Megatron-Patch
examples/qwen3/run_mcore_qwen3.sh at 7a91081), MODEL_SIZE=8B (dense Qwen3, 36 layers) on PP 4 with
MP_PP0_LAYERS=6: 6 layers on the first stage, 10 on each of the other three. The arguments are the corpus row's
(expected.json), whose values were read from the recipe by hand.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os

import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.config import ConfigError, load_config
from jaxpar.layout import ParallelLayout
from jaxpar.port.megatron import port_megatron
from tests.helpers import ROOT, run_steps

CORPUS = ROOT / "tests" / "fixtures" / "recipes" / "corpus"
FILE = "megatron/pai_qwen3_run_mcore_qwen3.sh"
ROW = next(r for r in json.loads((CORPUS / "expected.json").read_text())["recipes"] if r["file"] == FILE)


def _port(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["port", *argv])
    return code, out.getvalue(), err.getvalue()


def _with(args: list[str], name: str, value: str) -> list[str]:
    """``args`` with ``--var name=...`` replaced by ``--var name=value``."""
    return [f"{name}={value}" if a.startswith(f"{name}=") else a for a in args]


def test_pai_qwen3_first_stage_split_arrives(tmp_path):
    out = tmp_path / "qwen3.py"
    code, printed, err = _port("megatron", str(CORPUS / FILE), *ROW["args"], "-o", str(out))
    assert code == 0, err
    assert "--decoder-first-pipeline-num-layers = 6 -> parallel.first_stage_layers" in printed
    assert "--qk-layernorm = true -> model.qk_norm, model.name" in printed
    assert "(training script)" not in printed and " unknown " not in printed
    cfg = load_config(str(out))  # loads and validates at full size
    assert (cfg.parallel.first_stage_layers, cfg.parallel.last_stage_layers) == (6, 0)
    assert ParallelLayout.from_config(cfg).stage_layer_counts(cfg.model.num_layers) == (6, 10, 10, 10)
    assert (cfg.model.name, cfg.model.qk_norm, cfg.model.vocab_size) == ("qwen3", True, 151936)
    assert (cfg.mesh.data, cfg.mesh.pipeline, cfg.parallel.zero_stage, cfg.parallel.microbatches) == (2, 4, 1, 16)


@pytest.mark.skipif(
    os.environ.get("JAXPAR_SLOW") != "1",
    reason="JAXPAR_SLOW=1: ~10 s of compile (uneven stages train in tests/test_uneven_stages.py)",
)
def test_pai_qwen3_uneven_split_trains_one_step_shrunk(tmp_path):
    """The ported file, shrunk to tiny widths with the same mesh (data 2 x pipeline 4 = 8 CPU devices) and
    an uneven split of the same kind (first stage 2 layers, the others 1): one step, loss ~ ln(vocab)."""
    out = tmp_path / "qwen3.py"
    assert _port("megatron", str(CORPUS / FILE), *ROW["args"], "-o", str(out))[0] == 0
    tiny = {
        "model.num_layers": 5,
        "parallel.first_stage_layers": 2,
        "parallel.microbatches": 4,
        "train.global_batch": 8,
        "train.seq_len": 16,
        "model.embed_dim": 32,
        "model.num_heads": 4,
        "model.num_kv_heads": 2,
        "model.head_dim": 8,
        "model.mlp_dim": 64,
        "model.vocab_size": 128,
        "model.max_seq_len": 32,
        "model.compute_dtype": "float32",
        "model.param_dtype": "float32",
        "train.init_from": "",
    }
    cfg = load_config(str(out), [f"--config.{k}={v}" for k, v in tiny.items()])
    layout = ParallelLayout.from_config(cfg)
    assert (layout.devices, layout.stage_layer_counts(5)) == (8, (2, 1, 1, 1))
    assert (cfg.model.name, cfg.model.qk_norm, cfg.parallel.zero_stage) == ("qwen3", True, 1)
    history, _, _ = run_steps(cfg, 1)
    loss = history[0]["loss"]
    assert np.isfinite(history[0]["grad_norm"]) and history[0]["grad_norm"] > 0
    assert abs(loss - math.log(128)) < 0.1, loss


def test_pai_script_other_than_mmap_pretraining_is_refused_by_name():
    """MP_DATASET_TYPE=raw makes the script pass --dataset JSON-SFT: not Megatron's GPTDataset."""
    code, _, err = _port("megatron", str(CORPUS / FILE), *_with(ROW["args"], "MP_DATASET_TYPE", "raw"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "(training script) = pretrain_qwen.py" in err and "--dataset MMAP" in err
    assert "given: --patch-tokenizer-type Qwen3Tokenizer, --dataset JSON-SFT, --train-mode pretrain" in err


def test_unset_variable_after_a_layout_flag_is_asked_for():
    """SP=true with TP=1 takes neither branch of the script's `if`, so $sp_option is never assigned; its
    marker follows --use-distributed-optimizer. Without --var sp_option the port names it (before this, the
    flag read as unresolved and ZeRO-0 was written while the report said ZeRO-1)."""
    pairs = zip(ROW["args"][::2], ROW["args"][1::2])
    args = [word for pair in pairs if pair != ("--var", "sp_option=") for word in pair]
    assert len(args) == len(ROW["args"]) - 2
    code, _, err = _port("megatron", str(CORPUS / FILE), *args)
    assert code == 2, err
    assert "unresolved shell variables: sp_option (not set; used by --use-distributed-optimizer)" in err


QWEN_BLOCK = (
    "torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 4 --hidden-size 256 --num-attention-heads 4 "
    "--seq-length 512 --max-position-embeddings 512 --micro-batch-size 1 --global-batch-size 8 --lr 1e-4 "
    "--train-iters 10 --vocab-size 1000 --tokenizer-type NullTokenizer --disable-bias-linear --swiglu "
    "--normalization RMSNorm --position-embedding-type rope --qk-layernorm"
)


def test_qk_layernorm_in_the_qwen3_blocks_maps_and_elsewhere_is_a_model_change():
    cfg, report = port_megatron(QWEN_BLOCK + "\n", approximate=False)
    assert (cfg.model.name, cfg.model.qk_norm) == ("qwen3", True) and not report.model_changes
    moe = QWEN_BLOCK + " --num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01"
    cfg, report = port_megatron(moe + "\n", approximate=False)
    assert (cfg.model.name, cfg.model.qk_norm, cfg.model.num_experts) == ("qwen3_moe", True, 4)
    with pytest.raises(ConfigError, match="--qk-layernorm = true: .*qwen3 and qwen3_moe blocks only"):
        port_megatron(QWEN_BLOCK.replace("--normalization RMSNorm", "") + "\n", approximate=False)
    shared = moe + " --moe-shared-expert-intermediate-size 64\n"
    with pytest.raises(ConfigError, match="--qk-layernorm = true: .*no shared expert"):
        port_megatron(shared, approximate=False)


def test_pai_qwen3_moe_a3b_ports_with_its_first_stage_split(tmp_path):
    """MODEL_SIZE=A3B (Qwen3-30B-A3B: 48 layers, 128 experts of 768, top 8, aux loss 0.001) with
    MP_PP0_LAYERS=9: (48 - 9) % 3 = 0, so 9 layers on the first stage and 13 on each other."""
    args = _with(_with(ROW["args"], "2", "A3B"), "MP_PP0_LAYERS", "9")
    out = tmp_path / "a3b.py"
    code, _, err = _port("megatron", str(CORPUS / FILE), *args, "-o", str(out))
    assert code == 0, err
    cfg = load_config(str(out))
    assert (cfg.model.name, cfg.model.qk_norm, cfg.model.num_experts, cfg.model.experts_per_token) == (
        "qwen3_moe",
        True,
        128,
        8,
    )
    assert (cfg.model.mlp_dim, cfg.model.num_kv_heads, cfg.model.moe_aux_loss_coeff) == (768, 4, 0.001)
    assert ParallelLayout.from_config(cfg).stage_layer_counts(48) == (9, 13, 13, 13)
