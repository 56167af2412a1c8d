"""Several processes on one machine, started the way a user's shell starts them.

``scripts/launch_local.sh N jaxpar train`` from a clean environment (no test-session ``XLA_FLAGS``):
each process simulates its share of the mesh's devices (:func:`jaxpar.distributed.simulate_local_devices`),
so 2 and 4 processes train the same 8-device mesh as one process and log the same losses. And the
device-count rule itself: the share from the process count, a conflicting ``XLA_FLAGS`` refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxpar import distributed
from jaxpar.errors import ConfigError
from tests.helpers import ROOT, TINY

# fp32 so the processes' gloo reductions and one process's agree to roundoff; no validation
RUN = ["--config.model.compute_dtype=float32", "--config.train.global_batch=8", "--config.train.seq_len=64",
       "--config.train.steps=3", "--config.train.eval_batches=0", "--config.train.eval_every=0"]


def _clean_env(**extra: str) -> dict[str, str]:
    """A user's shell: PATH and HOME, no XLA_FLAGS, no JAX_PLATFORMS (the compile cache kept for speed)."""
    keep = ("PATH", "HOME", "JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
    return {k: os.environ[k] for k in keep if k in os.environ} | extra


def _losses(workdir) -> list[float]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def _train(cmd_prefix: list[str], workdir, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [*cmd_prefix, sys.executable, "-m", "jaxpar", "train", "--config", TINY, "--no-progress", *RUN,
           f"--config.train.workdir={workdir}"]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def single_process_losses(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("one")
    done = _train([], workdir, _clean_env())
    assert done.returncode == 0, done.stderr[-2000:]
    return _losses(workdir)


FOUR = pytest.mark.skipif(os.environ.get("JAXPAR_SLOW") != "1", reason="JAXPAR_SLOW=1: 4 processes (2 in the default suite)")


@pytest.mark.parametrize("processes", [2, pytest.param(4, marks=FOUR)])
def test_launch_local_gives_the_single_process_losses(tmp_path, single_process_losses, processes):
    launcher = ["bash", str(ROOT / "scripts" / "launch_local.sh"), str(processes)]
    done = _train(launcher, tmp_path, _clean_env(JAXPAR_HEARTBEAT_TIMEOUT="30"))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    losses = _losses(tmp_path)
    assert len(losses) == len(single_process_losses) == 3
    for ours, one in zip(losses, single_process_losses, strict=True):
        assert abs(ours - one) / abs(one) < 1e-5, (losses, single_process_losses)


def test_launch_local_refuses_a_conflicting_device_count(tmp_path):
    launcher = ["bash", str(ROOT / "scripts" / "launch_local.sh"), "2"]
    env = _clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=8")
    done = _train(launcher, tmp_path, env)
    assert done.returncode == 2
    errors = [x for x in done.stderr.splitlines() if x.startswith("error: ")]
    assert errors and "XLA_FLAGS sets --xla_force_host_platform_device_count=8 but this process needs 4" in errors[0]
    assert "Traceback" not in done.stderr


@pytest.fixture
def fresh(monkeypatch):
    """The rule as before JAX starts: no launch variables, no device count in XLA_FLAGS."""
    monkeypatch.setattr(distributed, "jax_started", lambda: False)
    for name in [n for n in os.environ if n.startswith(("SLURM_", "JAXPAR_"))] + ["JAX_PLATFORMS"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1")
    return monkeypatch


def test_share_is_mesh_devices_over_processes(fresh):
    assert distributed.simulate_local_devices(8) == 8
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8"
    fresh.setenv("XLA_FLAGS", "")
    fresh.setenv("JAXPAR_COORDINATOR", "127.0.0.1:1234")
    fresh.setenv("JAXPAR_NUM_PROCESSES", "4")
    assert distributed.simulate_local_devices(8) == 2
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    assert distributed.simulate_local_devices(8) == 2  # the same count given again agrees


def test_slurm_step_tasks_count_but_not_a_stale_variable(fresh):
    fresh.setenv("SLURM_NTASKS", "4")  # a batch script's shell, no srun step: one process
    assert distributed.launch_process_count() == 1
    for name, value in {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "node[1-2]",
                        "SLURM_PROCID": "1"}.items():
        fresh.setenv(name, value)
    assert distributed.launch_process_count() == 4
    assert distributed.simulate_local_devices(8) == 2


def test_conflicts_are_refused_in_one_line(fresh):
    fresh.setenv("JAXPAR_COORDINATOR", "127.0.0.1:1234")
    with pytest.raises(ConfigError, match="JAXPAR_NUM_PROCESSES is not"):
        distributed.launch_process_count()
    fresh.setenv("JAXPAR_NUM_PROCESSES", "3")
    with pytest.raises(ConfigError, match="do not split over 3 processes"):
        distributed.simulate_local_devices(8)
    fresh.setenv("JAXPAR_NUM_PROCESSES", "2")
    # XLA reads the last count given: every count given must be the share
    fresh.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4 --xla_force_host_platform_device_count=8")
    with pytest.raises(ConfigError, match=r"=4, 8 but this process needs 4 \(8 mesh devices over 2 processes\)"):
        distributed.simulate_local_devices(8)
    fresh.setenv("JAX_PLATFORMS", "cuda")  # not CPU: the flag does not apply
    assert distributed.simulate_local_devices(8) is None
