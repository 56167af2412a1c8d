"""OS errors are user errors (jaxpar.cli.errors): a closed pipe ends quietly (exit 141), a full disk is one
line naming the path with the earlier output intact (exit 2), Ctrl-C is one line and exit 130."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from jaxpar import write_guard
from jaxpar.cli import errors
from tests.fuzzkit import run_cli
from tests.helpers import ROOT
from tests.test_write_guard import PORT, RECIPE, snapshot

LISTING = ["sweep", "--list", "--devices", "2"]  # prints to stdout without starting JAX's devices


def _jaxpar(argv: list[str], stdout, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "jaxpar", *argv],
        stdout=stdout,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
        text=True,
        timeout=timeout,
    )


def test_a_closed_pipe_ends_quietly():
    """``jaxpar ... | head`` where head has gone: no traceback, no "Exception ignored", exit 141."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = _jaxpar(LISTING, write)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (errors.EXIT_BROKEN_PIPE, "")


def test_a_full_disk_under_stdout_is_one_line():
    with open("/dev/full", "w") as full:
        done = _jaxpar(LISTING, full)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "error: no space left on the device of the standard output (No space left on "
        "device); free space there or redirect the output elsewhere"
    ]


def _dev_full_mkstemp(real_mkstemp):
    """tempfile.mkstemp whose file descriptor writes to /dev/full: the kernel's own ENOSPC on the write."""

    def mkstemp(**kwargs):
        fd, path = real_mkstemp(**kwargs)
        os.close(fd)
        return os.open("/dev/full", os.O_WRONLY), path

    return mkstemp


def test_a_full_disk_under_port_o_is_one_line_and_keeps_the_earlier_file(tmp_path, monkeypatch):
    out = tmp_path / "out.py"
    code, _, err = run_cli([*PORT, str(RECIPE), "-o", str(out)])
    assert code == 0, err
    before = snapshot(tmp_path)
    monkeypatch.setattr(write_guard.tempfile, "mkstemp", _dev_full_mkstemp(tempfile.mkstemp))
    code, _, err = run_cli([*PORT, str(RECIPE), "-o", str(out), "--overwrite"])
    assert code == 2
    assert err.splitlines()[-1] == (
        f"error: no space left on the device of '{out}' (No space left on device); free "
        "space there or write elsewhere (an earlier output there is left as it was)"
    )
    assert snapshot(tmp_path) == before  # the earlier file, and no temporary file left


def test_a_full_disk_under_export_keeps_the_earlier_export(tmp_path, monkeypatch, capsys):
    from jaxpar.port import weights
    from tests.test_fuzz_files import _small
    from tests.test_weights import random_params

    model = _small().model
    params = random_params(model)
    out = weights.save_hf(params, model, tmp_path / "hf")
    before = snapshot(tmp_path)

    def save_file(_arrays, path, metadata=None):  # noqa: ARG001 - safetensors' signature
        with open(path, "wb") as f, open("/dev/full", "wb") as full:
            f.write(b"partial")
            full.write(b"x" * 1024)
            full.flush()

    monkeypatch.setattr(weights, "save_file", save_file)
    with pytest.raises(OSError) as raised:
        weights.save_hf(params, model, out, overwrite=True)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(out / "model.safetensors")
    assert errors.os_error(raised.value, []) == 2
    assert capsys.readouterr().err.startswith(f"error: no space left on the device of '{out / 'model.safetensors'}'")
    assert snapshot(tmp_path) == before


def test_a_full_disk_under_the_data_cache_names_the_file(tmp_path, monkeypatch):
    import numpy as np

    from jaxpar import data

    path = tmp_path / "cache" / "tokens.npy"
    data._save_atomic(path, np.arange(4))
    before = snapshot(tmp_path)
    monkeypatch.setattr(data.tempfile, "mkstemp", _dev_full_mkstemp(tempfile.mkstemp))
    with pytest.raises(OSError) as raised:
        data._save_atomic(path, np.arange(100_000))
    assert (raised.value.errno, raised.value.filename) == (errno.ENOSPC, str(path))
    assert snapshot(tmp_path) == before


def test_a_full_disk_under_a_checkpoint_names_the_folder(tmp_path):
    from jaxpar.checkpoint import Checkpointer

    ckpt = Checkpointer(str(tmp_path / "run"), 1, 2)
    try:
        with pytest.raises(OSError) as raised, ckpt._disk_errors():
            try:  # orbax reports its writer thread's failure wrapped in its own exception
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError as e:
                raise RuntimeError("async save failed") from e
        assert (raised.value.errno, raised.value.filename) == (errno.ENOSPC, ckpt.directory)
        with pytest.raises(ValueError, match="not a disk"), ckpt._disk_errors():
            raise ValueError("not a disk error")  # anything else passes through as it was
    finally:
        ckpt.close()


# seconds after the child began loading JAX's extension (the CLI's imports; before that is Python's own
# start-up) at which Ctrl-C arrives: while the CLI's modules load, while JAX starts, later
# (how jaxpar starts: python -m jaxpar, or the installed console script; the delay)
SLOW_DELAYS = [0.0, 0.1, 0.3, 0.6, 1.0, 1.5, 2.5, 4.0, 6.0]
DELAYS = (
    [("module", 0.0), ("script", 2.0)]
    if os.environ.get("JAXPAR_SLOW") != "1"
    else [(how, d) for how in ("module", "script") for d in SLOW_DELAYS]
)
SCRIPT = shutil.which("jaxpar")


def _loading_jax(pid: int, timeout: float = 60) -> None:
    """Wait until process ``pid`` has mapped jaxlib (its first extension module is loading)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/maps") as f:
            if "jaxlib" in f.read():
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not load jaxlib within {timeout} s")


@pytest.mark.parametrize("how, delay", DELAYS)
def test_ctrl_c_anywhere_is_one_line_and_130(tmp_path, how, delay):
    if how == "script" and SCRIPT is None:
        pytest.skip("no jaxpar console script on PATH (pip install -e . makes one)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = ["train", "--no-progress", f"--config.train.workdir={tmp_path / 'run'}", "--config.train.steps=1000"]
    start = [sys.executable, "-m", "jaxpar"] if how == "module" else [SCRIPT]
    proc = subprocess.Popen(
        [*start, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=ROOT, text=True
    )
    try:
        _loading_jax(proc.pid)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == errors.EXIT_INTERRUPTED, err[-2000:]
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines == ["interrupted"], err[-2000:]
