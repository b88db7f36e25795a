"""Checkpoints under tensor parallelism: where this rank's slices sit in the full tensors a checkpoint holds.

A checkpoint stores every parameter (and its optimizer moments) at its full, tp=1 shape, so it loads at any
tp. Each rank writes and reads only its own slices, as chunks with global offsets (`parallel/shards.py`):
a row-parallel weight's block of columns; a column-parallel weight's rows, which need not be contiguous
(the fused QKV projection holds its query heads and the KV heads they read) and so become one chunk per run of
consecutive full-weight rows; a vocabulary slice. Rows that several ranks hold alike (KV heads shared when
n_kv_head < tp) form runs of their own, the same on each of those ranks, so DCP writes them once.
Expert parallelism's slices of the stacked expert weights (a run of experts along dim 0, the expert-slice mark)
are rows alike: one run at the first expert's offset, written once by the ranks that hold the same experts.

`to_full` (an all-gather to full tensors) remains for tests and diagnostics; checkpoints never use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.marks import expert_slice, partition_dim, replicated_rows
from dist_llm.parallel.shards import ChunkedTensor, Offsets, Rect
from dist_llm.parallel.tensor.mappings import all_gather_dim

Run = tuple[int, int, int]  # local rows [start, end) are full-weight rows [global_start, ...)


def row_runs(rows: list[int], shared: tuple[int, int] | None = None) -> list[Run]:
    """Runs of consecutive full-weight rows in `rows` (local row i is full row rows[i]), also cut at the
    bounds of the local rows [first, end) that other ranks hold alike (`shared`)."""
    cuts = set(shared or ())
    runs: list[Run] = []
    for i, g in enumerate(rows):
        if runs and i not in cuts and g == runs[-1][2] + (i - runs[-1][0]):
            runs[-1] = (runs[-1][0], i + 1, runs[-1][2])
        else:
            runs.append((i, i + 1, g))
    return runs


@dataclass(frozen=True)
class TPSlice:
    """Which part of its full (tp=1) tensor a tensor-parallel parameter's local data is."""

    full_shape: torch.Size
    rows: torch.Tensor | None = None  # split along dim 0: the full-tensor row of each local row, in order
    col_start: int | None = None  # split along dim 1: its first full-tensor column (an even block of them)


def tp_slice(module: nn.Module, pname: str) -> TPSlice | None:
    """The global rows or columns of parameter `pname` of `module` that this tp rank holds (None: the parameter
    is not split, every rank holds it whole): the one answer that checkpoints and `model.init_from` use. It
    comes from the layer itself (parallel/tensor/layers.py), never from its `rows` buffer, which holds garbage
    between `to_empty` and `reset_buffers`."""
    p = module._parameters[pname]
    dim = partition_dim(p) if p is not None else None
    experts = expert_slice(p) if p is not None else None
    if experts is not None:  # expert parallelism: experts [first, first + E_local) of the layer's stack
        first, total = experts
        return TPSlice(torch.Size((total, *p.shape[1:])), rows=torch.arange(first, first + p.shape[0]))
    if dim is None:
        return None
    full = torch.Size(module.full_shape(pname))  # type: ignore[operator]
    if dim == 1:  # row-parallel: an even block of input columns
        return TPSlice(full, col_start=module.cols.start)  # type: ignore[union-attr]
    if hasattr(module, "rows_host"):  # column-parallel: the plan's rows (whole heads for the fused QKV)
        rows = module.rows_host
    else:  # a contiguous vocabulary slice
        rows = torch.arange(module.vocab_start, module.vocab_end)  # type: ignore[arg-type]
    if len(rows) != p.shape[0]:
        raise ValueError(f"{type(module).__name__}.{pname}: {p.shape[0]} local rows, but the layer names {len(rows)}")
    return TPSlice(full, rows=rows)


class TensorParallelState:
    """Where each tp-sliced parameter of `module` (found by its partition-dim mark) sits in its full
    tensor. At tp=1 every tensor is its own full tensor."""

    def __init__(self, module: nn.Module, ctx: ParallelContext) -> None:
        self.group, self.tp = ctx.tp_group, ctx.tp
        self.ep_group = ctx.ep_group
        self.expert_fqns: set[str] = set()  # expert-parallel slices: gathered over the ep group, not tp
        self.cols: dict[str, int] = {}  # fqn -> first full-weight column this rank holds (split along dim 1)
        self.runs: dict[str, list[Run]] = {}  # fqn -> runs of rows (split along dim 0)
        self.local_rows: dict[str, torch.Tensor] = {}  # fqn -> the full-weight rows this rank holds
        self.full_shape: dict[str, torch.Size] = {}
        for mod_name, mod in module.named_modules(remove_duplicate=False):
            for p_name, p in mod.named_parameters(recurse=False, remove_duplicate=False):
                part = tp_slice(mod, p_name)
                if part is None:
                    continue
                fqn = f"{mod_name}.{p_name}" if mod_name else p_name
                self.full_shape[fqn] = part.full_shape
                if expert_slice(p) is not None:
                    self.expert_fqns.add(fqn)
                if part.col_start is not None:
                    self.cols[fqn] = part.col_start
                else:
                    assert part.rows is not None
                    self.local_rows[fqn] = part.rows
                    shared = replicated_rows(p)
                    self.runs[fqn] = row_runs(part.rows.tolist(), shared[:2] if shared else None)

    # -- chunks with global offsets -------------------------------------------------------------------------
    def place(self, fqn: str, view: torch.Tensor, rect: Rect) -> list[tuple[Offsets, torch.Tensor]]:
        """The piece `view` of parameter `fqn`'s tp-local tensor, at `rect` (offsets, sizes) in it, as chunks
        (global offsets, view) of the full tensor."""
        offsets = rect[0]
        if fqn in self.cols:
            return [((offsets[0], offsets[1] + self.cols[fqn], *offsets[2:]), view)]
        if fqn not in self.runs:
            return [(tuple(offsets), view)]
        lo, hi = offsets[0], offsets[0] + rect[1][0]
        out = []
        for start, end, first in self.runs[fqn]:
            a, b = max(lo, start), min(hi, end)
            if a < b:
                out.append(((first + a - start, *offsets[1:]), view.narrow(0, a - lo, b - a)))
        return out

    def global_shape(self, fqn: str, local_shape: torch.Size) -> torch.Size:
        return self.full_shape.get(fqn, torch.Size(local_shape))

    def chunked(self, fqn: str, pieces: list[tuple[torch.Tensor, Rect]], local_shape: torch.Size,
                dtype: torch.dtype, device: torch.device) -> ChunkedTensor:
        """A ChunkedTensor of `fqn`'s full tensor from pieces (view, rect in the tp-local tensor)."""
        chunks = [c for view, rect in pieces for c in self.place(fqn, view, rect)]
        return ChunkedTensor(self.global_shape(fqn, local_shape), chunks, dtype=dtype, device=device)

    def shard(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        """A state tensor of parameter `fqn` (this rank's tp slice, whole or as FSDP2's DTensor of its rows) as
        chunks of its full tensor; tensors that are whole already (and DTensors of unsliced parameters, which
        DCP places itself) are returned as they are."""
        if isinstance(t, ChunkedTensor) or t.dim() == 0 or fqn not in self.full_shape:
            return t
        if hasattr(t, "device_mesh"):  # FSDP2 shards the tp slice along dim 0 again (unevenly at the end)
            from torch.distributed.tensor import Shard
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            if tuple(t.placements) != (Shard(0),):
                raise ValueError(f"{fqn}: a DTensor placed {t.placements}; checkpoints expect Shard(0) over dp")
            local = t.to_local()
            _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            rect = (tuple(offset), tuple(local.shape))
            return self.chunked(fqn, [(local, rect)], t.shape, t.dtype, local.device)
        return self.chunked(fqn, [(t, ((0,) * t.dim(), tuple(t.shape)))], t.shape, t.dtype, t.device)

    def shard_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint state ({"model": ..., "optim": {"state": ...}}) of this rank's slices -> the same state
        as chunks of the full tensors (no communication, nothing copied: the chunks view the given tensors)."""
        model = {k: self.shard(k, v) for k, v in state["model"].items()}
        optim = {k: {n: self.shard(k, t) if isinstance(t, torch.Tensor) else t for n, t in entry.items()}
                 for k, entry in state["optim"]["state"].items()}
        return {"model": model, "optim": {"state": optim}}

    # -- full tensors: whole-model sources (Hugging Face weights), tests and diagnostics -----------------------
    def local_of(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of `fqn`'s full tensor."""
        if fqn in self.cols:
            local_cols = self.full_shape[fqn][1] // self.tp
            return full.narrow(1, self.cols[fqn], local_cols).contiguous()
        if fqn in self.local_rows:
            return full[self.local_rows[fqn].to(full.device)].contiguous()
        return full

    def to_local(self, full: dict[str, Any], template: dict[str, Any], rank: int) -> dict[str, Any]:
        """Full tensors -> this rank's slices (the model part of a checkpoint-shaped state; `template` and
        `rank` are kept for callers of the earlier signature)."""
        model = {k: self.local_of(k, v) for k, v in full["model"].items()}
        return {"model": model, "optim": {"state": {}}}

    def _full(self, fqn: str, local: torch.Tensor) -> torch.Tensor:
        if hasattr(local, "full_tensor"):  # FSDP2 over dp shards the tp slice again: undo that first
            local = local.full_tensor()
        if fqn in self.cols:
            return all_gather_dim(local, 1, self.group, None)
        group = self.ep_group if fqn in self.expert_fqns else self.group
        rows = all_gather_dim(self.local_rows[fqn].to(local.device)[None], 0, group, None)
        gathered = all_gather_dim(local, 0, group, None)  # rank 0's rows, then rank 1's, ...
        full = torch.empty(self.full_shape[fqn], dtype=local.dtype, device=local.device)
        full[rows.reshape(-1)] = gathered
        return full

    def to_full(self, state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint state of this rank's slices -> the same state at full shapes (collective over tp)."""
        model = {k: self._full(k, v) if k in self.full_shape else v for k, v in state["model"].items()}
        optim = {k: {n: self._full(k, t) if n != "step" and k in self.full_shape else t for n, t in entry.items()}
                 for k, entry in state["optim"]["state"].items()}
        return {"model": model, "optim": {"state": optim}}

