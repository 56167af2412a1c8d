"""``jaxpar port``'s promise: an exit 0 means the config trains the recipe's model.

Every importer ends in exit 2 with one line naming the family / flavor / setting and the fix when
jaxpar would train another model (an unknown family or flavor, MoE as a dense backbone, ALiBi, MLA,
a shape the recipe does not state), unless ``--approximate``: then it exits 0, the report lists
each model change first and closes with a summary line. Precision-only changes (GradScaler fp16 as bf16,
fp8 as bf16) stay approximated rows with exit 0 (tests/test_port_quiet_defaults.py).
"""

from __future__ import annotations

import json

import pytest

from jaxpar.cli import main
from jaxpar.config import ConfigError, load_config
from jaxpar.models.inventory import count_params
from jaxpar.port.recipe import port_recipe
from jaxpar.port.report import SHAPE_FIELDS
from jaxpar.port.torchtitan import port_torchtitan
from tests.port_recipes import FIXTURES

CORPUS = FIXTURES / "corpus"
TT = FIXTURES / "torchtitan"
HF_LLAMA = {  # a small LLaMA config.json, as Hugging Face writes it
    "model_type": "llama",
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 1408,
    "vocab_size": 32000,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
}


def port(capsys, *argv: str) -> tuple[int, str, str]:
    """``jaxpar port ARGV``: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = main(["port", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, *argv: str) -> str:
    """The one-line error of a port that must exit 2 (no traceback, nothing written to stdout)."""
    code, out, err = port(capsys, *argv)
    assert code == 2 and out == "", (code, out, err)
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err.strip()


def approximated(capsys, *argv: str, first: tuple[str, ...]) -> str:
    """A port with --approximate: exit 0, the model changes ``first`` are the report's first rows, in order,
    and the closing line says the model changed."""
    code, out, err = port(capsys, *argv, "--approximate")
    assert code == 0, err
    rows = out.splitlines()[1 : 1 + len(first)]
    assert [r.split(" = ")[0].removeprefix("  MODEL CHANGE ").strip() for r in rows] == list(first), out
    assert all(r.startswith("  MODEL CHANGE ") for r in rows)
    assert "MODEL CHANGE" not in out.splitlines()[1 + len(first)]
    closing = [line for line in out.splitlines() if "MODEL CHANGED" in line]
    assert len(closing) == 1 and f"MODEL CHANGED ({len(first)}: {', '.join(first)})" in closing[0], out
    assert "does NOT train the recipe's model" in closing[0]
    return out


# --------------------------------------------------------------------------- torchtitan


def _toml(tmp_path, name: str, flavor: str, extra: str = "") -> str:
    path = tmp_path / "job.toml"
    path.write_text(
        f'[model]\nname = "{name}"\nflavor = "{flavor}"\n{extra}\n'
        "[training]\nlocal_batch_size = 2\nseq_len = 1024\nsteps = 10\n"
        "[parallelism]\ndata_parallel_shard_degree = -1\n"
    )
    return str(path)


def test_torchtitan_moe_family_is_refused_before_the_world_size(capsys):
    fixture = str(TT / "deepseek_v3_moe_ep8.toml")
    # the 16B flavor is model.name=deepseek_v3 with document-masked attention (model.attention_mask): it ports
    # as it is, so the only thing missing is the world size
    err = refused(capsys, "torchtitan", fixture)
    assert "the world size is needed" in err
    code, out, err = port(capsys, "torchtitan", fixture, "--world-size", "16")
    assert code == 0 and "MODEL CHANGE" not in out, err
    assert "model.flavor = 16B -> model.*" in out
    assert "(attention mask) = block_causal -> model.attention_mask" in out
    assert "(document separator) = deepseek-moe-16b-base -> model.eos_token_id  (EOS id 100001" in out
    err = refused(capsys, "torchtitan", str(TT / "llama4_moe_pp4_tp8.toml"), "--world-size", "64")
    assert "model.name = llama4" in err and "shared expert" in err  # not the toy model's heads


@pytest.mark.parametrize(
    "name, flavor, names",
    [
        ("llama3", "3B", ["model.flavor = 3B", "llama3 flavor '3B' is not in torchtitan's", "use one of the flavors"]),
        ("llama2", "debugmodel_moe", ["model.flavor = debugmodel_moe", "llama2 flavor"]),
        ("mamba2", "130M", ["model.name = mamba2", "model family 'mamba2' is not one jaxpar ports"]),
    ],
)
def test_torchtitan_unknown_family_or_flavor_is_refused(capsys, tmp_path, name, flavor, names):
    job = _toml(tmp_path, name, flavor, 'tokenizer_path = "t.model"' if name == "llama2" else "")
    err = refused(capsys, "torchtitan", job, "--world-size", "8")
    for text in names:
        assert text in err, err
    source = "model.flavor" if name != "mamba2" else "model.name"
    approximated(capsys, "torchtitan", job, "--world-size", "8", first=(source,))


def test_torchtitan_llama3_ports_with_scaled_rope(capsys, tmp_path):
    """torchtitan's current Llama 3 (since 5bbda42) rotates with Llama 3.1's scaled RoPE: the port sets
    model.rope_scaling=llama3 with torchtitan's RoPEScalingArgs and exits 0 with the recipe's model; the
    2024 schema's Llama 3 (a99d2e5) stays plain RoPE."""
    fixture = str(TT / "llama3_8b_32gpu.toml")
    code, out, err = port(capsys, "torchtitan", fixture, "--world-size", "32", "-o", str(tmp_path / "a.py"))
    assert code == 0 and "MODEL CHANGE" not in out and "\n  model: the recipe's; " in out, err
    assert "(rope scaling) = Llama 3.1 -> model.rope_scaling" in out and "5bbda42" in out
    m = load_config(str(tmp_path / "a.py")).model
    assert (m.rope_scaling, m.rope_scaling_factor, m.rope_low_freq_factor, m.rope_high_freq_factor) == (
        "llama3",
        8.0,
        1.0,
        4.0,
    )
    assert (m.rope_original_max_seq_len, m.rope_theta, m.num_layers, m.mlp_dim) == (8192, 500000.0, 32, 14336)
    # a torchtitan before 5bbda42 rotated unscaled: the note says how to port for it
    code, _, err = port(capsys, "torchtitan", fixture, "--world-size", "32", "--set", "model.rope_scaling=none")
    assert code == 0, err
    cfg, report = port_torchtitan(CORPUS / "torchtitan" / "2024_llama3_8b.toml", world_size=64)
    assert cfg.model.rope_scaling == "none" and report.find("(rope scaling)") is None
    assert "plain RoPE" in report.find("model.flavor").note and not report.model_changes


def test_torchtitan_llama3_debugmodel_shapes(capsys, tmp_path):
    """The debug flavors are torchtitan's real shapes: 238fa99's (6 layers, vocabulary 2048) and a99d2e5's
    (8 layers, the test tokenizer's 2000 + 256 = 2256); the 2024 one ports exactly."""
    cfg, report = port_torchtitan(_toml(tmp_path, "llama3", "debugmodel"), world_size=8)
    m = cfg.model
    assert (m.num_layers, m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim, m.vocab_size) == (
        6,
        256,
        16,
        16,
        16,
        768,
        2048,
    )
    assert (m.rope_theta, m.rope_scaling) == (500000.0, "llama3") and not report.model_changes
    job = _toml(tmp_path, "llama3", "debugmodel_flex_attn")
    err = refused(capsys, "torchtitan", job, "--world-size", "8")
    # no hf_assets_path: the flavor's document separator is unknown, named with its fix
    assert "(document separator) = (no model.hf_assets_path): flavor debugmodel_flex_attn" in err
    assert "--set model.eos_token_id=" in err and "more model change" not in err
    code, out, err = port(
        capsys,
        "torchtitan",
        job,
        "--world-size",
        "8",
        "--set",
        "model.attention_mask=block_causal",
        "--set",
        "model.eos_token_id=2",
    )
    assert code == 0 and "MODEL CHANGE" not in out, err
    code, out, err = port(
        capsys, "torchtitan", str(CORPUS / "torchtitan" / "2024_debug_model.toml"), "--world-size", "8"
    )
    assert code == 0 and "MODEL CHANGE" not in out and "model: the recipe's" in out.splitlines()[-1], err
    cfg, report = port_torchtitan(CORPUS / "torchtitan" / "2024_debug_model.toml", world_size=8)
    m = cfg.model
    assert (m.num_layers, m.embed_dim, m.num_heads, m.mlp_dim, m.vocab_size, m.rope_theta) == (
        8,
        256,
        16,
        768,
        2256,
        500000.0,
    )
    assert "test tokenizer" in report.find("model.flavor").note and not report.model_changes


def test_torchtitan_2024_schema_degrees_in_training_are_read():
    """The 2024 schema kept tensor_parallel_degree in [training]: TP 8 x FSDP 16 on 128 GPUs, not FSDP 128."""
    cfg, report = port_torchtitan(CORPUS / "torchtitan" / "2024_llama3_405b.toml", world_size=128)
    assert (cfg.mesh.data, cfg.mesh.tensor, cfg.train.global_batch, cfg.optim.warmup_steps) == (16, 8, 32, 599)
    row = report.find("training.tensor_parallel_degree")
    assert row.status == "mapped" and row.target == "mesh.tensor" and "2024 schema" in row.note
    assert report.find("training.warmup_steps").target == "optim.warmup_steps"
    assert not report.by_status("unknown") and not report.model_changes


# --------------------------------------------------------------------------- Megatron


def _args(tmp_path, *flags: str, script: str = "pretrain_gpt.py") -> str:
    path = tmp_path / "train.sh"
    body = [
        "--num-layers 4",
        "--hidden-size 256",
        "--num-attention-heads 4",
        "--seq-length 512",
        "--max-position-embeddings 512",
        "--micro-batch-size 1",
        "--global-batch-size 8",
        "--lr 1e-4",
        "--train-iters 10",
        "--vocab-size 1000",
        "--tokenizer-type NullTokenizer",
        "--bf16",
        *flags,
    ]
    path.write_text(f"torchrun --nproc_per_node 8 {script} \\\n    " + " \\\n    ".join(body) + "\n")
    return str(path)


def test_megatron_other_training_scripts_are_refused_first(capsys, tmp_path):
    err = refused(capsys, "megatron", _args(tmp_path, "--disable-bias-linear", script="pretrain_bert.py"))
    assert "(training script) = pretrain_bert.py: pretrain_bert.py trains BERT" in err
    t5 = open(_args(tmp_path, "--disable-bias-linear", script="pretrain_t5.py")).read()
    (tmp_path / "t5.sh").write_text(t5.replace("--num-layers", "--encoder-num-layers"))
    err = refused(capsys, "megatron", str(tmp_path / "t5.sh"))
    assert "pretrain_t5.py trains T5 (an encoder-decoder)" in err  # not "--num-layers is missing"


@pytest.mark.parametrize(
    "flags, source, says",
    [
        (["--position-embedding-type alibi"], "--position-embedding-type", "alibi positions"),
        (["--position-embedding-type rope", "--rotary-percent 0.5"], "--rotary-percent", "RoPE on 0.5 of each head"),
        (["--multi-latent-attention", "--q-lora-rank 64"], "--multi-latent-attention", "multi-head latent attention"),
        (["--mtp-num-layers 1"], "--mtp-num-layers", "multi-token prediction"),
        (["--qk-layernorm"], "--qk-layernorm", "QK layer norm"),
        (["--normalization LayerNorm1P"], "--normalization", "layernorm1p normalization"),
        (["--softmax-type learnable"], "--softmax-type", "attention sinks"),
        (["--window-size 127,0"], "--window-size", "sliding-window attention"),
        (["--quick-geglu", "--glu-linear-offset 1.0"], "--quick-geglu", "quick-GeLU gated MLP"),
        (["--rope-type yarn"], "--rope-type", "yarn RoPE"),
        ([], "--add-bias-linear (default)", "Megatron adds a bias to every linear layer"),
    ],
)
def test_megatron_model_changes_are_refused(capsys, tmp_path, flags, source, says):
    bias = [] if source == "--add-bias-linear (default)" else ["--disable-bias-linear"]
    recipe = _args(tmp_path, *bias, *flags)
    err = refused(capsys, "megatron", recipe)
    assert f"port megatron: {source}" in err and says in err and "pass --approximate" in err, err
    approximated(capsys, "megatron", recipe, first=(source,))


def test_megatron_unknown_vocabulary_is_resolved_by_set(capsys, tmp_path):
    recipe_path = tmp_path / "hf.sh"
    text = open(_args(tmp_path, "--disable-bias-linear", "--tokenizer-model meta/llama")).read()
    recipe_path.write_text(text.replace("--vocab-size 1000", "").replace("NullTokenizer", "HuggingFaceTokenizer"))
    err = refused(capsys, "megatron", str(recipe_path))
    assert "(vocabulary) = HuggingFaceTokenizer" in err and "--set model.vocab_size=N" in err
    code, out, err = port(capsys, "megatron", str(recipe_path), "--set", "model.vocab_size=128256", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["config"]["model"]["vocab_size"] == 128256 and doc["report"]["model_changes"] == []
    assert doc["report"]["closing"].startswith("model: the recipe's")


def test_megatron_document_mask_is_resolved_by_set(capsys, tmp_path):
    """--reset-attention-mask masks documents only where Megatron's backend applies the dataloader's mask (its
    local transformer; Transformer Engine ignores it): a model change whose fix names both answers, resolved
    by stating model.attention_mask (block_causal at NullTokenizer's end-of-document id = its --vocab-size)."""
    recipe = _args(tmp_path, "--disable-bias-linear", "--reset-attention-mask")
    err = refused(capsys, "megatron", recipe)
    assert "port megatron: --reset-attention-mask" in err and "NVIDIA/Megatron-LM#2357" in err
    assert "--set model.attention_mask=block_causal --set model.eos_token_id=" in err
    assert "--set model.attention_mask=causal" in err
    mask = ["--set", "model.attention_mask=block_causal", "--set", "model.eos_token_id=1000", "--json"]
    code, out, err = port(capsys, "megatron", recipe, *mask)
    assert code == 0, err
    doc = json.loads(out)
    model = doc["config"]["model"]
    assert (model["attention_mask"], model["eos_token_id"], model["vocab_size"]) == ("block_causal", 1000, 1024)
    assert doc["report"]["model_changes"] == [] and doc["report"]["closing"].startswith("model: the recipe's")
    code, out, err = port(capsys, "megatron", recipe, "--set", "model.attention_mask=causal", "--json")
    assert code == 0 and json.loads(out)["config"]["model"]["attention_mask"] == "causal", err


def test_megatron_moe_refusals_become_model_changes_with_approximate(capsys, tmp_path):
    recipe = _args(
        tmp_path,
        "--disable-bias-linear",
        "--swiglu",
        "--normalization RMSNorm",
        "--position-embedding-type rope",
        "--num-experts 4",
        "--moe-router-enable-expert-bias",
    )
    err = refused(capsys, "megatron", recipe)
    assert "--moe-router-enable-expert-bias: Megatron adds the bias to sigmoid scores only (here softmax)" in err
    out = approximated(capsys, "megatron", recipe, first=("--moe-router-enable-expert-bias",))
    assert "jaxpar's biased routing is sigmoid's" in out


# --------------------------------------------------------------------------- DeepSpeed and accelerate


def test_deepspeed_and_accelerate_need_the_model(capsys, tmp_path):
    ds = str(FIXTURES / "deepspeed" / "smoke_bf16_zero0.json")
    err = refused(capsys, "deepspeed", ds, "--world-size", "8")
    assert "(model): a DeepSpeed config does not describe the model" in err
    assert "--model-config CONFIG.json" in err and "--set each of " + ", ".join(SHAPE_FIELDS) in err
    fsdp = str(FIXTURES / "fsdp" / "accelerate_fsdp_full_shard.yaml")
    err = refused(capsys, "fsdp", fsdp)
    assert "(model): an accelerate config does not describe the model" in err
    approximated(capsys, "fsdp", fsdp, first=("(model)",))
    config = tmp_path / "config.json"
    config.write_text(json.dumps(HF_LLAMA))
    for argv in (["deepspeed", ds, "--world-size", "8"], ["fsdp", fsdp]):
        out = tmp_path / "out.py"
        code, printed, err = port(capsys, *argv, "--model-config", str(config), "-o", str(out), "--overwrite")
        assert code == 0 and "MODEL CHANGE" not in printed, err
        m = load_config(str(out)).model
        assert (m.num_layers, m.embed_dim, m.num_heads, m.num_kv_heads, m.mlp_dim, m.vocab_size) == (
            4,
            512,
            8,
            4,
            1408,
            32000,
        )
        assert "--model-config" in out.read_text() and "model: the recipe's" in out.read_text()
        assert m.rope_scaling == "none"
    # a Llama 3.1 config.json brings its scaled RoPE along
    llama31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config.write_text(json.dumps({**HF_LLAMA, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **llama31}}))
    out = tmp_path / "out31.py"
    code, printed, err = port(
        capsys, "deepspeed", ds, "--world-size", "8", "--model-config", str(config), "-o", str(out)
    )
    assert code == 0 and "MODEL CHANGE" not in printed, err
    m = load_config(str(out)).model
    assert (m.rope_scaling, m.rope_scaling_factor, m.rope_original_max_seq_len, m.rope_theta) == (
        "llama3",
        8.0,
        8192,
        5e5,
    )
    sets = [
        x for f, v in zip(SHAPE_FIELDS, (4, 512, 8, 4, 64, 1408, 32000), strict=True) for x in ("--set", f"{f}={v}")
    ]
    code, printed, err = port(capsys, "deepspeed", ds, "--world-size", "8", *sets[:-2])  # all but vocab_size
    assert code == 2 and "--set each of model.vocab_size, or pass --approximate" in err
    code, printed, err = port(capsys, "deepspeed", ds, "--world-size", "8", *sets)
    assert code == 0 and "MODEL CHANGE" not in printed, err
    err = refused(capsys, "megatron", _args(tmp_path, "--disable-bias-linear"), "--model-config", str(config))
    assert "a megatron recipe states its own model; drop --model-config" in err


def test_port_recipe_refuses_unless_approximate():
    fixture = str(FIXTURES / "fsdp" / "accelerate_fsdp_full_shard.yaml")
    with pytest.raises(ConfigError, match=r"port fsdp: \(model\)"):
        port_recipe("fsdp", fixture)
    cfg, report = port_recipe("fsdp", fixture, approximate=True)
    assert [e.source for e in report.model_changes] == ["(model)"] and report.ordered()[0].model
    assert report.to_dict()["entries"][0]["model_change"] and report.closing().startswith("MODEL CHANGED")
    assert count_params(cfg.model) > 0
