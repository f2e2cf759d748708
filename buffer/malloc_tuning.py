"""glibc allocator settings for processes that move large buffer records.

By default glibc gives freed heap memory above 128 kB back to the kernel and serves blocks of
128 kB and more with fresh `mmap`s, so a process that makes and drops ~200 kB group payloads
page-faults every one of them in again: on these machines that made unpacking a payload 5×
slower (163 µs against 33 µs for 200 kB, `benchmarks/buffer_throughput.py`). `tune_malloc()`
keeps up to 256 MB of freed memory for reuse instead. The buffer applies it once per process;
`ASYNCRL_TUNE_MALLOC=0` turns it off. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc <malloc.h>
TRIM_THRESHOLD = 256 << 20
MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit
TOP_PAD = 16 << 20

_applied: bool | None = None


def tune_malloc() -> bool:
    """Apply the settings once; True if they are in force."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    if not sys.platform.startswith("linux") or os.environ.get("ASYNCRL_TUNE_MALLOC", "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc; musl has no mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(
        mallopt(param, value) == 1
        for param, value in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_TOP_PAD, TOP_PAD),
        )
    )
