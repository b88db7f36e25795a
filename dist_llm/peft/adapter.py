"""Bottleneck adapters (Houlisby et al. 2019): h + up(gelu(down(h))) on the output of each block's attention
and of its MLP, before the residual add; `up` starts at zero, so the adapted model starts as the base.

They join through forward hooks, so the base keeps its parameter names. Under tensor parallelism the
attention and MLP outputs are whole on every rank (or a slice of the tokens with sequence parallelism), so
adapters are replicated; with sequence parallelism their gradients are partial sums, marked to be
all-reduced over tp like the norms'.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Adapter(nn.Module):
    def __init__(self, width: int, bottleneck: int, *, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.down = nn.Linear(width, bottleneck)
        self.up = nn.Linear(bottleneck, width)
        for p in self.parameters():
            p.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.down.reset_parameters()
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.up(F.gelu(self.down(h)))


def _adapt(module: nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    return module.adapter(output)


def add_adapter(module: nn.Module, width: int, bottleneck: int, *, sequence_parallel: bool = False) -> Adapter:
    """Put an adapter on `module`'s output (a block's attention or MLP)."""
    module.adapter = Adapter(width, bottleneck, sequence_parallel=sequence_parallel).to(
        next(module.parameters()).device)
    module.adapter.reset_parameters()
    module.register_forward_hook(_adapt)
    return module.adapter
