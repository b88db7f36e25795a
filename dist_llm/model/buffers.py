"""Buffers that are more than a recomputed table: state a run trains, and fp32 values no cast may round.

Modules take part through two duck-typed class attributes (the model stays free of whoever reads them):
  `trained_buffers`  persistent buffers holding state the run trains (an MoE layer's expert_bias): reset_buffers
                     gives only their start, so a build that fills tensors one at a time (DeepSpeed's ZeRO-3) reads
                     them from model.init_from, and its checkpoints save and resume them. Every other buffer is
                     recomputed by reset_buffers or rebuilt with the weights (NF4's mean and 16-level table).
  `fp32_buffers`     buffers that stay fp32 whatever casts the module: `Module.to(dtype)`, `.half()`, `.bfloat16()`
                     (the module's `_apply` calls `apply_keeping_fp32`), and a cast that assigns `.data` directly,
                     which no `_apply` sees (DeepSpeed's `data_types.buffer_dtype`: `fp32_buffers_kept` around it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


def trained_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every module's `trained_buffers` by name in `model` (as `model.state_dict()` names them), the live tensors."""
    return {f"{name}.{b}" if name else b: m._buffers[b] for name, m in model.named_modules()
            for b in getattr(m, "trained_buffers", ()) if m._buffers.get(b) is not None}


def apply_keeping_fp32(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor],
                       apply: Callable[[], Any]) -> None:
    """`apply()` (the module's own `Module._apply(fn)`) with the buffers named in `module.fp32_buffers` kept fp32:
    those go through `fn` as int32 bit patterns, which device moves keep and dtype casts skip (`to`, `half` and
    `bfloat16` cast floating tensors only), and come back fp32. One that arrives in a lower precision is made fp32
    first (it keeps the values it has). The state dict keeps its order."""
    order = list(module._buffers)
    held = {name: module._buffers.pop(name) for name in module.fp32_buffers  # type: ignore[attr-defined]
            if module._buffers.get(name) is not None}
    try:
        apply()
    finally:
        for name, t in held.items():
            moved = fn(t.float().view(torch.int32))
            module._buffers[name] = moved.view(torch.float32) if moved.dtype == torch.int32 else moved.float()
        reordered = {name: module._buffers[name] for name in order if name in module._buffers}
        module._buffers.clear()
        module._buffers.update(reordered)


@contextlib.contextmanager
def fp32_buffers_kept(model: nn.Module) -> Iterator[None]:
    """Around code that may cast buffers by assigning their `.data` (DeepSpeed's engine under
    `data_types.buffer_dtype`), which no `_apply` sees: every module's `fp32_buffers` are copied aside (they are
    small) and given their fp32 values back afterwards, found by name (a later device move may have replaced the
    tensor, after the cast rounded what it moved)."""
    kept = [(m, name, t.detach().clone()) for m in model.modules() for name in getattr(m, "fp32_buffers", ())
            if (t := m._buffers.get(name)) is not None and t.dtype == torch.float32 and not t.is_meta]
    yield
    with torch.no_grad():
        for m, name, values in kept:
            t = m._buffers[name]
            if t.dtype != torch.float32:
                t.data = values.to(t.device)
            else:
                t.copy_(values)
