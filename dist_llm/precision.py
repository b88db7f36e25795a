"""Mixed precision: autocast over fp32 master weights, and a dynamic loss scaler for fp16.

The parameters (and so the optimizer's master copy) stay fp32; autocast runs matmuls in bf16/fp16. The
scaler is written here rather than taken from `torch.amp.GradScaler` because that one unscales through
the optimizer's param groups, which sharded optimizers (ZeRO) do not expose: here the trainer unscales
whatever gradient tensors the data-parallel form holds, and decides the skip from the global norm, on the
device: the fused optimizer reads the decision as a tensor (`dist_llm/optim.py::guarded_step`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import torch

Precision = Literal["fp32", "bf16", "fp16"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: Precision, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


class LossScaler:
    """Dynamic loss scaling: halve the scale on a step with non-finite gradients (the step is skipped),
    double it after `growth_interval` good steps in a row. With `enabled=False` the scale is 1 and
    `update` only counts bad steps (the bf16/fp32 guard).

    Every counter is a tensor on the training device, updated by `update(found_inf)` without a host sync, so
    a step never waits for the device to tell whether it overflowed. Reading a counter (the properties,
    `state_dict`, `take_worst_run`) syncs: the trainer does it at log steps and checkpoints only."""

    def __init__(self, *, enabled: bool, scale: float = 2.0**16, growth_interval: int = 2000, backoff: float = 0.5,
                 growth: float = 2.0, min_scale: float = 1.0, device: torch.device | str = "cpu") -> None:
        self.enabled = enabled
        self.growth_interval, self.backoff, self.growth, self.min_scale = growth_interval, backoff, growth, min_scale
        self._scale = torch.tensor(scale if enabled else 1.0, dtype=torch.float32, device=device)
        self._inv_scale = 1.0 / self._scale
        # [good steps in a row, bad steps in a row, skipped steps, the longest bad run since take_worst_run]
        self._counts = torch.zeros(4, dtype=torch.int64, device=device)

    # -- the step ----------------------------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale if self.enabled else loss

    def unscale_(self, grads: list[torch.Tensor]) -> None:
        if self.enabled and grads:
            # (offloaded gradients live on the CPU while the scale stays on the training device)
            torch._foreach_mul_(grads, self._inv_scale.to(grads[0].device))

    def update(self, found_inf: torch.Tensor) -> None:
        """After a step whose gradients were non-finite where `found_inf` (a 0-dim tensor) is nonzero."""
        bad = found_inf.to(self._counts.device) != 0
        good_run, bad_run, skipped, worst = self._counts.unbind()
        good_run = torch.where(bad, 0, good_run + 1)
        bad_run = torch.where(bad, bad_run + 1, 0)
        self._counts.copy_(torch.stack([good_run, bad_run, skipped + bad.long(), torch.maximum(worst, bad_run)]))
        if self.enabled:
            grow = ~bad & (good_run % self.growth_interval == 0)
            shrunk = (self._scale * self.backoff).clamp(min=self.min_scale)
            self._scale.copy_(torch.where(bad, shrunk, torch.where(grow, self._scale * self.growth, self._scale)))
            torch.reciprocal(self._scale, out=self._inv_scale)

    # -- reading (host syncs) -------------------------------------------------------------------------------------
    @property
    def scale(self) -> float:
        return self._scale.item()

    @property
    def good_steps(self) -> int:
        return int(self._counts[0])

    @property
    def bad_steps_in_row(self) -> int:
        return int(self._counts[1])

    @property
    def skipped_steps(self) -> int:
        return int(self._counts[2])

    def take_worst_run(self) -> int:
        """The longest run of bad steps in a row since the last call (one host sync), then forget it."""
        worst = int(self._counts[3])
        self._counts[3] = self._counts[1]  # a run still going on counts on from here
        return worst

    def state_dict(self) -> dict[str, Any]:
        good, bad, skipped, _ = self._counts.tolist()
        return {"enabled": self.enabled, "scale": self.scale, "good_steps": good, "bad_steps_in_row": bad,
                "skipped_steps": skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters; the scale only from a run that scaled too (a bf16/fp32 run's is 1)."""
        if state.get("enabled", self.enabled) and self.enabled:
            self._scale.fill_(float(state["scale"]))
            torch.reciprocal(self._scale, out=self._inv_scale)
        bad = int(state.get("bad_steps_in_row", 0))
        self._counts.copy_(torch.tensor([int(state.get("good_steps", 0)), bad, int(state.get("skipped_steps", 0)),
                                         bad]))
