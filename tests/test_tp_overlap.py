"""The ring overlap of sequence-parallel layers (parallel/tensor/overlap.py: the forward, and the row layer's
backward): the ring path against the plain one (one blocking collective, then the matmul) and against one
process, on gloo ranks at tp 2 and 4."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_llm.parallel import comm
from dist_llm.parallel.tensor import overlap
from dist_llm.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, column_parallel_linears
from tests.distributed import run_distributed

B, T, C, H = 2, 16, 12, 24  # T splits over 4 ranks; H (the hidden width) too


def _run(layers: dict[str, Any], x_local: torch.Tensor, h_local: torch.Tensor) -> dict[str, Any]:
    """Column (two layers sharing one input, as gate and up) then row; outputs, gradients and bytes."""
    stats = layers["stats"]
    stats.reset()
    x = x_local.clone().requires_grad_()
    h = h_local.clone().requires_grad_()
    gate, up = column_parallel_linears(x, layers["gate"], layers["up"])  # (B, T, H/tp) each
    y = layers["down"](h)  # (B, T/tp, C)
    loss = (gate * up).square().sum() + y.square().sum()
    loss.backward()
    params = [p for name in ("gate", "up", "down") for p in layers[name].parameters()]
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return {"out": [gate.detach(), up.detach(), y.detach()], "grads": [x.grad, h.grad, *grads],
            "bytes": stats.snapshot()}


def _cases(rank: int, world_size: int) -> dict[str, Any]:
    group, stats = dist.group.WORLD, comm.CommStats()
    torch.manual_seed(0)  # every rank draws the same full tensors and keeps its part
    full = {n: torch.randn(o, i) for n, o, i in (("gate", H, C), ("up", H, C), ("down", C, H))}
    bias = {n: torch.randn(o) for n, o in (("gate", H), ("up", H), ("down", C))}
    x_full, h_full = torch.randn(B, T, C), torch.randn(B, T, H)
    layers: dict[str, Any] = {"stats": stats}
    for n in ("gate", "up"):
        m = ColumnParallelLinear(C, H, bias=True, group=group, stats=stats, sequence_parallel=True)
        m.init_from_full(lambda w, n=n: w.copy_(full[n]))
        with torch.no_grad():
            m.bias.copy_(m.local_part("bias", bias[n]))
        layers[n] = m
    down = RowParallelLinear(H, C, bias=True, group=group, stats=stats, sequence_parallel=True)
    down.init_from_full(lambda w: w.copy_(full["down"]))
    with torch.no_grad():
        down.bias.copy_(bias["down"])
    layers["down"] = down
    s, cols = T // world_size, slice(rank * H // world_size, (rank + 1) * H // world_size)
    x_local = x_full[:, rank * s:(rank + 1) * s].contiguous()
    h_local = h_full[:, :, cols].contiguous()  # a row-parallel input: all tokens, this rank's features
    try:
        overlap.ENABLED = True
        ring = _run(layers, x_local, h_local)
        overlap.ENABLED = False
        plain = _run(layers, x_local, h_local)
    finally:
        overlap.ENABLED = True

    # one process on the full tensors: this rank's part of each result
    xr, hr = x_full.clone().requires_grad_(), h_full.clone().requires_grad_()
    wr = {n: t.clone().requires_grad_() for n, t in full.items()}
    br = {n: t.clone().requires_grad_() for n, t in bias.items()}
    rows = slice(rank * H // world_size, (rank + 1) * H // world_size)
    g_ref, u_ref = (F.linear(xr, wr[n], br[n]) for n in ("gate", "up"))
    y_ref = F.linear(hr, wr["down"], br["down"])
    ((g_ref * u_ref).square().sum() + y_ref.square().sum()).backward()  # the sum of the ranks' losses
    ref_out = [g_ref[..., rows].detach(), u_ref[..., rows].detach(), y_ref[:, rank * s:(rank + 1) * s].detach()]
    ref_grads = [xr.grad[:, rank * s:(rank + 1) * s], hr.grad[:, :, cols],
                 wr["gate"].grad[rows], br["gate"].grad[rows], wr["up"].grad[rows], br["up"].grad[rows],
                 wr["down"].grad[:, cols],
                 # the row bias sees this rank's piece only (sequence-parallel mark: summed over tp after)
                 2 * y_ref[:, rank * s:(rank + 1) * s].detach().sum(dim=(0, 1))]
    return {"ring": ring, "plain": plain, "ref_out": ref_out, "ref_grads": ref_grads}


@pytest.mark.parametrize("tp", [2, 4])
def test_ring_overlap_equals_plain_and_one_process(tp: int) -> None:
    for rank, r in enumerate(run_distributed(_cases, tp)):
        ring, plain = r["ring"], r["plain"]
        # the same bytes, by kind: each ring step sends one piece, tp-1 steps = the collective's (tp-1)/tp
        assert ring["bytes"] == plain["bytes"], rank
        # column outputs: a matmul split by rows computes each row as the whole one does: bit for bit
        for a, b in zip(ring["out"][:2], plain["out"][:2]):
            assert torch.equal(a, b), rank
        # the row output: at tp=2 one addition (commutative): bit for bit; at tp=4 the ring's order of 3 sums
        if tp == 2:
            assert torch.equal(ring["out"][2], plain["out"][2]), rank
        for a, b in zip(ring["out"], r["ref_out"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # fp32 sums of 12-24 products in new orders
        # the row layer's weight gradient: the ring's sum over tp pieces against one mm of (out, B*T) by (B*T, in/tp)
        for a, b in zip(ring["grads"], plain["grads"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for a, b in zip(ring["grads"], r["ref_grads"]):
            # gradients of squares reach ~100: a few fp32 ulps of reordered sums there are ~1e-5 relative
            torch.testing.assert_close(a, b, rtol=5e-5, atol=1e-4)


class _Done:
    def wait(self) -> None:
        pass


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_the_ring_keeps_two_pieces_alive(tp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever tp, at most two received pieces are alive when the ring posts a transfer (the one being computed on
    and the one arriving): the point of the ring is never to hold the gathered (B, T, C). A caller that kept its
    reference to the last piece while the ring allocated the next buffer held three at tp >= 4 (found in review)."""
    import weakref

    received: list[weakref.ref[torch.Tensor]] = []
    alive_at_send: list[int] = []

    def shift(send: list[torch.Tensor], recv: list[torch.Tensor], group: Any, stats: Any) -> _Done:
        alive_at_send.append(sum(r() is not None for r in received) + 1)  # (+ the buffer being received into)
        recv[0].copy_(send[0])  # (one process stands for the ring: what arrives is irrelevant here)
        received.append(weakref.ref(recv[0]))
        return _Done()

    monkeypatch.setattr(comm, "group_size", lambda group: tp)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(comm, "ring_shift", shift)
    x, w = torch.randn(2, 3, 8), torch.randn(5, 8)
    with torch.no_grad():
        overlap.ring_gather_linears(x, [(w, None)], None, None)
        assert len(alive_at_send) == tp - 1 and max(alive_at_send) <= 2, alive_at_send
        alive_at_send.clear()
        received.clear()
        overlap.ring_gather_row_backward(torch.randn(2, 3, 5), x.repeat(1, tp, 1), w, None, None, input_grad=True,
                                         dtypes=(torch.float32, torch.float32))
        assert len(alive_at_send) == tp - 1 and max(alive_at_send) <= 2, alive_at_send
