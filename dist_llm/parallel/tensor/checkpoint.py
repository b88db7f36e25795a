"""Checkpoints under tensor parallelism: this rank's slices <-> the full tensors a checkpoint holds.

A checkpoint stores every parameter (and its optimizer moments) at its full, tp=1 shape, so it loads at any
tp. On save the slices are all-gathered over tp (every tp rank then holds the same full tensor and DCP
writes it once); on load each rank keeps its slice. The slices are found from the parameters'
`tp_partition_dim` and, for column-parallel layers, the full-weight rows each rank holds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.tensor.mappings import all_gather_dim, split_dim


class TensorParallelState:
    def __init__(self, module: nn.Module, ctx: ParallelContext) -> None:
        self.group = ctx.tp_group
        self.rows: dict[str, torch.Tensor] = {}  # fqn -> (tp, rows per rank): full rows held by each rank
        self.cols: set[str] = set()  # fqn of parameters split along dim 1
        self.full_shape: dict[str, torch.Size] = {}
        for mod_name, mod in module.named_modules(remove_duplicate=False):
            for p_name, p in mod.named_parameters(recurse=False, remove_duplicate=False):
                dim = getattr(p, "tp_partition_dim", None)
                if dim is None:
                    continue
                fqn = f"{mod_name}.{p_name}" if mod_name else p_name
                if dim == 1:
                    self.cols.add(fqn)
                    shape = list(p.shape)
                    shape[1] *= ctx.tp
                else:
                    mine = getattr(mod, "rows", None)
                    if mine is None:  # a contiguous vocabulary slice
                        mine = torch.arange(mod.vocab_start, mod.vocab_end)
                    self.rows[fqn] = all_gather_dim(mine.to(p.device)[None], 0, self.group, None)
                    shape = [int(self.rows[fqn].max()) + 1, *p.shape[1:]]
                self.full_shape[fqn] = torch.Size(shape)

    def _full(self, fqn: str, local: torch.Tensor) -> torch.Tensor:
        if hasattr(local, "full_tensor"):  # FSDP2 over dp shards the tp slice again: undo that first
            local = local.full_tensor()
        if fqn in self.cols:
            return all_gather_dim(local, 1, self.group, None)
        gathered = all_gather_dim(local, 0, self.group, None)  # rank 0's rows, then rank 1's, ...
        full = torch.empty(self.full_shape[fqn], dtype=local.dtype, device=local.device)
        full[self.rows[fqn].reshape(-1)] = gathered
        return full

    def _local(self, fqn: str, full: torch.Tensor, rank: int) -> torch.Tensor:
        if fqn in self.cols:
            return split_dim(full, 1, self.group)
        return full[self.rows[fqn][rank]].contiguous()

    def _map(self, state: dict[str, Any], fn: Any, like: dict[str, Any] | None = None) -> dict[str, Any]:
        """Apply fn(fqn, tensor, template_tensor) to every tp-sliced tensor of a checkpoint state."""
        like = like or state
        model = {k: fn(k, v, like["model"][k]) if k in self.full_shape else v for k, v in state["model"].items()}
        optim = {k: {n: fn(k, t, like["optim"]["state"][k][n]) if n != "step" and k in self.full_shape else t
                     for n, t in entry.items()}
                 for k, entry in state["optim"]["state"].items()}
        return {"model": model, "optim": {"state": optim}}

    def to_full(self, state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint state of this rank's slices -> the same state at full shapes (collective over tp)."""
        return self._map(state, lambda k, t, _: self._full(k, t))

    def empty_full(self, state: dict[str, Any]) -> dict[str, Any]:
        """Full-shape buffers to load a checkpoint into (no communication)."""
        return self._map(state, lambda k, t, _: torch.empty(self.full_shape[k], dtype=t.dtype, device=t.device))

    def to_local(self, full: dict[str, Any], template: dict[str, Any], rank: int) -> dict[str, Any]:
        """Full tensors -> this rank's slices, shaped like `template` (DTensors again under FSDP2)."""

        def local(k: str, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
            mine = self._local(k, t, rank)
            if hasattr(like, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor

                return distribute_tensor(mine, like.device_mesh, like.placements)
            return mine

        return self._map(full, local, like=template)
