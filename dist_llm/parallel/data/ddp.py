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


# No annotations on `bucket` and the return: DDP compares them with the real classes, and this module's
# postponed annotations are strings.
def _allreduce_mean_hook(ctx: ParallelContext, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: average a gradient bucket (a dist.GradBucket) over the dp group, as DDP's default does,
    with the bytes counted. Returns a Future of the averaged buffer."""
    buffer = bucket.buffer()
    buffer.div_(ctx.dp)
    work = comm.all_reduce(buffer, ctx.dp_group, ctx.comm, async_op=True)
    if work is None:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buffer)
        return fut
    return work.get_future().then(lambda f: f.value()[0])


class DDPDataParallel(DataParallel):
    name = "ddp"

    def __init__(self, model: nn.Module, cfg: Config, ctx: ParallelContext) -> None:
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # gradient_as_bucket_view: grads live in DDP's buckets, not in a second copy
        wrapped = DDP(model, device_ids=device_ids, process_group=ctx.dp_group, gradient_as_bucket_view=True,
                      bucket_cap_mb=cfg.parallel.bucket_mb)
        wrapped.register_comm_hook(ctx, _allreduce_mean_hook)
        self.ddp = wrapped
        super().__init__(model, cfg, ctx)
        self.model = wrapped

    def micro_step(self, *, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last else self.ddp.no_sync()
