"""Keep freed host memory in the process (CPU runs).

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh mmap and
unmaps it on free, and trims the heap top it frees. A CPU training step allocates and frees
activations of tens to hundreds of MiB per MicroPack, so each one comes back as new pages: the
kernel zero-fills them on first touch, one page fault per 4 KiB. Measured on this machine: a
2048-token MicroPack of the tiny model took up to ~65,000 faults per task in the 2-process
pipeline, and allocating and filling a 100 MiB tensor took 62 ms instead of 8 ms with the heap
kept (40 MiB: 26 ms instead of 3.4 ms).

`keep_freed_host_memory()` turns both off with `mallopt`, so freed memory stays in the heap and
the next MicroPack reuses warm pages (a CUDA run has its own caching allocator; this only
concerns host memory and is applied to the CPU worker processes). `SLIMPACK_KEEP_HOST_MEMORY=0`
opts out.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1  # mallopt takes a C int
TOP_PAD_BYTES = 64 << 20  # grow the heap in large steps


def keep_freed_host_memory() -> bool:
    """Serve large allocations from the heap and never trim it. True when applied (glibc),
    False where it does not apply (another libc, or opted out)."""
    if os.environ.get("SLIMPACK_KEEP_HOST_MEMORY", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(parameter, value) == 1 for parameter, value in
               ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, _INT_MAX), (M_TOP_PAD, TOP_PAD_BYTES)))


__all__ = ["keep_freed_host_memory"]
