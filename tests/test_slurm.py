"""jaxpar under a real SLURM cluster of emulated nodes (``scripts/slurm/local_cluster.sh``).

The shipped ``scripts/slurm/train.sbatch`` is submitted with ``sbatch`` from a clean environment
(PATH, HOME and the cluster's SLURM_CONF): 2 nodes x 1 task train the tiny config with the
single-process 8-device losses, and 2 nodes x 2 tasks take a one-process run over half-way and end
on its losses; a ``kill -9`` of one task fails the job within seconds, the next ``sbatch`` resumes
from the newest complete checkpoint with bitwise the losses of an uninterrupted run, and one
process resumes the same checkpoint; a job larger than the cluster fails at once; a layout whose
``tensor`` x ``context`` block spans nodes is refused. Skipped, with the reason, where SLURM cannot be installed (not root, no package registry).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

from jaxpar.distributed import without_device_count
from tests.helpers import ROOT, TINY

CLUSTER = ROOT / "scripts" / "slurm" / "local_cluster.sh"
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
STEPS, EVERY = 16, 4
# fp32 so gloo's reductions and one process's agree to roundoff; a constant step count for every
# run here, since the learning-rate schedule depends on it
RUN = [
    "--config.model.compute_dtype=float32",
    "--config.train.global_batch=8",
    "--config.train.seq_len=64",
    f"--config.train.steps={STEPS}",
    "--config.train.eval_batches=0",
    "--config.train.eval_every=0",
    f"--config.checkpoint.every={EVERY}",
    "--config.checkpoint.keep=8",
]


def _user_env(**extra: str) -> dict[str, str]:
    """A user's shell (PATH with this interpreter's scripts first, HOME), plus ``extra``. The test
    session's compile cache and XLA optimisation level are kept for speed; its device count is not
    (each task sets its own share)."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "/usr/bin:/bin")])
    keep = ("HOME", "JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
    flags = {"XLA_FLAGS": without_device_count(os.environ.get("XLA_FLAGS", ""))}
    return {k: os.environ[k] for k in keep if k in os.environ} | {"PATH": path} | flags | extra


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two emulated nodes of 2 CPUs each, up for the module; the environment to submit jobs with."""
    if shutil.which("sbatch") is None and os.geteuid() != 0:
        pytest.skip("SLURM is not installed and installing it needs root")
    state = tmp_path_factory.mktemp("slurm")
    proc = subprocess.Popen(
        ["bash", str(CLUSTER), "--cpus", "2", "--dir", str(state), "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_user_env(),
        start_new_session=True,
    )
    line = proc.stdout.readline()  # "ready SLURM_CONF=..." once both nodes are idle
    if not line.startswith("ready "):
        proc.wait(timeout=30)
        err = proc.stderr.read()
        if proc.returncode == 3:  # SLURM could not be installed here
            pytest.skip(f"SLURM unavailable: {err.strip().splitlines()[-1] if err.strip() else 'no reason given'}")
        pytest.fail(f"local_cluster.sh did not start (exit {proc.returncode}): {err[-2000:]}")
    yield _user_env(SLURM_CONF=line.split("SLURM_CONF=")[1].split()[0])
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    assert subprocess.run(["pgrep", "-f", f"slurm.*{state}"], capture_output=True).returncode == 1, (
        "a daemon outlived the cluster"
    )


class Job:
    """A submitted job, followed through ``scontrol show job`` every 0.1 s (``sbatch --wait`` polls
    the controller at intervals growing to several seconds, which would dominate these short runs)."""

    FINAL = (
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
    )

    def __init__(self, env: dict[str, str], job_id: str, stderr: str):
        self.env, self.id, self.stderr, self.returncode = env, job_id, stderr, None

    def poll(self) -> int | None:
        """The job's exit status once it has ended (its exit code, else 128 + its signal), else None."""
        shown = subprocess.run(
            ["scontrol", "show", "job", "-o", self.id], env=self.env, capture_output=True, text=True, timeout=30
        ).stdout
        fields = dict(f.split("=", 1) for f in shown.split() if "=" in f)
        if fields.get("JobState") in self.FINAL:
            code, signum = (int(v) for v in fields["ExitCode"].split(":"))
            self.returncode = code or (128 + signum if signum else 0)
            if fields["JobState"] != "COMPLETED" and self.returncode == 0:
                self.returncode = 1
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.time() + timeout
        while self.poll() is None:
            if time.time() > deadline:
                subprocess.run(["scancel", self.id], env=self.env, timeout=30)
                raise TimeoutError(f"job {self.id} still running after {timeout:.0f}s; cancelled")
            time.sleep(0.1)
        return self.returncode


def _sbatch(
    env: dict[str, str], workdir: pathlib.Path, *options: str, background: bool = False, extra: tuple[str, ...] = ()
) -> Job | subprocess.CompletedProcess:
    """Submit the shipped script (a bound on the job: --time) and, unless ``background``, wait for it
    (a bound on the wait). A refused submission is the ``sbatch`` process itself."""
    cmd = [
        "sbatch",
        "--parsable",
        "--time=5",
        f"--output={workdir}.out",
        f"--chdir={workdir.parent}",
        *options,
        str(SBATCH),
        TINY,
        *RUN,
        f"--config.train.workdir={workdir}",
        *extra,
    ]
    submitted = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    if submitted.returncode != 0:
        return submitted
    job = Job(env, submitted.stdout.strip().split(";")[0], submitted.stderr)
    if not background:
        job.wait(timeout=240)
    return job


class OneProcess:
    """A one-process 8-device run started in the background (it overlaps the cluster's start and the
    jobs' scheduling waits); :meth:`result` waits for it and returns its workdir and losses."""

    def __init__(self, workdir: pathlib.Path):
        self.workdir = workdir
        cmd = [sys.executable, "-m", "jaxpar", "train", "--config", TINY, "--no-progress", *RUN]
        self.proc = subprocess.Popen(
            [*cmd, f"--config.train.workdir={workdir}"],
            env=_user_env(),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._losses: dict[int, float] | None = None

    def result(self) -> tuple[pathlib.Path, dict[int, float]]:
        if self._losses is None:
            _, err = self.proc.communicate(timeout=240)
            assert self.proc.returncode == 0, err[-2000:]
            self._losses = _losses(self.workdir)
        return self.workdir, self._losses


def _losses(workdir: pathlib.Path) -> dict[int, float]:
    """Loss per step; a step logged again after a resume counts as its last record."""
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _log(workdir: pathlib.Path) -> str:
    path = pathlib.Path(f"{workdir}.out")
    return path.read_text() if path.exists() else "(no job output)"


def _close(ours: dict[int, float], reference: dict[int, float], rel: float = 1e-5) -> None:
    assert sorted(ours) == sorted(reference) == list(range(1, STEPS + 1)), (sorted(ours), sorted(reference))
    worst = max(abs(ours[s] - reference[s]) / abs(reference[s]) for s in reference)
    assert worst < rel, f"largest relative error {worst:.2e} over {STEPS} steps"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The single-process reference, started before the cluster (fixtures run in request order)."""
    return OneProcess(tmp_path_factory.mktemp("one") / "run")


@pytest.fixture(scope="module")
def two_nodes(one_process, cluster, tmp_path_factory):
    """The uninterrupted run: sbatch of the shipped script on 2 nodes, one task each."""
    workdir = tmp_path_factory.mktemp("two") / "run"
    done = _sbatch(cluster, workdir, "--nodes=2", "--ntasks-per-node=1")
    assert done.returncode == 0, done.stderr + _log(workdir)[-3000:]
    return workdir, _losses(workdir)


def test_two_nodes_train_the_single_process_losses(two_nodes, one_process):
    workdir, losses = two_nodes
    assert "2 tasks, coordinator 127.0.0.1:" in _log(workdir)
    _close(losses, one_process.result()[1])


def _task_pid(job: str, procid: int) -> int | None:
    """The pid of task ``procid`` of SLURM job ``job`` (read from each process's environment)."""
    want = {f"SLURM_JOB_ID={job}".encode(), f"SLURM_PROCID={procid}".encode()}
    for entry in pathlib.Path("/proc").iterdir():
        try:
            environ = set((entry / "environ").read_bytes().split(b"\0"))
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if want <= environ and b"train" in cmdline and b"srun" not in cmdline:
            return int(entry.name)
    return None


def test_kill_9_of_one_task_fails_the_job_and_sbatch_resumes_bitwise(cluster, tmp_path, two_nodes):
    workdir = tmp_path / "run"
    job = _sbatch(cluster, workdir, "--nodes=2", "--ntasks-per-node=1", background=True)
    deadline, pid = time.time() + 180, None
    while time.time() < deadline:  # until a checkpoint exists and a later step ran
        metrics = workdir / "metrics.jsonl"
        if metrics.exists() and max(_losses(workdir), default=0) > EVERY * 2:
            pid = _task_pid(job.id, 1)
            break
        if job.poll() is not None:
            break
        time.sleep(0.02)
    assert pid is not None, f"the job ended before the kill: {_log(workdir)[-3000:]}"
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    job.wait(timeout=120)
    assert job.returncode != 0, _log(workdir)
    assert time.time() - killed < 30, f"the job took {time.time() - killed:.0f}s to fail after the kill"
    lost = dict(_losses(workdir))
    assert max(lost) < STEPS, "the kill came after the last step"
    # the resumed run: a one-process resume of a copy, and sbatch again in place
    copy = tmp_path / "copy"
    shutil.copytree(workdir, copy)
    alone = OneProcess(copy)  # alongside the sbatch below
    done = _sbatch(cluster, workdir, "--nodes=2", "--ntasks-per-node=1")
    assert done.returncode == 0, done.stderr + _log(workdir)[-3000:]
    resumed = [line for line in _log(workdir).splitlines() if line.startswith("resumed from checkpoint at step")]
    assert resumed, _log(workdir)
    step = int(resumed[-1].split("step ")[1].split()[0])
    assert step > 0 and step % EVERY == 0 and step <= max(lost)
    assert _losses(workdir) == two_nodes[1]  # bitwise: the same layout as the uninterrupted run
    _close(alone.result()[1], two_nodes[1])


def test_two_nodes_of_two_tasks_resume_a_one_process_checkpoint(cluster, tmp_path, one_process):
    """4 processes on 2 nodes take over the one-process run half-way and end on its losses."""
    source, reference = one_process.result()
    workdir = tmp_path / "run"
    shutil.copytree(source, workdir)
    keep = STEPS // 2
    for path in (workdir / "checkpoints").iterdir():  # back to the middle of the run
        if path.name.isdigit() and int(path.name) > keep:
            shutil.rmtree(path)
    done = _sbatch(cluster, workdir, "--nodes=2", "--ntasks-per-node=2")
    assert done.returncode == 0, done.stderr + _log(workdir)[-3000:]
    log = _log(workdir)
    assert "4 tasks" in log and f"resumed from checkpoint at step {keep}" in log, log[-3000:]
    assert sum(f"jaxpar: process {i}/4 (slurm, node node{1 + i // 2})" in log for i in range(4)) == 4, log[-3000:]
    _close(_losses(workdir), reference)


def test_a_job_larger_than_the_cluster_fails_within_its_bound(cluster, tmp_path):
    started = time.time()
    done = _sbatch(cluster, tmp_path / "run", "--nodes=3")
    assert done.returncode != 0
    assert time.time() - started < 20
    assert "Batch job submission failed: Node count specification invalid" in done.stderr, done.stderr


def test_tensor_across_nodes_is_refused(cluster, tmp_path):
    workdir = tmp_path / "run"
    done = _sbatch(
        cluster,
        workdir,
        "--nodes=2",
        "--ntasks-per-node=1",
        extra=(
            "--config.mesh.data=1",
            "--config.mesh.tensor=2",
            "--config.mesh.context=4",
            "--config.model.attention=blockwise",
        ),
    )
    assert done.returncode != 0
    log = _log(workdir)
    assert "error: mesh.tensor=2 x mesh.context=4 = 8 devices span nodes (each node has 4 of the 8 devices)" in log
    assert "Traceback" not in log
