"""LoRA (Hu et al. 2021): y = W x + (alpha / r) B A x, with W frozen, A random and B zero at the start.

The low-rank pair lives in a child module `lora` of the target linear and joins it through a forward hook,
so the base weight keeps its name (`blocks.0.attn.qkv.weight`): checkpoints and Hugging Face weights load
into a LoRA model unchanged, and the adapter's own names (`blocks.0.attn.qkv.lora.A`) say where it sits.

Under tensor parallelism the pair is split like the layer it adapts, so every rank computes its part of the
same update and the result equals tp=1:
  column-parallel W (rows split): A whole, B split by output rows (the same rows as W). The gradient of the
    rank-r product A x is a partial sum over the ranks' B pieces: it is all-reduced (copy_to_tp), and with
    sequence parallelism the product is computed on the local tokens and all-gathered along the sequence.
  row-parallel W (columns split): A split by input columns, B whole. The partial products A_i x_i are summed
    over ranks (reduce_from_tp; reduce-scattered along the sequence with sequence parallelism).
The whole factor sees only a slice of the tokens under sequence parallelism; it is marked like the norms
so its gradient is all-reduced over tp.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dist_llm.model import init as model_init
from dist_llm.parallel.marks import mark_partition, mark_replicated_rows, mark_sequence_parallel, replicated_rows
from dist_llm.parallel.tensor import mappings as tpc
from dist_llm.parallel.tensor.layers import ColumnParallelLinear, RankLocalDropout, RowParallelLinear
from dist_llm.peft.expert_lora import merge_experts


def _linear_kind(layer: nn.Module) -> str:
    if isinstance(layer, ColumnParallelLinear):
        return "column"
    if isinstance(layer, RowParallelLinear):
        return "row"
    return "plain"


class LoRA(nn.Module):
    """The low-rank update of one linear layer: `A` (rank, in) and `B` (out, rank), this rank's slices."""

    def __init__(self, layer: nn.Module, rank: int, alpha: float, dropout: float, *,
                 tp_rank: int | None = None) -> None:
        super().__init__()
        self.kind = _linear_kind(layer)
        self.rank, self.scale = rank, alpha / rank
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.group = getattr(layer, "group", None)
        self.stats = getattr(layer, "stats", None)
        self.sequence_parallel = getattr(layer, "sequence_parallel", False)
        # Each tp rank holds a different part of the input of a row-parallel layer (its columns), and of a
        # column-parallel one under sequence parallelism (its slice of the sequence): masks from a stream of
        # the rank's own; as of a plain layer inside an MoE layer under tp (the shared expert, `tp_rank` given),
        # which sees the rank's own tokens. Otherwise the input is the same on every rank, and so must its mask be.
        own_part = self.kind == "row" or (self.kind == "column" and self.sequence_parallel)
        if tp_rank is None and own_part:
            tp_rank = tpc._rank(self.group)
        self.dropout = nn.Dropout(dropout) if tp_rank is None else RankLocalDropout(dropout, rank=tp_rank)
        device = next(iter([*layer.parameters(), *layer.buffers()])).device
        weight_shape = _weight_shape(layer)
        a_cols = weight_shape[1]  # the rank's input columns (all of them unless row-parallel)
        b_rows = weight_shape[0]
        self.A = nn.Parameter(torch.zeros(rank, a_cols, device=device))
        self.B = nn.Parameter(torch.zeros(b_rows, rank, device=device))
        if self.kind == "column":
            self.rows_host = layer.rows_host
            self.register_buffer("rows", layer.rows.clone(), persistent=False)  # read by TensorParallelState
            mark_partition(self.B, 0)
            shared = replicated_rows(layer.weight)
            if shared is not None:
                mark_replicated_rows(self.B, shared)
            self.layer_sync = layer._synced  # rows every rank of a KV group holds: gradients summed
            mark_sequence_parallel(self.A, self.sequence_parallel)
        elif self.kind == "row":
            self.cols = layer.cols
            mark_partition(self.A, 1)
            mark_sequence_parallel(self.B, self.sequence_parallel)
        self.merged = False

    # -- initialisation (model/init.py draws the chunks of the whole tensor this rank's part overlaps, from
    # generators of their own, and keeps the overlap: full_shape and local_part say what that part is)
    def init_rule(self, pname: str) -> model_init.Fill:
        """A ~ Kaiming-uniform over the full input width, B = 0: the update starts at zero."""
        return model_init.kaiming_uniform if pname == "A" else model_init.zeros

    def full_shape(self, pname: str) -> tuple[int, ...]:
        return (self.rank, self.in_features) if pname == "A" else (self.out_features, self.rank)

    def local_part(self, pname: str, full: torch.Tensor) -> torch.Tensor:
        if pname == "A":
            return full[:, self.cols] if self.kind == "row" else full
        return full[self.rows.to(full.device)] if self.kind == "column" else full

    def reset_buffers(self) -> None:
        if self.kind == "column":
            self.rows.copy_(self.rows_host)

    @torch.no_grad()
    def reset_parameters(self, seed: int, prefix: str, *, only: str | None = None) -> None:
        """Draw A and B (or only the one named `only`) from `seed` as this LoRA's tensors `prefix`.A and `prefix`.B."""
        for pname in ("A", "B") if only is None else (only,):
            model_init.fill_parameter(self, pname, f"{prefix}.{pname}", self.init_rule(pname), seed)

    def _b(self) -> torch.Tensor:
        return self.layer_sync(self.B) if self.kind == "column" else self.B

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(x)
        if self.kind == "column":
            h = F.linear(x, self.A)  # (B, T or T/tp, r): A is whole
            if self.sequence_parallel:
                h = tpc.gather_from_sequence(h, self.group, self.stats)
            else:
                h = tpc.copy_to_tp(h, self.group, self.stats)  # the gradient: a sum over the ranks' B rows
            return F.linear(h, self._b()) * self.scale
        if self.kind == "row":
            partial = F.linear(x, self.A)  # x holds this rank's input columns
            if self.sequence_parallel:
                h = tpc.reduce_scatter_to_sequence(partial, self.group, self.stats)
            else:
                h = tpc.reduce_from_tp(partial, self.group, self.stats)
            return F.linear(h, self.B) * self.scale
        return F.linear(F.linear(x, self.A), self.B) * self.scale

    def delta(self) -> torch.Tensor:
        """scale * B A, shaped like this rank's slice of the base weight."""
        return (self.B @ self.A) * self.scale


def _weight_shape(layer: nn.Module) -> tuple[int, int]:
    if hasattr(layer, "weight") and isinstance(layer.weight, torch.Tensor):
        return tuple(layer.weight.shape)  # type: ignore[return-value]
    return layer.out_features, layer.in_features  # a quantised layer: no float weight tensor


def _add_update(layer: nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    lora: LoRA = layer.lora
    if lora.merged:
        return output
    return output + lora(inputs[0]).to(output.dtype)


def add_lora(layer: nn.Module, rank: int, alpha: float, dropout: float, *, seed: int = 0, name: str = "",
             tp_rank: int | None = None) -> LoRA:
    """Attach a LoRA update to `layer` (nn.Linear, a tensor-parallel linear or a 4-bit one) called `name` in the
    whole model; its A is drawn from (seed, name), the same at every parallel layout. `tp_rank`: a plain layer
    that sees this tp rank's own tokens (inside an MoE layer under tp): dropout from the rank's own stream."""
    layer.lora = LoRA(layer, rank, alpha, dropout, tp_rank=tp_rank)
    layer.lora.reset_parameters(seed, f"{name}.lora" if name else "lora")
    layer.lora.hook = layer.register_forward_hook(_add_update)
    return layer.lora


def lora_modules(model: nn.Module) -> list[tuple[nn.Module, LoRA]]:
    return [(m, m.lora) for m in model.modules() if isinstance(getattr(m, "lora", None), LoRA)]


@torch.no_grad()
def merge(model: nn.Module) -> None:
    """Fold every LoRA update into its base weight (W += scale B A; an expert LoRA into each expert's W_e):
    inference then costs nothing extra."""
    for layer, lora in lora_modules(model):
        if not lora.merged:
            if not isinstance(getattr(layer, "weight", None), torch.Tensor):
                raise ValueError(f"cannot merge LoRA into a {type(layer).__name__}: its weight is quantised")
            layer.weight += lora.delta().to(layer.weight.dtype)
            lora.merged = True
    merge_experts(model)  # each expert's W_e += scale A_e B_e


@torch.no_grad()
def unmerge(model: nn.Module) -> None:
    """Undo `merge` (W -= scale B A), so training can go on."""
    for layer, lora in lora_modules(model):
        if lora.merged:
            layer.weight -= lora.delta().to(layer.weight.dtype)
            lora.merged = False
    merge_experts(model, sign=-1.0)
