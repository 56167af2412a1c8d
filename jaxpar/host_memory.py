"""The host C library's allocator held steady, so that CPU step times do not depend on a process's history.

XLA:CPU allocates each execution's temporaries and outputs afresh from ``malloc``. With glibc's
defaults a block at or above the *dynamic* mmap threshold (128 KiB at start, raised by each free of
an mmapped block up to 32 MiB) is a fresh ``mmap`` returned to the kernel when freed, and a thread
arena's heap is unmapped once it is empty. Each such block costs one minor page fault per 4 KiB page
the next step touches, and how many take that path depends on what the process allocated before:
one layout took from 10 to 22.5k faults per step in fresh processes (docs/performance.md, "Sweeps").
A sweep pools its passes within one process, so this state moves a layout's whole re-run.

:func:`steady_malloc` fixes the three thresholds with ``mallopt`` (glibc only; see ``mallopt(3)``):
an explicit mmap threshold switches the dynamic one off, and a top pad above a thread heap's 64 MiB
maximum keeps emptied heaps mapped. Blocks of 32 MiB or more (glibc's cap for the threshold) are
still mmapped; ``SweepRecord.minor_faults_per_step`` shows when that happens. The cost is resident
memory: freed blocks stay with the process instead of going back to the kernel.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's <malloc.h> option numbers
SETTINGS = {"mmap_threshold": 32 * 2**20, "trim_threshold": 2**30, "top_pad": 128 * 2**20}
_OPTIONS = {"mmap_threshold": M_MMAP_THRESHOLD, "trim_threshold": M_TRIM_THRESHOLD, "top_pad": M_TOP_PAD}
ENV_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def steady_malloc(apply: bool = True) -> str:
    """Set :data:`SETTINGS` in this process (``apply=False``: only say what applying would do);
    returns one line saying which allocator settings are in force. Leaves them alone when the
    environment sets any of :data:`ENV_VARIABLES` (the user's choice wins) or the C library is not
    glibc."""
    own = [name for name in ENV_VARIABLES if name in os.environ]
    if own:
        return f"the environment's malloc settings ({', '.join(own)})"
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        version = libc.gnu_get_libc_version().decode()
    except (OSError, AttributeError):
        return "the C library's default malloc settings (not glibc)"
    if apply:
        refused = [name for name, value in SETTINGS.items() if libc.mallopt(_OPTIONS[name], value) != 1]
        if refused:
            return f"glibc {version} malloc, mallopt refused {', '.join(refused)}"
    mib = {name: value // 2**20 for name, value in SETTINGS.items()}
    return (
        f"glibc {version} malloc: mmap threshold {mib['mmap_threshold']} MiB, trim threshold "
        f"{mib['trim_threshold']} MiB, top pad {mib['top_pad']} MiB (jaxpar.host_memory)"
    )
