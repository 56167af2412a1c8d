"""Every reader of a user-named file goes through the one opener (jaxpar.files): pointed at a FIFO
(whose open blocks until a writer comes) or at a file over its kind's cap, each subcommand / input kind
ends in one ``error:`` line, exit 2, within seconds, never a hang. Each case is a fresh ``jaxpar``
process under a subprocess timeout (no thread, no signal in the test process). Oversize files are
sparse (``truncate``): their size costs no disk. The default suite tries a FIFO on each reader that
answers without starting JAX, and the cap on those that answer in a second; ``JAXPAR_SLOW=1`` adds the
oversize ``port`` inputs and the ``train`` cases (about 5 s each: JAX starts before the file is read).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest

from jaxpar import files
from tests.helpers import ROOT, child_env

SLOW = os.environ.get("JAXPAR_SLOW") == "1"
LIMIT_S = 60  # the subprocess timeout: a hang fails the case rather than the suite
FAST_S = 20  # what a refusal may take (JAX's import included); a blocked open would take LIMIT_S
PLAN = ["plan", "--json", "--top", "1"]
TRAIN = ["train", "--config.train.steps=1"]
HEADER = (10**9).to_bytes(8, "little")  # a safetensors file whose first 8 bytes declare a 1 GB header

# (case, the hostile file's path under the case's folder, argv ({f} = that path, {d} = the folder),
#  the kind of jaxpar.files.CAPS its oversize variant exceeds (None: FIFO only), slow)
READERS = [
    ("--config", "cfg.py", [*PLAN, "--config", "{f}"], "config file", False),
    ("optim.name file", "opt.py", [*PLAN, "--config.optim.name={f}:make"], "optimizer file", False),
    ("deepspeed JSON", "ds.json", ["port", "deepspeed", "{f}", "--world-size", "8"], "recipe", False),
    ("megatron .args", "run.args", ["port", "megatron", "{f}"], "recipe", False),
    ("megatron launch script", "run.sh", ["port", "megatron", "{f}"], "recipe", False),
    ("torchtitan TOML", "job.toml", ["port", "torchtitan", "{f}"], "recipe", False),
    ("accelerate YAML", "fsdp.yaml", ["port", "fsdp", "{f}"], "recipe", False),
    (
        "HF config.json (--model-config)",
        "config.json",
        ["port", "deepspeed", "{d}/good.json", "--world-size", "8", "--model-config", "{f}"],
        "HF config.json",
        False,
    ),
    (
        "sweep --baseline",
        "results.json",
        ["sweep", "--devices", "2", "-o", "{d}/out", "--baseline", "{f}"],
        "sweep results",
        False,
    ),
    ("data.path (bin)", "tokens.bin", [*TRAIN, "--config.data.source=bin", "--config.data.path={f}"], None, True),
    ("safetensors header", "model.safetensors", [*TRAIN, "--config.train.init_from={f}"], "safetensors header", True),
    ("weights index", "model.safetensors.index.json", [*TRAIN, "--config.train.init_from={f}"], "weights index", True),
    ("workdir config.json", "w/config.json", [*TRAIN, "--config.train.workdir={d}/w"], None, True),
    (
        "checkpoint metadata",
        "w/checkpoints/2/_CHECKPOINT_METADATA",
        [*TRAIN, "--config.train.workdir={d}/w"],
        "checkpoint metadata",
        True,
    ),
]
CASES = [(f"{name}: FIFO", rel, argv, "FIFO", slow) for name, rel, argv, _kind, slow in READERS]
# the cap is one check for every kind: the default suite tries it on the readers that answer in a second
CASES += [
    (f"{name}: oversize", rel, argv, kind, slow or argv[0] == "port") for name, rel, argv, kind, slow in READERS if kind
]


def _hostile(path: pathlib.Path, shape: str) -> str:
    """Make ``path`` a FIFO or a file one byte over the cap of kind ``shape``; the error's words."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if shape == "FIFO":
        os.mkfifo(path)
        if path.name == "config.json" and path.parent.name == "w":  # the workdir's guard names the file itself
            return "config.json is not a regular file"
        return "is a FIFO (named pipe), not a regular file"
    cap = files.CAPS[shape]
    if shape == "safetensors header":
        path.write_bytes(HEADER)
        return f"declares a safetensors header of {files.size_text(10**9)}, more than the format allows ({files.size_text(cap)})"
    with open(path, "wb") as f:
        f.truncate(cap + 1)
    return f"more than a {shape} may be ({files.size_text(cap)})"


@pytest.mark.parametrize(
    "rel, argv, shape",
    [
        pytest.param(*c[1:4], marks=pytest.mark.skipif(c[4] and not SLOW, reason="JAXPAR_SLOW=1 (3 to 6 s each)"))
        for c in CASES
    ],
    ids=[c[0] for c in CASES],
)
def test_each_reader_refuses_a_fifo_and_an_oversize_file_in_one_line(tmp_path, rel, argv, shape):
    (tmp_path / "good.json").write_text('{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1}\n')
    words = _hostile(tmp_path / rel, shape)
    argv = [a.replace("{f}", str(tmp_path / rel)).replace("{d}", str(tmp_path)) for a in argv]
    start = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "jaxpar", *argv],
            cwd=tmp_path,
            env=child_env(PYTHONPATH=str(ROOT)),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=LIMIT_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"jaxpar {' '.join(argv)}: still running after {LIMIT_S} s (blocked on the {shape} file?)")
    seconds = time.monotonic() - start
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-2000:]
    assert words in lines[0] and pathlib.Path(rel).name in lines[0], lines[0]
    assert seconds < FAST_S, f"{seconds:.1f} s"
