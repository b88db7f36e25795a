"""ParallelContext: who this process is in the job, built once from the config and the torchrun environment.

It is passed explicitly to everything that needs a rank, a group or the device; nothing reads a global
process group. A single process started without torchrun is a valid context of size 1 (no process group,
every group None, every collective a no-op).

Ranks are laid out on a DeviceMesh with dims ("dp", "cp", "pp", "tp"), tp innermost: consecutive ranks (one node's
GPUs under torchrun) share a tensor-parallel group, whose all-reduces on every layer need the fastest links;
pipeline stages come next (their point-to-point activations cross nodes), and data-parallel replicas are
the outermost split (their gradient reductions overlap with backward and tolerate the slower network).

Expert parallelism (`parallel.ep`) is carved out of dp: dp rank d is expert-parallel rank d % ep of the ep group
of dp ranks [d - d % ep, d - d % ep + ep), so an ep group's ranks are adjacent in dp (on one node when tp = pp = 1)
for its all-to-alls on every MoE layer; the expert-data-parallel group joins the dp ranks d' with d' % ep == d % ep,
which hold the same experts and reduce their gradients.

Context-parallel ranks (each holding a part of every sequence, parallel/context_parallel/) sit between dp and pp:
their ring of key/value blocks runs every layer, so they come closer than the replicas; parameters are
replicated over cp as over dp, and gradients are reduced over the two together (`dp_cp_group`).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dist_llm.config import Config, ConfigError, check_interleaved
from dist_llm.parallel.comm import CommStats

log = logging.getLogger("dist_llm")


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


def resolve_degrees(world_size: int, dp: int, tp: int, pp: int, *, global_batch_size: int = 0,
                    micro_batch_size: int = 1, cp: int = 1) -> tuple[int, int, int]:
    """(dp, tp, pp) with dp filled in when 0; raises ConfigError when they (with cp) do not multiply to the world
    size or the global batch does not split over the dp ranks."""
    if dp == 0:
        if world_size % (tp * pp * cp):
            named = f"cp*tp*pp = {cp}*{tp}*{pp}" if cp > 1 else f"tp*pp = {tp}*{pp}"
            raise ConfigError(f"parallel: WORLD_SIZE={world_size} is not divisible by {named}")
        dp = world_size // (tp * pp * cp)
    if dp * cp * tp * pp != world_size:
        named = f"dp*cp*tp*pp = {dp}*{cp}*{tp}*{pp}" if cp > 1 else f"dp*tp*pp = {dp}*{tp}*{pp}"
        raise ConfigError(f"parallel: {named} = {dp * cp * tp * pp} does not match WORLD_SIZE={world_size}")
    if global_batch_size % (micro_batch_size * dp):
        raise ConfigError(f"train.global_batch_size: {global_batch_size} is not divisible by "
                          f"train.micro_batch_size * dp = {micro_batch_size} * {dp}")
    return dp, tp, pp


#: how long first_failure waits for the slowest rank: local rank 0 tokenizing a large corpus the first time can
#: take hours, far past parallel.timeout_s, which bounds a training step's collectives
PATIENT_TIMEOUT = timedelta(hours=24)


def layout_degrees(cfg: Config, world_size: int) -> tuple[int, int, int]:
    """(dp, tp, pp) of `cfg` at `world_size` ranks, with the rules that need dp known (expert parallelism's
    carve-out of dp, interleaving's micro-batch count): checked before a launcher starts any process, and again
    by each rank."""
    p = cfg.parallel
    dp, tp, pp = resolve_degrees(world_size, p.dp, p.tp, p.pp, global_batch_size=cfg.train.global_batch_size,
                                 micro_batch_size=cfg.train.micro_batch_size, cp=p.cp)
    if dp % p.ep:
        raise ConfigError(f"parallel.ep: {p.ep} does not divide dp={dp} (WORLD_SIZE={world_size} / (cp*tp*pp))")
    check_interleaved(cfg, dp)
    return dp, tp, pp


def init_process_group(backend: str, timeout: timedelta, device: torch.device) -> None:
    """The default process group from torchrun's environment.

    torchrun's agent keeps one TCPStore for all its restarts (`--max-restarts`), so a restarted worker would
    read the previous attempt's addresses, of dead processes, and fail to connect (pytorch/pytorch#135712).
    On one node the restart count is the same for every worker and names a fresh key prefix. Across nodes
    it is not (a healthy node re-forms without counting a restart): there launch/ sets
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which gives every attempt a new store."""
    env = os.environ
    device_id = device if device.type == "cuda" else None
    attempt = env.get("TORCHELASTIC_RESTART_COUNT")
    shared_store = attempt is not None and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    one_node = env.get("GROUP_WORLD_SIZE", "1") == "1"
    if not (shared_store and one_node):
        if shared_store and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and env.get("RANK") == "0":
            log.warning("torchrun shares its store between restarts on %s nodes: a restart may fail to connect; "
                        "set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun (launch/ does)", env["GROUP_WORLD_SIZE"])
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        return
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore(f"dist_llm/attempt_{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device_id)


@dataclass
class ParallelContext:
    rank: int
    world_size: int
    local_rank: int
    dp: int
    tp: int
    pp: int
    device: torch.device
    ep: int = 1
    mesh: DeviceMesh | None = None
    comm: CommStats = field(default_factory=CommStats)
    owns_group: bool = False
    #: the first and last pipeline stages of this rank's (dp, tp) position, for the tied embedding's gradient
    embedding_group: dist.ProcessGroup | None = None
    #: every rank's hostname, by rank
    hosts: list[str] = field(default_factory=list)
    #: a gloo group of every rank for small host-side agreements (whether to stop, peak memory): a collective on
    #: CPU tensors that never makes the host wait for the GPU. The default group when that is gloo already.
    cpu_group: dist.ProcessGroup | None = None
    patient_group: dist.ProcessGroup | None = None  # (first_failure's: see PATIENT_TIMEOUT)
    #: the ep ranks of this rank's dp row that hold different experts (all-to-all of tokens); None when ep = 1
    ep_group: dist.ProcessGroup | None = None
    #: the dp ranks that hold this rank's experts (their gradient reduction); the dp group when ep = 1
    expert_dp_group: dist.ProcessGroup | None = None
    #: context-parallel degree: ranks that each hold a part of every sequence (parallel/context_parallel/)
    cp: int = 1
    #: the dp x cp ranks of this rank's (pp, tp) position: where replicated gradients are reduced (None at cp=1:
    #: the dp group)
    dp_cp_process_group: dist.ProcessGroup | None = None

    # -- coordinates ------------------------------------------------------------------------------------------
    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _coord(self, dim: str) -> int:
        return 0 if self.mesh is None else self.mesh.get_local_rank(dim)

    @property
    def dp_rank(self) -> int:
        return self._coord("dp")

    @property
    def ep_rank(self) -> int:
        """This rank's place in its ep group: it holds experts [ep_rank * E/ep, (ep_rank + 1) * E/ep)."""
        return self.dp_rank % self.ep

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert: dp / ep."""
        return self.dp // self.ep

    @property
    def tp_rank(self) -> int:
        return self._coord("tp")

    @property
    def pp_rank(self) -> int:
        return self._coord("pp")

    @property
    def cp_rank(self) -> int:
        return self._coord("cp") if self.cp > 1 else 0

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same parameters and reduce their gradients together: dp x cp."""
        return self.dp * self.cp

    @property
    def dp_cp_rank(self) -> int:
        return self.dp_rank * self.cp + self.cp_rank

    def _group(self, dim: str) -> dist.ProcessGroup | None:
        return None if self.mesh is None else self.mesh.get_group(dim)

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self._group("dp")

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return self._group("tp")

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self._group("pp")

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        return self._group("cp") if self.cp > 1 else None

    @property
    def dp_cp_group(self) -> dist.ProcessGroup | None:
        """The group gradients of replicated parameters are reduced over (the dp group at cp=1)."""
        return self.dp_cp_process_group if self.cp > 1 else self.dp_group

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        return None if self.mesh is None else self.mesh["dp"]

    @property
    def dp_cp_mesh(self) -> DeviceMesh | None:
        """The dp x cp ranks as one mesh dim (FSDP2 shards over it); the dp mesh at cp=1. The first use at cp>1
        creates its groups: a collective, every rank at the same point."""
        if self.mesh is None or self.cp == 1:
            return self.dp_mesh
        return self.mesh["dp", "cp"]._flatten("dp_cp")

    def pp_neighbours(self) -> tuple[int | None, int | None]:
        """Global ranks of the previous and next pipeline stage at this rank's (dp, tp) position."""
        if self.pp == 1:
            return None, None
        ranks = dist.get_process_group_ranks(self.pp_group)
        r = self.pp_rank
        return (ranks[r - 1] if r > 0 else None), (ranks[r + 1] if r < self.pp - 1 else None)

    @property
    def pp_last_rank(self) -> int:
        """Global rank of the last pipeline stage at this rank's (dp, tp) position (this rank when pp=1)."""
        return dist.get_process_group_ranks(self.pp_group)[-1] if self.pp > 1 else self.rank

    @property
    def backend(self) -> str:
        return dist.get_backend() if dist.is_initialized() else "none"

    def placement(self) -> list[str]:
        """The mesh as it fell on the hosts: per host, its ranks and their (dp, pp, tp) coordinates. Consecutive
        ranks (one node's processes under torchrun) share a tp group; dp is the outermost split."""
        if self.world_size == 1:
            return []
        grid = torch.arange(self.world_size).reshape(self.dp, self.cp, self.pp, self.tp)
        coords: dict[int, tuple[int, ...]] = {
            int(grid[d, c, p, t]): ((d, c, p, t) if self.cp > 1 else (d, p, t))
            for d in range(self.dp) for c in range(self.cp) for p in range(self.pp) for t in range(self.tp)}
        by_host: dict[str, list[int]] = {}
        for rank, host in enumerate(self.hosts):
            by_host.setdefault(host, []).append(rank)
        where = ", at each (pp, tp) position" if self.world_size > self.dp * self.cp else ""
        ep = (f"; ep={self.ep} inside dp: expert groups (dp ranks) "
              + ", ".join(str(list(range(d, d + self.ep))) for d in range(0, self.dp, self.ep)) + where
              ) if self.ep > 1 else ""
        if self.cp > 1:
            lines = [f"mesh (dp={self.dp}, cp={self.cp}, pp={self.pp}, tp={self.tp}{ep}) over {len(by_host)} host(s), "
                     "ranks as (dp, cp, pp, tp):"]
        else:
            lines = [f"mesh (dp={self.dp}, pp={self.pp}, tp={self.tp}{ep}) over {len(by_host)} host(s), ranks as (dp, pp, tp):"]
        for host, ranks in by_host.items():
            shown = ", ".join(f"{r}{coords[r]}" for r in ranks[:16]) + (" ..." if len(ranks) > 16 else "")
            lines.append(f"  {host}: {shown}")
        return lines

    def layout(self) -> dict[str, int]:
        return {"world_size": self.world_size, "dp": self.dp, "tp": self.tp, "pp": self.pp,
                **({"cp": self.cp} if self.cp > 1 else {}), **({"ep": self.ep} if self.ep > 1 else {})}

    # -- construction -----------------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: Config) -> "ParallelContext":
        """Read RANK/WORLD_SIZE/LOCAL_RANK (torchrun's), check the degrees, initialise the process group
        (NCCL on CUDA, gloo on CPU) unless one exists, and build the mesh."""
        env = os.environ
        world_size = int(env.get("WORLD_SIZE", "1"))
        rank = int(env.get("RANK", "0"))
        local_rank = int(env.get("LOCAL_RANK", "0"))
        p = cfg.parallel
        cp = p.cp
        dp, tp, pp = layout_degrees(cfg, world_size)
        device = pick_device(cfg.train.device, local_rank)
        ctx = cls(rank=rank, world_size=world_size, local_rank=local_rank, dp=dp, tp=tp, pp=pp, device=device,
                  ep=p.ep, cp=cp)
        if world_size > 1:
            if not dist.is_initialized():
                backend = "nccl" if device.type == "cuda" else "gloo"
                init_process_group(backend, timedelta(seconds=p.timeout_s), device)
                ctx.owns_group = True
            ctx.cpu_group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
            # (formed now, while every rank is here: formed later, a rank that died before it would leave the
            # others in the store's wait for the whole PATIENT_TIMEOUT, not see its connection close)
            ctx.patient_group = dist.new_group(backend="gloo", timeout=PATIENT_TIMEOUT)
            ctx.mesh = init_device_mesh(device.type, (dp, cp, pp, tp), mesh_dim_names=("dp", "cp", "pp", "tp"))
            ctx.hosts = [""] * world_size
            dist.all_gather_object(ctx.hosts, socket.gethostname())
            # every rank creates every group, in the same order, and keeps its own
            grid = torch.arange(world_size).reshape(dp, cp, pp, tp)
            if pp > 1:
                for d in range(dp):
                    for c in range(cp):
                        for t in range(tp):
                            pair = [int(grid[d, c, 0, t]), int(grid[d, c, -1, t])]
                            group = dist.new_group(pair)
                            if rank in pair:
                                ctx.embedding_group = group
            if cp > 1:  # dp x cp flattened, per (pp, tp) position (ranks in (dp, cp) order)
                for s in range(pp):
                    for t in range(tp):
                        ranks = [int(r) for r in grid[:, :, s, t].flatten()]
                        group = dist.new_group(ranks)
                        if rank in ranks:
                            ctx.dp_cp_process_group = group
            ctx.expert_dp_group = ctx.dp_group
            if ctx.ep > 1:
                ctx._expert_groups()
        return ctx

    def _expert_groups(self) -> None:
        """The ep groups (runs of ep adjacent dp ranks) and the expert-dp groups (dp ranks equal modulo ep), at
        every (cp, pp, tp) position; every rank creates every group, in the same order, and keeps its own."""
        grid = torch.arange(self.world_size).reshape(self.dp, self.cp, self.pp, self.tp)
        for c, p, t in itertools.product(range(self.cp), range(self.pp), range(self.tp)):
            column = [int(r) for r in grid[:, c, p, t]]  # the dp group at (c, p, t)
            for start in range(0, self.dp, self.ep):
                ranks = column[start : start + self.ep]
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self.ep_group = group
            for first in range(self.ep):
                ranks = column[first :: self.ep]
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self.expert_dp_group = group

    # -- whole-job operations ------------------------------------------------------------------------------------
    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def first_failure(self, failure: Exception | None) -> Exception | None:
        """Every rank's `failure` (None: it went well) exchanged: the lowest rank's, or None when every rank's
        went well. A step only some ranks take (local rank 0 prepares the data) ends alike on all: a rank that
        failed alone would leave the others waiting in the next collective until its connection closes, and
        the launcher would report that broken connection, not the cause. (Pickled over the gloo group.)"""
        if self.world_size == 1 or not dist.is_initialized():
            return failure
        every: list[Exception | None] = [None] * self.world_size
        dist.all_gather_object(every, failure, group=self.patient_group)
        return next((f for f in every if f is not None), None)

    def destroy(self) -> None:
        """Tear down the process group this context created (DeepSpeed ZeRO-2 offload aborts at exit without it)."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
