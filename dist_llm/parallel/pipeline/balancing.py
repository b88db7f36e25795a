"""The MoE load-balancing losses of a pipeline stage's own blocks, joined to the stage's backward.

At one process the aux and z-loss terms ride on the LM loss (GPT._balancing_gradient), so one backward from
the loss reaches every router. Under pp the last stage's backward ends at its input: the routers of the earlier
stages are behind the activations sent point to point, which carry no graph. Each stage therefore makes the
objective's term for its own MoE layers and attaches it to the tensor its backward starts from (the stage output,
or the last stage's scaled loss): `_Attach` is the identity forward, and in backward hands the output's gradient
on unchanged and a gradient of one to the term (Megatron's MoEAuxLossAutoScaler does the same). Since the term
is already in the objective's units (`loss_fn` of the micro-batch's term times its targets, as
_balancing_gradient counts it under "sum"), one is the gradient the single backward gives it; the routers get
the one-process gradient per micro-batch, and the split backward of zb1 sees the term as part of the graph.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from dist_llm.data.sampler import IGNORE_INDEX
from dist_llm.model.moe import MoE


class _Attach(torch.autograd.Function):
    """fwd: x / bwd: (x's gradient, 1 for `term`): `term` joins any backward that starts at x's output."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, term: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.term_meta = (term.shape, term.dtype, term.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        shape, dtype, device = ctx.term_meta
        return grad, torch.ones(shape, dtype=dtype, device=device)


def stage_moe_layers(model: nn.Module, layers: range) -> list[MoE]:
    """The MoE layers of blocks `layers` of `model` (one stage's, or one chunk's under the interleaved schedule)."""
    return [m for i in layers for m in model.blocks[i].modules() if isinstance(m, MoE)]


def attach_balancing(out: torch.Tensor, moe: list[MoE], targets: torch.Tensor,
                     loss_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`out` (the stage output, or the last stage's scaled loss) with the balancing term of this micro-batch's
    forward through `moe` attached (the same tensor when the layers have none: dense stages, coefficients 0)."""
    terms = [m.last_loss for m in moe if m.last_loss is not None]
    if not terms or not torch.is_grad_enabled():
        return out
    # counted once per target, as GPT._balancing_gradient does under "sum", then divided and scaled as the loss
    term = loss_fn(torch.stack(terms).sum() * (targets != IGNORE_INDEX).sum())
    return _Attach.apply(out, term)


class HeldElsewhere:
    """In `moe.take_metrics`, an MoE layer another pipeline stage holds: zero sums, so that every stage lists
    the model's MoE layers in one order and one sum over the pp group leaves each row its holder's figures."""

    def __init__(self, n_experts: int, device: torch.device) -> None:
        self.expert_bias = torch.zeros(n_experts, device=device)  # (take_metrics reads the device from it)

    @property
    def stats(self) -> dict[str, torch.Tensor]:
        zero = torch.zeros((), device=self.expert_bias.device)
        return {"aux": zero, "z": zero, "dropped": zero, "forwards": zero, "load": torch.zeros_like(self.expert_bias)}

    @stats.setter
    def stats(self, value: dict[str, torch.Tensor]) -> None:  # (take_metrics resets the sums: nothing to reset)
        pass


def metric_layers(model: nn.Module, n_experts: int, is_moe_block: Callable[[int], bool],
                  device: torch.device) -> list[MoE | HeldElsewhere]:
    """Every MoE block's layer in block order: this stage's own, a `HeldElsewhere` for the others'."""
    out: list[MoE | HeldElsewhere] = []
    for i, block in enumerate(model.blocks):
        if is_moe_block(i):
            mine = [m for m in block.modules() if isinstance(m, MoE)]
            out += mine or [HeldElsewhere(n_experts, device)]
    return out
