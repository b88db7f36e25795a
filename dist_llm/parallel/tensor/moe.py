"""MoE layers under tensor parallelism: experts whole on every tp rank, the tokens split over the tp ranks.

Experts are not tensor-sharded (each tp rank holds whole experts, or under expert parallelism whole experts of
its ep slice); there is no key that asks for the other choice. Attention and the dense MLPs stay tensor-parallel.
What an MoE layer holds (router, experts, shared experts and their gate) is replicated over tp, and each tp rank
works on 1/tp of the layer's tokens:

  with sequence parallelism     the input is already this rank's chunk of the sequence: routed directly, the
                                output stays sequence-sharded (no collective of its own). Megatron-Core's way
                                (it requires sequence parallelism for MoE under tp)
  without sequence parallelism  this project's own: the input (B, T, C) is replicated, rank r keeps chunk r of
                                the sequence (`scatter_to_sequence`, no communication; backward all-gathers the
                                gradient slices), routes and runs it, and the outputs are all-gathered along the
                                sequence (`gather_sequence_replicated`; backward keeps this rank's slice)

Since each rank's router and experts see only its tokens, their gradients are partial sums: the parameters
carry the sequence-parallel mark, and `sync_sequence_parallel_grads` sums them over tp (as the norms' under
sequence parallelism), so every tp rank keeps the same expert and router parameters (an adapter on the layer's
output is not among them: `mark_moe_parameters`).

The balancing terms are the micro-batch's: the assignments per (batch row, expert) are all-gathered over tp (the
load, the imbalance and the aux-free bias's load count every token once; the capacity places each rank's rows
where one process would), and the summed router probabilities and z are all-reduced by `reduce_from_tp`, whose
backward is the identity: every tp rank forms the same aux and z and back-propagates the same gradient into
it, so each rank's own tokens receive exactly their part of the one-process gradient.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from dist_llm.compiling import keep_out_of_graphs
from dist_llm.model.moe import moe_layers
from dist_llm.parallel import comm
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.marks import mark_sequence_parallel
from dist_llm.parallel.tensor import mappings as tpc

log = logging.getLogger("dist_llm")


class TensorParallelTokens:
    """An MoE layer's tokens split over the tp group (model/moe.py's `TokenSplit`)."""

    def __init__(self, group: tpc.Group, rank: int, size: int, stats: comm.CommStats | None, *,
                 sequence_parallel: bool) -> None:
        self.group, self.rank, self.size, self.stats = group, rank, size, stats
        self.sequence_parallel = sequence_parallel

    def split(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.sequence_parallel else tpc.scatter_to_sequence(x, self.group, self.stats)

    def gather(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.sequence_parallel else tpc.gather_sequence_replicated(out, self.group, self.stats)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return tpc.reduce_from_tp(t, self.group, self.stats)

    @keep_out_of_graphs  # (the all-gather stays out of train.compile's graphs, as the mappings do)
    def gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        out = counts.new_empty((self.size * counts.shape[0], *counts.shape[1:]))  # (the ranks' rows, in order)
        comm.all_gather(out, counts.contiguous(), self.group, self.stats)
        return out.view(self.size, *counts.shape)


def apply_moe_tensor_parallel(model: nn.Module, ctx: ParallelContext, *, sequence_parallel: bool) -> None:
    """Split every MoE layer's tokens over the tp group and mark what the layer holds as summed over tp. On the
    meta model, before materialisation (the marks travel with the parameters). A no-op at tp = 1."""
    if ctx.tp == 1:
        return
    layers = moe_layers(model)
    for m in layers:
        m.tokens = TensorParallelTokens(ctx.tp_group, ctx.tp_rank, ctx.tp, ctx.comm,
                                        sequence_parallel=sequence_parallel)
    mark_moe_parameters(model, ctx)
    if layers:
        log.info("MoE under tensor parallel (tp=%d): %d MoE layer(s) with whole experts, each tp rank routing 1/%d "
                 "of the tokens%s", ctx.tp, len(layers), ctx.tp,
                 " (its sequence-parallel slice)" if sequence_parallel else "")


def mark_moe_parameters(model: nn.Module, ctx: ParallelContext) -> None:
    """Mark the parameters that see this rank's 1/tp of an MoE layer's tokens (router, experts and their LoRA
    pairs, shared expert and its LoRAs, shared gate) as summed over tp; again after PEFT has added its modules.

    Not an adapter on the layer's output (`moe.adapter`): it acts after the gather, on the whole replicated
    output without sequence parallelism (each rank already holds its full gradient: a sum would give tp times
    it), and on the rank's slice with it, where `add_adapter` has marked it already, as a dense block's."""
    if ctx.tp == 1:
        return
    for m in moe_layers(model):
        for part in (m.router, m.experts, m.shared, m.shared_gate):
            for p in part.parameters() if part is not None else ():
                mark_sequence_parallel(p)
