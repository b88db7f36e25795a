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

Fixing the mmap threshold also fixes glibc's trim threshold (it follows the dynamic one, at twice it) at its
starting 128 KiB: every free that leaves more than that free at the heap's top hands it back, and the next
allocation there faults it in again, page by page. A stage of the ZB-H1 schedule keeps each micro-batch's graph
from its B to its W, so its B and W cannot reuse the freed saved tensors as an ordinary backward does and move
the heap's top by tens of MiB each: measured on bench_pp's last stage (8 x 256, micro-batch 2, whose tensors are
all under 1 MiB), 4.9k faults a step at m=4 and 7% more CPU time than with the top kept (under 0.3k faults;
1F1B's last stage: 1k and under 0.1k). So the trim threshold is fixed at 64 MiB: up to that much freed at the top stays for reuse.
It is memory the process held a moment before (peaks are unchanged), and `perf.reset_peak_memory` trims the heap
before a new peak is measured.
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger("dist_llm")

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 1 << 20  # fixed: glibc's dynamic raise (up to 32 MiB) turned off
TRIM_BYTES = 64 << 20  # freed memory at the heap's top kept for reuse (see the module docstring)


def map_large_allocations(threshold: int = THRESHOLD_BYTES, trim: int = TRIM_BYTES) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes and its trim threshold at `trim` for this process; False
    where there is no glibc (macOS, musl) or it refused, which costs memory or time, not correctness. The settings
    are process-wide and stay (a notebook or a program that imports dist_llm's Trainer gets them too)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)  # the C library this process already has (find_library would run ldconfig)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = True
    for param, value, name in ((M_MMAP_THRESHOLD, threshold, "M_MMAP_THRESHOLD"), (M_TRIM_THRESHOLD, trim,
                                                                                  "M_TRIM_THRESHOLD")):
        if mallopt(param, value) != 1:
            log.debug("mallopt(%s, %d) refused", name, value)
            ok = False
    return ok
