"""Mixed precision: autocast over fp32 master weights, and a dynamic loss scaler for fp16.

The parameters (and so the optimizer's master copy) stay fp32; autocast runs matmuls in bf16/fp16. The
scaler is written here rather than taken from `torch.amp.GradScaler` because that one unscales through
the optimizer's param groups, which sharded optimizers (ZeRO) do not expose: here the trainer unscales
whatever gradient tensors the data-parallel form holds, and decides the skip from the global norm.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Literal

import torch

Precision = Literal["fp32", "bf16", "fp16"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: Precision, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


@dataclass
class LossScaler:
    """Dynamic loss scaling: halve the scale on a step with non-finite gradients (the step is skipped),
    double it after `growth_interval` good steps in a row. With `enabled=False` the scale is 1 and
    `update` only counts bad steps (the bf16/fp32 guard)."""

    enabled: bool
    scale: float = 2.0**16
    growth_interval: int = 2000
    backoff: float = 0.5
    growth: float = 2.0
    min_scale: float = 1.0
    good_steps: int = 0
    bad_steps_in_row: int = 0
    skipped_steps: int = 0

    def __post_init__(self) -> None:
        if not self.enabled:
            self.scale = 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale_(self, grads: list[torch.Tensor]) -> None:
        if self.enabled and grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, finite: bool) -> None:
        if finite:
            self.bad_steps_in_row = 0
            self.good_steps += 1
            if self.enabled and self.good_steps % self.growth_interval == 0:
                self.scale *= self.growth
            return
        self.bad_steps_in_row += 1
        self.skipped_steps += 1
        self.good_steps = 0
        if self.enabled:
            self.scale = max(self.scale * self.backoff, self.min_scale)

    def state_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "scale": self.scale, "good_steps": self.good_steps,
                "bad_steps_in_row": self.bad_steps_in_row, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters; the scale only from a run that scaled too (a bf16/fp32 run's is 1)."""
        state = dict(state)
        if not (state.pop("enabled", self.enabled) and self.enabled):
            state.pop("scale", None)
        for key, value in state.items():
            setattr(self, key, value)
