"""Every collective dist_llm issues, with byte accounting.

Each function returns early when the group has one rank. The bytes recorded are what this rank puts on
the wire under the standard algorithms: ring all-reduce 2(n-1)/n of the tensor, all-gather (n-1)/n of the
output, reduce-scatter (n-1)/n of the input, point-to-point the tensor.

Gloo has no native reduce-scatter: torch emulates `reduce_scatter_tensor` there with a full all-reduce,
twice the ideal bytes (measured on loopback: 7.97 MB for a 4 MB input on 2 ranks, as for all-reduce). So
on gloo this module reduce-scatters with `all_to_all_single` followed by a local sum, which moves exactly
the ideal (n-1)/n. NCCL keeps its native collective. This is the one place that fallback lives.
"""

from __future__ import annotations

import os
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dist_llm.profiling import span

ProcessGroup = dist.ProcessGroup

# torch 2.13 renames the single-tensor collectives (and warns on the old names); older releases lack the new ones
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


@dataclass
class CommStats:
    """Bytes this rank sent, by kind of collective, since the last `reset()`."""

    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, kind: str, nbytes: float) -> None:
        self.bytes[kind] += int(round(nbytes))
        self.calls[kind] += 1

    def snapshot(self) -> dict[str, int]:
        return dict(sorted(self.bytes.items()))

    def reset(self) -> dict[str, int]:
        """The counts so far, then zero."""
        out = self.snapshot()
        self.bytes.clear()
        self.calls.clear()
        return out

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


def group_size(group: ProcessGroup | None) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_gloo(group: ProcessGroup | None) -> bool:
    return dist.get_backend(group) == "gloo"


def all_reduce(t: torch.Tensor, group: ProcessGroup | None, stats: CommStats | None, *,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, async_op: bool = False) -> dist.Work | None:
    """In-place all-reduce of `t` over `group`."""
    n = group_size(group)
    if n == 1:
        return None
    if stats is not None:
        stats.add("all_reduce", 2 * (n - 1) / n * _nbytes(t))
    with span("comm.all_reduce"):
        return dist.all_reduce(t, op=op, group=group, async_op=async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None, stats: CommStats | None, *,
               async_op: bool = False) -> dist.Work | None:
    """`output` (n * input.numel()) = the ranks' `input`s concatenated in rank order."""
    n = group_size(group)
    if n == 1:
        output.copy_(input.view_as(output))
        return None
    if stats is not None:
        stats.add("all_gather", (n - 1) * _nbytes(input))
    with span("comm.all_gather"):
        if _is_gloo(group) and _nbytes(output) >= GLOO_EXCHANGE_BYTES:
            return _exchange_all_gather(output, input, group, n, async_op=async_op)
        return _all_gather_single(output, input, group=group, async_op=async_op)


#: outputs from this size up are all-gathered on gloo by sends and receives straight into the output (below)
GLOO_EXCHANGE_BYTES = 1 << 20


class _Works(dist.Work):
    """Several pending operations as one Work (FSDP2 waits on what the all-gather returns if it is a Work)."""

    def __init__(self, works: list[dist.Work]) -> None:
        super().__init__()
        self.works = works

    def wait(self, timeout: Any = None) -> bool:
        for work in self.works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def _exchange_all_gather(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None, n: int, *,
                         async_op: bool) -> dist.Work | None:
    """Gloo's all-gather receives into a flat buffer of the output's size and copies it into the output (measured
    on torch 2.13: a 64 MiB output raised the peak by 64 MiB): a whole second copy of what is gathered, such as
    a 125 MiB head under ZeRO-3. Here each rank sends its input to every other rank and receives theirs straight
    into their chunks of the output: the same bytes on the wire ((n-1) inputs sent), nothing allocated."""
    me = dist.get_rank(group)
    chunks = output.view(n, -1)
    chunks[me].copy_(input.reshape(-1))  # (a no-op where the input is that chunk, as FSDP2 and ZeRO hand it)
    ops = []
    for i in range(n):
        if i != me:
            peer = dist.get_global_rank(group, i) if group is not None else i
            ops.append(dist.P2POp(dist.isend, input, peer, group))
            ops.append(dist.P2POp(dist.irecv, chunks[i], peer, group))
    works = dist.batch_isend_irecv(ops)
    if async_op:
        return _Works(works)
    for work in works:
        work.wait()
    return None


class _AllToAllReduceScatter:
    """A pending gloo reduce-scatter: the all-to-all runs, then `wait()` sums the received chunks."""

    def __init__(self, work: dist.Work | None, received: torch.Tensor, output: torch.Tensor, average: bool) -> None:
        self.work, self.received, self.output, self.average = work, received, output, average

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        torch.sum(self.received, dim=0, out=self.output)  # (n, chunk) -> (chunk,)
        if self.average:
            self.output.div_(self.received.shape[0])

    def is_completed(self) -> bool:  # FSDP2 treats the return value as a Work
        return self.work is None or self.work.is_completed()


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None, stats: CommStats | None, *,
                   op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, async_op: bool = False) -> object | None:
    """`output` (input.numel() / n) = this rank's chunk of the sum (or mean, op=AVG) of the ranks' `input`s.

    With async_op=True returns a handle whose `wait()` completes the reduction (into `output`)."""
    n = group_size(group)
    if n == 1:
        output.copy_(input.view_as(output))
        return None
    if input.numel() != n * output.numel():
        raise ValueError(f"reduce_scatter: input of {input.numel()} elements is not {n} x output {output.numel()}")
    if stats is not None:
        stats.add("reduce_scatter", (n - 1) / n * _nbytes(input))
    average = op == dist.ReduceOp.AVG
    if not _is_gloo(group):
        with span("comm.reduce_scatter"):
            return _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        raise ValueError(f"reduce_scatter on gloo supports SUM and AVG, not {op}")
    received = torch.empty((n, output.numel()), dtype=input.dtype, device=input.device)
    with span("comm.reduce_scatter"):
        work = dist.all_to_all_single(received, input.reshape(-1).contiguous(), group=group, async_op=async_op)
    pending = _AllToAllReduceScatter(work, received, output.view(-1), average)
    if async_op:
        return pending
    pending.wait()
    return None


def all_to_all(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None, stats: CommStats | None, *,
               output_splits: list[int] | None = None, input_splits: list[int] | None = None) -> None:
    """`output` = the ranks' pieces of `input` meant for this rank, in rank order: rank i's `input` is cut along
    dim 0 into `input_splits` (even pieces when None) and piece j goes to rank j. The splits are host ints, as
    NCCL needs them before the call: a caller with sizes on the device reads them first (one sync).

    Bytes counted: what leaves this rank, i.e. every piece of `input` but its own."""
    n = group_size(group)
    if n == 1:
        output.copy_(input)
        return
    if stats is not None:
        row = _nbytes(input) // max(1, input.shape[0])
        me = dist.get_rank(group)
        own = (input_splits[me] if input_splits is not None else input.shape[0] // n) * row
        stats.add("all_to_all", _nbytes(input) - own)
    with span("comm.all_to_all"):
        dist.all_to_all_single(output, input.contiguous(), output_split_sizes=output_splits,
                               input_split_sizes=input_splits, group=group)


# -- failures -------------------------------------------------------------------------------------------------
_TIMED_OUT = ("Timed out", "timed out", "Timeout", "timeout")
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "pair closure", "Broken pipe",
              "Connection refused")


def _dotted(filename: str, function: str) -> str:
    parts = Path(filename).with_suffix("").parts
    return ".".join([*parts[len(parts) - 1 - parts[::-1].index("dist_llm"):], function])


def describe_failure(e: BaseException, *, rank: int, timeout_s: float, log_dir: str) -> str | None:
    """One line for a collective that failed (a rank stuck past `parallel.timeout_s`, or a peer gone): the
    collective, as the innermost torch.distributed call of the traceback names it, this rank, and what it
    means. None for an error that is not a collective's."""
    text = str(e)
    if not isinstance(e, RuntimeError) or not (isinstance(e, dist.DistError)
                                               or any(m in text for m in _TIMED_OUT + _PEER_LOST)):
        return None
    frames = traceback.extract_tb(e.__traceback__)
    c10d = [f.name for f in frames if f.filename.endswith("distributed_c10d.py") and not f.name.startswith("_")]
    ours = [_dotted(f.filename, f.name) for f in frames if f"{os.sep}dist_llm{os.sep}" in f.filename]
    if c10d:
        what = c10d[-1]
    elif any(f.name == "backward" for f in frames):
        what = "the gradient reduction in backward"
    else:
        what = "a collective"
    where = f" (from {ours[-1]})" if ours else ""
    if any(m in text for m in _PEER_LOST):
        why = f"a peer rank closed its connection: it crashed or was killed (see its log in {log_dir})"
    elif any(m in text for m in _TIMED_OUT):
        why = (f"no answer within parallel.timeout_s={timeout_s:g} s: a rank is stuck or far slower "
               f"(its heartbeat file shows its last finished step)")
    else:
        why = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return f"rank {rank}: {what}{where} failed: {why}"


def shared_error(error: str | None, group: Any) -> str | None:
    """Collective over `group`: the first rank's error (in rank order) of those `error`s the ranks hold, or None
    when none failed. Every rank returns the same answer, so all raise together and none waits in a later
    collective on a peer that gave up."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return error
    errors: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    return next((e for e in errors if e is not None), None)


# -- ring point-to-point (context parallelism) --------------------------------------------------------------------
def ring_shift(sends: list[torch.Tensor], recvs: list[torch.Tensor], group: ProcessGroup | None,
               stats: CommStats | None, *, kind: str = "ring") -> dist.Work | None:
    """Send each of `sends` to the next rank of `group` and receive each of `recvs` (same shapes, in the same
    order) from the previous one, all posted together as ONE `batch_isend_irecv`: under NCCL every rank posts
    its send and its receive at once, so no rank blocks in a send waiting on a peer that is itself sending.
    Returns a handle whose `wait()` completes all of them (None when nothing was posted); compute in between
    overlaps the transfer. Bytes sent are counted as `kind`. On one rank the receives are copies of the sends."""
    n = group_size(group)
    if n == 1:
        for s, r in zip(sends, recvs, strict=True):
            r.copy_(s)
        return None
    if len(sends) != len(recvs):
        raise ValueError(f"ring_shift: {len(sends)} sends but {len(recvs)} receives")
    if not sends:
        return None
    me = dist.get_rank(group)
    nxt, prev = (me + 1) % n, (me - 1) % n
    if group is not None:
        nxt, prev = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prev)
    ops = []
    for s, r in zip(sends, recvs):
        if stats is not None:
            stats.add(kind, _nbytes(s))
        # the same order of operations on every rank: gloo and NCCL match a pair's messages in posting order
        ops.append(dist.P2POp(dist.isend, s, nxt, group))
        ops.append(dist.P2POp(dist.irecv, r, prev, group))
    with span("comm.ring"):
        return _Works(dist.batch_isend_irecv(ops))
