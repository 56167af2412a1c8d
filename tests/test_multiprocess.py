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
import time

import pytest

from jaxpar import distributed
from jaxpar.errors import ConfigError
from tests.helpers import ROOT, TINY

# fp32 so the processes' gloo reductions and one process's agree to roundoff; no validation
RUN = [
    "--config.model.compute_dtype=float32",
    "--config.train.global_batch=8",
    "--config.train.seq_len=64",
    "--config.train.steps=3",
    "--config.train.eval_batches=0",
    "--config.train.eval_every=0",
]


def _clean_env(**extra: str) -> dict[str, str]:
    """A user's shell: PATH and HOME, no XLA_FLAGS, no JAX_PLATFORMS (the compile cache kept for speed)."""
    keep = ("PATH", "HOME", "JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
    return {k: os.environ[k] for k in keep if k in os.environ} | extra


def _losses(workdir) -> list[float]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def _train(cmd_prefix: list[str], workdir, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [
        *cmd_prefix,
        sys.executable,
        "-m",
        "jaxpar",
        "train",
        "--config",
        TINY,
        "--no-progress",
        *RUN,
        f"--config.train.workdir={workdir}",
    ]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def single_process_losses(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("one")
    done = _train([], workdir, _clean_env())
    assert done.returncode == 0, done.stderr[-2000:]
    return _losses(workdir)


FOUR = pytest.mark.skipif(
    os.environ.get("JAXPAR_SLOW") != "1", reason="JAXPAR_SLOW=1: 4 processes (2 in the default suite)"
)


@pytest.mark.parametrize("processes", [2, pytest.param(4, marks=FOUR)])
def test_launch_local_gives_the_single_process_losses_and_a_second_run_shares_the_cache(
    tmp_path, single_process_losses, processes
):
    """N local processes train the one-process losses, twice, sharing a fresh persistent-cache folder:
    the first run writes the step and the second reads it back and finishes. On jax 0.12.1 a train step
    with collectives across processes, read back from the cache, hangs (jaxpar.compat.cached_collectives_hang),
    so there the step is never written to it, and one run shows that."""
    from jaxpar.compat import cached_collectives_hang

    launcher = ["bash", str(ROOT / "scripts" / "launch_local.sh"), str(processes)]
    env = _clean_env(
        JAXPAR_HEARTBEAT_TIMEOUT="30",
        JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    # where the step is never written to the cache, a second run would only repeat the first
    for run in ("first",) if cached_collectives_hang() else ("first", "second"):
        done = _train(launcher, tmp_path / run, env)
        assert done.returncode == 0, (run, (done.stdout + done.stderr)[-3000:])
        losses = _losses(tmp_path / run)
        assert len(losses) == len(single_process_losses) == 3
        for ours, one in zip(losses, single_process_losses, strict=True):
            assert abs(ours - one) / abs(one) < 1e-5, (run, losses, single_process_losses)
    cached = sorted(p.name.split("-")[0] for p in (tmp_path / "cache").iterdir())
    assert ("jit_local_step" in cached) is not cached_collectives_hang(), cached


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
    fresh.setenv("JAXPAR_PROCESS_ID", "3")
    assert distributed.simulate_local_devices(8) == 2
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    assert distributed.simulate_local_devices(8) == 2  # the same count given again agrees


def test_slurm_step_tasks_count_but_not_a_stale_variable(fresh):
    fresh.setenv("SLURM_NTASKS", "4")  # a batch script's shell, no srun step: one process
    assert distributed.launch_process_count() == 1
    for name, value in {
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_PROCID": "1",
    }.items():
        fresh.setenv(name, value)
    assert distributed.launch_process_count() == 4
    assert distributed.simulate_local_devices(8) == 2


def test_conflicts_are_refused_in_one_line(fresh):
    fresh.setenv("JAXPAR_COORDINATOR", "127.0.0.1:1234")
    with pytest.raises(ConfigError, match="JAXPAR_NUM_PROCESSES is not"):
        distributed.launch_process_count()
    fresh.setenv("JAXPAR_NUM_PROCESSES", "3")
    with pytest.raises(ConfigError, match="JAXPAR_PROCESS_ID is not"):
        distributed.launch_process_count()
    fresh.setenv("JAXPAR_PROCESS_ID", "1")
    with pytest.raises(ConfigError, match="do not split over 3 processes"):
        distributed.simulate_local_devices(8)
    fresh.setenv("JAXPAR_NUM_PROCESSES", "2")
    # XLA reads the last count given: every count given must be the share
    fresh.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4 --xla_force_host_platform_device_count=8")
    with pytest.raises(ConfigError, match=r"=4, 8 but this process needs 4 \(8 mesh devices over 2 processes\)"):
        distributed.simulate_local_devices(8)
    fresh.setenv("JAX_PLATFORMS", "cuda")  # not CPU: the flag does not apply
    assert distributed.simulate_local_devices(8) is None


# ---------------------------------------------------------------- launch environments, as values

SLURM_STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "gpu[07-08],cpu1",
    "SLURM_NTASKS": "16",
    "SLURM_PROCID": "9",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURMD_NODENAME": "gpu08",
}


def test_slurm_step_spec_follows_jax_coordinator_rule():
    spec = distributed.launch_spec(
        SLURM_STEP | {"SLURM_STEP_TASKS_PER_NODE": "8(x2)", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    )
    assert (spec.source, spec.num_processes, spec.process_id, spec.node) == ("slurm", 16, 9, "gpu08")
    assert spec.coordinator == f"gpu07:{61440 + 4242 % 4096}"  # jax._src.clusters.slurm_cluster's port rule
    assert spec.local_device_ids == (1,)  # one task per GPU: task 1 of its node takes GPU 1
    ours = distributed.launch_spec(SLURM_STEP | {"JAXPAR_COORDINATOR": "10.0.0.7:6000"})
    assert ours.coordinator == "10.0.0.7:6000"
    with pytest.raises(ConfigError, match="JAXPAR_NUM_PROCESSES=4 but the srun step has SLURM_NTASKS=16"):
        distributed.launch_spec(SLURM_STEP | {"JAXPAR_NUM_PROCESSES": "4"})


@pytest.mark.parametrize(
    "tasks_per_node, visible, gpus_on_node, localid, expected",
    [
        ("1(x2)", "0,1,2,3,4,5,6,7", None, "0", None),  # one task per node: every GPU of the node
        ("8(x2)", "0,1,2,3,4,5,6,7", None, "5", (5,)),  # one task per GPU, GPUs shared: its own
        ("2(x2)", "0,1,2,3,4,5,6,7", None, "1", (4, 5, 6, 7)),  # two tasks of four GPUs
        ("8(x2)", "3", None, "3", None),  # --gpus-per-task: SLURM bound it, all it sees
        ("8(x2)", "", "8", "2", (2,)),  # GPU count from SLURM_GPUS_ON_NODE
        ("2(x2)", "", None, "1", None),  # no GPUs (CPU nodes)
    ],
)
def test_slurm_local_devices(tasks_per_node, visible, gpus_on_node, localid, expected):
    env = SLURM_STEP | {"SLURM_STEP_TASKS_PER_NODE": tasks_per_node, "SLURM_LOCALID": localid}
    if visible:
        env["CUDA_VISIBLE_DEVICES"] = visible
    if gpus_on_node:
        env["SLURM_GPUS_ON_NODE"] = gpus_on_node
    assert distributed.slurm_local_devices(env) == expected


def test_slurm_local_devices_refusals_and_override():
    env = SLURM_STEP | {"SLURM_STEP_TASKS_PER_NODE": "3(x2)", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    with pytest.raises(ConfigError, match="3 tasks on this node share 8 GPUs, which do not split evenly"):
        distributed.slurm_local_devices(env)
    assert distributed.slurm_local_devices(env | {"JAXPAR_LOCAL_DEVICES": "6,7"}) == (6, 7)
    with pytest.raises(ConfigError, match="JAXPAR_LOCAL_DEVICES='6;7'"):
        distributed.slurm_local_devices(env | {"JAXPAR_LOCAL_DEVICES": "6;7"})
    with pytest.raises(ConfigError, match="not SLURM's form"):
        distributed.slurm_tasks_on_node({"SLURM_STEP_TASKS_PER_NODE": "two"})
    assert distributed.slurm_tasks_on_node({"SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3"}) == 1


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("node1", "node1"),
        ("node[03-05,9],gpu1", "node03"),
        ("a1,b2", "a1"),
        ("[7-9]", "7"),
        ("rack2-n[1,5]", "rack2-n1"),
    ],
)
def test_first_slurm_node(nodelist, first):
    assert distributed.first_slurm_node(nodelist) == first


def test_explicit_and_kubernetes_indexed_job_specs():
    base = {"JAXPAR_COORDINATOR": "trainer-0.svc:1234", "JAXPAR_NUM_PROCESSES": "4"}
    assert distributed.launch_spec(base | {"JOB_COMPLETION_INDEX": "2"}).process_id == 2
    assert distributed.launch_spec(base | {"JOB_COMPLETION_INDEX": "2"}).source == "k8s-indexed-job"
    assert distributed.launch_spec(base | {"JAXPAR_PROCESS_ID": "3", "JOB_COMPLETION_INDEX": "0"}).process_id == 3
    with pytest.raises(ConfigError, match=r"JOB_COMPLETION_INDEX=4 must be in \[0, JAXPAR_NUM_PROCESSES=4\)"):
        distributed.launch_spec(base | {"JOB_COMPLETION_INDEX": "4"})
    assert not distributed.launch_spec({"SLURM_NTASKS": "4"}).distributed  # a stale variable: one process


def test_a_coordinator_that_does_not_resolve_is_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAXPAR_"))}
    env |= {
        "JAXPAR_COORDINATOR": "no-such-host.invalid:1234",
        "JAXPAR_NUM_PROCESSES": "2",
        "JAXPAR_PROCESS_ID": "1",
        "XLA_FLAGS": "",
    }
    done = _train([], tmp_path, env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "error: JAXPAR_COORDINATOR: coordinator host 'no-such-host.invalid' does not resolve; "
        "use an address every process can resolve"
    )


def test_a_coordinator_that_does_not_answer_fails_within_the_bound(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAXPAR_"))}
    env |= {
        "JAXPAR_COORDINATOR": f"127.0.0.1:{port}",
        "JAXPAR_NUM_PROCESSES": "2",
        "JAXPAR_PROCESS_ID": "1",
        "JAXPAR_COORDINATOR_TIMEOUT": "3",
        "XLA_FLAGS": "",
    }
    started = time.time()
    done = _train([], tmp_path, env)
    assert time.time() - started < 60
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: process 1/2 could not reach the coordinator at 127.0.0.1:{port} within 3s"), last
    assert "Traceback" not in done.stderr


def test_a_peer_that_never_joins_is_one_line_within_the_bound(tmp_path):
    """Process 0 of 2 alone: the coordinator runs, nobody else registers. jaxpar's watchdog ends it
    in one line before jax.distributed's own deadline (a C++ abort with a stack trace, exit 134)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = _clean_env(
        JAXPAR_COORDINATOR=f"127.0.0.1:{port}",
        JAXPAR_NUM_PROCESSES="2",
        JAXPAR_PROCESS_ID="0",
        JAXPAR_COORDINATOR_TIMEOUT="3",
    )
    started = time.time()
    done = _train([], tmp_path / "run", env)
    assert time.time() - started < 3 + distributed.REGISTRATION_MARGIN_S
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        f"error: process 0/2: the other processes did not join the job at 127.0.0.1:{port} within 3s "
        "(JAXPAR_COORDINATOR_TIMEOUT); start all 2 processes with the same coordinator (see their logs), "
        "or raise JAXPAR_COORDINATOR_TIMEOUT"
    ]


def test_tensor_and_context_must_stay_inside_a_node():
    from types import SimpleNamespace

    from jaxpar.layout import ParallelLayout
    from jaxpar.mesh import _check_inner_axes_in_nodes, _ordered_devices

    devices = [SimpleNamespace(process_index=p, id=8 * p + i) for p in range(4) for i in range(2)]
    nodes = ["a", "b", "a", "b"]  # SLURM's cyclic distribution: processes 0 and 2 share node a
    ordered = _ordered_devices(devices, nodes)
    assert [d.process_index for d in ordered] == [0, 0, 2, 2, 1, 1, 3, 3]
    import numpy as np

    fits = ParallelLayout(data=2, tensor=4)
    _check_inner_axes_in_nodes(fits, np.array(ordered, dtype=object).reshape(1, 2, 1, 4), nodes)
    spans = ParallelLayout(data=1, tensor=2, context=4)
    with pytest.raises(ConfigError, match=r"mesh.tensor=2 x mesh.context=4 = 8 devices span nodes \(each node has 4"):
        _check_inner_axes_in_nodes(spans, np.array(ordered, dtype=object).reshape(1, 1, 4, 2), nodes)
