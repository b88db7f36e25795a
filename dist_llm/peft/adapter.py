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

from dist_llm.model import init as model_init
from dist_llm.parallel.marks import mark_sequence_parallel


class Adapter(nn.Module):
    def __init__(self, width: int, bottleneck: int, *, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.down = nn.Linear(width, bottleneck)
        self.up = nn.Linear(bottleneck, width)
        for p in self.parameters():
            mark_sequence_parallel(p, sequence_parallel)

    @torch.no_grad()
    def reset_parameters(self, seed: int, prefix: str, *, only: str | None = None) -> None:
        """`down` as nn.Linear's default init, `up` zero; each tensor from (seed, its name `prefix`.down.weight, ...);
        with `only` (e.g. "up.bias"), that tensor alone."""
        fills = {"down.weight": model_init.kaiming_uniform, "down.bias": model_init.fan_in_uniform(self.down.in_features),
                 "up.weight": model_init.zeros, "up.bias": model_init.zeros}
        for name, fill in fills.items() if only is None else [(only, fills[only])]:
            owner, _, pname = name.partition(".")
            model_init.fill_parameter(getattr(self, owner), pname, f"{prefix}.{name}", fill, seed)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.up(F.gelu(self.down(h)))


def _adapt(module: nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    return module.adapter(output)


def add_adapter(module: nn.Module, width: int, bottleneck: int, *, sequence_parallel: bool = False, seed: int = 0,
                name: str = "") -> Adapter:
    """Put an adapter on `module`'s output (a block's attention or MLP) called `name` in the whole model; its
    values are drawn from (seed, name), the same at every parallel layout."""
    with torch.device(next(module.parameters()).device):
        module.adapter = Adapter(width, bottleneck, sequence_parallel=sequence_parallel)
    module.adapter.reset_parameters(seed, f"{name}.adapter" if name else "adapter")
    module.register_forward_hook(_adapt)
    return module.adapter
