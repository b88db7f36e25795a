"""Data parallelism: `parallel.zero_stage` 0 (DDP), 1 and 2 (ZeRO over flat buffers, written here), 3 (FSDP2);
or `parallel.backend=deepspeed`."""

from __future__ import annotations

from torch import nn

from dist_llm.config import Config
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.data.base import DataParallel


def build_data_parallel(model: nn.Module, cfg: Config, ctx: ParallelContext) -> DataParallel:
    """Wrap `model` for `parallel.zero_stage` over the context's dp group (the plain form at dp=1; stage 3
    still wraps in FSDP2 over a 1-rank dp dim when tp/pp ranks exist, so the code path stays the same)."""
    stage = cfg.parallel.zero_stage
    if cfg.parallel.backend == "deepspeed":
        from dist_llm.parallel.data.deepspeed import DeepSpeedDataParallel

        return DeepSpeedDataParallel(model, cfg, ctx)
    if ctx.dp == 1 and (stage != 3 or ctx.mesh is None):  # one process: nothing to shard over
        return DataParallel(model, cfg, ctx)
    if stage == 3:
        from dist_llm.parallel.data.fsdp import FSDPDataParallel

        return FSDPDataParallel(model, cfg, ctx)
    if stage == 0:
        from dist_llm.parallel.data.ddp import DDPDataParallel, FlatAllReduceDataParallel

        return FlatAllReduceDataParallel(model, cfg, ctx) if ctx.pp > 1 else DDPDataParallel(model, cfg, ctx)
    from dist_llm.parallel.data.zero import ZeroDataParallel

    return ZeroDataParallel(model, cfg, ctx, stage=stage)


__all__ = ["DataParallel", "build_data_parallel"]
