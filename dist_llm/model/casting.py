"""One autocast cast of an input that several matmuls read (SwiGLU's gate and up).

Autocast casts an fp32 input to the compute dtype at each matmul, and each matmul keeps its own 16-bit copy for
its weight's gradient: two copies of the MLP's input a block and micro-batch where one holds the same values
(2 bytes x n_embd a token: 2 GiB a micro-batch for a Llama-7B shape at 8k tokens). `cast_once` casts once and
hands each reader an alias of the one copy; autocast leaves a tensor already in its dtype as it is. In backward
the readers' input gradients are cast up and summed in x's dtype, as autograd did with a cast per reader: for
two readers bitwise the same gradients (a sum of two terms does not depend on the order); for more, the same up
to the order of the additions.
"""

from __future__ import annotations

import torch
from torch.autograd import Function


class _CastOnce(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype, n: int) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.x_dtype = x.dtype
        ctx.set_materialize_grads(False)  # a reader nobody used adds nothing
        low = x.to(dtype)
        return tuple(low.view_as(low) for _ in range(n))  # (distinct outputs, one storage)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):  # type: ignore[no-untyped-def, override]
        total = None
        for g in grads:
            if g is not None:
                g = g.to(ctx.x_dtype)
                total = g if total is None else total + g
        return total, None, None


def cast_once(x: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """`n` inputs for `n` matmuls that read x: under autocast, x (fp32) cast once to the compute dtype; else x."""
    device = x.device.type
    if (n < 2 or x.dtype != torch.float32 or not torch.amp.is_autocast_available(device)
            or not torch.is_autocast_enabled(device)):
        return (x,) * n
    dtype = torch.get_autocast_dtype(device)
    if dtype == x.dtype:
        return (x,) * n
    if not (torch.is_grad_enabled() and x.requires_grad):
        low = x.to(dtype)
        return (low,) * n
    return _CastOnce.apply(x, dtype, n)
