"""ZeRO stage 0: PyTorch DistributedDataParallel, its all-reduce routed through comm.py for accounting."""

from __future__ import annotations

import contextlib
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_llm.config import Config
from dist_llm.parallel import comm
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.data.base import DataParallel
from dist_llm.parallel.expert.grads import expert_parameters, reduce_expert_grads
from dist_llm.parallel.marks import expert_slice


# No annotations on `bucket` and the return: DDP compares them with the real classes, and this module's
# postponed annotations are strings.
def _allreduce_mean_hook(ctx: ParallelContext, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: average a gradient bucket (a dist.GradBucket) over the dp (x cp) group, as DDP's default
    does, with the bytes counted. Returns a Future of the averaged buffer."""
    buffer = bucket.buffer()
    buffer.div_(ctx.dp_cp)
    work = comm.all_reduce(buffer, ctx.dp_cp_group, ctx.comm, async_op=True)
    if work is None:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buffer)
        return fut
    return work.get_future().then(lambda f: f.value()[0])


class DDPDataParallel(DataParallel):
    name = "ddp"

    def __init__(self, model: nn.Module, cfg: Config, ctx: ParallelContext) -> None:
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # expert-parallel slices differ across the dp group: DDP leaves them, finish_grads reduces them over
        # the ranks that hold the same experts. The frozen ones too (a PEFT run's base experts): DDP would
        # broadcast dp rank 0's slice over every rank's own at construction.
        experts = expert_parameters(model)
        self.expert_params = [p for _, p in experts]
        sliced = [n for n, p in model.named_parameters() if expert_slice(p) is not None]
        if sliced:
            DDP._set_params_and_buffers_to_ignore_for_model(model, sliced)
        # LoRA on the experts alone (peft.targets experts_*) leaves DDP no tensor to reduce, and DDP refuses to
        # wrap such a module: every trained tensor is an expert slice, which finish_grads reduces. No DDP then
        # (every rank of the dp group sees the same model, so all skip it alike and none waits in its collectives)
        ignored = set(sliced)
        self.ddp: DDP | None = None
        if any(p.requires_grad for n, p in model.named_parameters() if n not in ignored):
            # gradient_as_bucket_view: grads live in DDP's buckets, not in a second copy
            # (the parameters are replicated over dp x cp: context-parallel ranks reduce their gradients too)
            self.ddp = DDP(model, device_ids=device_ids, process_group=ctx.dp_cp_group, gradient_as_bucket_view=True,
                           bucket_cap_mb=cfg.parallel.bucket_mb)
            self.ddp.register_comm_hook(ctx, _allreduce_mean_hook)
        super().__init__(model, cfg, ctx)
        if self.ddp is not None:
            self.model = self.ddp

    def micro_step(self, *, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last or self.ddp is None else self.ddp.no_sync()

    def finish_grads(self) -> None:
        # (fp32 gradients: parallel.bucket_mb of them per all-reduce)
        reduce_expert_grads(self.expert_params, self.ctx, max(1, int(self.cfg.parallel.bucket_mb * 2**20 / 4)))


class FlatAllReduceDataParallel(DataParallel):
    """ZeRO stage 0 under a pipeline: gradients accumulate in one flat buffer over all micro-batches, and
    `finish_grads` all-reduces it in buckets of `parallel.bucket_mb`.

    DDP cannot be used there: it decides in forward whether the next backward syncs, and a 1F1B stage runs
    the last micro-batch's forward before the earlier micro-batches' backwards. Reducing once after the
    schedule moves the same bytes as DDP's last-micro-step all-reduce, without the overlap."""

    name = "ddp-flat"

    def __init__(self, model: nn.Module, cfg: Config, ctx: ParallelContext) -> None:
        # expert-parallel slices differ across dp: outside the flat buffer, reduced over their expert-dp group
        self.expert_params = [p for _, p in expert_parameters(model)]
        experts = {id(p) for p in self.expert_params}
        params = [p for p in model.parameters() if p.requires_grad and id(p) not in experts]
        # (with LoRA on the experts alone no dense tensor trains: an empty buffer, its all-reduce loop issues
        # nothing on any rank of the group, which holds the same stage)
        dtype = next((p.dtype for p in [*params, *self.expert_params]), torch.float32)
        self.flat_grads = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=ctx.device)
        at = 0
        for p in params:  # every .grad a view of the flat buffer, so backward accumulates straight into it
            p.grad = self.flat_grads[at : at + p.numel()].view_as(p)
            at += p.numel()
        self.bucket_numel = max(1, int(cfg.parallel.bucket_mb * 2**20 / self.flat_grads.element_size()))
        super().__init__(model, cfg, ctx)

    def finish_grads(self) -> None:
        self.flat_grads.div_(self.ctx.dp_cp)  # divide before summing, as DDP does: an fp16 sum could overflow
        for lo in range(0, self.flat_grads.numel(), self.bucket_numel):
            comm.all_reduce(self.flat_grads[lo : lo + self.bucket_numel], self.ctx.dp_cp_group, self.ctx.comm)
        reduce_expert_grads(self.expert_params, self.ctx, self.bucket_numel)

    def zero_grad(self) -> None:
        self.flat_grads.zero_()  # keep the views: set_to_none would detach .grad from the buffer
        for p in self.expert_params:
            p.grad = None
