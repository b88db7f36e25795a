"""AdamW with decay on matrices only, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from dist_llm.config import OptimConfig


def decays(p: torch.Tensor) -> bool:
    """Whether weight decay applies: to matrices, not to vectors (biases, norm weights), nor to stacks of vectors
    (the MoE experts' biases (E, H), marked `no_weight_decay` by the model)."""
    return p.dim() >= 2 and not getattr(p, "no_weight_decay", False)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: matrices (embeddings, linear weights) decay; vectors (biases, norm weights) do not."""
    decay, no_decay = [], []
    for p in model.parameters():  # shared (tied) parameters come once
        if not p.requires_grad:
            continue
        (decay if decays(p) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# Devices with torch's fused AdamW kernel. It is the fastest there (on CPU too: 5x torch's default per-tensor
# loop on a 124M-shaped parameter set), and it reads a `found_inf` tensor, which lets a step with non-finite
# gradients be skipped without the host waiting for the device to say so.
FUSED_DEVICES = ("cpu", "cuda")


def adamw(groups: list[dict], cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """torch AdamW over `groups` with the config's hyperparameters, fused where the device has the kernel."""
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=True if device.type in FUSED_DEVICES else None)


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    return adamw(param_groups(model, cfg.weight_decay), cfg, device)


def guarded_step(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """`optimizer.step()`, except that where `found_inf` (a 0-dim float32 tensor on the parameters' device) is
    nonzero, parameters and optimizer state stay as they were. A fused optimizer decides that inside its kernel
    (as `torch.amp.GradScaler` has it do), so the step needs no host sync; any other reads the flag first."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        if not found_inf.item():
            optimizer.step()
        return
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf  # type: ignore[attr-defined]


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup to lr, cosine decay to min_lr at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
