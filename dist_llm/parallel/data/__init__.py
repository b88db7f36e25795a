"""Data parallelism: `parallel.zero_stage` 0 (DDP), 1 and 2 (ZeRO over flat buffers, written here), 3 (FSDP2);
or `parallel.backend=deepspeed`."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Callable

from torch import nn

from dist_llm.config import Config, ConfigError, zero_draws_from_meta
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.data.base import DataParallel, allocate_buffers

if TYPE_CHECKING:
    from dist_llm.parallel.data.deepspeed_shards import Fill


def uses_fsdp(cfg: Config, ctx: ParallelContext) -> bool:
    """Whether the data-parallel form is FSDP2: ZeRO-3 on the native backend, with a dp mesh to shard over."""
    return cfg.parallel.backend == "native" and cfg.parallel.zero_stage == 3 and not (ctx.dp == 1 and ctx.mesh is None)


def builds_flat_on_meta(cfg: Config, ctx: ParallelContext) -> bool:
    """`zero_draws_from_meta` where the ZeRO form shards (dp x cp > 1; the plain form takes a materialised model)."""
    return ctx.dp_cp > 1 and zero_draws_from_meta(cfg)


def builds_on_meta(cfg: Config, ctx: ParallelContext) -> bool:
    """Whether the data-parallel form takes the model on the meta device and materialises only what this rank
    keeps: FSDP2 and DeepSpeed's ZeRO-3 (deepspeed_shards.build_partitioned) their shards, native ZeRO-1/2 its flat
    buffer without the fp32 model (`builds_flat_on_meta`)."""
    from dist_llm.parallel.data.deepspeed_shards import builds_partitioned

    return uses_fsdp(cfg, ctx) or builds_partitioned(cfg) or builds_flat_on_meta(cfg, ctx)


def _check_every_stage_trains(cfg: Config, ctx: ParallelContext) -> None:
    """Under a pipeline, PEFT may leave a stage nothing to train (LoRA on the experts alone, and a stage of
    dense blocks): its optimizer and gradient buffers would be built over no tensor. Refused in one line, on
    every rank alike (each checks every stage from the config: none is left waiting in a collective)."""
    from dist_llm.memory import _stage_params

    if ctx.pp == 1:
        return
    for stage in range(ctx.pp):
        if not any(trains for _, _, trains in _stage_params(cfg, ctx.pp, stage)):
            raise ConfigError(f"peft.targets={list(cfg.peft.targets)}: pipeline stage {stage} of "
                              f"parallel.pp={ctx.pp} holds no tensor they name, so it has nothing to train; add a "
                              f"target its blocks have, or cut the stages (parallel.pp, model.moe_every) so that "
                              f"each holds one")


def build_data_parallel(model: nn.Module, cfg: Config, ctx: ParallelContext, *,
                        materialize: Callable[[nn.Module], None] | None = None,
                        fill_each: Callable[[], AbstractContextManager[Fill]] | None = None,
                        draw: Callable[[str], None] | None = None) -> DataParallel:
    """Wrap `model` for `parallel.zero_stage` over the context's dp group (the plain form at dp=1; stage 3
    still wraps in FSDP2 over a 1-rank dp dim when tp/pp ranks exist, so the code path stays the same).

    `materialize(model)` allocates and initialises a model built on the meta device: FSDP2 calls it between
    `fully_shard` and building the optimizer (so only shards are allocated); the other forms, which hold
    the parameters whole, call it before wrapping. DeepSpeed's ZeRO-3 instead takes one parameter at a time:
    `fill_each()` opens what fills each (a random draw, a reader of model.init_from) for the build. Native
    ZeRO-1/2 from a random start (`builds_flat_on_meta`) allocates the buffers, then `draw(name)` initialises each
    parameter once the form has allocated it (one at a time, in fp32, beside its flat buffer)."""
    stage = cfg.parallel.zero_stage
    if cfg.peft.method != "none":  # (every form: FSDP2's and DeepSpeed's optimizers need a tensor as ours do)
        _check_every_stage_trains(cfg, ctx)
    if uses_fsdp(cfg, ctx):
        from dist_llm.parallel.data.fsdp import FSDPDataParallel

        return FSDPDataParallel(model, cfg, ctx, materialize=materialize)
    if cfg.parallel.backend == "deepspeed":  # (at ZeRO-3 it partitions each parameter as it materialises it)
        from dist_llm.parallel.data.deepspeed import DeepSpeedDataParallel

        return DeepSpeedDataParallel(model, cfg, ctx, materialize=materialize, fill_each=fill_each)
    flat_on_meta = materialize is not None and builds_flat_on_meta(cfg, ctx)
    if flat_on_meta:
        if draw is None:
            raise ValueError("a ZeRO-1/2 build from the meta device needs draw (each parameter's initial values)")
        allocate_buffers(model, ctx.device)
    elif materialize is not None:
        materialize(model)
    if ctx.dp_cp == 1 and (stage != 3 or ctx.mesh is None):  # one process: nothing to shard over
        return DataParallel(model, cfg, ctx)
    if stage == 0:
        from dist_llm.parallel.data.ddp import DDPDataParallel, FlatAllReduceDataParallel

        return FlatAllReduceDataParallel(model, cfg, ctx) if ctx.pp > 1 else DDPDataParallel(model, cfg, ctx)
    if ctx.ep > 1:  # the experts in ZeRO buffers of their own, over the expert-dp group
        from dist_llm.parallel.expert.zero import ExpertZeroDataParallel

        form: DataParallel = ExpertZeroDataParallel(model, cfg, ctx, stage=stage, draw=draw if flat_on_meta else None)
    else:
        from dist_llm.parallel.data.zero import ZeroDataParallel

        form = ZeroDataParallel(model, cfg, ctx, stage=stage, draw=draw if flat_on_meta else None)
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:  # (a tensor no ZeRO form holds: a frozen one, which builds_flat_on_meta rules out)
        raise RuntimeError(f"ZeRO-{stage} meta build left {left[:3]} unallocated")
    return form


__all__ = ["DataParallel", "build_data_parallel", "builds_flat_on_meta", "builds_on_meta", "uses_fsdp"]
