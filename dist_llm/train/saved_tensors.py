"""Counting the activation memory autograd holds: the bytes of the tensors saved for backward.

On a CPU there is no allocator peak to read, so the memory calculator's activation terms and the
pipeline's in-flight micro-batches are checked by this count instead. Each saved tensor is counted by its
storage, once however many ops save it or views of it, from when it is saved until autograd releases its
last reference (after its backward, or when the graph is dropped: the meter itself must not keep it alive,
see `_pack`). Parameters are left out: they are model states, held whether or not a graph exists.
"""

from __future__ import annotations

from typing import Iterable

import torch


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage behind `t` (a DTensor's local shard), or None for a tensor without one of its own."""
    local = t.to_local() if hasattr(t, "to_local") else t
    try:
        storage = local.untyped_storage()
        storage.data_ptr()
    except (RuntimeError, NotImplementedError):  # wrapper subclasses, freed FSDP2 storages
        return None
    return storage


class _Held:
    """What the pack hook leaves in the graph: the tensor, and a release of its count when the graph drops it."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: "SavedTensorMeter", key: int) -> None:
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedTensorMeter:
    """A context manager: while it is active, `live_bytes` is what autograd holds for backward and
    `peak_bytes` the most it held at once."""

    def __init__(self, params: Iterable[torch.Tensor] = (), module: torch.nn.Module | None = None) -> None:
        self._skip = {s.data_ptr() for s in map(_storage, params) if s is not None}
        # FSDP2 swaps the module's parameters for unsharded ones during forward: they are parameters too,
        # freed after forward however autograd refers to them, so the module is asked at each save
        self._module = module
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [bytes, references]
        self.live_bytes = 0
        self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> object:
        storage = None if isinstance(t, torch.nn.Parameter) else _storage(t)
        if storage is None or storage.data_ptr() in self._skip or storage.nbytes() == 0:
            return t
        if self._module is not None and storage.data_ptr() in self._current_params():
            return t
        key = storage.data_ptr()
        entry = self._refs.get(key)
        if entry is None:
            self._refs[key] = [storage.nbytes(), 1]
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        else:
            entry[1] += 1
        # Detached, as autograd itself keeps a saved output: `t` may be an output of the node saving it (RMSNorm's
        # rstd, attention's output), and holding it with its grad_fn closes a cycle node -> saved tensor -> node
        # through C++, which Python's gc cannot see. A backward without retain_graph breaks it by releasing the
        # saved tensors; zb1's split backward (retain_graph, split_backward.py) and a graph dropped unused never
        # do, so every such graph of the metered step stayed alive for the life of the process (pytorch#189025).
        # The unpacked tensor gets its grad_fn back from autograd (SavedVariable::unpack), so nothing is lost.
        # A tensor without a grad_fn closes no cycle and is held as it is: detaching it would make a new Python
        # object and let the original's die, and a cache that shares a tensor while it lives (the ALiBi bias,
        # model/positions.py) would then build one a block in the metered step.
        return _Held(t if t.grad_fn is None else t.detach(), self, key)

    def _current_params(self) -> set[int]:
        return {s.data_ptr() for s in map(_storage, self._module.parameters()) if s is not None}  # type: ignore[union-attr]

    @staticmethod
    def _unpack(held: object) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held  # type: ignore[return-value]

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._refs[key]
            self.live_bytes -= entry[0]

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
