"""Hostile input, round two (issue 32), one table across the families: config files that misbehave,
overrides and flags that conflict or cannot act, recipes built to be slow, files that are not files,
environment variables. Each case must end in one ``error:`` line with exit 2 naming what it names
here, or (the ``None`` rows) succeed; never a traceback, a hang or a silent acceptance. A seeded
sample runs by default, every case under ``JAXPAR_SLOW=1``."""

from __future__ import annotations

import json
import os

import pytest

from tests import fuzzkit
from tests.fuzzkit import cli_refused, run_cli
from tests.helpers import ROOT

PLAN = ["plan", "--json", "--top", "1"]
TYPO = "JAXPAR_" + "TYPO"  # spelt apart: test_environment finds every JAXPAR_ name the repository reads

# file name -> content (written into a fresh folder per case; "FIFO" makes a named pipe, "DIR" a folder)
FILES = {
    "loop.py": "while True:\n    pass\n",
    "stdin.py": "x = input()\n",
    "thread.py": (
        "import threading, time\nfrom jaxpar.config import default_config\n\n"
        "def get_config():\n    threading.Thread(target=time.sleep, args=(3600,)).start()\n"
        "    return default_config()\n"
    ),
    "loud.py": "from jaxpar.config import default_config\n\ndef get_config():\n    print('x' * 100000)\n"
    "    return default_config()\n",
    "nan.py": "from jaxpar.config import default_config\n\ndef get_config():\n    c = default_config()\n"
    "    c.optim.lr = float('nan')\n    return c\n",
    "strsteps.py": "def get_config():\n    return {'train': {'steps': '10'}}\n",
    "exits.py": "import os\nos._exit(0)\n",
    "fifo.py": "FIFO",
    "dir.py": "DIR",
    "arr.sh": "ARGS=(\n --num-layers 2\n",
    "deep.yaml": "a: " + "[" * 1000 + "]" * 1000 + "\n",
    "alias.yaml": "a: &x [1]\nb: *x\n",
    "dup.json": '{"train_batch_size": 8, "train_batch_size": 16}',
    "big.json": json.dumps({"k": "x" * 2_000_000}),
}

# (argv with {d} for the folder of FILES, environment, the error line's start after "error: " or None: exit 0)
CASES = [
    (["inspect", "--config", "{d}/loop.py"], {"JAXPAR_CONFIG_TIMEOUT": "1"}, "--config: '{d}/loop.py': did not finish"),
    (["train", "--config", "{d}/loop.py"], {"JAXPAR_CONFIG_TIMEOUT": "1"}, "--config: '{d}/loop.py': did not finish"),
    ([*PLAN, "--config", "{d}/stdin.py"], {}, "--config: '{d}/stdin.py' failed to load (EOFError"),
    ([*PLAN, "--config", "{d}/thread.py"], {}, None),
    ([*PLAN, "--config", "{d}/loud.py"], {}, None),
    ([*PLAN, "--config", "{d}/nan.py"], {}, "optim.lr=nan: use a finite value > 0"),
    ([*PLAN, "--config", "{d}/strsteps.py"], {}, "config.train.steps: expected int, got '10'"),
    ([*PLAN, "--config", "{d}/exits.py"], {}, "--config: '{d}/exits.py': the process running it ended without"),
    ([*PLAN, "--config", "{d}/fifo.py"], {}, "--config: '{d}/fifo.py' is a FIFO (named pipe), not a regular file"),
    ([*PLAN, "--config", "{d}/dir.py"], {}, "--config: '{d}/dir.py' is a folder, not a regular file"),
    ([*PLAN, "--config", "/dev/zero"], {}, "--config: '/dev/zero' is a character device"),
    (
        [*PLAN, "--config", f"{ROOT}/configs/tiny.py:extra"],
        {},
        f"--config: '{ROOT}/configs/tiny.py': get_config does not",
    ),
    ([*PLAN, "--config.train.global_batch=1e3"], {}, "--config.train.global_batch: '1e3' is not a valid int"),
    ([*PLAN, "--config.optim.lr=inf"], {}, "optim.lr=inf: use a finite value > 0"),
    ([*PLAN, "--config.train.workdir=~/x"], {}, "config.train.workdir='~/x': jaxpar does not expand '~'"),
    ([*PLAN, "--config.data.path=~/tokens.bin"], {}, "config.data.path='~/tokens.bin': jaxpar does not expand '~'"),
    ([*PLAN, "--config.model=1"], {}, "--config.model: unknown config key 'model'"),
    ([*PLAN, "--config.train.global_batch="], {}, "--config.train.global_batch: '' is not a valid int"),
    ([*PLAN, "--config.train.steps=1", "--config.train.steps=2"], {}, "jaxpar plan: --config.train.steps given twice"),
    (
        ["sweep", "--list", "--config.parallel.sequence_parallel=maybe"],
        {},
        "--config.parallel.sequence_parallel: 'maybe' is not",
    ),
    ([*PLAN, "--global-batch", "64", "--config.train.global_batch=64"], {}, "plan: --global-batch and --config.train"),
    ([*PLAN, "--config.mesh.data=2"], {}, "plan: --config.mesh.data=2: plan does not read mesh.data"),
    ([*PLAN, "--top", "2"], {}, "jaxpar plan: --top given twice"),
    ([*PLAN, "--layout", "tensor=0"], {}, "--layout 'tensor=0': expected comma-separated"),
    ([*PLAN, "--efficiency", "2"], {}, "--efficiency 2.0: use a value in (0, 1]"),
    ([*PLAN, "--devices", "7"], {}, "plan: 7 devices is not a multiple of 8 devices per node"),
    (["compare", "--layout", "data=8", "--config.mesh.data=8"], {}, "compare: --config.mesh.data=8: compare does"),
    (["sweep", "--list", "--config.train.steps=3"], {}, "sweep: --config.train.steps=3: sweep does not read"),
    (["sweep", "--list", "--only", "("], {}, "--only '(': not a regular expression"),
    (["port", "megatron", "{d}/arr.sh"], {}, "megatron: line 1: the array ARGS=( is never closed"),
    (["port", "fsdp", "{d}/deep.yaml"], {}, "fsdp: deep.yaml: the YAML nests more than 100 levels deep"),
    (["port", "fsdp", "{d}/alias.yaml"], {}, "fsdp: alias.yaml: YAML alias *x (line 2)"),
    (["port", "deepspeed", "{d}/dup.json", "--world-size", "8"], {}, "deepspeed: dup.json repeats key(s)"),
    (
        ["port", "deepspeed", "{d}/big.json", "--world-size", "8"],
        {},
        "deepspeed: '{d}/big.json' is 1.91 MiB, more than",
    ),
    (["port", "deepspeed", "{d}/fifo.py", "--world-size", "8"], {}, "deepspeed: '{d}/fifo.py' is a FIFO"),
    (["port", "torchtitan", "{d}/dir.py"], {}, "torchtitan: '{d}/dir.py' is a folder"),
    (["port", "megatron", "{d}/arr.sh", "--config.train.steps=3"], {}, "port: --config.train.steps=3: port does not"),
    (PLAN, {"JAXPAR_CONFIG_TIMEOUT": "0"}, "JAXPAR_CONFIG_TIMEOUT='0': use a whole number of seconds"),
    (PLAN, {"JAXPAR_HEARTBEAT_TIMEOUT": "abc"}, "JAXPAR_HEARTBEAT_TIMEOUT='abc': use a whole number"),
    (PLAN, {TYPO: "1"}, f"{TYPO}: not a jaxpar variable"),
    (["inspect"], {"JAXPAR_COORDINATOR": "localhost:1234"}, "JAXPAR_COORDINATOR is set but JAXPAR_NUM_PROCESSES"),
    (
        ["export", "-o", f"{ROOT}/configs/tiny.py", "--config", f"{ROOT}/configs/tiny.py"],
        {},
        f"export -o {ROOT}/configs/tiny.py: is the input --config=",
    ),
    (["drill", "--processes", "3"], {}, "--processes 3: use 1, 2, 4 or 8"),
    (["drill", "--config.train.workdir=x"], {}, "drill: --config.train.workdir: the drill puts its two runs"),
]


def _folder(tmp_path) -> str:
    for name, content in FILES.items():
        path = tmp_path / name
        if content == "FIFO":
            os.mkfifo(path)
        elif content == "DIR":
            path.mkdir()
        else:
            path.write_text(content)
    return str(tmp_path)


@pytest.mark.parametrize(
    "argv, env, words",
    fuzzkit.sample("hostile: round two", CASES, 12),
    ids=lambda v: " ".join(v)[:60] if isinstance(v, list) else None,
)
def test_hostile_input_round_two(argv, env, words, tmp_path, monkeypatch):
    folder = _folder(tmp_path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    argv = [a.replace("{d}", folder) for a in argv]
    if words is None:
        code, _out, err = run_cli(argv)
        assert code == 0, err[-2000:]
        return
    line = cli_refused("hostile: round two", argv)
    assert line.startswith("error: " + words.replace("{d}", folder)), line
