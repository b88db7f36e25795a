"""glibc's malloc settings (host_malloc.py): what a process's heap keeps and gives back, in page faults."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# 64 blocks of 512 KiB (under the 1 MiB mmap threshold: from the heap), written, then freed, four rounds, as a ZB-H1
# stage's B and W allocate and free each micro-batch. glibc's malloc and free directly, so that no other allocation
# lands at the heap's top between rounds; the minor page faults of rounds 2-4 are memory given back and faulted in
# again.
_CHURN = r"""
import ctypes, resource, sys
from dist_llm.host_malloc import map_large_allocations
assert map_large_allocations(**({"trim": 128 << 10} if sys.argv[1] == "trim-128k" else {}))
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
size, ptrs, faults = 512 << 10, [0] * 64, []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(len(ptrs)):
        ptrs[i] = libc.malloc(size)
        ctypes.memset(ptrs[i], 1, size)
    for p in ptrs:
        libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[1:]))
"""


def test_the_heap_top_is_reused_not_faulted_in_again() -> None:
    """With the trim threshold at glibc's 128 KiB (where fixing the mmap threshold left it before), the 32 MiB freed
    at the heap's top go back to the system each round and every page is faulted in again (8160 a round); with the
    64 MiB threshold the later rounds reuse them (0 measured)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallopt: Linux only")
    faults = {how: int(subprocess.run([sys.executable, "-c", _CHURN, how], capture_output=True, text=True,
                                      check=True, cwd=Path(__file__).resolve().parent.parent).stdout.strip())
              for how in ("trim-128k", "default")}
    assert faults["trim-128k"] > 3 * 8000, faults  # the control: the churn the setting removes
    assert faults["default"] < 300, faults
