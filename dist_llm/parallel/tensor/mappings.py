"""The conjugate collectives of tensor (and sequence) parallelism, as autograd functions.

Each public wrapper takes the tensor-parallel group explicitly (and the byte counter), returns its input
unchanged when the group has one rank, and is the dual of another: its backward is the other's forward.

  copy_to_tp            fwd: identity                      bwd: all-reduce
  reduce_from_tp        fwd: all-reduce                    bwd: identity
  scatter_to_tp         fwd: keep my chunk of the last dim bwd: all-gather the last dim
  gather_from_tp        fwd: all-gather the last dim       bwd: keep my chunk of the last dim
  scatter_to_sequence   fwd: keep my chunk of dim 1 (T)    bwd: all-gather dim 1
  gather_from_sequence  fwd: all-gather dim 1              bwd: reduce-scatter dim 1
  reduce_scatter_to_sequence  fwd: reduce-scatter dim 1    bwd: all-gather dim 1
  gather_sequence_replicated  fwd: all-gather dim 1        bwd: keep my chunk of dim 1 (the dual of
                        scatter_to_sequence: the gathered tensor is consumed alike on every rank, as the residual
                        stream outside sequence parallelism, so each rank's gradient of it is already the whole one)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Function

from dist_llm.compiling import keep_out_of_graphs
from dist_llm.parallel import comm

Group = dist.ProcessGroup | None
Stats = comm.CommStats | None


def _rank(group: Group) -> int:
    return dist.get_rank(group) if comm.group_size(group) > 1 else 0


def split_dim(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    n = comm.group_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over {n} tensor-parallel ranks")
    return x.chunk(n, dim=dim)[_rank(group)].contiguous()


def all_gather_dim(x: torch.Tensor, dim: int, group: Group, stats: Stats) -> torch.Tensor:
    n = comm.group_size(group)
    moved = x.movedim(dim, 0).contiguous()  # gather along dim 0, where chunks are contiguous
    out = torch.empty((n * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out, moved, group, stats)
    return out.movedim(0, dim).contiguous()


def reduce_scatter_dim(x: torch.Tensor, dim: int, group: Group, stats: Stats) -> torch.Tensor:
    n = comm.group_size(group)
    moved = x.movedim(dim, 0).contiguous()
    if moved.shape[0] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over {n} tensor-parallel ranks")
    out = torch.empty((moved.shape[0] // n, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, moved, group, stats)
    return out.movedim(0, dim).contiguous()


def all_reduce(x: torch.Tensor, group: Group, stats: Stats) -> torch.Tensor:
    out = x.contiguous().clone()
    comm.all_reduce(out, group, stats)
    return out


class _CopyToTP(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, stats: Stats) -> torch.Tensor:
        ctx.group, ctx.stats = group, stats
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return all_reduce(grad, ctx.group, ctx.stats), None, None


class _ReduceFromTP(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, stats: Stats) -> torch.Tensor:
        return all_reduce(x, group, stats)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None, None


class _ScatterToTP(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, stats: Stats) -> torch.Tensor:
        ctx.group, ctx.stats = group, stats
        return split_dim(x, -1, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return all_gather_dim(grad, -1, ctx.group, ctx.stats), None, None


class _GatherFromTP(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, stats: Stats) -> torch.Tensor:
        ctx.group = group
        return all_gather_dim(x, -1, group, stats)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return split_dim(grad, -1, ctx.group), None, None


class _ScatterToSequence(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, stats: Stats) -> torch.Tensor:
        ctx.group, ctx.stats = group, stats
        return split_dim(x, 1, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return all_gather_dim(grad, 1, ctx.group, ctx.stats), None, None


class _GatherFromSequence(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, stats: Stats) -> torch.Tensor:
        ctx.group, ctx.stats = group, stats
        return all_gather_dim(x, 1, group, stats)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        # the gathered sequence fed a tensor-parallel region: each rank holds a partial gradient of all of it
        return reduce_scatter_dim(grad, 1, ctx.group, ctx.stats), None, None


class _ReduceScatterToSequence(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, stats: Stats) -> torch.Tensor:
        ctx.group, ctx.stats = group, stats
        return reduce_scatter_dim(x, 1, group, stats)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return all_gather_dim(grad, 1, ctx.group, ctx.stats), None, None


class _GatherSequenceReplicated(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, stats: Stats) -> torch.Tensor:
        ctx.group = group
        return all_gather_dim(x, 1, group, stats)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return split_dim(grad, 1, ctx.group), None, None


def _wrap(fn: type[Function]):  # type: ignore[no-untyped-def]
    # Kept out of torch.compile's graphs (train.compile compiles each block): Dynamo cannot trace our collectives
    # (the process group, the byte counter, gloo's send/receive fallback), so a compiled block breaks its graph
    # here and the collective, forward and backward, runs eagerly between the compiled pieces, as in an eager run.
    @keep_out_of_graphs
    def apply(x: torch.Tensor, group: Group, stats: Stats = None) -> torch.Tensor:
        if comm.group_size(group) == 1:
            return x
        return fn.apply(x, group, stats)

    apply.__doc__ = fn.__name__
    return apply


copy_to_tp = _wrap(_CopyToTP)
reduce_from_tp = _wrap(_ReduceFromTP)
scatter_to_tp = _wrap(_ScatterToTP)
gather_from_tp = _wrap(_GatherFromTP)
scatter_to_sequence = _wrap(_ScatterToSequence)
gather_from_sequence = _wrap(_GatherFromSequence)
reduce_scatter_to_sequence = _wrap(_ReduceScatterToSequence)
gather_sequence_replicated = _wrap(_GatherSequenceReplicated)
