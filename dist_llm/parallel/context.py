"""ParallelContext: who this process is in the job, built once from the config and the torchrun environment.

It is passed explicitly to everything that needs a rank, a group or the device; nothing reads a global
process group. A single process started without torchrun is a valid context of size 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dist_llm.config import Config, ConfigError


def pick_device(kind: str, local_rank: int) -> torch.device:
    """`train.device`: auto picks LOCAL_RANK's GPU when CUDA is present, else the CPU."""
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device: cuda was asked for but CUDA is not available")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


@dataclass
class ParallelContext:
    rank: int
    world_size: int
    local_rank: int
    dp: int
    tp: int
    pp: int
    device: torch.device
    initialized_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp * self.pp) if self.dp > 1 else 0

    def layout(self) -> dict[str, int]:
        return {"world_size": self.world_size, "dp": self.dp, "tp": self.tp, "pp": self.pp}

    @classmethod
    def from_config(cls, cfg: Config) -> "ParallelContext":
        env = os.environ
        world_size = int(env.get("WORLD_SIZE", "1"))
        rank = int(env.get("RANK", "0"))
        local_rank = int(env.get("LOCAL_RANK", "0"))
        p = cfg.parallel
        dp = p.dp or world_size // (p.tp * p.pp)
        if dp * p.tp * p.pp != world_size:
            raise ConfigError(
                f"parallel: dp*tp*pp = {dp}*{p.tp}*{p.pp} = {dp * p.tp * p.pp} does not match WORLD_SIZE={world_size}")
        if dp > 1:
            raise ConfigError(f"parallel.dp={dp} (WORLD_SIZE={world_size}) is not supported yet: this version "
                              "trains on one process")
        device = pick_device(cfg.train.device, local_rank)
        ctx = cls(rank=rank, world_size=world_size, local_rank=local_rank, dp=dp, tp=p.tp, pp=p.pp, device=device)
        if world_size > 1 and not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=timedelta(seconds=p.timeout_s))
            ctx.initialized_group = True
        return ctx

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def destroy(self) -> None:
        if self.initialized_group and dist.is_initialized():
            dist.destroy_process_group()
