"""The one opener (jaxpar.files): every path jaxpar reads, given as a FIFO, a folder, a device, a socket or
a file over its kind's cap, ends in one line naming the path (exit 2) within seconds, never a hang.

The table is path kind x CLI entry that reads a path. The entries whose reader is Python run in this
process under a time bound (a FIFO's ``open`` is interrupted by the bound's signal); those whose
reader is native code (safetensors, orbax, numpy's memmap) run in a subprocess with a timeout, since
a native ``open`` retries through the signal: one of them in the default suite, every one under
``JAXPAR_SLOW=1`` (each starts JAX, ~10 s), together with the in-process table through subprocesses.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

from jaxpar import files
from jaxpar.errors import ConfigError
from tests.fuzzkit import FULL, cli_refused
from tests.helpers import ROOT, TINY, child_env

RECIPE = ROOT / "tests" / "fixtures" / "recipes" / "deepspeed" / "megatron_ds_bf16_zero1.json"
LIMIT_S = 60  # a subprocess case; a refusal takes ~10 s on 2 busy cores (JAX starts)
FAST = ["--config.train.steps=1", "--config.train.eval_batches=0"]


_SHORT: list[pathlib.Path] = []  # the short folders of sockets, removed after the module's tests


@pytest.fixture(scope="module", autouse=True)
def _remove_short_folders():
    yield
    for folder in _SHORT:
        shutil.rmtree(folder, ignore_errors=True)


def _special(kind: str, path: pathlib.Path, cap: int | None) -> pathlib.Path | None:
    """Make ``path`` a ``kind`` of file; None where the kind does not apply (no cap to exceed)."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "device":
        path.symlink_to("/dev/zero")  # a link keeps the suffix a reader may want
    elif kind == "socket":
        # AF_UNIX paths are short (108 bytes): bound in a short folder, reached through a link
        short = pathlib.Path(tempfile.mkdtemp(prefix="jx", dir="/tmp")) / "s"
        _SHORT.append(short.parent)
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(short))
        sock.close()
        path.symlink_to(short)
    elif kind == "oversized":
        if cap is None:
            return None
        with open(path, "wb") as f:
            f.truncate(cap + 1)  # sparse: no disk space used
    return path


WORDS = {
    "fifo": "is a FIFO (named pipe), not a regular file",
    "folder": "is a folder, not a regular file",
    "device": "is a character device, not a regular file",
    "socket": "is a socket, not a regular file",
    "oversized": "more than a",
}
KINDS = tuple(WORDS)

# (entry, file name, files.CAPS kind, argv with @P = the path, @D = its folder, @T = the test's folder)
ENTRIES = [
    ("--config", "cfg.py", "config file", ["plan", "--config", "@P"]),
    ("port deepspeed", "ds.json", "recipe", ["port", "deepspeed", "@P", "--world-size", "8"]),
    ("port megatron", "run.args", "recipe", ["port", "megatron", "@P"]),
    ("port torchtitan", "job.toml", "recipe", ["port", "torchtitan", "@P", "--world-size", "8"]),
    ("port fsdp", "fsdp.yaml", "recipe", ["port", "fsdp", "@P"]),
    (
        "port --model-config",
        "hf/config.json",  # the flag takes the file or its folder: the folder, whose config.json is the case
        "HF config.json",
        ["port", "deepspeed", str(RECIPE), "--world-size", "8", "--model-config", "@D"],
    ),
    (
        "sweep --baseline",
        "results.json",
        "sweep results",
        [
            "sweep",
            "--devices",
            "2",
            "--steps",
            "2",
            "--warmup",
            "0",
            "--no-progress",
            "-o",
            "@T/out",
            "--baseline",
            "@P",
        ],
    ),
    ("optim.name=FILE.py:fn", "opt.py", "optimizer file", ["plan", "--config.optim.name=@P:make"]),
]
CASES = [(e, kind) for e in ENTRIES for kind in KINDS if not (kind == "oversized" and files.CAPS[e[2]] is None)]


def _argv(template: list[str], path: pathlib.Path, tmp: pathlib.Path) -> list[str]:
    return [a.replace("@P", str(path)).replace("@D", str(path.parent)).replace("@T", str(tmp)) for a in template]


def _subprocess(argv: list[str], cwd: pathlib.Path) -> tuple[int, str]:
    """``jaxpar ARGV`` in a child process: (exit code, stderr); a hang fails the test at LIMIT_S."""
    env = child_env(PYTHONPATH=str(ROOT))
    try:
        done = subprocess.run(
            [sys.executable, "-m", "jaxpar", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=LIMIT_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"jaxpar {argv} ran past {LIMIT_S} s: it hangs")
    return done.returncode, done.stderr


def _one_line(code: int, err: str, path: pathlib.Path, kind: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err[-2000:])
    assert str(path) in lines[0] and WORDS[kind] in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("entry, kind", CASES, ids=[f"{e[0]}-{k}" for e, k in CASES])
def test_a_path_that_is_not_a_regular_file_is_one_line(tmp_path, entry, kind):
    _, name, cap_kind, template = entry
    (tmp_path / name).parent.mkdir(exist_ok=True)
    path = _special(kind, tmp_path / name, files.CAPS[cap_kind])
    line = cli_refused("file kinds", _argv(template, path, tmp_path))
    _one_line(2, line, path, kind)
    if kind == "oversized":
        assert files.size_text(files.CAPS[cap_kind]) in line, line  # the cap is stated


@pytest.mark.skipif(not FULL, reason="JAXPAR_SLOW=1: the in-process table again, each case in a subprocess")
@pytest.mark.parametrize("entry, kind", CASES, ids=[f"{e[0]}-{k}" for e, k in CASES])
def test_the_same_in_a_subprocess(tmp_path, entry, kind):
    _, name, cap_kind, template = entry
    (tmp_path / name).parent.mkdir(exist_ok=True)
    path = _special(kind, tmp_path / name, files.CAPS[cap_kind])
    _one_line(*_subprocess(_argv(template, path, tmp_path), tmp_path), path, kind)


def _hf_folder(tmp: pathlib.Path) -> pathlib.Path:
    """An HF folder of the tiny config's model holding only its config.json (the weights are the case)."""
    from jaxpar.config import load_config
    from jaxpar.port.weights import hf_config_from_model

    hf = tmp / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(hf_config_from_model(load_config(TINY).model)))
    return hf


def _checkpoint(tmp: pathlib.Path) -> pathlib.Path:
    """A run's workdir with one checkpoint (the tiny config, one step)."""
    run = tmp / "run"
    code, err = _subprocess(
        ["train", "--no-progress", *FAST, "--config.checkpoint.every=1", f"--config.train.workdir={run}"], tmp
    )
    assert code == 0, err[-2000:]
    return run


def _weights(tmp: pathlib.Path, kind: str) -> pathlib.Path:
    return _special(kind, _hf_folder(tmp) / "model.safetensors", None)


def _hf_config(tmp: pathlib.Path, kind: str) -> pathlib.Path:
    (tmp / "hf").mkdir()
    return _special(kind, tmp / "hf" / "config.json", files.CAPS["HF config.json"])


def _checkpoint_metadata(tmp: pathlib.Path, kind: str) -> pathlib.Path:
    path = _checkpoint(tmp) / "checkpoints" / "1" / "_CHECKPOINT_METADATA"
    path.unlink()
    return _special(kind, path, files.CAPS["checkpoint metadata"])


def _train(tmp: pathlib.Path, *overrides: str) -> list[str]:
    return ["train", "--no-progress", *FAST, f"--config.train.workdir={tmp / 'r'}", *overrides]


# native readers, in a subprocess: (case, make the path of a kind in the test's folder, argv, kinds)
NATIVE = [
    (
        "train.init_from's model.safetensors",
        _weights,
        lambda tmp, path: _train(tmp, f"--config.train.init_from={path.parent}"),
        ("fifo", "folder", "device"),
    ),
    (
        "train.init_from's config.json",
        _hf_config,
        lambda tmp, path: _train(tmp, f"--config.train.init_from={path.parent}"),
        ("fifo", "device", "oversized"),
    ),
    (
        "data.path of a bin source",
        lambda tmp, kind: _special(kind, tmp / "tokens.bin", None),
        lambda tmp, path: _train(tmp, "--config.data.source=bin", f"--config.data.path={path}"),
        ("fifo", "folder", "device"),
    ),
    (
        "a checkpoint's metadata (export)",
        _checkpoint_metadata,
        lambda tmp, path: ["export", f"--config.train.workdir={tmp / 'run'}", "-o", str(tmp / "hf-out")],
        ("fifo", "folder", "oversized"),
    ),
]
NATIVE_CASES = [(n[:3], kind) for n in NATIVE for kind in n[3]]
DEFAULT_NATIVE = {("train.init_from's model.safetensors", "fifo")}  # safetensors' open would block for good


@pytest.mark.parametrize(
    "case, kind",
    [
        pytest.param(
            c,
            k,
            marks=[] if (c[0], k) in DEFAULT_NATIVE else pytest.mark.skipif(not FULL, reason="JAXPAR_SLOW=1 (~10 s)"),
        )
        for c, k in NATIVE_CASES
    ],
    ids=[f"{c[0]}-{k}" for c, k in NATIVE_CASES],
)
def test_native_readers_are_never_handed_a_special_file(tmp_path, case, kind):
    _, make, argv = case
    path = make(tmp_path, kind)
    _one_line(*_subprocess(argv(tmp_path, path), tmp_path), path, kind)


def test_yaml_aliases_are_refused_before_they_expand(tmp_path):
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)
    )
    path = tmp_path / "fsdp.yaml"
    path.write_text(bomb)
    line = cli_refused("file kinds", ["port", "fsdp", str(path)])
    assert "YAML alias *a (line 2)" in line and "fsdp.yaml" in line, line
    assert files.load_yaml("a: &x 1\nb: 2\n", "t") == {"a": 1, "b": 2}  # an anchor alone expands nothing


def test_the_opener_reads_regular_files_and_refuses_what_grew(tmp_path):
    path = tmp_path / "r.json"
    path.write_text('{"a": 1}')
    assert files.read_text(path, "recipe", "t", "fix") == '{"a": 1}'
    assert files.read_head(path, "recipe", "t", "fix", 2) == b'{"'
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 0"):
        files.read_text(path, "recipe", "t", "fix")
    with pytest.raises(ConfigError, match="t: file '.*nope' not found; fix"):
        files.read_bytes(tmp_path / "nope", "recipe", "t", "fix")
    with pytest.raises(ConfigError, match="cannot read"):
        files.read_bytes("a\x00b", "recipe", "t", "fix")
