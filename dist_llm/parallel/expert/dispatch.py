"""Token dispatch and combine across the ep group by all-to-all (expert parallelism).

Each rank routes its own tokens exactly as at ep=1 and sorts the (token, slot) rows by global expert id, so
the rows for the experts of ep rank j are one contiguous run. Then, per MoE layer:

    counts      all-to-all of the per-expert row counts (E,) -> what every ep rank sends to my E/ep experts;
                read on the host once (NCCL takes split sizes as host ints, before the call: Megatron does so too)
    dispatch    all-to-all of the rows, variable splits         fwd: rows to their experts' rank / bwd: the reverse
    experts     the received rows regrouped by local expert (they arrive by source rank), the grouped matmul
    combine     the reverse all-to-all, rows back to their tokens' rank in the order they left
                                                                fwd: rows back / bwd: their gradients to the experts
The gates' weighting and the index_add into the tokens stay in the MoE layer, on the tokens' rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dist_llm.compiling import keep_out_of_graphs
from dist_llm.parallel import comm


class _AllToAll(torch.autograd.Function):
    """fwd: rows of x cut by `in_splits` go to the ep ranks, `out_splits` arrive / bwd: the same all-to-all
    with the splits swapped (each gradient row goes back to where its row came from)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any,
                stats: comm.CommStats | None) -> torch.Tensor:  # type: ignore[override]
        ctx.splits, ctx.group, ctx.stats = (out_splits, in_splits), group, stats
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm.all_to_all(out, x, group, stats, output_splits=out_splits, input_splits=in_splits)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        comm.all_to_all(back, grad.contiguous(), ctx.group, ctx.stats, output_splits=in_splits,
                        input_splits=out_splits)
        return back, None, None, None, None


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any,
                    stats: comm.CommStats | None) -> torch.Tensor:
    """Differentiable all-to-all of the rows of x (see `_AllToAll`)."""
    return _AllToAll.apply(x, out_splits, in_splits, group, stats)


class AllToAllDispatch:
    """What an MoE layer calls instead of its experts under expert parallelism: rows sorted by global expert in,
    the experts' outputs for those rows, in the same order, out."""

    def __init__(self, group: Any, ep: int, n_experts: int, stats: comm.CommStats | None) -> None:
        self.group, self.ep, self.stats = group, ep, stats
        self.n_local = n_experts // ep

    # Kept out of torch.compile's graphs (train.compile compiles each block): the split sizes are read on the host
    # and change every step (inside a graph: a graph break and a recompile per new split), so a compiled block
    # breaks its graph here and the dispatch, the experts and the combine run eagerly, as in an eager run.
    @keep_out_of_graphs
    def __call__(self, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor,
                 expert_of_row: torch.Tensor) -> torch.Tensor:
        """x (M, C) sorted by global expert, `counts` (E,) rows per global expert -> (M, C)."""
        ep, n_local = self.ep, self.n_local
        # received[i, e]: rows ep rank i sends to my local expert e (even splits: E/ep counts to each rank)
        received = torch.empty_like(counts)
        comm.all_to_all(received, counts.contiguous(), self.group, self.stats)
        sent_host, received_host = torch.stack([counts, received]).view(2, ep, n_local).sum(-1).tolist()  # (one sync)
        rows = all_to_all_rows(x, received_host, sent_host, self.group, self.stats)  # (R, C) by source rank
        # regroup by local expert (stable: by source rank within an expert), run them, restore the arrival order
        local_expert = torch.arange(n_local, device=x.device).repeat(ep)  # (ep * n_local,) expert of each run
        expert_of_received = torch.repeat_interleave(local_expert, received, output_size=rows.shape[0])  # (R,)
        order = torch.argsort(expert_of_received, stable=True)
        if rows.shape[0]:
            out = experts(rows[order], received.view(ep, n_local).sum(0), expert_of_received[order])
        else:  # no rows for my experts (the grouped matmul refuses none): one zero row through expert 0, none kept.
            # The experts stay in the graph, so backward reaches their weights where it does on every peer (ZeRO-2
            # starts each expert bucket's reduce-scatter from those gradients: at the same point, in the same
            # order on every rank of the expert-dp group) and runs both reverse all-to-alls its peers wait in.
            one = torch.zeros_like(counts[:n_local])
            one[0] = 1
            # The zero row hangs off the received (empty) rows, so it is in the graph: FSDP2 (ZeRO-3 at ep > 1) starts
            # the experts' reduce-scatter from a hook on their inputs' gradient, which a detached input never gets
            # (it would then reduce at the end of backward, out of order with the peers' collectives).
            zero_row = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
            none = experts(zero_row, one, one[:1] * 0)[:0]
            out = none + rows.to(none.dtype)  # (the dtype the peers' experts return: what comes back to them)

        # restored[order[i]] = out[i], by gathering at the inverse permutation: index_copy's backward keeps its
        # source (the experts' outputs, R x C) alive until backward, index_select's only the (R,) index
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        restored = out.index_select(0, inverse)
        return all_to_all_rows(restored, sent_host, received_host, self.group, self.stats)
