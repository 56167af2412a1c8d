"""Test session set-up: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os
import re

_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ARG001 - pytest's hook signature
    """Print how many hostile-input cases each fuzz family ran (tests/fuzzkit.py), when any ran."""
    import sys

    fuzzkit = sys.modules.get("tests.fuzzkit")
    if fuzzkit is None or not fuzzkit.COUNTS:
        return
    mode = "all cases (JAXPAR_SLOW=1)" if fuzzkit.FULL else f"seeded sample, seed {fuzzkit.SEED}"
    terminalreporter.section(f"hostile-input fuzz: generated cases per family ({mode})")
    for family, count in sorted(fuzzkit.COUNTS.items()):
        terminalreporter.write_line(f"{family:<40} {count:>5}")
    terminalreporter.write_line(f"{'total':<40} {sum(fuzzkit.COUNTS.values()):>5}")
