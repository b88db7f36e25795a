"""Context parallelism applied to a model from outside: the layer factory learns the sequence split.

The GPT asks its `LayerFactory` for the global positions of the tokens it holds (learned positions, RoPE) and,
when `factory.sequence` is set, hands its attention core to it (model/factory.py `SequenceSplit`). `RingSequence`
answers both for one rank of a cp group: positions from the zigzag layout, attention by `ring_attention` over the
group. Everything else in the model works token by token and needs nothing.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from dist_llm.model.factory import LayerFactory
from dist_llm.parallel import comm
from dist_llm.parallel.context_parallel.layout import local_positions
from dist_llm.parallel.context_parallel.ring import ring_attention

log = logging.getLogger("dist_llm")

LAYOUT = "zigzag"  # every rank the same causal work (layout.py); the sampler slices the batch the same way


class RingSequence:
    """This rank's place in a context-parallel group: `model.factory.SequenceSplit` by ring attention."""

    def __init__(self, *, group: dist.ProcessGroup | None, rank: int, cp: int, stats: comm.CommStats | None,
                 layout: str = LAYOUT) -> None:
        self.group, self.rank, self.cp, self.stats, self.layout = group, rank, cp, stats, layout
        self._positions: dict[tuple[int, torch.device], torch.Tensor] = {}

    def positions(self, t_local: int, device: torch.device) -> torch.Tensor:
        key = (t_local, device)
        if key not in self._positions:  # (every layer asks; one small tensor per length and device)
            self._positions[key] = torch.tensor(local_positions(self.rank, self.cp, t_local, self.layout),
                                                device=device)
        return self._positions[key]

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  alibi_slopes: torch.Tensor | None) -> torch.Tensor:
        return ring_attention(q, k, v, group=self.group, stats=self.stats, causal=True, layout=self.layout,
                              alibi_slopes=alibi_slopes)


def apply_context_parallel(layers: LayerFactory, *, group: dist.ProcessGroup | None, rank: int, cp: int,
                           stats: comm.CommStats | None) -> None:
    """Give the model's layer factory the sequence split of this rank (before or after the model is built: the
    model reads it at forward time)."""
    layers.sequence = RingSequence(group=group, rank=rank, cp=cp, stats=stats)
    log.info("applied context parallel: cp=%d, %s layout, ring attention (rank %d holds positions %s)", cp, LAYOUT,
             rank, "zigzag chunks %d and %d of %d" % (rank, 2 * cp - 1 - rank, 2 * cp))


def sequence_positions(rank: int, cp: int, block_size: int) -> list[int] | None:
    """The positions of a block_size window this cp rank takes (what the sampler slices); None at cp=1."""
    return None if cp == 1 else local_positions(rank, cp, block_size // cp, LAYOUT)
