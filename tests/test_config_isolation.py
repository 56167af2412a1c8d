"""A ``--config`` file runs in a child process with a time limit (jaxpar.isolated): a file that loops,
starts a thread that never ends or ends the interpreter cannot hang or end ``jaxpar``; the values that
come back are exactly those the file builds."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxpar import config, isolated
from jaxpar.config import loading
from jaxpar.environment import check_environment
from jaxpar.errors import ConfigError
from tests.fuzzkit import cli_refused
from tests.helpers import ROOT, child_env

HEAD = "from jaxpar.config import default_config\n\n"
CONFIGS = sorted((ROOT / "configs").glob("*.py"))


def _file(tmp_path, body: str) -> str:
    path = tmp_path / "cfg.py"
    path.write_text(HEAD + body)
    return str(path)


@pytest.mark.parametrize(
    "body, words",
    [
        ("while True:\n    pass\n", "did not finish within 1 s (it was stopped)"),
        ("def get_config():\n    import time\n    time.sleep(600)\n", "did not finish within 1 s (it was stopped)"),
        ("import os\nos._exit(0)\n", "the process running it ended without a result (exit code 0)"),
        (
            "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n",
            "the process running it ended without a result (signal 11)",
        ),
    ],
)
def test_a_config_file_that_hangs_or_ends_the_interpreter_is_one_line(tmp_path, monkeypatch, body, words):
    monkeypatch.setenv("JAXPAR_CONFIG_TIMEOUT", "1")
    path = _file(tmp_path, body)
    line = cli_refused("hostile: config files", ["inspect", "--config", path])
    assert line.startswith(f"error: --config: '{path}': {words}; "), line
    assert "JAXPAR_CONFIG_TIMEOUT" in line, line


def test_a_thread_the_config_starts_does_not_keep_jaxpar_alive(tmp_path):
    body = (
        "import threading, time\n\n"
        "def get_config():\n"
        "    threading.Thread(target=time.sleep, args=(3600,)).start()  # not a daemon\n"
        "    c = default_config()\n    c.train.steps = 7\n    return c\n"
    )
    argv = [sys.executable, "-m", "jaxpar", "plan", "--json", "--config", _file(tmp_path, body)]
    # the hang guard: without the child process, the thread keeps the interpreter alive for an hour
    done = subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.lstrip().startswith(("{", "[")), done.stdout[:200]


@pytest.mark.parametrize("fork", [True, False], ids=["fork", "fresh interpreter"])
def test_the_values_come_back_exactly(fork, monkeypatch):
    """Each shipped config through the child equals the same file run in this process, type for type."""
    monkeypatch.setattr(isolated, "fork_is_safe", lambda: fork)
    monkeypatch.setattr(loading, "_VALUES", {})  # every file through the child here, none from earlier loads
    for path in CONFIGS[:3] if not fork else CONFIGS:
        here = config.merge_into_defaults(config.config_file_values(str(path)), source=str(path)).to_dict()
        there = config.load_config(str(path)).to_dict()
        assert there == here, path.name
        flat_here, flat_there = config.flatten(here), config.flatten(there)
        assert {k: type(v) for k, v in flat_there.items()} == {k: type(v) for k, v in flat_here.items()}


def test_a_config_error_in_the_child_is_the_same_line(tmp_path):
    path = _file(tmp_path, "def get_config():\n    return {'model': {'embed_dim': 'wide'}}\n")
    with pytest.raises(ConfigError) as e:
        config.load_config(path)
    assert str(e.value) == "config.model.embed_dim: expected int, got 'wide'; fix the value in the config"


@pytest.mark.parametrize("value", ["0", "abc", "1.5"])
def test_a_bad_time_limit_is_refused(value, monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match=f"JAXPAR_CONFIG_TIMEOUT='{value}': use a whole number of seconds"):
        check_environment({"JAXPAR_CONFIG_TIMEOUT": value}, jax_runs=False)
    monkeypatch.setenv("JAXPAR_CONFIG_TIMEOUT", value)
    with pytest.raises(ConfigError, match=f"JAXPAR_CONFIG_TIMEOUT='{value}': use a whole number of seconds"):
        config.load_config(_file(tmp_path, "def get_config():\n    return default_config()\n"))


def test_a_config_file_runs_once_per_process_for_the_same_bytes(tmp_path, monkeypatch):
    """The child runs a file once for the same bytes and argument; new bytes run it again (the values
    are kept by content, not by name or time: a rewrite within one clock tick is seen)."""
    runs = []
    real = isolated.call
    monkeypatch.setattr(isolated, "call", lambda *a, **k: runs.append(a[2]) or real(*a, **k))
    path = tmp_path / "c.py"
    body = "from jaxpar.config import default_config\ndef get_config():\n    c = default_config()\n"
    path.write_text(body + "    c.train.steps = 11\n    return c\n")
    assert config.load_config(str(path)).train.steps == 11
    first = config.load_config(str(path))
    first.train.steps = 99  # the caller's copy: the kept values stay the file's
    assert config.load_config(str(path)).train.steps == 11 and len(runs) == 1
    path.write_text(body + "    c.train.steps = 12\n    return c\n")
    assert config.load_config(str(path)).train.steps == 12 and len(runs) == 2
