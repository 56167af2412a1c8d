"""``jaxpar.host_memory``: glibc's malloc held steady, the mechanism reproduced in a fresh process."""

import json
import subprocess
import sys

import pytest

from jaxpar import host_memory

GLIBC = host_memory.steady_malloc(apply=False).startswith("glibc")

# One thread allocates three 25 MiB blocks, touches them and frees them, six times over. The third
# block does not fit the thread arena's first 64 MiB heap, so it lands on a second heap, which
# glibc's defaults unmap once it is empty: each round faults that block's 6400 pages in again.
ROUNDS = """
import ctypes, json, resource, sys, threading
from jaxpar.host_memory import steady_malloc
line = steady_malloc() if sys.argv[1] == "steady" else "defaults"
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
size, faults = 25 * 2**20, []
def rounds():
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        blocks = [libc.malloc(size) for _ in range(3)]
        for b in blocks:
            ctypes.memset(b, 1, size)
        for b in reversed(blocks):
            libc.free(b)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
thread = threading.Thread(target=rounds)
thread.start()
thread.join()
print(json.dumps({"line": line, "faults": faults}))
"""


def _rounds(mode: str, env: dict | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout)


@pytest.mark.skipif(not GLIBC, reason="the settings are glibc's mallopt options")
def test_steady_malloc_stops_the_refaulting_of_freed_heaps():
    pages = 25 * 2**20 // 4096
    default = _rounds("default")["faults"]
    assert all(f >= pages for f in default[2:])  # every later round faults one block in again
    steady = _rounds("steady")
    assert steady["faults"][0] >= 3 * pages  # the first round touches fresh memory either way
    assert steady["faults"][1:] == [0] * 5
    assert (
        steady["line"].startswith("glibc ")
        and "mmap threshold 32 MiB, trim threshold 1024 MiB, top pad 128 MiB" in (steady["line"])
    )


def test_the_environments_malloc_settings_win(monkeypatch):
    monkeypatch.setenv("MALLOC_TOP_PAD_", "0")
    assert host_memory.steady_malloc() == "the environment's malloc settings (MALLOC_TOP_PAD_)"
