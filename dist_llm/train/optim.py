"""AdamW with decay on matrices only, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from dist_llm.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: matrices (embeddings, linear weights) decay; vectors (biases, norm weights) do not."""
    decay, no_decay = [], []
    for p in model.parameters():  # shared (tied) parameters come once
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    # the fused kernel is the fastest on CUDA; on CPU torch picks its per-tensor loop (foreach is GPU-only by default)
    fused = device.type == "cuda"
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, fused=fused or None)


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
