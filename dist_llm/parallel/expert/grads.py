"""Gradients of expert-parallel slices: reduced over the expert-data-parallel group only.

The divisor. Every rank divides its token-loss sum by 1/dp of the global batch's targets, and the dense
parameters' gradients are averaged over the dp ranks, so the result is the one-process gradient. An expert's
gradient on this rank already sums, through the all-to-all's backward, the contributions of the tokens of all
ep ranks of its group; summing it over the expert-dp group (the dp/ep ranks holding the same experts) adds the
other groups' tokens, so the sum covers every dp rank's tokens once. Dividing by dp (not dp/ep) then gives what
the dense parameters get: the mean over dp of the ranks' loss gradients.
"""

from __future__ import annotations

import torch
from torch import nn

from dist_llm.parallel import comm
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.marks import expert_slice


def expert_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every expert-parallel slice of `model` that trains."""
    return [(n, p) for n, p in model.named_parameters() if expert_slice(p) is not None and p.requires_grad]


def reduce_expert_grads(params: list[nn.Parameter], ctx: ParallelContext, bucket_numel: int) -> None:
    """Sum the experts' gradients over the expert-dp group and divide by dp (see the module docstring), in flat
    all-reduces of up to `bucket_numel` elements (a parameter larger than that alone): the copy they need is one
    bucket, not every expert gradient of the rank a second time. A parameter no token reached on this rank
    contributes zeros. Every rank of the group forms the same buckets (the same parameters in the same order)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket: list[torch.Tensor] = []
    for i, p in enumerate(params):
        bucket.append(p.grad)
        size = sum(g.numel() for g in bucket)
        if i + 1 == len(params) or size + params[i + 1].numel() > bucket_numel:
            flat = torch.cat([g.reshape(-1) for g in bucket]).div_(ctx.dp) if len(bucket) > 1 else None
            if flat is None:  # one tensor: reduced in place
                bucket[0].div_(ctx.dp)
                comm.all_reduce(bucket[0], ctx.expert_dp_group, ctx.comm)
            else:
                comm.all_reduce(flat, ctx.expert_dp_group, ctx.comm)
                torch._foreach_copy_(bucket, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in bucket]), bucket)])
            bucket = []
