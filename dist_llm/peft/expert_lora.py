"""LoRA on the routed experts of an MoE layer: one low-rank pair per expert, applied in the grouped compute.

A stacked expert weight W (E, in, out) gets A (E, in, r) and B (E, r, out), B zero (the update starts at zero),
each expert's A drawn as a dense LoRA's A (Kaiming-uniform over its `in` inputs). The experts' forward adds, on
each expert's contiguous slice of sorted rows x_e,

    x_e @ W_e  +  (alpha / r) * (x_e @ A_e) @ B_e

with the same grouped matmul as the base (the two low-rank products are two more grouped matmuls), so the rows
never leave their expert's slice. The pair lives in a child of the experts module (`lora_up` for `w_up`,
`lora_gate`, `lora_down`): the base weights keep their names, and `blocks.1.moe.experts.lora_up.A` says where
the update sits.

Under expert parallelism the pair is sliced like the experts (the rank's E/ep along dim 0) and carries the same
expert-slice mark: its gradients are reduced over the expert-dp group, ZeRO-1/2 keep it in the expert buffers,
checkpoints place it by global expert id. Each expert's A is drawn from a generator of its own (model/init.py's
`init_rows`), so a rank draws its experts' alone and every ep layout starts from the one-process values.
"""

from __future__ import annotations

import torch
from torch import nn

from dist_llm.model import init as model_init
from dist_llm.model.moe import GroupedImpl, grouped_matmul, grouped_rows_fit
from dist_llm.parallel.marks import expert_slice, mark_expert_slice
from dist_llm.parallel.tensor.layers import RankLocalDropout

#: base weight of the experts -> the name of its LoRA child
LORA_OF = {"w_up": "lora_up", "w_gate": "lora_gate", "w_down": "lora_down"}


class ExpertLoRA(nn.Module):
    """The per-expert low-rank update of one stacked expert weight (this rank's experts)."""

    def __init__(self, weight: torch.Tensor, rank: int, alpha: float, dropout: float, *,
                 tp_rank: int | None = None) -> None:
        super().__init__()
        n_local, self.in_features, self.out_features = weight.shape
        self.rank, self.scale = rank, alpha / rank
        self.first, self.n_total = expert_slice(weight) or (0, n_local)  # (the whole stack without ep)
        self.n_local = n_local
        # Under tp each rank routes its own tokens (a row count of its own): a mask from the shared stream would
        # put the tp ranks' streams out of step for every later replicated dropout; the rank's own stream instead.
        self.dropout = nn.Dropout(dropout) if tp_rank is None else RankLocalDropout(dropout, rank=tp_rank)
        self.A = nn.Parameter(torch.zeros(n_local, self.in_features, rank, device=weight.device))
        self.B = nn.Parameter(torch.zeros(n_local, rank, self.out_features, device=weight.device))
        if expert_slice(weight) is not None:
            for p in (self.A, self.B):
                mark_expert_slice(p, self.first, self.n_total)
        self.merged = False

    # -- initialisation (model/init.py: the whole (E, ...) shape, one expert per generator, this rank's drawn)
    def init_rule(self, pname: str) -> model_init.Fill:
        """Each A_e as nn.Linear's default over its `in` inputs (a dense LoRA's A), B = 0."""
        return model_init.fan_in_uniform(self.in_features) if pname == "A" else model_init.zeros

    def init_rows(self, pname: str) -> int:
        return 1  # (one expert's pair per generator, as the experts' own weights)

    def full_shape(self, pname: str) -> tuple[int, ...]:
        return (self.n_total, *getattr(self, pname).shape[1:])

    def local_part(self, pname: str, full: torch.Tensor) -> torch.Tensor:
        return full.narrow(0, self.first, self.n_local)

    @torch.no_grad()
    def reset_parameters(self, seed: int, prefix: str, *, only: str | None = None) -> None:
        for pname in ("A", "B") if only is None else (only,):
            model_init.fill_parameter(self, pname, f"{prefix}.{pname}", self.init_rule(pname), seed)

    def forward(self, x: torch.Tensor, counts: torch.Tensor, *, impl: GroupedImpl) -> torch.Tensor | None:
        """x (M, in) sorted by expert, `counts` (E_local,) -> the update (M, out); None once merged."""
        if self.merged:
            return None
        if impl == "grouped_mm" and not grouped_rows_fit(self.rank, x):
            impl = "loop"
        h = grouped_matmul(self.dropout(x), self.A, counts, impl=impl)  # (M, r)
        return grouped_matmul(h, self.B, counts, impl=impl) * self.scale  # (M, out)

    def delta(self) -> torch.Tensor:
        """scale * A_e B_e for each of this rank's experts: (E_local, in, out), shaped like the base weight."""
        return torch.bmm(self.A, self.B) * self.scale

    def extra_repr(self) -> str:
        return f"experts {self.first}-{self.first + self.n_local - 1} of {self.n_total}, rank {self.rank}"


def add_expert_lora(experts: nn.Module, pname: str, rank: int, alpha: float, dropout: float, *, seed: int = 0,
                    name: str = "", tp_rank: int | None = None) -> ExpertLoRA:
    """Attach a per-expert LoRA to the stacked weight `pname` of `experts` (called `name` in the whole model);
    its A is drawn from (seed, name), the same at every expert-parallel layout. `tp_rank`: this rank's place in
    the tp group that splits the MoE layer's tokens (None: the layer runs every token)."""
    lora = ExpertLoRA(getattr(experts, pname), rank, alpha, dropout, tp_rank=tp_rank)
    setattr(experts, LORA_OF[pname], lora)
    lora.reset_parameters(seed, f"{name}.{LORA_OF[pname]}" if name else LORA_OF[pname])
    return lora


def expert_loras(model: nn.Module) -> list[tuple[nn.Module, str, ExpertLoRA]]:
    """(experts module, base weight name, its LoRA) of every expert LoRA of `model`."""
    return [(m, pname, getattr(m, child)) for m in model.modules() for pname, child in LORA_OF.items()
            if isinstance(getattr(m, child, None), ExpertLoRA)]


@torch.no_grad()
def merge_experts(model: nn.Module, *, sign: float = 1.0) -> None:
    """W_e += sign * scale A_e B_e for every expert LoRA not yet merged (sign -1: undo a merge)."""
    for experts, pname, lora in expert_loras(model):
        if lora.merged == (sign < 0):
            w = getattr(experts, pname)
            w += sign * lora.delta().to(w.dtype)
            lora.merged = sign > 0
