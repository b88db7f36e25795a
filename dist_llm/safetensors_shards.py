"""Sharded safetensors, written tensor by tensor: what `dist-llm convert` writes, as transformers lays it out.

A model over `max_shard_bytes` is cut into `model-00001-of-0000N.safetensors` files (a new one starts when the
next tensor would take the current one past the limit; a tensor larger than the limit gets a file of its own)
with `model.safetensors.index.json` ({"metadata": {"total_size": bytes}, "weight_map": {name: file}}); a model
that fits is one `model.safetensors`. Every name, shape and dtype is known before a byte is written, so each
file's header is written first and each tensor's bytes are appended as the tensor arrives: the writer never
holds more than the one tensor it is handed (safetensors' own `save_file` needs them all at once), and a view
or a tensor of another dtype is converted block by block of rows as it is written.

The format (https://github.com/huggingface/safetensors, "Format"): an 8-byte little-endian header length N,
N bytes of JSON ({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}, padded
with spaces to a multiple of 8), then the tensors' bytes, little-endian, C order, back to back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import struct
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import torch

from dist_llm.config import ConfigError
from dist_llm.fileio import atomic_path

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' default for save_pretrained

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "tb": 10**12, "b": 1}


def parse_shard_size(text: str | int) -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes (GB = 10**9, GiB = 2**30, as transformers reads them)."""
    if isinstance(text, int):
        size = text
    else:
        low = text.strip().lower()
        unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if low.endswith(u)), "")
        try:
            size = int(float(low[: len(low) - len(unit)]) * _UNITS.get(unit, 1))
        except ValueError:
            raise ConfigError(f"--max-shard-size: expected a size such as 5GB, 500MB or 2GiB, got {text!r}") from None
    if size <= 0:
        raise ConfigError(f"--max-shard-size: must be positive, got {text!r}")
    return size


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor to be written: its name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_shards(entries: list[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """`entries` in order, cut into files of at most `max_shard_bytes` each (a larger tensor alone in one)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def shard_names(n: int, stem: str = "model") -> list[str]:
    return [f"{stem}.safetensors"] if n == 1 else [f"{stem}-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def _header(entries: list[Entry], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for e in entries:
        if e.dtype not in _DTYPES:
            raise ConfigError(f"{e.name}: dtype {e.dtype} has no safetensors equivalent")
        header[e.name] = {"dtype": _DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data then starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


# A tensor handed over as a view (GPT-2's transposed Conv1D weights) or in another dtype than the file's is
# made contiguous and cast this many bytes of rows at a time: the file's bytes never exist as a second tensor.
WRITE_BLOCK_BYTES = 16 * 2**20


def _write_tensor(f: BinaryIO, entry: Entry, t: torch.Tensor) -> None:
    # a float may be cast to the planned float dtype (fp32 weights exported as bf16); nothing else changes type
    castable = t.dtype == entry.dtype or (t.dtype.is_floating_point and entry.dtype.is_floating_point)
    if tuple(t.shape) != entry.shape or not castable:
        raise AssertionError(f"{entry.name}: got {tuple(t.shape)} {t.dtype}, planned {entry.shape} {entry.dtype}")
    t = t.detach().cpu()
    if t.numel() == 0:
        return
    if (t.is_contiguous() and t.dtype == entry.dtype) or t.dim() == 0:
        f.write(memoryview(t.to(entry.dtype).contiguous().reshape(-1).view(torch.uint8).numpy()))  # no copy
        return
    step = max(1, WRITE_BLOCK_BYTES // max(1, t[0].numel() * max(t.element_size(), entry.dtype.itemsize)))
    for a in range(0, t.shape[0], step):
        block = t[a:a + step].contiguous().to(entry.dtype)
        f.write(memoryview(block.reshape(-1).view(torch.uint8).numpy()))


def _next(stream: Iterator[tuple[str, torch.Tensor]], entry: Entry) -> torch.Tensor:
    got, t = next(stream)
    if got != entry.name:
        raise AssertionError(f"tensor {got} arrived where {entry.name} was planned")
    return t


def write_file(path: Path, entries: list[Entry], stream: Iterator[tuple[str, torch.Tensor]],
               metadata: dict[str, str]) -> None:
    """One safetensors file of `entries`, their tensors taken from `stream` one at a time."""
    if sys.byteorder != "little":  # pragma: no cover - the format is little-endian; so is every machine we run on
        raise ConfigError("safetensors files are little-endian: this machine is not")
    with open(path, "wb") as f:
        f.write(_header(entries, {"format": "pt", **metadata}))
        for entry in entries:
            _write_tensor(f, entry, _next(stream, entry))  # dropped before the next is made


def write_shards(folder: Path, entries: list[Entry], tensors: Iterable[tuple[str, torch.Tensor]], *,
                 max_shard_bytes: int, metadata: dict[str, str] | None = None, stem: str = "model",
                 atomic: bool = False) -> list[str]:
    """Write `tensors` (name, tensor pairs, in the order and of the shapes and dtypes of `entries`; an
    iterator that makes each when asked) into `folder` as sharded safetensors, with the index when there is
    more than one file; returns the names of the files written (the index last). `atomic`: each file is
    written under a temporary name and renamed into place (for a folder that is not itself being built
    aside)."""
    metadata = metadata or {}
    shards = plan_shards(entries, max_shard_bytes)
    names = shard_names(len(shards), stem)
    stream = iter(tensors)
    for name, shard in zip(names, shards):
        with _target(folder / name, atomic) as file:
            write_file(file, shard, stream, metadata)
    if len(shards) == 1:
        return names
    index = {"metadata": {"total_size": sum(e.nbytes for e in entries), **metadata},
             "weight_map": {e.name: name for name, shard in zip(names, shards) for e in shard}}
    index_name = f"{stem}.safetensors.index.json"
    with _target(folder / index_name, atomic) as file:  # last: it names the files, which are then all there
        file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*names, index_name]


@contextlib.contextmanager
def _target(path: Path, atomic: bool) -> Iterator[Path]:
    if not atomic:  # the caller builds a temporary folder that appears whole (fileio.atomic_folder)
        yield path
        return
    with atomic_path(path) as tmp:
        yield tmp


__all__ = ["DEFAULT_MAX_SHARD_SIZE", "Entry", "SAFETENSORS_FILE", "SAFETENSORS_INDEX", "parse_shard_size",
           "plan_shards", "shard_names", "write_file", "write_shards"]
