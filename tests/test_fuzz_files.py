"""Fuzz: mutated HF weight files (for ``train.init_from``) and mutated training checkpoints (for
resume and ``jaxpar export``). Each mutation must be refused in one line (a ConfigError) or load
correctly; never a traceback, a hang, NaN weights reaching training, or a damaged checkpoint
silently exported.

Weights are written here from the expected tensor names and shapes (no model is built); the
checkpoints come from one tiny single-device model, saved twice (steps 1 and 2) and damaged in copies.
"""

from __future__ import annotations

import json
import pathlib
import random
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxpar.checkpoint import Checkpointer
from jaxpar.config import load_config
from jaxpar.port import weights
from jaxpar.port.export import export_checkpoint
from jaxpar.port.weights import check_hf_model
from tests import fuzzkit
from tests.helpers import TINY

SMALL = [
    "--config.mesh.data=1",
    "--config.mesh.tensor=1",
    "--config.model.vocab_size=64",
    "--config.model.embed_dim=32",
    "--config.model.num_layers=2",
    "--config.model.num_heads=2",
    "--config.model.num_kv_heads=2",
    "--config.model.head_dim=16",
    "--config.model.mlp_dim=64",
    "--config.model.max_seq_len=32",
    "--config.train.seq_len=32",
    "--config.train.global_batch=2",
    "--config.model.compute_dtype=float32",
]


def _small(*extra: str):
    return load_config(TINY, [*SMALL, *extra])


def _hf_tensors(model) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    leaves, _ = weights._leaves(model)
    return {name: rng.normal(0, 0.02, leaf.hf_shape).astype(np.float32) for leaf in leaves for name in leaf.names()}


def _write_hf(directory: pathlib.Path, tensors: dict[str, np.ndarray], model, shards: int = 1) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(weights.hf_config_from_model(model)))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
        return
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n] for n in part}, str(directory / file))
        weight_map |= dict.fromkeys(part, file)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _load(path: pathlib.Path, model) -> dict:
    check_hf_model(str(path), model)  # what port.weights.load_checked runs first
    return weights.load_hf(path, model)


def _tensor_cases(model) -> dict[str, dict[str, np.ndarray]]:
    """Refusable damage to the tensors themselves."""
    good = _hf_tensors(model)
    name = "model.layers.1.mlp.down_proj.weight"
    out = {}
    for label, change in (
        ("int32", lambda a: a.astype(np.int32)),
        ("int8", lambda a: a.astype(np.int8)),
        ("bool", lambda a: a > 0),
        ("nan", lambda a: np.where(a > 0.03, np.nan, a).astype(np.float32)),
        ("inf", lambda a: np.where(a > 0.03, np.inf, a).astype(np.float32)),
        ("huge_for_bf16", lambda a: np.full(a.shape, 1e39, np.float64)),
        ("wrong_shape", lambda a: a[:-1]),
        ("transposed", lambda a: np.ascontiguousarray(a.T)),
        ("scalar", lambda a: np.ones((), np.float32)),
    ):
        out[label] = {**good, name: change(good[name])}
    out["missing"] = {k: v for k, v in good.items() if k != name}
    out["extra"] = {**good, "model.layers.2.mlp.down_proj.weight": good[name]}
    return out


def test_damaged_tensors_are_refused(tmp_path):
    model = _small("--config.model.param_dtype=bfloat16").model  # bf16: a float64 1e39 overflows to inf
    for label, tensors in _tensor_cases(model).items():
        path = tmp_path / label
        _write_hf(path, tensors, model)
        message = fuzzkit.expect_refused("weights: damaged tensors", _load, path, model)
        assert "down_proj" in message or "layers.2" in message, (label, message)


def test_damaged_bytes_and_shards(tmp_path):
    model = _small().model
    good = _hf_tensors(model)
    base = tmp_path / "good"
    _write_hf(base, good, model, shards=2)
    loaded = _load(base, model)  # the undamaged checkpoint loads, bit for bit
    back = weights.hf_tensors(loaded, model)
    assert sorted(back) == sorted(good)
    for name, value in good.items():
        np.testing.assert_array_equal(np.asarray(back[name], np.float32), value)
    rng = random.Random(f"{fuzzkit.SEED}:weights")
    cases = []
    for file in ("model-00001-of-00002.safetensors", "model.safetensors.index.json", "config.json"):
        for label, data in fuzzkit.mutations((base / file).read_bytes(), rng).items():
            cases.append((f"{file}:{label}", file, data))
    extra = [
        ("index:no_weight_map", "model.safetensors.index.json", b'{"metadata": {}}'),
        ("index:list", "model.safetensors.index.json", b"[1, 2]"),
        ("index:map_of_ints", "model.safetensors.index.json", b'{"weight_map": {"a": 1}}'),
        ("config:list", "config.json", b"[]"),
        (
            "config:wrong_type",
            "config.json",
            json.dumps({**weights.hf_config_from_model(model), "hidden_size": "wide"}).encode(),
        ),
        (
            "config:other_model",
            "config.json",
            json.dumps({**weights.hf_config_from_model(model), "num_hidden_layers": 3}).encode(),
        ),
        ("config:deep", "config.json", b"[" * 100000 + b"]" * 100000),
    ]
    for label, file, data in fuzzkit.sample("weights: damaged bytes", cases, 12) + extra:
        path = tmp_path / label.replace(":", "_").replace(".", "_")
        shutil.copytree(base, path)
        (path / file).write_bytes(data)
        message, params = fuzzkit.expect_refused_or_ok("weights: damaged bytes", _load, path, model)
        if params is not None:  # a harmless change (e.g. flipped bytes in the JSON's whitespace): finite floats
            assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(params)), label
    path = tmp_path / "missing_shard"
    shutil.copytree(base, path)
    (path / "model-00002-of-00002.safetensors").unlink()
    message = fuzzkit.expect_refused("weights: damaged bytes", _load, path, model)
    assert "model-00002-of-00002.safetensors" in message and "missing" in message


# --------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_checkpoints(tmp_path_factory)


def make_checkpoints(tmp_path_factory, *extra: str) -> pathlib.Path:
    """A workdir with checkpoints at steps 1 and 2 of the small model, written from one device
    (checkpoints hold the model form: any layout restores them)."""
    from jaxpar.config import validate
    from jaxpar.mesh import single_device_mesh
    from jaxpar.train.state import Setup

    workdir = tmp_path_factory.mktemp("ckpt") / "run"
    cfg = _small(f"--config.train.workdir={workdir}", *extra)
    setup = Setup(cfg, validate(cfg, 1), single_device_mesh())
    params, opt = setup.init(0)
    ckpt = Checkpointer(str(workdir), 1, 5)
    for step in (1, 2):
        ckpt.save(step, params, opt, {"step": step}, cfg)
    ckpt.close()
    return workdir


def _files(step_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(f for f in step_dir.rglob("*") if f.is_file() and f.stat().st_size > 0)


def _damage_cases(run: pathlib.Path) -> list[tuple[str, object]]:
    step = run / "checkpoints" / "2"
    cases: list[tuple[str, object]] = [
        ("delete_state", lambda d: shutil.rmtree(d / "state")),
        ("delete_meta", lambda d: shutil.rmtree(d / "meta")),
        ("truncate_all", lambda d: [f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]) for f in _files(d)]),
        ("garbage_all", lambda d: [f.write_bytes(b"\x00\xff" * 8) for f in _files(d)]),
    ]
    for f in _files(step):
        rel = f.relative_to(step)
        cases.append((f"truncate:{rel}", lambda d, r=rel: (d / r).write_bytes((d / r).read_bytes()[:7])))
        cases.append((f"delete:{rel}", lambda d, r=rel: (d / r).unlink()))
    return cases


def test_damaged_checkpoints_export_the_good_one_or_refuse(run_dir, tmp_path):
    cases = fuzzkit.sample("checkpoint: damaged (export)", _damage_cases(run_dir), 8)
    for i, (label, damage) in enumerate(cases):
        run = tmp_path / f"run{i}"
        shutil.copytree(run_dir, run)
        damage(run / "checkpoints" / "2")
        cfg = _small(f"--config.train.workdir={run}")
        notes: list[str] = []
        message, done = fuzzkit.expect_refused_or_ok(
            "checkpoint: damaged (export)", export_checkpoint, cfg, str(tmp_path / f"out{i}"), echo=notes.append
        )
        assert message is None or "checkpoint" in message, (label, message)
        if done is not None and done.step == 1:  # fell back: it says which one it skipped
            assert len(notes) == 1 and notes[0].startswith("checkpoint 2 ") and "\n" not in notes[0], (label, notes)
        if done is not None:
            params = weights.load_hf(done.output, cfg.model)
            assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(params))
        named = fuzzkit.expect_refused_or_ok(
            "checkpoint: damaged (export --step)", export_checkpoint, cfg, str(tmp_path / f"outstep{i}"), 2
        )[0]
        assert named is None or "2" in named, (label, named)


def test_damaged_newest_checkpoint_is_removed_on_resume(run_dir, tmp_path):
    from jaxpar.train.state import one_device_checkpoint_state

    cases = fuzzkit.sample("checkpoint: damaged (resume)", _damage_cases(run_dir), 4)
    for i, (label, damage) in enumerate(cases):
        run = tmp_path / f"run{i}"
        shutil.copytree(run_dir, run)
        damage(run / "checkpoints" / "2")
        cfg = _small(f"--config.train.workdir={run}")
        params, opt = one_device_checkpoint_state(cfg)
        notes: list[str] = []
        ckpt = Checkpointer(str(run), 1, 2, echo=notes.append, model=cfg.model)
        fuzzkit.COUNTS["checkpoint: damaged (resume)"] += 1
        with fuzzkit.bounded():
            step, _, _ = ckpt.restore({"params": params, "opt_state": opt})
        ckpt.close()
        if step == 1:  # 2 was damaged: reported, then removed; what is left restores
            assert notes[0].startswith("checkpoint 2 ") and notes[1].startswith("removed damaged checkpoint(s) [2]")
            assert Checkpointer(str(run), 1, 2).steps() == [1], label
        else:
            assert step == 2 and not notes, (label, notes)


def test_checkpoint_of_another_model_is_named_not_removed(run_dir, tmp_path):
    from jaxpar.train.state import one_device_checkpoint_state

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    for override, field in (
        ("--config.model.embed_dim=64", "model.embed_dim"),
        ("--config.model.num_layers=4", "model.num_layers"),
        ("--config.model.tie_embeddings=true", "model.tie_embeddings"),
    ):
        cfg = _small(f"--config.train.workdir={run}", override)
        message = fuzzkit.expect_refused("checkpoint: another model", export_checkpoint, cfg, str(tmp_path / "o"))
        assert field in message and "checkpoint 2" in message, message
        params, opt = one_device_checkpoint_state(cfg)
        ckpt = Checkpointer(str(run), 1, 2, echo=lambda _: None, model=cfg.model)
        message = fuzzkit.expect_refused(
            "checkpoint: another model", ckpt.restore, {"params": params, "opt_state": opt}
        )
        ckpt.close()
        assert field in message
    assert Checkpointer(str(run), 1, 2).steps() == [1, 2]  # nothing removed
