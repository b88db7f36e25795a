"""A DCP checkpoint written and read one whole tensor at a time, for `dist-llm convert` (one process, no model).

Writing: `StreamingSavePlanner` saves a state dict of placeholders (meta tensors of the full shapes and dtypes,
which hold no memory) through `dcp.save`; DCP asks the planner for each tensor's data as it writes it
(`resolve_data`), and the planner makes it then, by a function of its name. DCP's FileSystemWriter keeps a
reference to every tensor of a file until the file is closed (a name -> tensor dict kept for its safetensors
format, and its loop variables), so dropping our reference would free nothing: the planner frees the storage
of the tensor it made before (`untyped_storage().resize_(0)`) when the next is asked for, once the writer has
written it. The writer of `streaming_writer()` resolves one item at a time, in plan order (`_SerialCpuLoader`:
one thread and no copy-ahead, which on a machine with CUDA would otherwise resolve several ahead).

Reading: `read_whole` loads one tensor of a checkpoint (every chunk any rank wrote of it), each stored chunk
deserialised once, with weights_only=True, from the checkpoint's own files (`SafeReader`'s checks); a tensor
stored as one chunk is returned as deserialised, with no second buffer (DCP's own load deserialises each chunk
and then copies it into the tensor asked for: twice the tensor at the peak).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from dist_llm.config import ConfigError
from dist_llm.train.checkpoint import SafeReader
from dist_llm.train.safe_metadata import load_failure


# -- writing ----------------------------------------------------------------------------------------------------
def placeholders(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Meta tensors of `shapes`: what DCP plans a save by (names, shapes, dtypes), holding no data."""
    return {name: torch.empty(shape, dtype=dtype, device="meta") for name, shape in shapes.items()}


class StreamingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, except that each tensor's data is `make(fqn)` (fqn: the flattened key, e.g.
    "model.wte.weight"), made when the writer asks for it; the one made before is freed then."""

    def __init__(self, make: Callable[[str], torch.Tensor]) -> None:
        super().__init__()
        self.make = make
        self._last: torch.Tensor | None = None

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        self.release()  # the writer has written it (one item at a time, in order): its bytes go now
        fqn = write_item.index.fqn
        t = self.make(fqn)
        want = write_item.tensor_data
        assert want is not None
        if tuple(t.shape) != tuple(want.size) or t.dtype != want.properties.dtype:
            raise AssertionError(f"{fqn}: made {tuple(t.shape)} {t.dtype}, planned {tuple(want.size)} "
                                 f"{want.properties.dtype}")
        if t.untyped_storage().nbytes() != t.nbytes or t.device.type != "cpu":
            t = t.to("cpu").clone()  # the writer would copy it itself, and keep the copy
        self._last = t
        return t

    def release(self) -> None:
        """Free the last tensor made (its storage: the writer may still hold the tensor object)."""
        if self._last is not None:
            self._last.untyped_storage().resize_(0)
            self._last = None


def streaming_writer(path: Path) -> FileSystemWriter:
    """A FileSystemWriter that resolves and writes one tensor at a time: one thread, no copy-ahead (with
    copy-ahead it resolves items until 10 MB are in flight, on machines with CUDA)."""
    return FileSystemWriter(str(path), thread_count=1, per_thread_copy_ahead=0)


# -- reading ----------------------------------------------------------------------------------------------------
def _failure(path: Path, e: Exception) -> BaseException:
    """A failed read as `dcp.load`'s failures are told: one line naming the checkpoint and the reason."""
    return load_failure(path, CheckpointException("read", {0: (e, traceback.extract_tb(e.__traceback__))}))


class ChunkReader:
    """The tensors of a checkpoint, each read whole from its stored chunks."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reader = SafeReader(str(path))
        meta = self.reader.read_metadata()  # safe_metadata.load_index: no pickle code runs; chunks tile the tensor
        self.index: dict[str, Any] = meta.state_dict_metadata
        self.storage: dict[str, list[tuple[MetadataIndex, Any]]] = {}
        for key, info in (meta.storage_data or {}).items():
            self.storage.setdefault(key.fqn, []).append((key, info))

    def read_whole(self, fqn: str) -> torch.Tensor:
        """Tensor `fqn` at its full shape and saved dtype. Peak: the tensor, plus one stored chunk while it is
        copied in when there are several (none when it is stored whole)."""
        meta = self.index[fqn]
        assert isinstance(meta, TensorStorageMetadata)
        stored = self.storage.get(fqn, [])
        if len(stored) != len(meta.chunks) or any(info.transform_descriptors for _, info in stored):
            return self._through_dcp(fqn, meta)  # (compressed or otherwise transformed chunks: DCP's own path)
        dtype, size = meta.properties.dtype, tuple(meta.size)
        out: torch.Tensor | None = None
        for key, info in stored:
            chunk = self._load_chunk(info)
            sizes = next((tuple(c.sizes) for c in meta.chunks if c.offsets == key.offset), None)
            if sizes is None or tuple(chunk.shape) != sizes or chunk.dtype != dtype:
                raise ConfigError(f"{self.path}: {fqn}: a stored chunk of {tuple(chunk.shape)} {chunk.dtype} at "
                                  f"{tuple(key.offset or ())} does not match the index ({sizes} {dtype})")
            if len(stored) == 1 and sizes == size:
                return chunk  # stored whole: the deserialised chunk is the tensor
            if out is None:
                out = torch.empty(size, dtype=dtype)
            view = out
            for dim, (o, n) in enumerate(zip(key.offset, sizes)):
                view = view.narrow(dim, o, n)
            view.copy_(chunk)
            del chunk  # before the next is read
        if out is None:  # (an empty tensor has one empty chunk, which returned above)
            raise ConfigError(f"{self.path}: {fqn}: no stored chunks")
        return out

    def _load_chunk(self, info: Any) -> torch.Tensor:
        try:
            with self.reader.fs.create_stream(self.path / info.relative_path, "rb") as stream:
                chunk = torch.load(self.reader._slice_file(stream, info), map_location="cpu", weights_only=True)
            if not isinstance(chunk, torch.Tensor):
                raise ConfigError(f"{self.path / info.relative_path}: a stored chunk is a {type(chunk).__name__}, "
                                  "not a tensor (a damaged or foreign checkpoint)")
            return chunk
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - a shard that is no plain tensor, a truncated file: one line
            raise _failure(self.path, e) from None

    def _through_dcp(self, fqn: str, meta: TensorStorageMetadata) -> torch.Tensor:
        t = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        try:  # no_dist: this one process reads every rank's chunks of the tensor, whatever the process group
            dcp.load({fqn: t}, storage_reader=self.reader, no_dist=True)
        except CheckpointException as e:
            raise load_failure(self.path, e) from None
        return t


__all__ = ["ChunkReader", "StreamingSavePlanner", "placeholders", "streaming_writer"]
