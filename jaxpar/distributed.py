"""Multi-process start-up: ``jax.distributed`` from the launch environment, and XLA flag profiles.

Sources, in order (:func:`launch_spec` decides every value; JAX's own detection is off):
* SLURM, inside an ``srun`` step of several tasks: count and id from ``SLURM_NTASKS`` /
  ``SLURM_PROCID``; coordinator ``JAXPAR_COORDINATOR`` if set, else JAX's rule
  (:func:`slurm_coordinator`); each task's GPUs chosen explicitly (:func:`slurm_local_devices`);
* explicit variables (what ``scripts/launch_local.sh`` sets): ``JAXPAR_COORDINATOR`` (host:port),
  ``JAXPAR_NUM_PROCESSES``, ``JAXPAR_PROCESS_ID`` (or a Kubernetes indexed Job's
  ``JOB_COMPLETION_INDEX``), optionally ``JAXPAR_LOCAL_DEVICES``;
* otherwise a single process.

On CPU the processes talk over gloo. A coordinator that does not resolve is refused before JAX
starts; one that does not answer, or a job not every process joins, within
``JAXPAR_COORDINATOR_TIMEOUT`` seconds (default 120) is one line. When a process dies, the
coordination service fails the others after ``JAXPAR_HEARTBEAT_TIMEOUT`` seconds (default 100).
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Mapping

from jaxpar.config import ConfigError

DEVICE_FLAG = "--xla_force_host_platform_device_count"

# NCCL / XLA settings for real GPU clusters (written for them, checked on an accelerator when one
# is lent): latency-hiding scheduler so collectives overlap compute, and bigger combine buckets.
GPU_XLA_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
)


def _int_env(name: str, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    value = env[name]
    if not value.isdigit():
        raise ConfigError(f"{name}={value!r}: must be a non-negative integer")
    return int(value)


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """How this process joins the job: what ``jax.distributed.initialize`` is given, every value
    decided here (JAX's own cluster detection is switched off, so nothing is guessed twice)."""

    source: str  # "single" | "explicit" | "slurm" | "k8s-indexed-job"
    num_processes: int = 1
    process_id: int = 0
    coordinator: str | None = None  # host:port
    local_device_ids: tuple[int, ...] | None = None  # GPUs of this process, None = all it sees
    node: str = ""  # what places this process: SLURMD_NODENAME, JAXPAR_NODE or the host name

    @property
    def distributed(self) -> bool:
        return self.num_processes > 1 or self.source != "single"


def launch_spec(env: Mapping[str, str] | None = None) -> LaunchSpec:
    """Read the launch environment (sources and order: the module docstring). Refuses in one line a
    job that cannot meet: a coordinator without a process count, a process id outside the count, a
    count that disagrees with SLURM's."""
    env = os.environ if env is None else env
    node = env.get("SLURMD_NODENAME") or env.get("JAXPAR_NODE") or socket.gethostname()
    if in_slurm_step(env):
        num, pid = _int_env("SLURM_NTASKS", env), _int_env("SLURM_PROCID", env)
        if "JAXPAR_NUM_PROCESSES" in env and _int_env("JAXPAR_NUM_PROCESSES", env) != num:
            raise ConfigError(
                f"JAXPAR_NUM_PROCESSES={env['JAXPAR_NUM_PROCESSES']} but the srun step has SLURM_NTASKS={num} "
                "tasks; unset JAXPAR_NUM_PROCESSES (under srun every task is a process)"
            )
        coordinator = env.get("JAXPAR_COORDINATOR") or slurm_coordinator(env)
        return LaunchSpec("slurm", num, pid, coordinator, slurm_local_devices(env), node)
    if "JAXPAR_COORDINATOR" in env:
        if "JAXPAR_NUM_PROCESSES" not in env:
            raise ConfigError(
                "JAXPAR_COORDINATOR is set but JAXPAR_NUM_PROCESSES is not; set both (and JAXPAR_PROCESS_ID)"
            )
        num = _int_env("JAXPAR_NUM_PROCESSES", env)
        if num < 1:
            raise ConfigError(f"JAXPAR_NUM_PROCESSES={num}: must be at least 1")
        if "JAXPAR_PROCESS_ID" in env:
            source, name = "explicit", "JAXPAR_PROCESS_ID"
        elif "JOB_COMPLETION_INDEX" in env:  # a Kubernetes indexed Job numbers its pods 0..completions-1
            source, name = "k8s-indexed-job", "JOB_COMPLETION_INDEX"
        else:
            raise ConfigError(
                "JAXPAR_COORDINATOR is set but JAXPAR_PROCESS_ID is not; set it to this process's "
                "index (0 on the coordinator's host)"
            )
        pid = _int_env(name, env)
        if not 0 <= pid < num:
            raise ConfigError(f"{name}={pid} must be in [0, JAXPAR_NUM_PROCESSES={num})")
        ids = _device_list("JAXPAR_LOCAL_DEVICES", env) if "JAXPAR_LOCAL_DEVICES" in env else None
        return LaunchSpec(source, num, pid, env["JAXPAR_COORDINATOR"], ids, node)
    return LaunchSpec("single", node=node)


def in_slurm_step(env: Mapping[str, str] | None = None) -> bool:
    """Inside an ``srun`` step of several tasks (the batch script itself is no step, and a stale
    ``SLURM_NTASKS`` outside a step is one process)."""
    env = os.environ if env is None else env
    needed = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_NTASKS")
    return all(v in env for v in needed) and _int_env("SLURM_NTASKS", env) > 1


def slurm_coordinator(env: Mapping[str, str]) -> str:
    """JAX's rule for a SLURM step: the first node of ``SLURM_STEP_NODELIST``, port
    61440 + job id mod 4096 (``jax._src.clusters.slurm_cluster``)."""
    first = first_slurm_node(env["SLURM_STEP_NODELIST"])
    return f"{first}:{61440 + _int_env('SLURM_JOB_ID', env) % 4096}"


def first_slurm_node(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[03-05,9],gpu1`` -> ``node03``."""
    match = re.match(r"([^,\[]*)(?:\[([^,\]-]+))?", nodelist)
    if not match or not (match.group(1) or match.group(2)):
        raise ConfigError(f"SLURM_STEP_NODELIST={nodelist!r}: no node name in it")
    return match.group(1) + (match.group(2) or "")


def slurm_tasks_on_node(env: Mapping[str, str]) -> int:
    """How many tasks of the step run on this node, from ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``:
    three nodes of two, then one of one) at ``SLURM_NODEID``."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return 1
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE={spec!r}: not SLURM's form, e.g. 2(x3),1")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = _int_env("SLURM_NODEID", env) if "SLURM_NODEID" in env else 0
    if node >= len(counts):
        raise ConfigError(f"SLURM_NODEID={node} but SLURM_STEP_TASKS_PER_NODE={spec!r} lists {len(counts)} nodes")
    return counts[node]


def _device_list(name: str, env: Mapping[str, str]) -> tuple[int, ...]:
    value = env[name].strip()
    if not re.fullmatch(r"\d+(,\d+)*", value):
        raise ConfigError(f"{name}={env[name]!r}: use comma-separated device indices, e.g. 0,1,2,3")
    return tuple(int(v) for v in value.split(","))


def slurm_local_devices(env: Mapping[str, str]) -> tuple[int, ...] | None:
    """The GPUs of this SLURM task, as indices into the GPUs it can see; None means all of them.

    JAX alone gives a SLURM task only GPU ``SLURM_LOCALID`` (jax-ml/jax#16788), so one task per node
    would drive one GPU of eight. Here: ``JAXPAR_LOCAL_DEVICES`` if set; one task on the node: all
    its GPUs; tasks that each see only their own GPUs (``--gpus-per-task``, ``--gpu-bind``): all they
    see; tasks sharing the node's G GPUs: task ``SLURM_LOCALID`` takes its G / tasks consecutive ones.
    """
    if "JAXPAR_LOCAL_DEVICES" in env:
        return _device_list("JAXPAR_LOCAL_DEVICES", env)
    tasks = slurm_tasks_on_node(env)
    if tasks == 1:
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    gpus = (
        len(visible.split(","))
        if visible
        else (_int_env("SLURM_GPUS_ON_NODE", env) if "SLURM_GPUS_ON_NODE" in env else 0)
    )
    if gpus == 0 or gpus < tasks:  # no GPUs (CPU), or SLURM bound each task to its own
        return None
    if gpus % tasks:
        raise ConfigError(
            f"{tasks} tasks on this node share {gpus} GPUs, which do not split evenly; use --gpus-per-task, "
            "or set JAXPAR_LOCAL_DEVICES to this task's GPU indices"
        )
    share, local = gpus // tasks, _int_env("SLURM_LOCALID", env)
    return tuple(range(local * share, (local + 1) * share))


def coordinator_timeout(env: Mapping[str, str] | None = None) -> int:
    """Seconds a process waits for the coordinator (``JAXPAR_COORDINATOR_TIMEOUT``, default 120)."""
    env = os.environ if env is None else env
    if "JAXPAR_COORDINATOR_TIMEOUT" not in env:
        return 120
    value = _int_env("JAXPAR_COORDINATOR_TIMEOUT", env)
    if value < 1:
        raise ConfigError("JAXPAR_COORDINATOR_TIMEOUT=0: use a number of seconds of at least 1")
    return value


def _coordinator_source(spec: LaunchSpec) -> str:
    if spec.source == "slurm" and "JAXPAR_COORDINATOR" not in os.environ:
        return "the first node of SLURM_STEP_NODELIST"
    return "JAXPAR_COORDINATOR"


def check_coordinator(spec: LaunchSpec, wait: int) -> None:
    """Fail in one line, before JAX starts, where ``jax.distributed`` would abort the process or
    wait out its deadline: a coordinator host that does not resolve; on process 0, a port already
    in use; on the others, a coordinator that does not accept connections within ``wait`` seconds."""
    where = _coordinator_source(spec)
    host, _, port = (spec.coordinator or "").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{where}={spec.coordinator!r}: use host:port")
    host = host.strip("[]")
    try:
        socket.getaddrinfo(host, int(port))
    except (OSError, UnicodeError):
        fix = (
            "set JAXPAR_COORDINATOR=<its address>:<port> in the batch script (scripts/slurm/train.sbatch does)"
            if where.startswith("the first")
            else "use an address every process can resolve"
        )
        raise ConfigError(f"{where}: coordinator host {host!r} does not resolve; {fix}") from None
    if spec.process_id == 0:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("", int(port)))
            except OSError as e:
                raise ConfigError(
                    f"{where}: port {port} on this host (process 0, the coordinator) is not free "
                    f"({e.strerror}); pick another port"
                ) from None
        return
    deadline = time.monotonic() + wait
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"process {spec.process_id}/{spec.num_processes} could not reach the coordinator at "
                    f"{spec.coordinator} within {wait}s ({e.strerror or e}); check that process 0 runs there "
                    "and the port is open, or raise JAXPAR_COORDINATOR_TIMEOUT"
                ) from None
            time.sleep(0.25)


def initialize_from_env() -> bool:
    """Join the multi-process job described by the environment; returns True if distributed. Waits
    at most ``JAXPAR_COORDINATOR_TIMEOUT`` seconds for the coordinator, then fails in one line."""
    import jax

    spec = launch_spec()
    if not spec.distributed:
        return False
    timeout = _heartbeat_timeout()
    wait = coordinator_timeout()
    check_coordinator(spec, wait)
    _gloo_on_cpu()
    # A peer that never registers would end in jax.distributed's C++ abort (a stack trace, exit 134)
    # once its own deadline passes: ours comes first and says it in one line.
    watchdog = threading.Timer(wait, _registration_timed_out, args=(spec, wait))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator_address=spec.coordinator,
            num_processes=spec.num_processes,
            process_id=spec.process_id,
            local_device_ids=list(spec.local_device_ids) if spec.local_device_ids is not None else None,
            cluster_detection_method="deactivate",
            heartbeat_timeout_seconds=timeout,
            initialization_timeout=wait + REGISTRATION_MARGIN_S,
        )
    finally:
        watchdog.cancel()
    # One line per process: where it runs and what it drives (the GPU-binding check of a new cluster).
    devices = jax.local_devices()
    print(
        f"jaxpar: process {spec.process_id}/{spec.num_processes} ({spec.source}, node {spec.node}): "
        f"{len(devices)} local {devices[0].platform} devices {[d.id for d in devices]}",
        flush=True,
    )
    return True


REGISTRATION_MARGIN_S = 30  # JAX's own registration deadline lies this far past jaxpar's


def _registration_timed_out(spec: LaunchSpec, wait: int) -> None:
    """The watchdog of :func:`initialize_from_env`: not every process registered within ``wait``
    seconds. One line on stderr and exit 2 (no run has started, nothing is written yet)."""
    others = "the other processes" if spec.process_id == 0 else "process 0 or the other processes"
    sys.stderr.write(
        f"error: process {spec.process_id}/{spec.num_processes}: {others} did not join the job at "
        f"{spec.coordinator} within {wait}s (JAXPAR_COORDINATOR_TIMEOUT); start all {spec.num_processes} "
        "processes with the same coordinator (see their logs), or raise JAXPAR_COORDINATOR_TIMEOUT\n"
    )
    sys.stderr.flush()
    os._exit(2)


def _heartbeat_timeout() -> int:
    if "JAXPAR_HEARTBEAT_TIMEOUT" not in os.environ:
        return 100
    value = _int_env("JAXPAR_HEARTBEAT_TIMEOUT")
    if value < 1:
        raise ConfigError("JAXPAR_HEARTBEAT_TIMEOUT=0: use a number of seconds of at least 1")
    return value


def _gloo_on_cpu() -> None:
    """Processes on CPU exchange collectives over gloo (set before ``jax.distributed`` starts)."""
    import jax

    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def _host_flags_apply() -> bool:
    """Whether XLA_FLAGS' simulated CPU devices can still act: JAX has not started its backends and
    ``JAX_PLATFORMS`` does not leave CPU out."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    return not jax_started() and not (platforms and "cpu" not in platforms.split(","))


def gpu_xla_flags() -> str:
    """XLA_FLAGS for GPU clusters, appended to whatever the user already set."""
    current = os.environ.get("XLA_FLAGS", "")
    extra = [f for f in GPU_XLA_FLAGS if f.split("=")[0] not in current]
    return " ".join([current, *extra]).strip()


def jax_started() -> bool:
    """Whether JAX has started its backends (after that, XLA_FLAGS are no longer read)."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)
    except Exception:  # private API moved: assume started
        return True


def launch_process_count() -> int:
    """How many processes the launch environment starts (:func:`launch_spec`)."""
    return launch_spec().num_processes


def simulate_local_devices(total: int) -> int | None:
    """Set this process's simulated CPU devices for a mesh of ``total``: its share, ``total /
    processes`` (the one place ``jaxpar train`` decides the count). A count already in ``XLA_FLAGS``
    must be that share, else one line names the flag and the fix (N processes each simulating the
    whole mesh see N times its devices). Returns the share, or None where it does not apply (another
    platform asked for, or JAX's backends started)."""
    if not _host_flags_apply():
        return None
    processes = launch_process_count()
    if total % processes:
        raise ConfigError(
            f"the mesh's {total} devices do not split over {processes} processes; set --config.mesh.* so "
            f"the product is a multiple of {processes}, or start a number of processes that divides {total}"
        )
    share = total // processes
    flags = os.environ.get("XLA_FLAGS", "")
    given = {int(v) for v in re.findall(rf"{DEVICE_FLAG}=(\d+)", flags)}
    if given and given != {share}:
        counts = ", ".join(str(v) for v in sorted(given))
        raise ConfigError(
            f"XLA_FLAGS sets {DEVICE_FLAG}={counts} but this process needs {share} ({total} mesh devices over "
            f"{processes} process{'es' if processes > 1 else ''}); drop the flag from XLA_FLAGS and jaxpar sets it"
        )
    if not given:
        os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_FLAG}={share}".strip()
    return share


def without_device_count(flags: str) -> str:
    """``XLA_FLAGS`` less its simulated-device count: for a process that ``jaxpar train`` gives its
    own share (:func:`simulate_local_devices`)."""
    return " ".join(f for f in flags.split() if not f.startswith(DEVICE_FLAG))


def ensure_host_devices(count: int) -> bool:
    """Ask XLA for at least ``count`` simulated CPU devices, if JAX has not started its backends and
    the platform may be CPU (``inspect`` compiles for data*tensor*pipeline*context devices, which a
    laptop simulates; XLA reads the flag once). Returns whether ``XLA_FLAGS`` was changed."""
    if not _host_flags_apply():
        return False
    flags = os.environ.get("XLA_FLAGS", "")
    current = re.search(rf"{DEVICE_FLAG}=(\d+)", flags)
    if current and int(current.group(1)) >= count:
        return False
    flags = re.sub(rf"{DEVICE_FLAG}=\d+", "", flags).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_FLAG}={count}".strip()
    return True
