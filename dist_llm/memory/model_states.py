"""Model states per rank (parameters, gradients, master weights, optimizer states), by two models.

* The ZeRO paper's (Rajbhandari et al. 2020), for a parameter count alone (`paper_model_states`): mixed
  precision keeps 2 bytes of fp16 parameters and 2 of gradients per parameter, and K = 12 bytes of optimizer
  states (a 4-byte fp32 master copy plus Adam's two 4-byte moments); stage 1 shards the K bytes over the dp
  ranks, stage 2 the gradients too, stage 3 everything.

* Our own implementation's, exactly (`predict`): each parameter's local shape after tensor parallelism
  (whole heads of the fused QKV, column rows, row columns, vocabulary rows), the blocks of this rank's
  pipeline stage, PEFT's frozen base (QLoRA's in 4-bit NF4), then what each data-parallel form holds:
    none / DDP / flat all-reduce   fp32 parameters and gradients, Adam moments (8 B) for trainable ones
    ZeRO-1/2 (ours)                a flat buffer of all trainable parameters in the compute dtype, bucket-
                                   padded to dp; gradients in parallel.grad_accum_dtype (fp32 by default):
                                   stage 1 a full buffer, stage 2 a 1/dp shard plus two reused bucket buffers
                                   in the compute dtype (at most two buckets in flight); fp32 master and
                                   moments for the rank's shard (master only in mixed runs)
    ZeRO-3 (FSDP2)                 fp32 parameter, gradient and moment shards: dim 0 split in dp chunks;
                                   gradients are reduce-scattered every micro-step, so no unsharded gradient
                                   outlives a micro-step's backward under accumulation
    DeepSpeed ZeRO-1/2             as DeepSpeed's own estimator counts them (`_deepspeed_zero_states`): 16-bit
                                   parameters, a gradient partition and its fp32 copy, fp32 master and moments
  plus PyTorch's 4-byte `step` tensor per optimizer tensor. Tests check these against the bytes a training
  rank really holds.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dist_llm.config import Config, ConfigError
from dist_llm.memory import moe as memory_moe
from dist_llm.memory.estimate import Estimate, _runs_on_gloo
from dist_llm.memory.params import _local_shape, _nf4_nbytes, _stage_params

PAPER_K = 12


# -- the ZeRO paper ---------------------------------------------------------------------------------------
def paper_model_states(params: float, dp: int, zero_stage: int, precision: str = "mixed") -> Estimate:
    """Model states per rank for `params` parameters, as the ZeRO paper counts them (no padding, no steps)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"--zero-stage: must be 0, 1, 2 or 3, got {zero_stage}")
    if precision not in ("mixed", "fp32"):
        raise ConfigError(f"--precision: must be mixed or fp32, got {precision}")
    p, g, master, opt = (2.0, 2.0, 4.0, 8.0) if precision == "mixed" else (4.0, 4.0, 0.0, 8.0)
    if zero_stage >= 1:
        master, opt = master / dp, opt / dp
    if zero_stage >= 2:
        g /= dp
    if zero_stage >= 3:
        p /= dp
    return Estimate(params_bytes=round(p * params), grads_bytes=round(g * params), master_bytes=round(master * params),
                    optimizer_bytes=round(opt * params))


# -- model states, exactly as our data-parallel forms hold them ------------------------------------------------
def model_state_bytes(cfg: Config, *, dp: int, tp: int, pp: int, pp_rank: int = 0) -> Estimate:
    """Bytes of model states on rank 0 of the given pipeline stage (dp rank 0, tp rank 0). With expert
    parallelism (moe.py) the rank holds E/ep experts, sharded by ZeRO over the dp/ep ranks that share them;
    the dense parameters over all dp ranks."""
    from dist_llm.parallel.data.zero import accum_dtype, rank_segments
    from dist_llm.precision import DTYPES

    p, t = cfg.parallel, cfg.train
    params = _stage_params(cfg, pp, pp_rank)
    ep = memory_moe.ep_degree(cfg)
    qlora = cfg.peft.method == "qlora"
    trainable: list[tuple[str, tuple[int, ...]]] = []
    frozen_bytes = 0
    for name, full_shape, requires_grad in params:
        shape = _local_shape(name, full_shape, cfg, tp)
        if ep > 1 and memory_moe.is_expert(name):
            shape = memory_moe.local_expert_shape(shape, ep)
        n = math.prod(shape)
        if requires_grad:
            trainable.append((name, shape))
        elif qlora and name.startswith("blocks.") and name.endswith(".weight") and len(full_shape) == 2:
            frozen_bytes += _nf4_nbytes(n)
        else:
            frozen_bytes += 4 * n
    mixed = t.precision != "fp32"
    est = Estimate()
    stage = p.zero_stage if dp > 1 or p.zero_stage == 3 else 0
    if p.backend == "deepspeed":
        if stage in (1, 2):
            return _deepspeed_zero_states(trainable, frozen_bytes, dp=dp, stage=stage, precision=t.precision)
        est.notes.append(f"parallel.backend=deepspeed at ZeRO-{stage}: our own form's counts, not DeepSpeed's "
                         "exact buffers")
    if stage in (1, 2) and p.backend == "native":
        compute = DTYPES[t.precision]
        size = torch.tensor([], dtype=compute).element_size()
        accum = torch.tensor([], dtype=accum_dtype(cfg)).element_size()
        est.params_bytes = frozen_bytes
        has_wte = any(n == "wte.weight" for n, _, _ in params)
        for group, group_dp in _zero_groups(trainable, dp, ep):  # (one plan each: dense over dp, experts dp/ep)
            buckets = zero_buckets(cfg, group, dp=group_dp, pp=pp, has_wte=has_wte)
            total = sum(b.numel for b in buckets)
            shard = total // group_dp
            segments = rank_segments(buckets, 0)
            est.params_bytes += total * size
            est.grads_bytes += (total if stage == 1 else shard) * accum
            est.master_bytes += 4 * shard if mixed else 0
            est.optimizer_bytes += 8 * sum(s.hi - s.lo for s in segments) + 4 * len(segments)
            est.temporary_bytes = max(est.temporary_bytes, _zero_in_flight_bytes(cfg, stage, buckets, size, accum))
        return est
    if stage == 3:  # FSDP2: dim 0 of every parameter split into dp chunks (experts: dp/ep), rank 0 the first
        def chunk(name: str, s: tuple[int, ...]) -> int:
            parts = dp // ep if memory_moe.is_expert(name) else dp
            return math.prod((-(-s[0] // parts), *s[1:])) if s else 1

        local = [chunk(n, s) for n, s in trainable]
        frozen = 0
        for name, full_shape, requires_grad in params:
            if not requires_grad:
                s = _local_shape(name, full_shape, cfg, tp)
                if qlora and name.startswith("blocks.") and name.endswith(".weight") and len(full_shape) == 2:
                    frozen += _nf4_nbytes(math.prod(s), dp=dp)  # (its NF4 storage is sharded too)
                else:
                    frozen += 4 * chunk(name, s)
        est.params_bytes = 4 * sum(local) + frozen
        est.grads_bytes = 4 * sum(local)
        est.optimizer_bytes = 8 * sum(local) + 4 * len(local)
        return est
    n_train = sum(math.prod(s) for _, s in trainable)
    est.params_bytes = 4 * n_train + frozen_bytes
    est.grads_bytes = 4 * n_train
    est.optimizer_bytes = 8 * n_train + 4 * len(trainable)
    return est


def _zero_groups(trainable: list[tuple[str, tuple[int, ...]]], dp: int,
                 ep: int) -> list[tuple[list[tuple[str, tuple[int, ...]]], int]]:
    """The (parameters, ranks sharing them) ZeRO-1/2 plans: one over dp, or at ep>1 the dense parameters over dp
    and the rank's experts over the dp/ep ranks of its expert-data-parallel group."""
    if ep == 1:
        return [(trainable, dp)]
    dense = [x for x in trainable if not memory_moe.is_expert(x[0])]
    experts = [x for x in trainable if memory_moe.is_expert(x[0])]
    return [(dense, dp), (experts, dp // ep)]


def zero_buckets(cfg: Config, trainable: list[tuple[str, tuple[int, ...]]], *, dp: int, pp: int,
                 has_wte: bool) -> list[Any]:
    """Our ZeRO-1/2's buckets (zero.plan_buckets) for these trainable (name, local shape)s, in registration order."""
    from types import SimpleNamespace

    from dist_llm.parallel.data.zero import bucket_numel, plan_buckets, tied_alone
    from dist_llm.precision import DTYPES

    fake = [(n, torch.empty(s, device="meta")) for n, s in trainable][::-1]
    alone = tied_alone(cfg, pp, SimpleNamespace(wte=True if has_wte else None))  # type: ignore[arg-type]
    return plan_buckets(fake, dp, bucket_numel(cfg.parallel.bucket_mb, DTYPES[cfg.train.precision]),
                        frozenset([alone] if alone else []))


def _deepspeed_zero_states(trainable: list[tuple[str, tuple[int, ...]]], frozen_bytes: int, *, dp: int, stage: int,
                           precision: str) -> Estimate:
    """DeepSpeed's ZeRO-1/2 (`DeepSpeedZeroOptimizer`), counted as its estimator
    `estimate_zero2_model_states_mem_needs` (no offload) counts them: the module's parameters in the compute
    dtype, whole; the reduced gradient partition in that dtype plus the fp32 copy of it that its step makes;
    the fp32 master partition and Adam's two moments; all but the parameters 1/dp. bf16: 2 + 18/dp bytes per
    parameter. Stage 1 holds the same at the step (it too keeps only its partition's gradients between
    micro-steps); both hold each parameter's whole gradient for a moment in backward, until its bucket is
    reduced. Its flat buffers pad each parameter group by fewer than dp elements, left out; Adam's `step` is
    one 4-byte tensor per group."""
    n = sum(math.prod(s) for _, s in trainable)
    size = 4 if precision == "fp32" else 2
    groups = len({len(s) >= 2 for _, s in trainable})  # decay (matrices) and no-decay (vectors), flattened
    return Estimate(params_bytes=size * n + frozen_bytes, grads_bytes=round((size + 4) * n / dp),
                    master_bytes=round(4 * n / dp), optimizer_bytes=round(8 * n / dp) + 4 * groups)


def _zero_in_flight_bytes(cfg: Config, stage: int, buckets: list[Any], size: int, accum: int) -> int:
    """ZeRO-1/2's transient gradient bytes during backward, beyond the model states. Stage 2: its two bucket
    buffers (compute dtype; bucket i in buffer i % 2, so at most two buckets in flight) and the gradients
    autograd holds for the bucket that is filling (at most the largest) before they move into a buffer.
    Stage 1 with a wider accumulator: one parameter's 16-bit gradient at a time (within a bucket). On gloo
    (CPU) each reduce-scatter in flight also has an all-to-all scratch of its bucket (parallel/comm.py; NCCL reduces
    in place): both buffers' worth for stage 2, one bucket (in the accumulator's dtype) for stage 1."""
    from dist_llm.parallel.data.zero import buffer_numels

    largest = max(b.numel for b in buckets)
    gloo = _runs_on_gloo(cfg)
    if stage == 2:
        buffers = sum(buffer_numels(buckets)) * size
        return buffers * (2 if gloo else 1) + largest * size
    return largest * (size if accum != size else 0) + (largest * accum if gloo else 0)
