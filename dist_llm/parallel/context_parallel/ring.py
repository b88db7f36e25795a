"""Ring attention: each context-parallel rank holds a slice of the sequence; keys and values go round the ring.

Forward, cp steps: at step i rank r holds the key/value block of rank (r - i) mod cp. It posts that block's send
to the next rank (and the receive of the following block from the previous one) first, then attends its queries
to the block it holds, then waits: the transfer overlaps the compute. Partial results merge by the log-sum-exp
rule, kept in fp32 with the per-row lse (what backward needs). Fully masked blocks are not computed; their keys
still travel (every rank needs every block to pass through), so forward sends exactly 2 (k, v) x (cp - 1) blocks.

Backward passes the key/value blocks round again (cp - 1 sends) with the gradient accumulator of each block
travelling with them: rank r keeps its own block's gradient from step 0 locally; the accumulator of block j is
started by rank j+1 at step 1, gathers each later rank's share and reaches home after the last step, so it also
takes cp - 1 sends. Backward therefore moves twice forward's bytes (fp32; under bf16 the accumulators travel in
fp32, so backward sends 1 + 2 = 3 times the bf16 kv bytes rather than 2).

Under GQA/MQA only the n_kv_head heads travel; each block is expanded to the query heads locally and its key/value
gradients are summed back to the kv heads before they travel.

Positions: RoPE is applied to q and k before this core with global positions (layout.local_positions), so the core
needs nothing for it. ALiBi needs the distance between global positions, so the core adds it per block. Attention
dropout is not supported here (the caller refuses dropout > 0 with cp > 1).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.distributed as dist

from dist_llm.compiling import keep_out_of_graphs
from dist_llm.parallel import comm
from dist_llm.parallel.context_parallel.layout import Block, block_plan, check_layout, local_positions

NEG_INF = float("-inf")
#: queries per tile of a block: a block's fp32 scores are (B, nh, rows, T_local) at a time, not T_local^2 (at 8k
#: tokens per rank and 32 heads a whole block's scores would take 8 GiB a copy)
QUERY_ROWS = 512


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, nkv, T, hs) -> (B, nkv * groups, T, hs): query head h uses kv head h // groups (SDPA's enable_gqa)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold(dx: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, nh, T, hs) -> (B, nkv, T, hs): the gradient of `_expand`."""
    if groups == 1:
        return dx
    B, H, T, D = dx.shape
    return dx.view(B, H // groups, groups, T, D).sum(2)


class _Ring:
    """What one call knows: the group, its position in it, the layout's positions and the block plan."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, group: dist.ProcessGroup | None,
                 stats: comm.CommStats | None, causal: bool, layout: str, slopes: torch.Tensor | None,
                 scale: float, query_rows: int = QUERY_ROWS) -> None:
        self.group, self.stats, self.causal, self.scale = group, stats, causal, scale
        self.query_rows = query_rows
        self.cp = comm.group_size(group)
        self.rank = dist.get_rank(group) if self.cp > 1 else 0
        self.t_local = q.shape[2]
        self.groups = q.shape[1] // k.shape[1]
        self.layout = layout
        self.plan, self.positions = _tables(self.rank, self.cp, self.t_local, layout, causal, q.device)
        self.slopes = None if slopes is None else slopes.float().to(q.device)
        self.q_pos = self.positions[self.rank]

    def tiles(self, blk: Block) -> list[tuple[int, int]]:
        """The query rows [a, b) of block `blk`, `query_rows` at a time."""
        return [(a, min(a + self.query_rows, self.t_local)) for a in range(blk.q_start, self.t_local, self.query_rows)]

    def scores(self, q: torch.Tensor, k: torch.Tensor, blk: Block, rows: tuple[int, int]) -> torch.Tensor:
        """fp32 scores (B, nh, b - a, Tk) of queries q = rows [a, b) against keys [:k_end] of block `blk`, ALiBi and
        the causal mask from global positions."""
        s = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if self.slopes is None and not blk.masked:
            return s
        k_pos = self.positions[blk.src, : blk.k_end]
        distance = (k_pos[None, :] - self.q_pos[rows[0] : rows[1], None]).float()  # j - i, <= 0 where allowed
        if self.slopes is not None:
            s = s + self.slopes[:, None, None] * distance
        if blk.masked:
            s = s.masked_fill(distance > 0, NEG_INF)
        return s

    def block_kv(self, kv: torch.Tensor, blk: Block) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [:k_end] of the travelling (2, B, nkv, T, hs) block, fp32, expanded to the query heads."""
        k, v = kv[0, :, :, : blk.k_end].float(), kv[1, :, :, : blk.k_end].float()
        return _expand(k, self.groups), _expand(v, self.groups)

    def shift(self, sends: list[torch.Tensor]) -> tuple[list[torch.Tensor], dist.Work | None]:
        """Post the sends to the next rank and the matching receives from the previous one (one batch)."""
        recvs = [torch.empty_like(s) for s in sends]
        return recvs, comm.ring_shift(sends, recvs, self.group, self.stats)


@functools.lru_cache(maxsize=64)
def _tables(rank: int, cp: int, t_local: int, layout: str, causal: bool,
            device: torch.device) -> tuple[dict[int, Block], torch.Tensor]:
    """The block plan and every rank's global positions (on `device`), made once per shape, not per layer and
    call: each copy of a host list to a GPU waits for the host."""
    plan = {b.step: b for b in block_plan(rank, cp, t_local, layout, causal)}
    positions = torch.tensor([local_positions(r, cp, t_local, layout) for r in range(cp)], device=device)
    return plan, positions


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """out, lse <- the softmax over both key sets, from each set's normalised output and lse (in place)."""
    new = torch.logaddexp(lse, block_lse)
    # a row no key has reached yet is -inf in both: keep it at 0 output instead of exp(-inf - -inf) = nan
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    out.mul_(torch.exp(lse - safe)[..., None]).add_(block_out * torch.exp(block_lse - safe)[..., None])
    lse.copy_(new)


def _forward(ring: _Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, T, D = q.shape
    qf = q.float()
    out = torch.zeros(B, H, T, D, dtype=torch.float32, device=q.device)
    lse = torch.full((B, H, T), NEG_INF, dtype=torch.float32, device=q.device)
    kv = torch.stack((k, v))  # (2, B, nkv, T, hs): the block that travels, one message per step
    for step in range(ring.cp):
        nxt, work = ring.shift([kv]) if step < ring.cp - 1 else ([kv], None)
        blk = ring.plan.get(step)
        if blk is not None:
            kb, vb = ring.block_kv(kv, blk)
            for a, b in ring.tiles(blk):
                s = ring.scores(qf[:, :, a:b], kb, blk, (a, b))
                block_lse = torch.logsumexp(s, dim=-1)  # (B, nh, rows); finite: every computed row sees a key
                p = torch.exp(s - block_lse[..., None])
                _merge(out[:, :, a:b], lse[:, :, a:b], torch.matmul(p, vb), block_lse)
        if work is not None:
            work.wait()
        kv = nxt[0]
    return out, lse


def _block_grads(ring: _Ring, blk: Block, kv: torch.Tensor, qf: torch.Tensor, dof: torch.Tensor, lse: torch.Tensor,
                 delta: torch.Tensor, dq: torch.Tensor) -> torch.Tensor:
    """Accumulate block `blk`'s share of dq in place; return its (2, B, nkv, k_end, hs) key/value gradients."""
    kb, vb = ring.block_kv(kv, blk)
    dk, dv = torch.zeros_like(kb), torch.zeros_like(vb)  # (B, nh, Tk, hs), summed over the query tiles
    for a, b in ring.tiles(blk):
        p = torch.exp(ring.scores(qf[:, :, a:b], kb, blk, (a, b)) - lse[:, :, a:b, None])  # masked: exp(-inf) = 0
        do = dof[:, :, a:b]
        dv.add_(torch.matmul(p.transpose(-1, -2), do))
        ds = p * (torch.matmul(do, vb.transpose(-1, -2)) - delta[:, :, a:b, None])
        dq[:, :, a:b].add_(torch.matmul(ds, kb), alpha=ring.scale)
        dk.add_(torch.matmul(ds.transpose(-1, -2), qf[:, :, a:b]), alpha=ring.scale)
    return torch.stack((_fold(dk, ring.groups), _fold(dv, ring.groups)))


def _backward(ring: _Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
              dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qf, dof = q.float(), dout.float()
    delta = (dof * out.float()).sum(-1)  # (B, nh, T): rowsum(dO * O), the softmax backward's correction
    dq = torch.zeros_like(qf)
    kv = torch.stack((k, v))
    zeros = lambda: torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)  # noqa: E731
    own = zeros()  # this rank's share of its own block's gradients (step 0), kept at home
    acc: torch.Tensor | None = None  # the accumulator of the block held at this step, travelling with it
    for step in range(ring.cp):
        sends = ([kv] if step < ring.cp - 1 else []) + ([acc] if step >= 2 else [])
        recvs, work = ring.shift(sends) if sends else ([], None)
        blk = ring.plan.get(step)
        grads = _block_grads(ring, blk, kv, qf, dof, lse, delta, dq) if blk is not None else None
        if work is not None:
            work.wait()
        if step == 0:
            target = own
        else:  # step 1 starts block (rank - 1)'s accumulator; later steps add to the one just received
            target = recvs[-1] if step >= 2 else zeros()
            acc = target
        if grads is not None:
            target[:, :, :, : blk.k_end].add_(grads)
        if step < ring.cp - 1:
            kv = recvs[0]
    if ring.cp > 1:  # the last step's accumulator belongs to the next rank: one more hop takes each one home
        (home,), work = ring.shift([acc])
        work.wait()
        own.add_(home)
    return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring) -> torch.Tensor:
        with torch.autocast(q.device.type, enabled=False):  # fp32 scores and sums, as the backward recomputes them
            out, lse = _forward(ring, q, k, v)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)  # only this rank's slice: the point of context parallelism
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            return (*_backward(ctx.ring, q, k, v, out, lse, dout), None)


# Kept out of torch.compile's graphs (train.compile compiles each block): the ring's sends and receives and its
# Python loop over blocks are not traceable, so a compiled block breaks its graph here and the ring, forward and
# backward, runs eagerly between the compiled pieces, the same operations as in an eager run.
@keep_out_of_graphs
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: dist.ProcessGroup | None,
                   stats: comm.CommStats | None, causal: bool = True, layout: str = "zigzag",
                   alibi_slopes: torch.Tensor | None = None, scale: float | None = None,
                   query_rows: int = QUERY_ROWS) -> torch.Tensor:
    """Attention of this rank's queries (B, nh, T_local, hs) to the whole sequence's keys and values, of which this
    rank holds (B, nkv, T_local, hs) (nh a multiple of nkv: MHA, GQA, MQA), the sequence split over `group` as
    `layout` places it. Returns (B, nh, T_local, hs) in q's dtype, equal to SDPA on the whole sequence; the ring's
    bytes are counted in `stats` as "ring". `alibi_slopes` (nh,) adds -slope * (i - j) from global positions.
    Each block is computed `query_rows` queries at a time (the transient scores' size)."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"ring_attention: q (B, nh, T, hs) and k, v (B, nkv, T, hs) expected, got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, H, T, D = q.shape
    if k.shape[0] != B or k.shape[2:] != (T, D) or H % k.shape[1]:
        raise ValueError(f"ring_attention: k/v {tuple(k.shape)} do not fit q {tuple(q.shape)} "
                         f"(same batch, tokens and head size; query heads a multiple of kv heads)")
    if alibi_slopes is not None and alibi_slopes.shape != (H,):
        raise ValueError(f"ring_attention: alibi_slopes of shape {tuple(alibi_slopes.shape)}, expected ({H},)")
    if alibi_slopes is not None and not causal:
        raise ValueError("ring_attention: ALiBi is defined here for causal attention only (as in the model)")
    check_layout(layout, comm.group_size(group), T)
    if query_rows < 1:
        raise ValueError(f"ring_attention: query_rows must be >= 1, got {query_rows}")
    ring = _Ring(q, k, group, stats, causal, layout, alibi_slopes, 1.0 / math.sqrt(D) if scale is None else scale,
                 query_rows)
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), ring)
