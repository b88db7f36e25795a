"""Expert parallelism (`parallel.ep`): each MoE layer's experts split over the ep ranks of a dp row.

Applied from outside to the meta model: every MoE layer's `experts` becomes this rank's `LocalExperts` (experts
[ep_rank * E/ep, (ep_rank + 1) * E/ep)) and its `dispatch` the all-to-all (dispatch.py). Attention, the router,
dense and shared-expert MLPs stay data-parallel over all of dp; the experts are data-parallel over the dp/ep
ranks that hold the same ones (ParallelContext.expert_dp_group), with their gradients reduced there (data.py).
"""

from __future__ import annotations

import logging

from torch import nn

from dist_llm.model.moe import moe_layers
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.expert.dispatch import AllToAllDispatch
from dist_llm.parallel.expert.layers import LocalExperts

log = logging.getLogger("dist_llm")


def apply_expert_parallel(model: nn.Module, ctx: ParallelContext) -> None:
    """Slice the experts of every MoE layer of `model` (on the meta device: nothing is allocated here) to this
    rank's and route their tokens through the ep group. A no-op at ep = 1."""
    if ctx.ep == 1:
        return
    layers = moe_layers(model)
    for m in layers:
        old = m.experts
        n_local = m.n_experts // ctx.ep
        first = ctx.ep_rank * n_local
        local = LocalExperts(m.n_experts, first, n_local, old.w_up.shape[1], old.w_up.shape[2],
                             swiglu=old.w_gate is not None, bias=old.b_up is not None)
        local.impl = old.impl
        m.experts = local
        m.dispatch = AllToAllDispatch(ctx.ep_group, ctx.ep, m.n_experts, ctx.comm)
    if layers:
        log.info("applied expert parallel (ep=%d): %d MoE layer(s), experts %d-%d of %d on this rank", ctx.ep,
                 len(layers), layers[0].experts.first, layers[0].experts.first + layers[0].experts.n_local - 1,
                 layers[0].n_experts)


__all__ = ["apply_expert_parallel", "AllToAllDispatch", "LocalExperts"]
