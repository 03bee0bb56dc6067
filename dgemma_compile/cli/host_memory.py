"""Host memory that a step frees stays in the process for the next step (glibc malloc), instead of going back to the
operating system and faulting in again, zeroed, page by page.

Why: a compiled CPU step allocates its large temporaries afresh on every call (Inductor's wrapper: `empty_strided`
per buffer, freed at the end of the call). glibc serves blocks above its mmap threshold (128 KiB, raised on the fly up
to 32 MiB) with their own mappings and returns freed memory above its trim threshold to the kernel, so every step
touches tens of MB of new pages. Measured on the scaled bench model at batch 1 (bench/results/host_memory_cpu_
2026-12-07.md): ~16,400 page faults per denoise step (~64 MB), 650 once retained, and the step 1.23x faster. The same
cause made the vocabulary region cost more inside the whole step than compiled alone (issue 39 item 3). PyTorch's CPU
performance guide and vLLM's CPU backend recommend preloading tcmalloc or jemalloc for this; `retain_freed_memory`
gets the same effect from the C library every Linux install has, with no preload.

What it costs: the process keeps the blocks it has freed (up to `MMAP_THRESHOLD_MAX` each) for reuse, so its
resident memory stays near the high-water mark of the run (tests/model/test_real_size.py's peak: +0.2 GB of ~6 GB). Who
calls it: the CLI's generate and serve when they run as the program (`cli.main`'s `owns_process`), once, before the
model loads; a library user calls it in their own process if they want it (it changes a process-wide setting, so the
library never does so on its own).
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 2**20
"""glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2; mallopt refuses more): blocks up to this size come
from the heaps and stay there when freed; larger ones keep a mapping of their own, returned when freed (a step's
temporaries at the scaled bench model's size are 16 MB; weights and a released-size model's [B, C, V] blocks are
larger: a mapping of their own, returned when freed, is what glibc does best with those)."""


def retain_freed_memory() -> str:
    """Make glibc keep freed blocks of up to `MMAP_THRESHOLD_MAX` in the process: such blocks come from the heaps
    (`M_MMAP_THRESHOLD`, fixed at its maximum instead of glibc's dynamic one) and no heap is trimmed
    (`M_TRIM_THRESHOLD` at its maximum). Process-wide, so the CLI calls it only when it owns its process (`cli.main`'s
    `owns_process`) and `python -m bench` only in its worker processes.

    Returns a short description of what was done, for the log: "glibc X: freed memory retained", or why it was not
    ("unchanged (not Linux)", "unchanged (no glibc mallopt)", "not retained (glibc X mallopt refused ...)"). Never raises: on another C library the
    process keeps its allocator's own behaviour.
    """
    if not sys.platform.startswith("linux"):
        return "unchanged (not Linux)"
    try:
        libc = ctypes.CDLL(None)
        mallopt, version = libc.mallopt, libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return "unchanged (no glibc mallopt)"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    version.restype = ctypes.c_char_p
    # the trim threshold is a size_t inside glibc; mallopt takes an int, so its largest value is the int maximum
    refused = [name for name, param, value in (("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX),
                                               ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, 2**31 - 1))
               if mallopt(param, value) != 1]
    if refused:
        return f"not retained (glibc {version().decode()} mallopt refused {', '.join(refused)})"
    return f"glibc {version().decode()}: freed memory retained"
