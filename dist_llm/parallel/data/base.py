"""The interface the trainer drives, and its single-process form (no data parallelism).

A data-parallel form owns the model wrapper, the optimizer and the gradients. The trainer only says when
(micro-step boundaries, clipping, the step) and never how: DDP all-reduces, ZeRO reduce-scatters into
shards and all-gathers parameters, FSDP2 shards everything.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from dist_llm.config import Config
from dist_llm.parallel import comm
from dist_llm.parallel.context import ParallelContext
from dist_llm.optim import build_optimizer, guarded_step, set_lr
from dist_llm.parallel.marks import expert_slice, is_pp_duplicate, partition_dim, replicated_rows


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the local storage of `tensors` (DTensors count their local shard), each counted once."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        key = local.data_ptr() if local.numel() else id(local)
        if key in seen:
            continue
        seen.add(key)
        total += local.numel() * local.element_size()
    return total


def quantised_bytes(module: nn.Module) -> int:
    """Bytes of a quantised base (QLoRA's NF4) held as buffers, outside `parameters()`: each layer's fp32 mean.
    (Its codes, block scales and group factors are frozen parameters, counted with the others: FSDP2's shards.)"""
    from dist_llm.peft.nf4 import NF4Linear

    return sum(m.scale_mean.nbytes for m in module.modules() if isinstance(m, NF4Linear))


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def replicated_rows_square_sum(p: nn.Parameter, g: torch.Tensor, offset: int) -> torch.Tensor:
    """Sum of squares of a gradient piece, rows that `factor` tp ranks hold alike weighted 1/factor, so the
    sum over the tp group counts them once. `replicated_rows(p)` = (first row, end row, factor)."""
    rows_held = replicated_rows(p)
    assert rows_held is not None
    first, end, factor = rows_held
    row_len = math.prod(p.shape[1:])  # (from the shape: p[0] of a sharded DTensor would all-gather)
    rows = (offset + torch.arange(g.numel(), device=g.device)) // row_len
    weight = torch.where((rows >= first) & (rows < end), 1.0 / factor, 1.0)
    return (g.reshape(-1).float().pow(2) * weight).sum()


class DataParallel:
    """One process: the model as built, torch AdamW over all its parameters."""

    name = "none"
    #: True when the engine scales fp16 losses and skips overflowing steps itself (DeepSpeed)
    handles_loss_scaling = False

    def __init__(self, model: nn.Module, cfg: Config, ctx: ParallelContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.module = model  # the unwrapped GPT: parameter names, counts, checkpoints
        self.model: nn.Module = model  # what the trainer calls
        self.optimizer = self.build_optimizer()

    def build_optimizer(self) -> torch.optim.Optimizer:
        return build_optimizer(self.model, self.cfg.optim, self.ctx.device)

    # -- a step, in the order the trainer calls it ----------------------------------------------------------
    def micro_step(self, *, last: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-step's forward and backward; `last` is the one whose backward must sync."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def finish_grads(self) -> None:
        """Wait for the gradient reduction of this step to complete."""

    #: True when ranks hold disjoint pieces of the reduced gradient (ZeRO, FSDP), False when replicas (DDP)
    dp_sharded_grads = False
    #: True when a pipeline stage must run its part through the model's own call, where the form hooks in (FSDP2)
    hooks_on_model_call = False

    def stream_dtype(self) -> torch.dtype:
        """The residual stream's dtype: that of the parameters as the forward computes with them (the
        embedding's output with one stage). A later pipeline stage carries on in it from the compute-dtype
        activations it receives."""
        return next(self.module.parameters()).dtype

    def grad_shards(self) -> list[tuple[nn.Parameter, torch.Tensor, int]]:
        """(parameter, the reduced gradient of it that this rank holds, where that piece starts among the
        parameter's flattened elements), for every parameter with a gradient."""
        return [(p, p.grad, 0) for p in self.module.parameters() if p.grad is not None]

    def tied_embedding_grad(self) -> torch.Tensor:
        """After `finish_grads`: the part of the tied embedding's gradient this rank holds, laid out alike on
        the first and the last pipeline stage, which sum it (the head's and the embedding's contributions)."""
        return self.module.wte.weight.grad

    def local_grads(self) -> list[torch.Tensor]:
        """The gradient tensors this rank holds (to unscale in place)."""
        return [g for _, g, _ in self.grad_shards()]

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip to `max_norm` (inf: no clipping) by the global L2 norm, and return that norm.

        Squares are summed per rank, then over the dp group where ranks hold disjoint gradient pieces, and
        over the tp group for tensor-parallel shards (replicated parameters are counted once). Expert-parallel
        slices are disjoint over the ep group: where the dp group does not sum them already (replicas, DDP),
        the ep group does, so each expert counts once."""
        shards = self.grad_shards()
        device = self.ctx.device  # where collectives run; gradients may live elsewhere (parallel.offload=cpu)
        sums = torch.zeros(2, dtype=torch.float32, device=device)  # [tp-sharded, replicated across tp]
        expert_sum = torch.zeros(1, dtype=torch.float32, device=device)
        if shards:
            grad_device = shards[0][1].device
            norms = torch._foreach_norm([g for _, g, _ in shards], dtype=torch.float32)  # fp16 squares overflow
            squares = torch.stack(norms).float().pow(2)
            for i, (p, g, offset) in enumerate(shards):
                if replicated_rows(p) is not None:  # rows held by several tp ranks: count them once
                    squares[i] = replicated_rows_square_sum(p, g, offset)
                if is_pp_duplicate(p):  # the tied embedding, also held by the first stage
                    squares[i] = 0.0
            sharded, expert = self._masks(shards, grad_device)
            # (where, not a boolean index: indexing by a mask makes the host wait for the device)
            dense = torch.where(expert, 0.0, squares)
            sums = torch.stack([torch.where(sharded, dense, 0.0).sum(), torch.where(sharded, 0.0, dense).sum()])
            sums = sums.to(device)  # two floats to the collectives' device (NCCL reduces device tensors only)
            expert_sum = torch.where(expert, squares, 0.0).sum()[None].to(device)
        if self.ctx.ep > 1:
            if not self.dp_sharded_grads:  # replicas over dp/ep, disjoint experts over ep
                comm.all_reduce(expert_sum, self.ctx.ep_group, self.ctx.comm)
            sums = torch.cat([sums[:1], sums[1:] + expert_sum])  # (whole experts on each tp rank: tp-replicated)
        if self.dp_sharded_grads:
            comm.all_reduce(sums, self.ctx.dp_cp_group, self.ctx.comm)
        comm.all_reduce(sums, self.ctx.pp_group, self.ctx.comm)  # stages hold disjoint parameters
        tp_part = sums[:1].clone()
        comm.all_reduce(tp_part, self.ctx.tp_group, self.ctx.comm)
        norm = (tp_part[0] + sums[1]).sqrt()
        if shards and max_norm != float("inf"):
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_([g for _, g, _ in shards], coef.to(shards[0][1].device))
        return norm

    def _masks(self, shards: list[tuple[nn.Parameter, torch.Tensor, int]],
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Which of `shards` are tensor-parallel shards, and which expert-parallel slices, as bool tensors on the
        gradients' `device`, made once (the parameters with gradients are the same every step)."""
        key = tuple(id(p) for p, _, _ in shards)
        cached = getattr(self, "_sharded_mask", None)
        if cached is None or cached[0] != key:
            tp = torch.tensor([partition_dim(p) is not None for p, _, _ in shards], device=device)
            ep = torch.tensor([expert_slice(p) is not None for p, _, _ in shards], device=device)
            self._sharded_mask = cached = (key, (tp, ep))
        return cached[1]

    def step(self, lr: float, found_inf: torch.Tensor) -> torch.Tensor | None:
        """The optimizer step at learning rate `lr`, a no-op on the device where `found_inf` (0-dim float32)
        is nonzero. Returns the gradient norm when the engine computes it inside its step (DeepSpeed), else None."""
        set_lr(self.optimizer, lr)
        guarded_step(self.optimizer, found_inf)
        return None

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # -- checkpoints: full-shape tensors keyed by parameter name, so any layout can load them ---------------------
    # Only tensors are saved: DCP unpickles any other object on load. param_groups (hyperparameters) come from
    # the config instead, so they are left out and put back from the live optimizer.
    def checkpoint_state(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": {"state": optim_sd["state"]}}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        _, current = get_state_dict(self.model, self.optimizer)
        optim_sd = {"state": state["optim"]["state"], "param_groups": current["param_groups"]}
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=optim_sd)

    def save_engine_state(self, path: Path) -> None:
        """Every rank, inside the checkpoint folder being written (before its manifest): an engine's own files
        (DeepSpeed's), so the manifest covers them. Our forms keep everything in the DCP tensors."""

    def load_engine_state(self, path: Path, group: Any = None) -> None:
        """After `load_checkpoint_state`: put back what `save_engine_state` wrote into the checkpoint `path`.
        Collective over `group` (the checkpoint group) where an engine has files: a rank that cannot load its
        file stops every rank."""

    def no_optimizer_state_note(self, path: Path) -> str:
        """Why checkpoint `path` holds no optimizer state, for the one warning of a resume with a fresh optimizer
        ('' where it needs no words: a model converted from Hugging Face)."""
        return ""

    def last_step_skipped(self) -> torch.Tensor | None:
        """After `step`: 1.0 where an engine skipped the step by its own decision (DeepSpeed checks overflow
        inside its step), else 0.0; None when the trainer's `found_inf` decided it."""
        return None

    # -- accounting ------------------------------------------------------------------------------------------
    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds in parameters, gradients, fp32 master weights and optimizer states."""
        params = list(self.model.parameters())
        return {"params": tensor_bytes(params) + quantised_bytes(self.module),
                "grads": tensor_bytes(p.grad for p in params), "master": 0,
                "optimizer": tensor_bytes(optimizer_state_tensors(self.optimizer))}


Owners = dict[int, list[tuple[nn.Module, str]]]


def parameter_owners(model: nn.Module) -> Owners:
    """id(parameter) -> every (module, name) holding it (a tied one: two)."""
    owners: Owners = {}
    for module in model.modules():
        for pname, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, pname))
    return owners


def replace_meta_parameter(meta: nn.Parameter, data: torch.Tensor, owners: Owners) -> nn.Parameter:
    """A new Parameter over `data` in the place of meta-device `meta` in every module holding it (a meta tensor's
    storage cannot be swapped for a real one), with its marks (parallel/marks.py) and requires_grad."""
    p = nn.Parameter(data, requires_grad=meta.requires_grad)
    for attr, value in vars(meta).items():
        setattr(p, attr, value)
    for module, pname in owners[id(meta)]:
        module._parameters[pname] = p
    return p


def allocate_buffers(model: nn.Module, device: torch.device) -> None:
    """Allocate the buffers of a model built on the meta device (small: RoPE tables, ALiBi slopes, tp row
    indices, an MoE layer's expert bias) on `device` and recompute their values, its parameters left on meta."""
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty_like(b, device=device)
    model.reset_buffers()  # type: ignore[operator]
