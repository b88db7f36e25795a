"""This rank's experts under expert parallelism: a slice along dim 0 of each MoE layer's stacked expert weights."""

from __future__ import annotations

import torch

from dist_llm.model.moe import Experts
from dist_llm.parallel.marks import mark_expert_slice


class LocalExperts(Experts):
    """Experts [first, first + n_local) of `n_experts`, stacked as the whole layer's are. Initialisation draws
    these experts alone, each from its generator in the whole layer (model/init.py's `full_shape` / `local_part`
    hooks and the experts' `init_rows`), so every layout starts from the one-process values; checkpoints place
    the rows at `first` (the expert-slice mark)."""

    def __init__(self, n_experts: int, first: int, n_local: int, n_embd: int, hidden: int, *, swiglu: bool,
                 bias: bool) -> None:
        super().__init__(n_local, n_embd, hidden, swiglu=swiglu, bias=bias)
        self.n_total, self.first, self.n_local = n_experts, first, n_local
        for p in self.parameters():
            mark_expert_slice(p, first, n_experts)

    def full_shape(self, pname: str) -> tuple[int, ...]:
        return (self.n_total, *getattr(self, pname).shape[1:])

    def local_part(self, pname: str, full: torch.Tensor) -> torch.Tensor:
        return full.narrow(0, self.first, self.n_local)

    def extra_repr(self) -> str:
        return f"experts {self.first}-{self.first + self.n_local - 1} of {self.n_total}"
