"""Every example of the hostile-input issue, one test each: a one-line error with exit code 2
(or, for the losses, the user's files left intact). The generated variants of each family are in
tests/test_fuzz_*.py; these are the named cases, end to end through the command line."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxpar.analysis.plan import PlanOptions
from jaxpar.checkpoint import Checkpointer
from jaxpar.config import ConfigError, validate
from jaxpar.port import weights
from jaxpar.train.loop import Trainer, TrainingDiverged
from tests import fuzzkit
from tests.fuzzkit import cli_refused, run_cli
from tests.helpers import ROOT, TINY
from tests.test_fuzz_files import SMALL, _hf_tensors, _small, _write_hf, make_checkpoints
from tests.test_fuzz_recipes import SEEDS

# the small model trained on the 8 simulated devices (the Trainer uses them all)
EIGHT = ["--config.mesh.data=8", "--config.train.global_batch=8", "--config.data.source=synthetic"]


def _with(argv: list[str], *overrides: str) -> list[str]:
    """``argv`` with ``overrides`` instead of its own values of those keys (the CLI refuses a key given twice)."""
    keys = {o.split("=")[0] for o in overrides}
    return [a for a in argv if a.split("=")[0] not in keys] + list(overrides)


SMALL_EIGHT = _with(SMALL, *EIGHT)


def _config_file(tmp_path, body: str) -> str:
    path = tmp_path / "cfg.py"
    path.write_text("from jaxpar.config import default_config\n\n" + body)
    return str(path)


# --------------------------------------------------------------------------- config files that misbehave


@pytest.mark.parametrize(
    "body, words",
    [
        ("def get_config():\n    raise RuntimeError('boom')\n", ["get_config() raised RuntimeError: boom"]),
        ("def get_config():\n    return None\n", ["returned NoneType"]),
        ("def get_config():\n    return 5\n", ["returned int"]),
        ("def get_config(a, b):\n    return default_config()\n", ["does not accept the call get_config()"]),
        (
            "def get_config():\n    c = default_config()\n    c.model.embed_dim = 'wide'\n    return c\n",
            ["embed_dim", "get_config() raised TypeError"],
        ),  # ConfigDict's own type check, in one line
        ("def get_config():\n    return {'model': {'embed_dim': 'wide'}}\n", ["config.model.embed_dim: expected int"]),
        ("import sys\nsys.exit(3)\n", ["failed to load (SystemExit"]),
        ("get_config = 5\n", ["defines no get_config()"]),
        ("def get_config(:\n", ["failed to load (SyntaxError"]),
    ],
)
def test_config_files_that_misbehave(tmp_path, body, words):
    line = cli_refused("hostile: config files", ["plan", "--json", "--config", _config_file(tmp_path, body)])
    assert all(w in line for w in words), line


# --------------------------------------------------------------------------- values that cannot work


@pytest.mark.parametrize(
    "override, words",
    [
        ("--config.train.eval_batches=-1", ["train.eval_batches=-1"]),
        ("--config.train.eval_every=5 --config.train.eval_batches=0", ["train.eval_every=5 with train.eval_batches=0"]),
        ("--config.model.head_dim=31", ["model.head_dim=31", "even"]),
        ("--config.train.workdir=", ["train.workdir is empty"]),
        ("--config.train.workdir=@FILE", ["is a file"]),
        ("--config.optim.lr=inf", ["optim.lr=inf"]),
        ("--config.optim.b1=1.0", ["optim.b1=1.0", "[0, 1)"]),
        ("--config.optim.b2=-0.1", ["optim.b2=-0.1"]),
        ("--config.model.rope_theta=0", ["model.rope_theta=0.0"]),
        ("--config.model.init_std=nan", ["model.init_std=nan"]),  # not blamed on the learning rate
        ("--config.data.path=/tmp/tokens.bin", ["data.path", "data.source='stdlib'"]),
        ("--config.mesh.data=100000000000000000000", ["mesh.data"]),
    ],
)
def test_values_that_cannot_work_are_refused_before_any_compile(tmp_path, override, words):
    afile = tmp_path / "a_file"
    afile.write_text("x")
    start = time.perf_counter()
    line = cli_refused("hostile: values", ["train", "--no-progress", *override.replace("@FILE", str(afile)).split()])
    assert all(w in line for w in words), line
    if "optim.lr" not in override:
        assert "optim.lr" not in line, line  # e.g. a NaN init_std is not blamed on the learning rate
    assert time.perf_counter() - start < 10  # refused at validation, not after a compile


def test_a_run_without_a_finite_loss_exits_2(tmp_path):
    cfg = _small(
        *EIGHT,
        f"--config.train.workdir={tmp_path}",
        "--config.train.steps=2",
        "--config.train.eval_batches=1",
        "--config.train.inject_bad_steps=1,2",
        "--config.train.max_bad_steps=5",
    )
    with pytest.raises(TrainingDiverged, match="no finite loss in 2 steps"):
        Trainer(cfg, validate(cfg), echo=lambda _: None, progress=False).run()


@pytest.mark.parametrize(
    "damage, words",
    [
        ("nan", ["holds NaN or Inf"]),
        ("int32", ["stored as I32", "not a float dtype"]),
    ],
)
def test_init_from_weights_are_checked_before_training(tmp_path, damage, words):
    model = _small().model
    tensors = _hf_tensors(model)
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name].astype(np.int32) if damage == "int32" else np.full_like(tensors[name], np.nan)
    _write_hf(tmp_path / "hf", tensors, model)
    cfg = _small(*EIGHT, f"--config.train.workdir={tmp_path / 'run'}", f"--config.train.init_from={tmp_path / 'hf'}")
    trainer = Trainer(cfg, validate(cfg), echo=lambda _: None, progress=False, weights_loader=weights.load_checked)
    with pytest.raises(ConfigError) as info:
        trainer.initialize()
    trainer.close()
    assert all(w in str(info.value) for w in words) and "q_proj" in str(info.value)


# --------------------------------------------------------------------------- settings silently ignored


def test_port_refuses_config_overrides_and_unused_names(tmp_path):
    ds, meg = tmp_path / "ds.json", tmp_path / "m.args"
    ds.write_text(SEEDS["deepspeed"])
    meg.write_text(SEEDS["megatron"])
    line = cli_refused(
        "hostile: ignored settings", ["port", "deepspeed", str(ds), "--world-size", "8", "--config.train.steps=5"]
    )
    assert "--set train.steps=VALUE" in line
    line = cli_refused(
        "hostile: ignored settings", ["port", "deepspeed", str(ds), "--world-size", "8", "--set", "learnin_rate=3e-4"]
    )
    assert "--set learnin_rate" in line
    line = cli_refused("hostile: ignored settings", ["port", "megatron", str(meg), "--var", "GPU_PER_NODE=8"])
    assert "--var GPU_PER_NODE" in line and "never uses" in line


# --------------------------------------------------------------------------- absurd sizes


def test_absurd_sizes_are_refused_quickly(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(SEEDS["deepspeed"])
    line = cli_refused("hostile: absurd sizes", ["port", "deepspeed", str(ds), "--world-size", str(10**20)])
    assert "--world-size" in line
    start = time.perf_counter()
    line = cli_refused("hostile: absurd sizes", ["plan", "--nodes", str(10**12)])
    assert "more than any cluster" in line and time.perf_counter() - start < 5
    line = cli_refused("hostile: absurd sizes", ["plan", "--nodes", "0"])
    assert line == "error: --nodes 0: use an integer >= 1"
    for bad in (0.0, -0.5, float("nan")):
        with pytest.raises(ConfigError, match="efficiency"):
            PlanOptions(efficiency=bad)
        with pytest.raises(ConfigError, match="link_efficiency"):
            PlanOptions(link_efficiency=bad)
    cli_refused("hostile: absurd sizes", ["compare", "--layout", "data=-1", "--efficiency", "-1"])


# --------------------------------------------------------------------------- unreadable files


def test_unreadable_recipe_and_weight_files(tmp_path):
    for kind, suffix in (("deepspeed", ".json"), ("megatron", ".args"), ("torchtitan", ".toml"), ("fsdp", ".yaml")):
        path = tmp_path / f"binary{suffix}"
        path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
        line = cli_refused("hostile: unreadable files", ["port", kind, str(path), "--world-size", "8"])
        assert str(path) in line or path.name in line, line
    toml = tmp_path / "tt.toml"
    toml.write_text(SEEDS["torchtitan"].replace("tensor_parallel_degree = 2", 'tensor_parallel_degree = "two"'))
    line = cli_refused("hostile: unreadable files", ["port", "torchtitan", str(toml), "--world-size", "8"])
    assert "parallelism.tensor_parallel_degree = 'two'" in line
    toml.write_text(SEEDS["torchtitan"].replace("tensor_parallel_degree = 2", "tensor_parallel_degree = -2"))
    line = cli_refused("hostile: blamed right", ["port", "torchtitan", str(toml), "--world-size", "8"])
    assert "tensor_parallel_degree = -2" in line and "mesh.data" not in line  # not a derived field
    model = _small().model
    _write_hf(tmp_path / "sharded", _hf_tensors(model), model, shards=2)
    (tmp_path / "sharded" / "model-00002-of-00002.safetensors").unlink()
    from jaxpar.port import weights
    from jaxpar.port.weights import check_hf_model

    with pytest.raises(ConfigError, match="names shard 'model-00002-of-00002.safetensors' which is missing"):
        weights.load_hf(tmp_path / "sharded", model)
    (tmp_path / "sharded" / "config.json").write_bytes(b"\xff\xfe{garbage")
    with pytest.raises(ConfigError, match="config.json: not a readable JSON file"):
        check_hf_model(str(tmp_path / "sharded"), model)  # what port.weights.load_checked runs first


# --------------------------------------------------------------------------- damaged checkpoints, losses


def _run(workdir, *extra) -> Trainer:
    cfg = _small(
        *EIGHT,
        f"--config.train.workdir={workdir}",
        "--config.train.steps=2",
        "--config.train.eval_batches=1",
        "--config.checkpoint.every=1",
        "--config.checkpoint.keep=2",
        *extra,
    )
    return Trainer(cfg, validate(cfg), echo=notes.append, progress=False)


notes: list[str] = []


def _damage(step_dir: pathlib.Path) -> None:
    for f in (step_dir / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Checkpoints at steps 1 and 2 of the small model (saved directly: no train step compiled)."""
    return make_checkpoints(tmp_path_factory)


def test_keep_2_with_a_damaged_newest_keeps_only_restorable_checkpoints(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    _damage(run / "checkpoints" / "2")
    notes.clear()
    _run(run).run()  # resumes from 1, removes the damaged 2, trains step 2 again and saves it
    removed = [n for n in notes if n.startswith("removed damaged checkpoint(s)")]
    assert len(removed) == 1 and "[2]" in removed[0] and "resumed from step 1" in removed[0]
    assert any(n.startswith("resumed from checkpoint at step 1") for n in notes)
    assert Checkpointer(str(run), 1, 2).steps() == [1, 2]  # the good one it resumed from is still there
    cfg = _small(f"--config.train.workdir={run}")
    from jaxpar.train.state import one_device_checkpoint_state

    params, opt = one_device_checkpoint_state(cfg)
    for step in (1, 2):  # both restore
        got = Checkpointer(str(run), 1, 2, echo=lambda _: None).restore(
            {"params": params, "opt_state": opt}, step=step, prune_damaged=False
        )
        assert got[0] == step


def _subprocess(args, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # XLA_FLAGS: tests/conftest.py's, with its 8 devices
    return subprocess.run(
        [sys.executable, "-m", "jaxpar", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_export_and_resume_of_damaged_or_foreign_checkpoints_in_one_line(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    _damage(run / "checkpoints" / "2")
    common = ["--config", TINY, *SMALL_EIGHT, f"--config.train.workdir={run}"]
    done = _subprocess(["export", *common, "-o", str(tmp_path / "hf")], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "checkpoint step 1" in done.stdout
    err = [x for x in done.stderr.splitlines() if x.strip()]
    assert len(err) == 1 and err[0].startswith("note: checkpoint 2 ") and "Traceback" not in done.stderr, err
    named = _subprocess(["export", *common, "--step", "2", "-o", str(tmp_path / "hf2")], tmp_path)
    assert named.returncode == 2 and named.stderr.count("\n") == 1, named.stderr
    assert named.stderr.startswith("error: --step 2: checkpoint 2") and "damaged" in named.stderr
    other = _subprocess(
        ["train", "--no-progress", *_with(common, "--config.model.embed_dim=64", "--config.train.steps=2")], tmp_path
    )
    assert other.returncode == 2, other.stderr[-2000:]
    assert "Event loop is closed" not in other.stderr and "Traceback" not in other.stderr
    err = [x for x in other.stderr.splitlines() if x.strip()]
    assert len(err) == 1 and "model.embed_dim=32" in err[0] and "checkpoint 2" in err[0], err
    assert Checkpointer(str(run), 1, 2).steps() == [1, 2]  # a foreign model's checkpoints are never removed


def test_drill_checks_before_deleting(tmp_path):
    mine = tmp_path / "reference"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    line = cli_refused(
        "hostile: losses",
        ["drill", "--workdir", str(tmp_path), "--config.checkpoint.every=1", "--config.train.steps=5"],
    )
    assert "was not made by jaxpar drill" in line
    assert (mine / "notes.txt").read_text() == "keep me"
    afile = tmp_path / "file"
    afile.write_text("x")
    assert "is a file" in cli_refused(
        "hostile: losses", ["drill", "--workdir", str(afile), "--config.checkpoint.every=1", "--config.train.steps=5"]
    )
    assert afile.read_text() == "x"


def test_internal_errors_stay_exit_1(monkeypatch):
    """The other path still works: a bug is exit 1 with one line (not swallowed as bad input)."""
    import jaxpar.cli.plan as plan

    def broken(_args):
        raise KeyError("bug")

    monkeypatch.setattr(plan, "run_plan", broken)
    code, _, err = run_cli(["plan"])
    fuzzkit.COUNTS["hostile: internal error"] += 1
    assert code == 1 and "internal error (KeyError" in err


def test_drill_reports_a_refused_run_in_one_line(tmp_path):
    """The drill's training run refuses NaN weights (exit 2): the drill says so in one line, exit 2."""
    model = _small().model
    tensors = _hf_tensors(model)
    tensors["model.norm.weight"] = np.full_like(tensors["model.norm.weight"], np.inf)
    _write_hf(tmp_path / "hf", tensors, model)
    args = [
        "drill",
        "--config",
        TINY,
        "--workdir",
        str(tmp_path / "drill"),
        "--trials",
        "1",
        *SMALL_EIGHT,
        "--config.checkpoint.every=1",
        "--config.train.steps=3",
        f"--config.train.init_from={tmp_path / 'hf'}",
    ]
    done = _subprocess(args, tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    err = [x for x in done.stderr.splitlines() if x.strip()]
    assert len(err) == 1 and err[0].startswith("error: the reference run refused its input (tensor 'model.norm.weight'")
