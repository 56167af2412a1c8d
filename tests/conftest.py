"""Test session set-up: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os
import re

from session_flags import ELEMENTAL_EMITTER, FUSION_EMITTERS, LLVM_LEVEL

_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
# LLVM's optimisation level for the CPU code XLA emits: 0 in the test session unless XLA_FLAGS sets it.
# The HLO passes, the buffer assignment (memory_analysis) and the collectives are the same; the tiny
# programs run a little slower and compile much faster. Measured: tests/test_equivalence.py alone,
# 98 -> 65 s. The subprocesses tests start (CLI runs, drills) inherit it through XLA_FLAGS.
if LLVM_LEVEL not in _flags:
    _flags += f" {LLVM_LEVEL}=0"
# XLA:CPU's elemental emitter in place of its fusion emitters, where the installed XLA has the switch
# (jax 0.10; 0.12 has neither the switch nor the compile cost). Measured on jax 0.10.2, 2 cores:
# tests/test_pipeline.py, test_equivalence.py and test_moe.py 196 -> 124 s; one step of the tiny
# d2 x t2 x p2 layout compiles in 1.9 s instead of 3.4 s. Every collective is the same; the buffer
# assignment moves (15 of the memory grid's seed 124's 16 layouts by at most 0.34%, one ~1B context-parallel
# layout by +6.8%), so the tests that hold estimates against it compile with XLA's default emitter back
# (tests/helpers.py: MEMORY_OPTIONS), as experiments/memory_grid.py and users do.
if FUSION_EMITTERS not in _flags:
    from jaxpar.versions import jax_release

    if jax_release()[:2] == (0, 10):
        _flags += f" {ELEMENTAL_EMITTER}"
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# JAX's persistent compilation cache, one fresh folder per test session, shared by the xdist workers
# and the processes tests start (drills, CLI runs): a program compiled again (the same tiny layout in
# several files, an interrupted run and its resume) is read back instead of compiled. Measured: the
# two-process SIGKILL drill 72 -> 61 s. A folder given in JAX_COMPILATION_CACHE_DIR is kept.
# The process that made the folder (pytest's controller) deletes it when the session ends.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxpar-tests-xla-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


_WORKER_COUNTS: dict[str, int] = {}  # pytest-xdist: the fuzz counts the workers sent back


def _fuzz_counts() -> dict[str, int]:
    import sys

    fuzzkit = sys.modules.get("tests.fuzzkit")
    return dict(fuzzkit.COUNTS) if fuzzkit is not None else {}


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001 - pytest's hook signature
    """In a pytest-xdist worker: hand this worker's fuzz counts to the controller."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["fuzz_counts"] = _fuzz_counts()


def pytest_unconfigure(config):  # noqa: ARG001 - pytest's hook signature
    """Delete the session's compilation cache folder (only the one this process made)."""
    if _OWN_CACHE is not None:
        import shutil

        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def pytest_configure(config):
    """Register the xdist hook only where pytest-xdist runs (its hook spec is needed)."""
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistCounts(), "jaxpar-fuzz-counts")


class _XdistCounts:
    def pytest_testnodedown(self, node, error):  # noqa: ARG002 - pytest-xdist's hook signature
        for family, count in getattr(node, "workeroutput", {}).get("fuzz_counts", {}).items():
            _WORKER_COUNTS[family] = _WORKER_COUNTS.get(family, 0) + count


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ARG001 - pytest's hook signature
    """Print how many hostile-input cases each fuzz family ran (tests/fuzzkit.py), when any ran."""
    counts = dict(_fuzz_counts())
    for family, count in _WORKER_COUNTS.items():
        counts[family] = counts.get(family, 0) + count
    if not counts:
        return
    full = os.environ.get("JAXPAR_SLOW") == "1"
    mode = "all cases (JAXPAR_SLOW=1)" if full else f"seeded sample, seed {os.environ.get('JAXPAR_FUZZ_SEED', '0')}"
    terminalreporter.section(f"hostile-input fuzz: generated cases per family ({mode})")
    for family, count in sorted(counts.items()):
        terminalreporter.write_line(f"{family:<40} {count:>5}")
    terminalreporter.write_line(f"{'total':<40} {sum(counts.values()):>5}")


# The longest test files (2026-12-04 fresh-clone run: the SLURM cluster, the fault drills, the
# optimizer and equivalence grids, the multi-process runs) go first: pytest-xdist's loadfile hands
# files out in collection order (with --no-loadscope-reorder, pyproject.toml: else it orders them by
# test count, which put the 5-test SLURM file last), and a long file handed out last leaves the
# other worker idle.
LONG_FILES = (
    "test_slurm.py",
    "test_fault.py",
    "test_optim.py",
    "test_multiprocess.py",
    "test_equivalence.py",
    "test_sweep.py",
    "test_compile_cache.py",
    "test_train_cli.py",
    "test_checkpoint.py",
)


def pytest_collection_modifyitems(session, config, items):  # noqa: ARG001 - pytest's hook signature
    """Long files first, each file's tests kept together and in order (the same order on every worker)."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: the rest keep their order
