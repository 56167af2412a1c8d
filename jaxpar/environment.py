"""Every environment variable jaxpar reads, in one table, checked before JAX starts.

A bad value would otherwise surface late and far from its cause (``int("abc")`` deep in start-up, a
C++ abort on an ``XLA_FLAGS`` flag XLA does not know, a backend error for ``JAX_PLATFORMS=gpu``
without CUDA); here each is one line naming the variable and the fix. The launch variables are read
by :func:`jaxpar.distributed.launch_spec`, which this check calls, so their rules live in one place.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Mapping

from jaxpar.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Variable:
    kind: str  # "seconds" (integer >= 1) | "path" | "text"
    meaning: str


# The variables jaxpar itself defines; the launch ones are also parsed by jaxpar.distributed.
JAXPAR_VARIABLES: dict[str, Variable] = {
    "JAXPAR_COORDINATOR": Variable("text", "host:port of process 0's coordination service"),
    "JAXPAR_NUM_PROCESSES": Variable("text", "processes in the job (with JAXPAR_COORDINATOR)"),
    "JAXPAR_PROCESS_ID": Variable("text", "this process's index, 0 on the coordinator's host"),
    "JAXPAR_LOCAL_DEVICES": Variable("text", "this process's GPU indices, e.g. 0,1,2,3"),
    "JAXPAR_NODE": Variable("text", "the node this process runs on (default: the host name)"),
    "JAXPAR_COORDINATOR_TIMEOUT": Variable("seconds", "how long to wait for the coordinator (default 120)"),
    "JAXPAR_HEARTBEAT_TIMEOUT": Variable("seconds", "how long peers wait on a silent process (default 100)"),
    "JAXPAR_CONFIG_TIMEOUT": Variable("seconds", "how long a --config file may take to load (default 30)"),
    "JAXPAR_CACHE_DIR": Variable("path", "jaxpar's cache of prepared data (default ~/.cache/jaxpar)"),
    "JAXPAR_PORT": Variable("text", "scripts/launch_local.sh: the coordinator port (default: a free one)"),
    "JAXPAR_STOP_TIMEOUT": Variable(
        "seconds", "scripts/launch_local.sh: after SIGTERM/SIGINT, seconds before SIGKILL to its processes (default 30)"
    ),
    # the test suite's own (a user running the tests has them set; jaxpar's commands ignore them)
    "JAXPAR_SLOW": Variable("text", "the test suite: 1 runs the slow grids"),
    "JAXPAR_FUZZ_SEED": Variable("text", "the test suite: the fuzz tables' seed"),
    "JAXPAR_MEMORY_SEED": Variable("text", "the test suite: the random memory grid's seed"),
    "JAXPAR_EXTRA_RECIPES": Variable("text", "the test suite: a folder of extra recipes to port"),
    "JAXPAR_BIN": Variable("text", "experiments: the jaxpar command the side-by-side driver runs"),
    "JAXPAR_SWEEP_ABORT": Variable("text", "the test suite: the sweep layout whose worker aborts"),
}

# Platform names JAX accepts in JAX_PLATFORMS, and the plugin modules the GPU ones need.
PLATFORMS = ("cpu", "cuda", "gpu", "rocm", "tpu")
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
ROCM_PLUGINS = ("jax_rocm60_plugin", "jax_rocm7_plugin", "jax_plugins.xla_rocm60", "jax_plugins.xla_rocm7")

# XLA flags jaxpar sets or recommends: known to XLA, no probe needed.
KNOWN_XLA_FLAGS = (
    "--xla_force_host_platform_device_count",
    "--xla_backend_optimization_level",
    "--xla_gpu_enable_latency_hiding_scheduler",
    "--xla_gpu_all_reduce_combine_threshold_bytes",
    "--xla_gpu_all_gather_combine_threshold_bytes",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes",
    "--xla_dump_to",
    "--xla_dump_hlo_as_text",
    "--xla_cpu_use_thunk_runtime",
)


def check_environment(env: Mapping[str, str] | None = None, jax_runs: bool = True, probe_xla: bool = True) -> None:
    """Refuse, in one line, an environment jaxpar would misread or XLA would abort on
    (``XLA_FLAGS`` and ``JAX_PLATFORMS`` only when ``jax_runs``)."""
    env = os.environ if env is None else env
    for name in sorted(n for n in env if n.startswith("JAXPAR_")):
        if name not in JAXPAR_VARIABLES:
            close = difflib.get_close_matches(name, JAXPAR_VARIABLES, n=1)
            hint = f"did you mean {close[0]}?" if close else f"jaxpar reads {', '.join(sorted(JAXPAR_VARIABLES))}"
            raise ConfigError(f"{name}: not a jaxpar variable; {hint} (unset it)")
        var = JAXPAR_VARIABLES[name]
        value = env[name]
        if var.kind == "seconds" and not (value.isascii() and value.isdigit() and int(value) >= 1):
            raise ConfigError(f"{name}={value!r}: use a whole number of seconds of at least 1 ({name}: {var.meaning})")
        if var.kind == "path" and not value.strip():
            raise ConfigError(f"{name} is empty: set a folder path or unset it ({var.meaning})")
    from jaxpar.distributed import launch_spec

    launch_spec(env)  # the launch variables: SLURM's and JAXPAR_COORDINATOR's rules
    if not jax_runs:
        return
    check_platforms(env.get("JAX_PLATFORMS", ""))
    flags = env.get("XLA_FLAGS", "")
    if flags.strip():
        check_xla_flags(flags, probe=probe_xla)


def check_platforms(value: str) -> None:
    """``JAX_PLATFORMS``: names JAX knows, and a GPU platform only where its plugin is installed."""
    for name in [v.strip() for v in value.split(",") if v.strip()]:
        if name not in PLATFORMS:
            raise ConfigError(
                f"JAX_PLATFORMS={value!r}: {name!r} is not a platform; use {', '.join(PLATFORMS)} "
                "(comma-separated) or unset it"
            )
        plugins = CUDA_PLUGINS if name in ("cuda", "gpu") else ROCM_PLUGINS if name == "rocm" else ()
        if plugins and not any(_importable(p) for p in plugins):
            extra = "cuda12" if name != "rocm" else "rocm"
            raise ConfigError(
                f"JAX_PLATFORMS={value!r}: no {name} plugin for jax is installed here; install "
                f"jax[{extra}] on a GPU host, or unset JAX_PLATFORMS to run on the CPU"
            )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_xla_flags(flags: str, probe: bool = True) -> None:
    """Every ``XLA_FLAGS`` token is a ``--flag`` or ``--flag=value``; flags jaxpar does not know are
    tried once in a child process (XLA aborts the process on an unknown one), and the verdict is
    cached per jaxlib version and flag set under :func:`jaxpar.data.default_cache_dir`."""
    tokens = flags.split()
    bad = [t for t in tokens if not re.fullmatch(r"--[A-Za-z0-9_]+(=.*)?", t)]
    if bad:
        raise ConfigError(f"XLA_FLAGS: {bad[0]!r} is not a flag; XLA takes --name=value tokens separated by spaces")
    unknown = sorted({t.split("=")[0] for t in tokens} - set(KNOWN_XLA_FLAGS))
    if not unknown or not probe:
        return
    import jaxlib

    key = hashlib.sha256(f"{jaxlib.__version__} {' '.join(unknown)}".encode()).hexdigest()[:20]
    from jaxpar.data import default_cache_dir

    verdict = default_cache_dir() / "xla-flags" / key
    if verdict.is_file():
        return
    probe_env = dict(os.environ, XLA_FLAGS=" ".join(unknown), JAX_PLATFORMS="cpu")
    try:
        done = subprocess.run(
            [sys.executable, "-c", "import jax; jax.devices('cpu')"],
            env=probe_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        return  # no verdict: let XLA itself judge
    if done.returncode != 0:
        named = re.search(r"Unknown flags? in XLA_FLAGS: (.*)", done.stderr)
        if named:
            raise ConfigError(
                f"XLA_FLAGS: XLA does not know {named.group(1).strip()} (jaxlib {jaxlib.__version__}) "
                "and would abort; remove or correct them"
            )
        return
    try:
        verdict.parent.mkdir(parents=True, exist_ok=True)
        verdict.write_text(" ".join(unknown) + "\n")
    except OSError:
        pass  # an unwritable cache only costs the probe next time
