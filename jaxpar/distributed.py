"""Multi-process start-up: ``jax.distributed`` from the environment, and XLA flag profiles.

Sources, in order:
* explicit variables (what ``scripts/launch_local.sh`` sets): ``JAXPAR_COORDINATOR``
  (host:port), ``JAXPAR_NUM_PROCESSES``, ``JAXPAR_PROCESS_ID``;
* SLURM, inside an ``srun`` step of several tasks: ``jax.distributed.initialize()`` reads the SLURM
  variables itself;
* otherwise a single process: nothing to do.

On CPU the processes talk over gloo. A process that dies stops sending heartbeats; the
coordination service then fails the others after ``JAXPAR_HEARTBEAT_TIMEOUT`` seconds (default
100, as JAX) instead of letting them hang in a collective.
"""

from __future__ import annotations

import os
import re
import sys

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


def _int_env(name: str) -> int:
    value = os.environ[name]
    if not value.isdigit():
        raise ConfigError(f"{name}={value!r}: must be a non-negative integer")
    return int(value)


def initialize_from_env() -> bool:
    """Join the multi-process job described by the environment. Returns True if distributed."""
    import jax

    timeout = int(os.environ.get("JAXPAR_HEARTBEAT_TIMEOUT", "100"))
    if "JAXPAR_COORDINATOR" in os.environ:
        num, pid = _int_env("JAXPAR_NUM_PROCESSES"), _int_env("JAXPAR_PROCESS_ID")
        if not 0 <= pid < num:
            raise ConfigError(f"JAXPAR_PROCESS_ID={pid} must be in [0, JAXPAR_NUM_PROCESSES={num})")
        _gloo_on_cpu()
        jax.distributed.initialize(
            coordinator_address=os.environ["JAXPAR_COORDINATOR"],
            num_processes=num,
            process_id=pid,
            heartbeat_timeout_seconds=timeout,
            initialization_timeout=timeout,
        )
        return True
    if _in_slurm_step():
        _gloo_on_cpu()
        jax.distributed.initialize(heartbeat_timeout_seconds=timeout)
        return True
    return False


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
    """How many processes the launch environment starts: ``JAXPAR_NUM_PROCESSES`` with
    ``JAXPAR_COORDINATOR``, SLURM's task count inside an ``srun`` step, else 1."""
    if "JAXPAR_COORDINATOR" in os.environ:
        if "JAXPAR_NUM_PROCESSES" not in os.environ:
            raise ConfigError("JAXPAR_COORDINATOR is set but JAXPAR_NUM_PROCESSES is not; set both (and JAXPAR_PROCESS_ID)")
        num = _int_env("JAXPAR_NUM_PROCESSES")
        if num < 1:
            raise ConfigError(f"JAXPAR_NUM_PROCESSES={num}: must be at least 1")
        return num
    if _in_slurm_step():
        return _int_env("SLURM_NTASKS")
    return 1


def _in_slurm_step() -> bool:
    """Inside an ``srun`` step of several tasks (the batch script itself is no step)."""
    needed = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_NTASKS")
    return all(v in os.environ for v in needed) and _int_env("SLURM_NTASKS") > 1


def simulate_local_devices(total: int) -> int | None:
    """Set how many simulated CPU devices this process has for a mesh of ``total`` devices: its
    share, ``total / processes``. The one place that decides the count for ``jaxpar train``.

    A device count already in ``XLA_FLAGS`` must be that share (XLA reads the last one given, so
    every one given must agree): otherwise one line names the flag and the fix, since N processes
    that each simulate the whole mesh see N times its devices. Returns the share, or None where it
    does not apply (a platform other than CPU is asked for, or JAX has started its backends).
    """
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
    """Ask XLA for at least ``count`` simulated CPU devices, if JAX has not started its backends
    yet and the platform may be CPU. Returns whether ``XLA_FLAGS`` was changed.

    Why: ``inspect`` compiles the layout for data*tensor*pipeline*context devices; on a laptop those are
    simulated CPU devices, and XLA reads the flag only once, when the first backend starts.
    """
    if not _host_flags_apply():
        return False
    flags = os.environ.get("XLA_FLAGS", "")
    current = re.search(rf"{DEVICE_FLAG}=(\d+)", flags)
    if current and int(current.group(1)) >= count:
        return False
    flags = re.sub(rf"{DEVICE_FLAG}=\d+", "", flags).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_FLAG}={count}".strip()
    return True
