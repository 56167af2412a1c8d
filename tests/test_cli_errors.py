"""The CLI's one error path: bad input -> `error: <one line>`, exit 2; a bug -> one line naming the
exception and a traceback file, exit 1; Ctrl-C -> 130. Flags that mean something only with another
flag, and a --layout key given twice, are refused in one line. Nothing here compiles or trains."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from jaxpar.cli import main
from jaxpar.cli import plan as plan_cli
from jaxpar.config import ConfigError
from tests.helpers import ROOT, TINY


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _raise(error: BaseException):
    def run(args):
        raise error

    return run


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """The system temporary folder, redirected (where a traceback goes when no workdir is known)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_internal_error_is_one_line_and_a_traceback_file(capsys, monkeypatch, private_tmp):
    monkeypatch.setattr(plan_cli, "run_plan", _raise(RuntimeError("boom in the search\nsecond line")))
    code, out, err = _run(capsys, "plan", "--devices", "8")
    path = private_tmp / f"jaxpar-error-{os.getpid()}.log"
    assert code == 1 and out == ""
    assert err == f"jaxpar: internal error (RuntimeError: boom in the search); traceback written to {path}\n"
    log = path.read_text()
    assert log.splitlines()[0].endswith("jaxpar plan --devices 8")  # the command line that failed
    assert "Traceback (most recent call last)" in log and "in run" in log  # the frame that raised
    assert log.rstrip().endswith("RuntimeError: boom in the search\nsecond line")


def test_internal_error_without_a_message(capsys, monkeypatch, private_tmp):
    monkeypatch.setattr(plan_cli, "run_plan", _raise(KeyError()))
    code, _, err = _run(capsys, "plan")
    assert code == 1 and err.startswith("jaxpar: internal error (KeyError); traceback written to ")


def test_train_internal_error_writes_the_traceback_into_the_workdir(capsys, monkeypatch, tmp_path, private_tmp):
    from jaxpar.train import loop

    class Broken:
        def __init__(self, cfg, layout, progress=True, weights_loader=None):
            pass

        def run(self):
            raise ZeroDivisionError("division by zero in the step")

    monkeypatch.setattr(loop, "Trainer", Broken)
    workdir = tmp_path / "run"
    workdir.mkdir()
    code, _, err = _run(capsys, "train", "--config", TINY, f"--config.train.workdir={workdir}")
    path = workdir / f"jaxpar-error-{os.getpid()}.log"
    assert code == 1
    assert (
        err == f"jaxpar: internal error (ZeroDivisionError: division by zero in the step); traceback written "
        f"to {path}\n"
    )
    assert "in run" in path.read_text() and "ZeroDivisionError" in path.read_text()
    # a workdir that does not exist (yet) is not created for the log: the temporary folder takes it
    code, _, err = _run(capsys, "train", "--config", TINY, f"--config.train.workdir={tmp_path / 'none'}")
    assert code == 1 and err.endswith(f"{private_tmp / f'jaxpar-error-{os.getpid()}.log'}\n")
    assert not (tmp_path / "none").exists()


def test_config_error_is_exit_2_on_one_line(capsys, monkeypatch):
    code, out, err = _run(capsys, "plan", "--config", "configs/nope.py")
    assert (code, out) == (2, "")
    assert err == "error: --config: file 'configs/nope.py' not found; pass a path such as configs/tiny.py\n"
    monkeypatch.setattr(plan_cli, "run_plan", _raise(ConfigError("first part\nsecond part")))
    assert _run(capsys, "plan")[1:] == ("", "error: first part second part\n")  # one line, always


def test_keyboard_interrupt_is_130(capsys, monkeypatch):
    monkeypatch.setattr(plan_cli, "run_plan", _raise(KeyboardInterrupt()))
    assert _run(capsys, "plan") == (130, "", "interrupted\n")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["inspect", "--ops"], "inspect: --ops applies only with --json; add --json or drop --ops"),
        (["plan", "--aot-top", "2"], "plan: --aot-top applies only with --aot; add --aot or drop --aot-top"),
        (
            ["plan", "--devices", "16", "--nodes", "2"],
            "plan: --devices and --nodes both set the same thing; give one of them",
        ),
        (
            ["port", "fsdp", "x.yaml", "--allow-unresolved"],
            "port fsdp: --allow-unresolved applies to deepspeed, "
            "megatron and torchtitan recipes only (an FSDP config leaves no value open); drop it",
        ),
        (
            ["port", "torchtitan", "x.toml", "--pipeline", "2"],
            "port torchtitan: --tensor/--pipeline apply to deepspeed only; this recipe names its own parallel sizes",
        ),
        (
            ["port", "deepspeed", "x.json", "--var", "A=1"],
            "port: --var sets shell variables of Megatron launch recipes only",
        ),
    ],
)
def test_flags_that_need_another_flag_are_refused(capsys, argv, message):
    assert _run(capsys, *argv) == (2, "", f"error: {message}\n")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--layout", "data=1,tensor=8,data=2"], "--layout 'data=1,tensor=8,data=2': data given twice"),
        (["plan", "--layout", "virtual=2,tensor=2,virtual=3"], "virtual given twice"),
        (["compare", "--layout", "data=8,zero=1,zero=3"], "--layout 'data=8,zero=1,zero=3': zero given twice"),
        (["compare", "--layout", "data=8", "--layout", "data=8,sp=1,sp=0"], "sp given twice"),
    ],
)
def test_duplicate_layout_keys_are_refused(capsys, argv, message):
    code, out, err = _run(capsys, *argv)
    assert (code, out) == (2, "") and message in err and err.endswith("; give each key once\n")
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--top", "0"], "--top 0: use an integer >= 1"),
        (["plan", "--microbatches", "0"], "--microbatches 0: use an integer >= 1"),  # was a ZeroDivisionError
        (["plan", "--seq", "0"], "--seq 0: use an integer >= 1"),  # was silently the config's seq_len
        (["plan", "--efficiency", "0"], "--efficiency 0.0: use a value in (0, 1]"),  # was a ZeroDivisionError
        (["compare", "--layout", "data=8", "--global-batch", "0"], "--global-batch 0: use an integer >= 1"),
        (["port", "fsdp", "x.yaml", "--world-size", "0"], "--world-size 0: use an integer >= 1"),  # ZeroDivisionError
    ],
)
def test_numbers_out_of_range_are_refused(capsys, argv, message):
    assert _run(capsys, *argv) == (2, "", f"error: {message}\n")


def test_the_entry_point_exits_with_the_codes():
    """`python -m jaxpar` returns main()'s code (bad input: 2, before JAX starts)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "jaxpar", "inspect", "--ops"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "error: inspect: --ops applies only with --json; add --json or drop --ops\n"


def test_a_library_made_for_another_jax_is_one_line_exit_2(tmp_path):
    """flax 0.12.8 under jax 0.11.2 (a GPU machine's JAX, 2026-12-05) raised AttributeError inside
    ``import flax.nnx``. Here a flax whose module code raises the same error, first on the path in a
    ``site-packages`` folder, stands for it: the environment's error (exit 2, versions named), not a bug."""
    fake = tmp_path / "site-packages" / "flax"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "raise AttributeError(\"module 'jax.experimental.hijax' has no attribute 'HiPrimitive'\")\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{fake.parent}{os.pathsep}{ROOT}"}
    argv = [sys.executable, "-m", "jaxpar", "inspect", "--config", TINY]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: flax "), done.stderr
    assert "does not import under jax " in lines[0] and "HiPrimitive" in lines[0]
    assert "jax 0.12 + flax 0.12.12" in lines[0] and "Traceback" not in done.stderr


def test_a_bug_inside_jaxpar_stays_an_internal_error():
    """Only a dependency's own module code counts as a broken installation: an AttributeError raised
    by jaxpar's code is still a bug (exit 1)."""
    from jaxpar.cli import errors

    try:
        raise AttributeError("no attribute")
    except AttributeError as e:
        assert errors.broken_dependency(e) is None
