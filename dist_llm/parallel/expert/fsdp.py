"""ZeRO-3 (FSDP2) of MoE blocks: the units an MoE layer needs inside its block's unit.

FSDP2 wraps each block (parallel/data/fsdp.py); an MoE layer adds, before its block is wrapped:

  router   a unit of its own over dp that gathers in fp32 (no 16-bit param_dtype): the router runs in fp32 at
           every precision (model/moe.py `Router`), and a 16-bit gather would round its weights first.
  experts  at ep > 1 only: a unit over the expert-dp mesh (the dp/ep ranks that hold this rank's E/ep experts,
           ParallelContext.expert_dp_group), so a rank keeps (E/ep)/(dp/ep) experts' rows of the stack, never
           the layer's whole (E, ...) stack. At ep = 1 the experts stay in the block's unit, sharded over dp.

The experts' gradient divide factor. FSDP2 divides a unit's reduce-scatter sum by its mesh size by default:
right for the block's parameters, whose gradient on each of the dp ranks is that rank's loss gradient (each rank's
loss is its tokens' sum over 1/dp of the global batch's targets), so the mean over dp is the one-process gradient.
An expert's unsharded gradient on a rank already sums, through the all-to-all's backward, the loss gradients of
the ep ranks of its ep group (their tokens that chose its experts); the reduce-scatter over expert-dp sums those
over the dp/ep groups, so the sum holds every dp rank's loss gradient exactly once: dividing it by dp (not by
expert-dp = dp/ep, FSDP2's default) gives the mean over dp that the dense parameters get, the one-process
gradient (parallel/expert/grads.py derives the same for DDP). Over several expert-dp ranks
`set_force_sum_reduction_for_comms` keeps the collective a plain SUM followed by the division (else FSDP2 would
pass a PREMUL_SUM op, which NCCL has and gloo lacks). Over one (dp = ep) it stays off: torch 2.13's FSDP2 then
skips the collective and divides the copy by the factor, and with the option on would divide it a second time.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from dist_llm.model.moe import moe_layers
from dist_llm.parallel.context import ParallelContext


def expert_dp_mesh(ctx: ParallelContext) -> DeviceMesh:
    """A 1-D mesh over this rank's expert-dp group (the group the context made; no new communicator)."""
    return DeviceMesh.from_group(ctx.expert_dp_group, ctx.device.type, mesh_dim_names=("expert_dp",))


def shard_moe_units(model: nn.Module, ctx: ParallelContext, *, mp: MixedPrecisionPolicy,
                    **kwargs: Any) -> list[FSDPModule]:
    """`fully_shard` every MoE layer's router (fp32, over dp) and, at ep > 1, its experts (over expert-dp, their
    gradients divided by dp: the module docstring says why); `kwargs` are the block units' other options (mesh,
    offload, reshard_after_forward). Call before the blocks are wrapped. Returns the new units."""
    units: list[FSDPModule] = []
    layers = moe_layers(model)
    if not layers:
        return units
    fp32 = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    experts_mesh = expert_dp_mesh(ctx) if ctx.ep > 1 else None
    if experts_mesh is not None:
        # Without biases the experts return the grouped matmul's output as a view (model/moe.py `_ContiguousGrad`),
        # and FSDP2 warns that an in-place op on it would skip its pre-backward hook. The dispatch only reads it
        # (into a new tensor by index_copy, or a slice added out of place): nothing is written in place.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPLocalExperts\) returned a view")
    for layer in layers:
        units.append(fully_shard(layer.router, mp_policy=fp32, **kwargs))
        if experts_mesh is not None:
            unit = fully_shard(layer.experts, mp_policy=mp, **{**kwargs, "mesh": experts_mesh})
            unit.set_gradient_divide_factor(float(ctx.dp))
            unit.set_force_sum_reduction_for_comms(ctx.expert_dp > 1)
            units.append(unit)
    return units
