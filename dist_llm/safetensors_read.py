"""Regions of safetensors files read with explicit reads (`os.preadv`), not through a memory map.

safetensors' `safe_open` maps the file, and a slice reads through the mapping: every page it touches stays
resident in the process (counted in its resident set, VmHWM) until the file is closed. A row-parallel slice
(`[:, a:b]` of a (rows, cols) tensor) touches pages across the whole tensor, so a tensor-parallel rank loading
a 1 GiB model held ~250 MiB of mapped shards at its peak beside its own quarter of the model. Read here: the
bytes of whole rows, in blocks of at most BLOCK_BYTES, into one reused buffer, of which the caller copies the
columns it keeps (converting to its own dtype); the buffer is the only memory the read takes, whatever the
tensor's size. Where the destination wants exactly the file's bytes (whole rows, the file's dtype, contiguous
CPU memory) they are read straight into it instead (`read_rows_into`): no buffer at all. The values are those
safetensors gives: the same bytes, viewed in the file's dtype.

The format (https://github.com/huggingface/safetensors, "Format"): an 8-byte little-endian header length N,
N bytes of JSON ({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}), then the
tensors' bytes, little-endian, C order, `data_offsets` relative to the end of the header. Everything a read
trusts is checked: the header when it is parsed (`read_header`: the length against the file, each tensor's
dtype, shape and its offsets against its size, all exact integers, and the tensors' ranges tiling the data
from its start, no two sharing a byte), the file's length when it is opened for reading (`ShardFile`:
a truncated file is found by the first read of any of its tensors, as safe_open found it), and the values a
read keeps, block by block while they are in hand (`check_finite`: a NaN or an infinity is no weight).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

#: the dtypes a weight can be read from (an integer tensor is no weight)
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
MAX_HEADER = 100_000_000  # the bound safetensors itself puts on a header
#: the most bytes of a file read at once (and held in the read buffer): a block of whole rows
BLOCK_BYTES = 16 * 2**20


@dataclasses.dataclass(frozen=True)
class Stored:
    """A tensor in a safetensors file: its shape and dtype, and where its bytes lie ([begin, end), absolute)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    begin: int
    end: int


def read_header(file: Path) -> dict[str, Stored]:
    """Tensor name -> Stored from a safetensors file's header (its first 8 + N bytes; no tensor data read).
    ValueError (or OSError) saying what is wrong where the header is not one of weights this module can read."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        # (read on every rank before anything else: a forged length must not make each allocate gigabytes)
        if not 2 <= size <= min(os.fstat(f.fileno()).st_size - 8, MAX_HEADER):
            raise ValueError(f"header length {size} does not fit the file or exceeds {MAX_HEADER} bytes")
        try:
            header = json.loads(f.read(size))
        except RecursionError:  # (nested past Python's limit: a header of weights is two levels deep)
            raise ValueError("the header is nested too deeply to be one of weights") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        if not isinstance(v, dict):
            raise ValueError(f"tensor {k!r}: its entry is not an object")
        if v.get("dtype") not in DTYPES:
            raise ValueError(f"tensor {k!r} is {v.get('dtype')}, not a floating-point weight")
        shape, offsets = v.get("shape"), v.get("data_offsets")
        # exact integers: int() would take 64.9 as 64 and true as 1, and read other bytes than the file meant
        if not isinstance(shape, list) or not all(_is_int(n) for n in shape):
            raise ValueError(f"tensor {k!r}: shape {shape!r} is not a list of integers")
        if any(n < 0 for n in shape):
            raise ValueError(f"tensor {k!r} has a negative dimension {tuple(shape)}")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(x) for x in offsets):
            raise ValueError(f"tensor {k!r}: data_offsets {offsets!r} are not two integers")
        dtype, (begin, end) = DTYPES[v["dtype"]], offsets
        if not 0 <= begin <= end or end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {k!r}: data_offsets [{begin}, {end}] do not hold {tuple(shape)} of {v['dtype']}")
        out[k] = Stored(tuple(shape), dtype, 8 + size + begin, 8 + size + end)
    _check_tiling(out, 8 + size)
    return out


def _is_int(x: object) -> bool:
    return type(x) is int  # (not bool, which JSON's true gives)


def _check_tiling(tensors: dict[str, Stored], start: int) -> None:
    """The tensors' byte ranges, sorted by where they begin, tile the data region from its start (`start`, absolute):
    no gap, no overlap (two tensors reading the same bytes), as safetensors' reference reader insists."""
    before: tuple[str, Stored] | None = None
    for name, t in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        at = before[1].end if before is not None else start
        if t.begin != at:
            span = f"tensor {name!r}: data_offsets [{t.begin - start}, {t.end - start}]"
            if before is None:
                raise ValueError(f"{span} leave a gap at the start of the data: invalid offset")
            other = f"those of {before[0]!r} [{before[1].begin - start}, {before[1].end - start}]"
            raise ValueError(f"{span} {'overlap' if t.begin < at else 'leave a gap after'} {other}: invalid offset")
        before = name, t


class ShardFile:
    """One safetensors file open for reading regions of its tensors (`blocks`). Opening checks that the file
    holds every byte its header describes (OSError or ValueError otherwise)."""

    def __init__(self, file: Path, tensors: dict[str, Stored]) -> None:
        if sys.byteorder != "little":  # pragma: no cover - the format is little-endian; so is every machine we run on
            raise ValueError("safetensors files are little-endian: this machine is not")
        self.file = file
        self.tensors = tensors
        self.fd = -1
        self.fd = os.open(file, os.O_RDONLY)
        try:
            have = os.fstat(self.fd).st_size
            need = max((t.end for t in tensors.values()), default=0)
            if have < need:
                raise ValueError(f"the file has {have} bytes, its header describes {need}: truncated")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            self.close()

    def blocks(self, key: str, rows: tuple[int, int], cols: tuple[int, int] | None = None, *,
               block_bytes: int = BLOCK_BYTES) -> Iterator[tuple[int, torch.Tensor]]:
        """Rows [rows) (of dim 0) of tensor `key`, and of them columns [cols) (of dim 1; all when None), block
        by block: (the block's first row, counted from rows[0]; the block in the file's dtype). Each block is a
        view of one buffer that the next overwrites: copy it out before asking for the next."""
        yield from self._blocks(key, rows, cols, block_bytes)

    def _blocks(self, key: str, rows: tuple[int, int], cols: tuple[int, int] | None,
                block_bytes: int) -> Iterator[tuple[int, torch.Tensor]]:
        t = self.tensors[key]
        r0, r1 = rows
        if not 0 <= r0 <= r1 <= (t.shape[0] if t.shape else 1):
            raise ValueError(f"rows [{r0}, {r1}) out of tensor {key!r} of shape {t.shape}")
        row_shape = t.shape[1:]
        row_bytes = math.prod(row_shape) * t.dtype.itemsize
        if r1 == r0 or row_bytes == 0:
            return
        step = max(1, block_bytes // row_bytes)
        buffer = bytearray(min(r1 - r0, step) * row_bytes)
        for a in range(r0, r1, step):
            n = min(step, r1 - a)
            self._read_into(memoryview(buffer)[: n * row_bytes], t.begin + a * row_bytes)
            block = torch.frombuffer(buffer, dtype=t.dtype, count=n * row_bytes // t.dtype.itemsize)
            block = block.view(n, *row_shape)
            block = block if cols is None else block[:, cols[0]:cols[1]]
            check_finite(key, block, a)  # (what this read keeps, while it is in the buffer)
            yield a - r0, block

    def read_rows_into(self, key: str, rows: tuple[int, int], out: torch.Tensor,
                       cols: tuple[int, int] | None = None, *, block_bytes: int = BLOCK_BYTES) -> None:
        """Rows [rows) of tensor `key` (of them columns [cols), all when None) into `out`, of that region's shape,
        converted to out's dtype. Where the bytes in the file are exactly out's (whole rows, the file's dtype, `out`
        contiguous in CPU memory) they are read straight into it: no buffer, no copy. Otherwise through `blocks`'
        buffer of at most `block_bytes`."""
        t = self.tensors[key]
        whole_rows = cols is None or (len(t.shape) > 1 and cols == (0, t.shape[1]))
        if whole_rows and out.dtype == t.dtype and out.device.type == "cpu" and out.is_contiguous():
            r0, r1 = rows
            if not 0 <= r0 <= r1 <= (t.shape[0] if t.shape else 1):
                raise ValueError(f"rows [{r0}, {r1}) out of tensor {key!r} of shape {t.shape}")
            want = (r1 - r0, *t.shape[1:]) if t.shape else ()
            if tuple(out.shape) != want:
                raise ValueError(f"{key}: destination of shape {tuple(out.shape)} for rows of shape {want}")
            row_bytes = math.prod(t.shape[1:]) * t.dtype.itemsize
            if out.numel():
                self._read_into(_bytes_of(out), t.begin + r0 * row_bytes)
                check_finite(key, out, r0, block_bytes=block_bytes)
            return
        for i, block in self._blocks(key, rows, cols, block_bytes):  # (one read, whichever way it goes)
            out[i : i + len(block)].copy_(block)

    def _read_into(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):  # (a read may return fewer bytes than asked)
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got == 0:
                raise ValueError(f"the file ends at byte {offset + done}, inside tensor data: truncated")
            done += got


class NonFinite(ValueError):
    """A tensor holds a NaN or an infinity: no weight does, and training from it would skip every step."""

    def __init__(self, key: str, row: int) -> None:
        super().__init__(f"tensor {key!r} holds a NaN or infinite value (row {row})")


def check_finite(key: str, t: torch.Tensor, first_row: int = 0, *, block_bytes: int = BLOCK_BYTES) -> None:
    """Raise NonFinite (naming tensor `key` and the row, counted from `first_row`) where `t` holds a NaN or an
    infinity. In pieces of rows of at most `block_bytes` in fp32: each piece's fp32 sum first (NaN and infinity
    carry through a sum; only values near fp32's limit could overflow it, and the search then finds no row), and
    only a piece whose sum is not finite searched by isfinite's mask (a byte a value)."""
    rows = t.reshape(1) if t.dim() == 0 else t
    if rows.numel() == 0 or not (rows.is_floating_point() or rows.is_complex()):
        return
    step = max(1, block_bytes // (4 * max(1, rows[0].numel())))  # (the sum's fp32 copy of a 16-bit piece)
    for a in range(0, len(rows), step):
        piece = rows[a : a + step]
        if not piece.is_complex() and bool(torch.isfinite(piece.sum(dtype=torch.float32))):
            continue
        ok = torch.isfinite(piece)
        if not ok.all():
            raise NonFinite(key, first_row + a + int((~ok).reshape(len(ok), -1).any(1).nonzero()[0]))


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor as writable bytes (valid while `t` lives: the caller holds it)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


__all__ = ["BLOCK_BYTES", "DTYPES", "MAX_HEADER", "NonFinite", "ShardFile", "Stored", "check_finite", "read_header"]
