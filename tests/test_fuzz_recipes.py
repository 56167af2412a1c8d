"""Fuzz: mutated recipe files of each importer (DeepSpeed JSON, Megatron arguments, torchtitan TOML,
accelerate FSDP YAML). Each mutation must be refused in one line (a ConfigError, exit 2 on the
command line) or port to a config that validates; never a traceback or a hang.

Mutations: byte-level damage (truncation, binary garbage, flipped bytes, NUL and non-UTF-8 bytes),
every leaf value replaced by a value of another type or an absurd size, and pathological nesting.
The seeds are small recipes written here, so the suite needs no files outside the repository; each
seed's model is one jaxpar trains (a bias-free Megatron GPT, torchtitan's Qwen3 debugmodel, and for
DeepSpeed and accelerate, which do not describe the model, its shape given with --set as a user
would), so the seeds port with exit 0 and every mutation reaches the importer's checks.
"""

from __future__ import annotations

import json
import random
import tomllib

import pytest
import yaml

from jaxpar.config import validate
from jaxpar.port.recipe import port_recipe
from tests import fuzzkit

SEEDS = {
    "deepspeed": json.dumps(
        {
            "train_batch_size": 32,
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 1.0,
            "steps_per_print": 10,
            "bf16": {"enabled": True},
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
            },
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 10, "total_num_steps": 100},
            },
            "zero_optimization": {"stage": 1},
        },
        indent=2,
    ),
    "megatron": "\n".join(
        [
            "# shell variables",
            "GPUS_PER_NODE=8",
            "NUM_NODES=1",
            "# flags",
            "--nproc_per_node $GPUS_PER_NODE",
            "--nnodes $NUM_NODES",
            "--num-layers 4",
            "--hidden-size 128",
            "--num-attention-heads 4",
            "--seq-length 256",
            "--max-position-embeddings 256",
            "--micro-batch-size 2",
            "--global-batch-size 16",
            "--train-iters 100",
            "--lr 3e-4",
            "--min-lr 3e-5",
            "--lr-decay-style cosine",
            "--lr-warmup-iters 10",
            "--weight-decay 0.1",
            "--adam-beta1 0.9",
            "--adam-beta2 0.95",
            "--clip-grad 1.0",
            "--bf16",
            "--tensor-model-parallel-size 2",
            "--pipeline-model-parallel-size 1",
            "--vocab-size 256",
            "--disable-bias-linear",
            "",
        ]
    ),
    "torchtitan": "\n".join(
        [
            "[model]",
            'name = "qwen3"',
            'flavor = "debugmodel"',
            "",
            "[optimizer]",
            'name = "AdamW"',
            "lr = 3e-4",
            "eps = 1e-8",
            "",
            "[lr_scheduler]",
            "warmup_steps = 10",
            "",
            "[training]",
            "local_batch_size = 2",
            "seq_len = 256",
            "max_norm = 1.0",
            "steps = 100",
            "",
            "[parallelism]",
            "data_parallel_replicate_degree = 1",
            "data_parallel_shard_degree = -1",
            "tensor_parallel_degree = 2",
            "pipeline_parallel_degree = 1",
            "context_parallel_degree = 1",
            "",
        ]
    ),
    "fsdp": "\n".join(
        [
            "distributed_type: FSDP",
            "mixed_precision: bf16",
            "num_processes: 8",
            "fsdp_config:",
            "  fsdp_sharding_strategy: FULL_SHARD",
            "  fsdp_activation_checkpointing: false",
            "  fsdp_offload_params: false",
            "",
        ]
    ),
}
SUFFIX = {"deepspeed": ".json", "megatron": ".args", "torchtitan": ".toml", "fsdp": ".yaml"}
WORLD = {"deepspeed": 8, "megatron": None, "torchtitan": 8, "fsdp": None}
# DeepSpeed JSON and accelerate YAML do not describe the model: the user gives its shape (--set)
MODEL = {
    "model.num_layers": "2",
    "model.embed_dim": "64",
    "model.num_heads": "4",
    "model.num_kv_heads": "4",
    "model.head_dim": "16",
    "model.mlp_dim": "128",
    "model.vocab_size": "256",
}
WRONG = ["abc", -3, 0, 10**30, 1.5e308, None, True, [1, 2], {"k": 1}, "\u00b2", ""]


def _port(kind: str, path) -> object:
    fields = MODEL if kind in ("deepspeed", "fsdp") else None
    cfg, report = port_recipe(kind, str(path), world_size=WORLD[kind], fields=fields)
    validate(cfg)  # whatever ports must validate: no silently accepted bad value
    return cfg, report


def _check(kind: str, family: str, path) -> None:
    message, _ = fuzzkit.expect_refused_or_ok(family, _port, kind, path)
    assert message is None or len(message) < 2000


@pytest.mark.parametrize("kind", sorted(SEEDS))
def test_seed_recipes_port(kind, tmp_path):
    path = tmp_path / f"seed{SUFFIX[kind]}"
    path.write_text(SEEDS[kind])
    cfg, report = _port(kind, path)
    assert report.entries and not report.model_changes
    assert "model: the recipe's" in report.closing()


@pytest.mark.parametrize("kind", sorted(SEEDS))
def test_damaged_bytes(kind, tmp_path):
    data = SEEDS[kind].encode()
    for name, damaged in fuzzkit.mutations(data, random.Random(f"{fuzzkit.SEED}:{kind}")).items():
        path = tmp_path / f"{name}{SUFFIX[kind]}"
        path.write_bytes(damaged)
        _check(kind, f"recipe bytes ({kind})", path)


def _leaves(tree, prefix=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, (*prefix, k))
    else:
        yield prefix


def _replace(tree, path, value):
    tree = json.loads(json.dumps(tree))
    node = tree
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return tree


def _toml(tree: dict) -> str:
    """A TOML writer for the seed's shape (tables of scalars and lists); values TOML cannot hold
    (None, nested dicts in a table) are written as strings."""

    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v) if v == v and abs(v) != float("inf") else '"nan"'
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(str(v))

    lines = []
    for table, body in tree.items():
        if not isinstance(body, dict):
            lines.append(f"{table} = {value(body)}")
            continue
        lines.append(f"[{table}]")
        lines += [f"{k} = {value(v)}" for k, v in body.items()]
    return "\n".join(lines) + "\n"


def _structured_cases(kind: str) -> list[tuple[str, str]]:
    """(label, file text) with each leaf replaced by each WRONG value."""
    if kind == "megatron":
        lines = SEEDS[kind].splitlines()
        out = []
        for i, line in enumerate(lines):
            if line.startswith("--") and " " in line:
                flag = line.split(" ")[0]
                out += [
                    (f"{flag}={w!r}", "\n".join(lines[:i] + [f"{flag} {w}"] + lines[i + 1 :]))
                    for w in WRONG
                    if not isinstance(w, (dict, list)) and w is not None
                ]
            elif "=" in line:
                name = line.split("=")[0]
                out += [
                    (f"{name}={w!r}", "\n".join(lines[:i] + [f"{name}={w}"] + lines[i + 1 :]))
                    for w in WRONG
                    if isinstance(w, (int, str))
                ]
        return out
    tree = {"deepspeed": json.loads, "torchtitan": tomllib.loads, "fsdp": yaml.safe_load}[kind](SEEDS[kind])
    dump = {"deepspeed": json.dumps, "torchtitan": _toml, "fsdp": yaml.safe_dump}[kind]
    return [(f"{'.'.join(path)}={w!r}", dump(_replace(tree, path, w))) for path in _leaves(tree) for w in WRONG]


@pytest.mark.parametrize("kind", sorted(SEEDS))
def test_wrong_types_and_absurd_sizes(kind, tmp_path):
    cases = fuzzkit.sample(f"recipe values ({kind})", _structured_cases(kind), 40)
    for i, (label, text) in enumerate(cases):
        path = tmp_path / f"case{i}{SUFFIX[kind]}"
        path.write_text(text)
        try:
            _check(kind, f"recipe values ({kind})", path)
        except AssertionError as e:
            raise AssertionError(f"{kind} {label}: {e}") from None


@pytest.mark.parametrize("kind", sorted(SEEDS))
def test_pathological_nesting_and_size(kind, tmp_path):
    deep = {
        "deepspeed": "[" * 200000 + "]" * 200000,
        "torchtitan": "x = " + "[" * 100000 + "]" * 100000,
        "fsdp": "a: " + "[" * 100000 + "]" * 100000,
        "megatron": "--num-layers " + "(" * 100000,
    }[kind]
    huge_line = {
        "deepspeed": '{"k": "' + "x" * 2_000_000 + '"}',
        "torchtitan": "k = '" + "x" * 2_000_000 + "'",
        "fsdp": "k: " + "x" * 2_000_000,
        "megatron": "--lr " + "9" * 100000,
    }[kind]
    for name, text in (("deep", deep), ("huge", huge_line)):
        path = tmp_path / f"{name}{SUFFIX[kind]}"
        path.write_text(text)
        _check(kind, f"recipe structure ({kind})", path)
