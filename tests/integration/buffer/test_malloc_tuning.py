"""buffer/malloc_tuning.py: glibc keeps large payloads' memory on its heap once tuned (each case in a
fresh interpreter, since the settings are process-wide)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import ctypes, sys
from asyncrl.buffer.malloc_tuning import tune_malloc
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
tuned = tune_malloc()
before = libc.mallinfo2().hblkhd
block = bytearray(4 << 20)  # a 4 MB payload: glibc's default serves it with its own mmap
print(tuned, libc.mallinfo2().hblkhd - before >= 4 << 20)
"""


def probe(**env: str) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                         env={**os.environ, **env}, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))  # fmt: skip
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_tuned_process_serves_large_blocks_from_its_heap():
    assert probe() == "True False"  # tuned: no fresh mmap (and no page faults) per payload
    assert probe(ASYNCRL_TUNE_MALLOC="0") == "False True"  # opted out: glibc's defaults
