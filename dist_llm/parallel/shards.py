"""This rank's part of a global tensor as rectangular chunks with global offsets, for DCP to write and read.

A checkpoint holds every tensor at its global (tp=1, unsharded) shape, so any layout loads it. A rank holds
pieces of those tensors: tensor-parallel row runs or column blocks, ZeRO's 1-D ranges of a flattened
parameter, FSDP2's rows. `ChunkedTensor` is a tensor of the global shape that holds no data of its own, only
a list of (global offsets, local view) chunks; it implements DCP's `_Checkpointable` hooks, so DCP writes each
chunk (a chunk several ranks hold alike, e.g. a replicated one, once: its index is fqn + offsets) and, on
load, reads (resharding) straight into the views, i.e. into the live parameters and optimizer state.
Nothing is gathered: each rank writes and reads only its own bytes.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager

Offsets = tuple[int, ...]
Rect = tuple[Offsets, Offsets]  # (offsets, sizes)


def range_rectangles(shape: Sequence[int], lo: int, hi: int) -> list[Rect]:
    """Elements [lo, hi) of a row-major tensor of `shape` as rectangles (offsets, sizes), in order: a partial
    first row, the full rows, a partial last row (each partial row decomposed the same way one dim down)."""
    shape = tuple(shape)
    if lo >= hi:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(lo, inner)
    r1, c1 = divmod(hi, inner)

    def partial(row: int, a: int, b: int) -> list[Rect]:
        return [((row, *o), (1, *s)) for o, s in range_rectangles(shape[1:], a, b)]

    if r0 == r1:
        return partial(r0, c0, c1)
    out: list[Rect] = []
    if c0:
        out += partial(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0, *([0] * (len(shape) - 1))), (r1 - r0, *shape[1:])))
    if c1:
        out += partial(r1, 0, c1)
    return out


def narrow(t: torch.Tensor, rect: Rect) -> torch.Tensor:
    """The view of `t` that `rect` covers."""
    for dim, (o, n) in enumerate(zip(*rect)):
        t = t.narrow(dim, o, n)
    return t


class ChunkedTensor(torch.Tensor):
    """A global tensor of which this rank holds `chunks`: (global offsets, local view) pairs, no overlap. It
    carries no storage; only DCP's checkpoint hooks read it."""

    chunks: list[tuple[Offsets, torch.Tensor]]

    @staticmethod
    def __new__(cls, shape: Sequence[int], chunks: list[tuple[Offsets, torch.Tensor]], *,
                dtype: torch.dtype, device: torch.device) -> "ChunkedTensor":
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device, requires_grad=False)
        t.chunks = [(tuple(o), v) for o, v in chunks if v.numel()]  # an empty piece is no chunk
        for o, v in t.chunks:
            if v.dtype != dtype or len(o) != len(shape) or any(a + n > d for a, n, d in zip(o, v.shape, shape)):
                raise ValueError(f"chunk at {o} of {tuple(v.shape)} {v.dtype} does not fit {tuple(shape)} {dtype}")
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.detach.default:
            return args[0]
        if func is torch.ops.aten.is_pinned.default:
            return False
        raise TypeError(f"{func}: a ChunkedTensor only describes a rank's chunks to torch.distributed.checkpoint")

    def __repr__(self) -> str:  # (the default would read the data)
        return f"ChunkedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, chunks={len(self.chunks)})"

    # -- DCP's _Checkpointable protocol ---------------------------------------------------------------------
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        size = torch.Size(self.shape)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(o)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(o), v.shape),
                                                      properties=TensorProperties(dtype=self.dtype), size=size))
                for o, v in self.chunks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=v.shape) for o, v in self.chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.index is not None and index.index < len(self.chunks):
            o, v = self.chunks[index.index]
            if torch.Size(o) == index.offset:
                return v
        for o, v in self.chunks:
            if torch.Size(o) == index.offset:
                return v
        raise ValueError(f"{index.fqn}: this rank holds no chunk at {tuple(index.offset or ())}")

    def chunk_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for _, v in self.chunks)


def is_chunked(t: Any) -> bool:
    return isinstance(t, ChunkedTensor)


def map_tensors(state: Any, fn: Callable[[str, torch.Tensor], Any], prefix: str = "") -> Any:
    """`state` (nested dicts) with every tensor t at dotted key k replaced by fn(k, t)."""
    if isinstance(state, dict):
        return {k: map_tensors(v, fn, f"{prefix}{k}.") for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return fn(prefix[:-1], state)
    return state


def chunk_bytes(state: Any) -> int:
    """Bytes of the chunks (and plain tensors) this rank hands DCP in `state`, DTensors by their local part."""
    total = [0]

    def add(_: str, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, ChunkedTensor):
            total[0] += t.chunk_bytes()
        else:
            local = t.to_local() if hasattr(t, "to_local") else t
            total[0] += local.numel() * local.element_size()
        return t

    map_tensors(state, add)
    return total[0]


# -- staging for background saves: DCP's stager copies plain tensors only ----------------------------------------
def unwrap_for_staging(state: Any) -> tuple[Any, dict[str, tuple[torch.Size, torch.dtype, list[Offsets]]]]:
    """`state` with each ChunkedTensor replaced by the list of its chunk tensors (plain ones, which a stager can
    copy), and what `rewrap` needs to rebuild them. A chunk viewing a storage much larger than what this state
    takes of it (e.g. a master shard that is a slice of the flat parameters) is cloned first: a stager copies
    whole storages, which would then copy more than this rank's own bytes."""
    used: dict[int, int] = {}

    def count(_: str, t: torch.Tensor) -> torch.Tensor:
        for _, v in (t.chunks if isinstance(t, ChunkedTensor) else []):
            key = v.untyped_storage().data_ptr()
            used[key] = used.get(key, 0) + v.numel() * v.element_size()
        return t

    map_tensors(state, count)
    layout: dict[str, tuple[torch.Size, torch.dtype, list[Offsets]]] = {}

    def own(v: torch.Tensor) -> torch.Tensor:
        storage = v.untyped_storage()
        return v.clone() if storage.nbytes() > 2 * used[storage.data_ptr()] else v

    def split(key: str, t: torch.Tensor) -> Any:
        if not isinstance(t, ChunkedTensor):
            return t
        layout[key] = (t.shape, t.dtype, [o for o, _ in t.chunks])
        return [own(v) for _, v in t.chunks]

    return map_tensors(state, split), layout


def rewrap(staged: Any, layout: dict[str, tuple[torch.Size, torch.dtype, list[Offsets]]], prefix: str = "") -> Any:
    """The inverse of `unwrap_for_staging`, over the staged copies."""
    if isinstance(staged, dict):
        return {k: rewrap(v, layout, f"{prefix}{k}.") for k, v in staged.items()}
    key = prefix[:-1]
    if key in layout:
        shape, dtype, offsets = layout[key]
        views = list(staged)
        device = views[0].device if views else torch.device("cpu")
        return ChunkedTensor(shape, list(zip(offsets, views)), dtype=dtype, device=device)
    return staged


class ChunkStager(AsyncStager):
    """A DCP stager (DefaultStager, say) made to stage ChunkedTensors: it stages their chunks as plain tensors
    and wraps the staged copies again."""

    def __init__(self, inner: AsyncStager) -> None:
        self.inner = inner

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self.inner.should_synchronize_after_execute

    def stage(self, state_dict: dict[str, Any]) -> Future | dict[str, Any]:
        plain, layout = unwrap_for_staging(state_dict)
        staged = self.inner.stage(plain)
        if not isinstance(staged, Future):
            return rewrap(staged, layout)
        out: Future = Future()

        def done(f: Future) -> None:
            try:
                out.set_result(rewrap(f.result(), layout))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the staging
                out.set_exception(e)

        staged.add_done_callback(done)
        return out

    def synchronize_staging(self) -> None:
        self.inner.synchronize_staging()

    def close(self) -> None:
        self.inner.close()
