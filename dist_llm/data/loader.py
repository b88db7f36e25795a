"""The next step's batches, built in a background thread while this step computes.

Gathering token windows from the memory-mapped corpus (and, for a GPU, copying them into pinned memory) is
host work that would otherwise sit between two steps, with the GPU idle. A one-thread pool builds step s+1's
micro-batches while step s runs; the copy to the device is then queued from pinned memory without waiting.
Which windows a step trains on depends on the step number alone (see sampler.py), so prefetching changes
nothing that is computed.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

HostBatches = list[tuple[torch.Tensor, torch.Tensor]]


class BatchPrefetcher:
    """`get(step)` returns `load(step)`, taken from the background thread when it was prefetched, and starts
    building `load(step + 1)`. With `enabled=False` every load runs in the caller's thread."""

    def __init__(self, load: Callable[[int], HostBatches], *, enabled: bool) -> None:
        self._load = load
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dist_llm-data") if enabled else None
        self._next: tuple[int, Future[HostBatches]] | None = None

    def get(self, step: int) -> HostBatches:
        ahead, self._next = self._next, None
        batches = ahead[1].result() if ahead is not None and ahead[0] == step else self._load(step)
        if self._pool is not None:
            self._next = (step + 1, self._pool.submit(self._load, step + 1))
        return batches

    def close(self) -> None:
        """Stop the thread (a batch being built is finished and dropped)."""
        self._next = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
