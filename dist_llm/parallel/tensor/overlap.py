"""Overlap for sequence parallelism: "collective matmul" (Wang et al. 2023; Megatron's tp_comm_overlap).

The sequence collectives of a sequence-parallel layer are split into the tp pieces of the sequence and passed
around the tp ring, one point-to-point step at a time, while the matmul of the piece already at hand runs:

  ring_gather_linears      column-parallel forward: step k multiplies the piece held (its own at k=0) while
                           it passes that piece on to the next rank and receives the previous rank's; after
                           tp-1 steps every piece has been multiplied, and no (B, T, C) input was ever gathered.
  ring_linear_reduce_scatter  row-parallel forward: step k computes the partial output of piece (r-k-1) mod tp,
                           adds the partial sum received for it and passes it on; the send of step k runs under
                           the matmul of step k+1. After tp-1 steps each rank holds the full sum of its piece.
  ring_gather_row_backward row-parallel backward: the output gradient gathered as the column input is, each
                           piece's input- and weight-gradient matmuls under the next piece's transfer.

Bytes: each step sends one piece, so tp-1 steps send (tp-1)/tp of the gathered input / of the partial output,
exactly what the all-gather / reduce-scatter they replace count; they are counted under those kinds.
Numerics: a matmul split by rows computes each row as the whole matmul does, so the column forward equals the
gathered one (bit for bit in fp32 on CPU: tests/test_tp_overlap.py). The ring reduce-scatter sums the partials
in ring order; at tp=2 that is one addition, commutative, so equal bit for bit to gloo's sum; at tp>2 within
fp32 rounding (NCCL's own order is unspecified too).
NCCL: every rank issues the same `ring_shift`s (one batch_isend_irecv each, send and receive posted together)
in the same order; each handle is waited before the buffer it receives into is read and before the buffer it
sends from is dropped or reused.

`ENABLED` switches the ring off (back to one blocking collective then the matmul), read in each layer's forward
(its backward takes the path its forward took): for scripts/trace_tp.py's before/after comparison and the
equality test, not a user setting (on CPU the ring costs no speed: measured).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_llm.parallel import comm

ENABLED = True


def ring_gather_linears(x: torch.Tensor, params: list[tuple[torch.Tensor, torch.Tensor | None]],
                        group: dist.ProcessGroup | None, stats: comm.CommStats | None) -> tuple[torch.Tensor, ...]:
    """y_i = all_gather_seq(x) W_i^T + b_i (B, T, out_i) for x (B, T/tp, C), the gather done piece by piece
    under the matmuls. Weights and biases already in x's dtype."""
    n = comm.group_size(group)
    B, s, _ = x.shape
    outs = [x.new_empty((B, n * s, w.shape[0])) for w, _ in params]  # (B, T, out_i)
    for src, held in _ring_pieces(x, group, stats):
        for (w, b), out in zip(params, outs):
            out[:, src * s:(src + 1) * s] = F.linear(held, w, b)  # (B, T/tp, out_i)
        del held  # (before the ring allocates the next piece's buffer: two pieces alive, not three)
    return tuple(outs)


def _ring_pieces(x: torch.Tensor, group: dist.ProcessGroup | None,
                 stats: comm.CommStats | None) -> Iterator[tuple[int, torch.Tensor]]:
    """(rank, that rank's piece) for every piece of the sequence-split x around the ring, this rank's first: while
    the caller works on a piece, it is already on its way to the next rank and the previous rank's is arriving.
    Counted as the all-gather it replaces. The caller drops its reference to a piece before asking for the next
    (else three pieces are alive at tp >= 4, not two) and runs the ring to its end (its peers wait for it)."""
    n, me = comm.group_size(group), dist.get_rank(group)
    held = x.contiguous()  # the piece of rank (me - k) % n at step k
    for k in range(n):
        work, incoming = None, None
        if k < n - 1:
            incoming = torch.empty_like(held)
            work = comm.ring_shift([held], [incoming], group, None)
            if stats is not None:
                stats.add("all_gather", held.numel() * held.element_size())
        yield (me - k) % n, held
        if work is not None:
            work.wait()  # `held` (sent) is kept alive to here; `incoming` is read only after
            held = incoming


def ring_linear_reduce_scatter(x: torch.Tensor, w: torch.Tensor, group: dist.ProcessGroup | None,
                               stats: comm.CommStats | None) -> torch.Tensor:
    """reduce_scatter_seq(x W^T) (B, T/tp, out) for x (B, T, in/tp), each piece's partial sum passed on while
    the next piece's matmul runs."""
    n, me = comm.group_size(group), dist.get_rank(group)
    B, T, _ = x.shape
    s = T // n
    acc: torch.Tensor | None = None
    work, incoming = None, None
    for k in range(n):
        c = (me - k - 1) % n  # the piece whose partial sum this rank adds to at step k; c == me at the last
        part = F.linear(x[:, c * s:(c + 1) * s], w)  # (B, T/tp, out), runs while the previous send flies
        if work is not None:
            work.wait()
            assert incoming is not None
            part = incoming.add_(part)  # the sum of ranks c+1 .. me-1 (ring order), plus this rank's
        acc = part
        if k < n - 1:
            incoming = torch.empty_like(acc)
            work = comm.ring_shift([acc], [incoming], group, None)
            if stats is not None:
                stats.add("reduce_scatter", acc.numel() * acc.element_size())
    assert acc is not None
    return acc


class RowSequenceParallelLinear(torch.autograd.Function):
    """fwd: y = reduce_scatter_seq(x W^T) by the ring / bwd: the output gradient gathered along the sequence by
    the ring too (its dual), each piece's input- and weight-gradient matmuls under the next piece's transfer.

    Under autocast x and W are cast to the compute dtype as autocast would, the reduction runs in it, and the
    gradients return in x's and W's own dtypes. Saves x (the compute-dtype copy) only when W trains."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, group: dist.ProcessGroup | None,  # type: ignore[no-untyped-def]
                stats: comm.CommStats | None) -> torch.Tensor:
        ctx.group, ctx.stats, ctx.dtypes = group, stats, (x.dtype, w.dtype)
        device = x.device.type
        if torch.is_autocast_enabled(device) and x.is_floating_point():
            x = x.to(torch.get_autocast_dtype(device))
        wc = w.to(x.dtype)
        with torch.autocast(device, enabled=False):
            y = ring_linear_reduce_scatter(x, wc, group, stats)
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, wc)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[no-untyped-def]
        x, wc = ctx.saved_tensors
        return (*ring_gather_row_backward(grad.to(wc.dtype), x, wc, ctx.group, ctx.stats,
                                          input_grad=ctx.needs_input_grad[0], dtypes=ctx.dtypes), None, None)


def ring_gather_row_backward(g: torch.Tensor, x: torch.Tensor | None, wc: torch.Tensor,
                             group: dist.ProcessGroup | None, stats: comm.CommStats | None, *, input_grad: bool,
                             dtypes: tuple[torch.dtype, torch.dtype]) -> tuple[torch.Tensor | None, ...]:
    """The row layer's backward with its output gradient g (B, T/tp, out) gathered around the ring under the
    matmuls, as ring_gather_linears gathers the column input: step k takes the piece of rank (me - k) % tp to
    its rows of the input gradient (g_k W, bit for bit the gathered matmul's rows) and adds g_k^T x_k to the
    weight gradient (summed over the pieces in fp32: in fp32 the one mm's sum in another order, within fp32
    rounding; under autocast each piece's product is rounded to the compute dtype before that sum).
    Bytes: tp-1 pieces sent, the all-gather's count, counted as it."""
    n = comm.group_size(group)
    B, s, _ = g.shape
    gx = g.new_empty((B, n * s, wc.shape[1])) if input_grad else None  # (B, T, in/tp)
    gw: torch.Tensor | None = None
    for src, held in _ring_pieces(g, group, stats):
        if gx is not None:
            gx[:, src * s:(src + 1) * s] = held.matmul(wc)
        if x is not None:
            part = torch.tensordot(held, x[:, src * s:(src + 1) * s], dims=([0, 1], [0, 1])).float()  # (out, in/tp)
            gw = part if gw is None else gw.add_(part)
        del held  # (as in ring_gather_linears)
    return (None if gx is None else gx.to(dtypes[0]), None if gw is None else gw.to(dtypes[1]))
