"""The environment, checked before JAX starts (:mod:`jaxpar.environment`): every variable jaxpar
reads is in one table, and a bad value is one line naming it, exit code 2."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from jaxpar import environment
from jaxpar.errors import ConfigError
from tests.helpers import ROOT, TINY

BAD = [  # (environment, the start of the one line)
    (
        {"JAXPAR_HEARTBEAT_TIMOUT": "5"},
        "JAXPAR_HEARTBEAT_TIMOUT: not a jaxpar variable; did you mean JAXPAR_HEARTBEAT_TIMEOUT?",
    ),
    (
        {"JAXPAR_HEARTBEAT_TIMEOUT": "abc"},
        "JAXPAR_HEARTBEAT_TIMEOUT='abc': use a whole number of seconds of at least 1",
    ),
    ({"JAXPAR_COORDINATOR_TIMEOUT": "0"}, "JAXPAR_COORDINATOR_TIMEOUT='0': use a whole number of seconds"),
    ({"JAXPAR_CACHE_DIR": " "}, "JAXPAR_CACHE_DIR is empty: set a folder path or unset it"),
    ({"JAXPAR_COORDINATOR": "h:1"}, "JAXPAR_COORDINATOR is set but JAXPAR_NUM_PROCESSES is not"),
    (
        {"JAXPAR_COORDINATOR": "h:1", "JAXPAR_NUM_PROCESSES": "2"},
        "JAXPAR_COORDINATOR is set but JAXPAR_PROCESS_ID is not",
    ),
    (
        {"JAXPAR_COORDINATOR": "h:1", "JAXPAR_NUM_PROCESSES": "x", "JAXPAR_PROCESS_ID": "0"},
        "JAXPAR_NUM_PROCESSES='x': must be a non-negative integer",
    ),
    (
        {
            "JAXPAR_LOCAL_DEVICES": "0;1",
            "JAXPAR_COORDINATOR": "h:1",
            "JAXPAR_NUM_PROCESSES": "2",
            "JAXPAR_PROCESS_ID": "0",
        },
        "JAXPAR_LOCAL_DEVICES='0;1': use comma-separated device indices",
    ),
    ({"JAX_PLATFORMS": "gpu"}, "JAX_PLATFORMS='gpu': no gpu plugin for jax is installed here"),
    ({"JAX_PLATFORMS": "cpu,metal"}, "JAX_PLATFORMS='cpu,metal': 'metal' is not a platform"),
    ({"XLA_FLAGS": "xla_cpu_foo"}, "XLA_FLAGS: 'xla_cpu_foo' is not a flag"),
]


@pytest.mark.parametrize("env, message", BAD, ids=[next(iter(e)) + "=" + next(iter(e.values())) for e, _ in BAD])
def test_bad_environment_is_one_line(env, message):
    with pytest.raises(ConfigError) as caught:
        environment.check_environment(env)
    assert str(caught.value).startswith(message), str(caught.value)
    assert "\n" not in str(caught.value)


def test_good_environments_pass():
    environment.check_environment({})
    environment.check_environment(
        {
            "JAX_PLATFORMS": "cpu",
            "JAXPAR_HEARTBEAT_TIMEOUT": "30",
            "JAXPAR_SLOW": "1",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
        }
    )
    environment.check_environment({"JAX_PLATFORMS": "gpu", "XLA_FLAGS": "--bogus"}, jax_runs=False)  # port: no JAX


def test_every_jaxpar_variable_in_the_repository_is_in_the_table():
    """A variable read anywhere (package, scripts, tests, experiments) must be declared, or
    check_environment would refuse it for a user who sets it."""
    names = set()
    for folder in ("jaxpar", "scripts", "tests", "experiments", ".ci"):
        for path in (ROOT / folder).rglob("*"):
            if path.name == "test_environment.py":  # its misspelt names are the point
                continue
            if path.is_file() and path.suffix in (".py", ".sh", ".sbatch", "") and "__pycache__" not in path.parts:
                names |= set(re.findall(r"\bJAXPAR_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="ignore")))
    names.discard("JAXPAR_VARIABLES")  # the table's own name
    declared = set(environment.JAXPAR_VARIABLES)
    assert names - declared == set(), f"undeclared: {sorted(names - declared)}"
    assert declared - names == set(), f"declared but never read: {sorted(declared - names)}"


def test_an_xla_flag_xla_does_not_know_is_refused_before_xla_aborts(tmp_path):
    """XLA aborts the process in C++ on an unknown flag; jaxpar tries the flags in a child first and
    says which, in one line with exit 2."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXPAR_")}
    env |= {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_no_such_flag=1",
        "JAXPAR_CACHE_DIR": str(tmp_path),
    }
    done = subprocess.run(
        [sys.executable, "-m", "jaxpar", "train", "--config", TINY],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip() == (
        f"error: XLA_FLAGS: XLA does not know --xla_no_such_flag (jaxlib "
        f"{__import__('jaxlib').__version__}) and would abort; remove or correct them"
    )


def test_a_good_flag_set_is_probed_once(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXPAR_CACHE_DIR", str(tmp_path))
    environment.check_xla_flags("--xla_cpu_enable_fast_math=false")  # XLA knows it: the child starts
    assert len(list((tmp_path / "xla-flags").iterdir())) == 1

    def no_child(*args, **kwargs):
        raise AssertionError("probed again")

    monkeypatch.setattr(subprocess, "run", no_child)
    environment.check_xla_flags("--xla_cpu_enable_fast_math=true")  # the same flag: the cached verdict
