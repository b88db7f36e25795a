"""Which tokens of a sequence a context-parallel rank holds, and which attention blocks it computes.

Pure arithmetic, no processes: the ring kernel (ring.py) follows `block_plan`, and the tests count work from it.

Layouts of a sequence of T = cp * t_local tokens:
- "contiguous": rank r holds tokens [r * t_local, (r + 1) * t_local). Under a causal mask rank r's queries see
  r + 1 of the cp key blocks: the last rank does ~2cp-1 times the first rank's attention work.
- "zigzag": the sequence in 2cp chunks of c = t_local / 2; rank r holds chunks r and 2cp-1-r (in that order).
  Every rank then has the same causal work: its diagonal block, and half of every other block (all its queries
  against the first half of an earlier rank's keys, or its second half of queries against all of a later rank's).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Sequence

import torch

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str, cp: int, t_local: int) -> None:
    """One line naming the culprit for a layout this module cannot place."""
    if layout not in LAYOUTS:
        raise ValueError(f"context parallel layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    if cp < 1:
        raise ValueError(f"context parallel degree must be >= 1, got {cp}")
    if layout == "zigzag" and t_local % 2:
        raise ValueError(f"zigzag layout needs an even number of tokens per rank, got {t_local} "
                         f"(the sequence length must be a multiple of 2 x cp = {2 * cp})")


def local_positions(rank: int, cp: int, t_local: int, layout: str) -> list[int]:
    """Global positions (ascending) of the t_local tokens rank `rank` holds: what RoPE, learned positions and
    ALiBi must see instead of 0..t_local-1."""
    check_layout(layout, cp, t_local)
    if layout == "contiguous":
        return list(range(rank * t_local, (rank + 1) * t_local))
    c = t_local // 2
    far = 2 * cp - 1 - rank
    return list(range(rank * c, (rank + 1) * c)) + list(range(far * c, (far + 1) * c))


def split_sequence(x: torch.Tensor, rank: int, cp: int, layout: str, *, dim: int = 1) -> torch.Tensor:
    """This rank's part of a whole-sequence tensor (T along `dim`), in `local_positions` order."""
    T = x.shape[dim]
    if T % cp:
        raise ValueError(f"sequence length {T} is not a multiple of the context parallel degree {cp}")
    check_layout(layout, cp, T // cp)
    if layout == "contiguous":
        return x.chunk(cp, dim=dim)[rank]
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat((chunks[rank], chunks[2 * cp - 1 - rank]), dim=dim)


def merge_sequence(parts: Sequence[torch.Tensor], layout: str, *, dim: int = 1) -> torch.Tensor:
    """The whole-sequence tensor from every rank's part (in rank order): the inverse of `split_sequence`."""
    cp = len(parts)
    check_layout(layout, cp, parts[0].shape[dim])
    if layout == "contiguous":
        return torch.cat(list(parts), dim=dim)
    halves = [p.chunk(2, dim=dim) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


@dataclass(frozen=True)
class Block:
    """One attention block a rank computes at ring step `step`: its queries [q_start:] against the first `k_end`
    keys of rank `src`'s block; `masked` when some of those pairs lie above the causal diagonal."""

    step: int
    src: int
    q_start: int
    k_end: int
    masked: bool

    def entries(self, t_local: int) -> int:
        """Score entries computed (masked ones included)."""
        return (t_local - self.q_start) * self.k_end


def block_plan(rank: int, cp: int, t_local: int, layout: str, causal: bool) -> list[Block]:
    """The blocks rank `rank` computes, in ring order: at step i it holds the keys of rank (rank - i) mod cp.

    Fully masked blocks are left out (the keys still pass through on their way round the ring). Positions ascend
    within a rank's part, so the queries that see any key form a suffix and the keys any query sees a prefix:
    slicing to them is what makes zigzag compute half of each off-diagonal block."""
    q_pos = local_positions(rank, cp, t_local, layout)
    plan = []
    for step in range(cp):
        src = (rank - step) % cp
        k_pos = local_positions(src, cp, t_local, layout)
        if not causal:
            plan.append(Block(step, src, 0, t_local, False))
            continue
        q_start = bisect_left(q_pos, k_pos[0])  # queries before the first key see none of this block
        k_end = bisect_right(k_pos, q_pos[-1])  # keys after the last query are seen by none
        if q_start == t_local or k_end == 0:
            continue
        plan.append(Block(step, src, q_start, k_end, masked=k_pos[k_end - 1] > q_pos[q_start]))
    return plan


def unmasked_entries(rank: int, cp: int, t_local: int, layout: str, causal: bool) -> int:
    """Query-key pairs rank `rank` attends (the attention FLOPs that do work), summed over its blocks."""
    q_pos = torch.tensor(local_positions(rank, cp, t_local, layout))
    total = 0
    for blk in block_plan(rank, cp, t_local, layout, causal):
        k_pos = torch.tensor(local_positions(blk.src, cp, t_local, layout))[: blk.k_end]
        q = q_pos[blk.q_start:]
        total += int((k_pos[None, :] <= q[:, None]).sum()) if causal else q.numel() * k_pos.numel()
    return total
