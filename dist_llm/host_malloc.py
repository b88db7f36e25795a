"""Give freed host tensors back to the operating system at once (glibc's malloc on Linux).

glibc serves a request of at least M_MMAP_THRESHOLD bytes with a mapping of its own, unmapped on free; smaller
ones come from its heaps, which keep freed memory for reuse. The threshold starts at 128 KiB but is dynamic:
each free of a mapped block raises it to that block's size (up to 32 MiB). After a few frees of 4-11 MiB
tensors, tensors of that size come from the heaps, and FSDP2's per-block gathers (freed and allocated again
for the next block, between activations that stay) leave holes the heaps neither fill nor return: measured on a
ZeRO-3 LoRA step of a 278M-parameter Llama at dp=4, ~17 MiB of resident memory per block left behind in the
forward, 313 MiB of a 1.4 GiB peak. Setting the threshold fixes it (and turns the dynamic raise off), so every
tensor from 1 MiB up is mapped on allocation and unmapped on free; what is resident is what is alive.
The price is a page fault per page of each new large tensor. Why 1 MiB and not glibc's starting 128 KiB: a
training step of configs/tiny.yaml on one CPU thread (a loop of forward, backward, AdamW) took
~1.4-1.7x as long at 128 KiB as with glibc's dynamic threshold, and about the same at 1 MiB or 4 MiB
(alternating runs, 2026-11-25): the many activations between 128 KiB and 1 MiB then come from the heap again.
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger("dist_llm")

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
THRESHOLD_BYTES = 1 << 20  # fixed: glibc's dynamic raise (up to 32 MiB) turned off


def map_large_allocations(threshold: int = THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes for this process; False where there is no glibc (macOS,
    musl) or it refused, which costs memory, not correctness. The setting is process-wide and stays (a notebook or
    a program that imports dist_llm's Trainer gets it too)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)  # the C library this process already has (find_library would run ldconfig)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, threshold) == 1
    if not ok:
        log.debug("mallopt(M_MMAP_THRESHOLD, %d) refused", threshold)
    return ok
