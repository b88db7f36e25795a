"""ZeRO stages 1 and 2, written here over flat buffers (Rajbhandari et al. 2020).

Layout. The parameters, in reverse registration order (about the order backward produces their
gradients), are packed into buckets of about `parallel.bucket_mb`; each bucket is padded to a multiple of
dp, and dp rank r owns slice r of every bucket. Every parameter becomes a view into one flat buffer, so a
bucket's all-gather writes straight into the model.

  stage 1: gradients accumulate into a flat buffer; after the last micro-step each bucket is reduce-scattered
           in place (in the accumulation dtype), so rank r's slice holds the mean gradient of its shard.
  stage 2: no full gradient buffer. A hook on each parameter notices when a bucket's gradients are all
           computed, copies them into one of two reused bucket buffers, frees them, and starts that bucket's
           reduce-scatter (in the compute dtype) while backward goes on; a third bucket first waits for the
           older of the two, so at most two buckets are in flight. The results accumulate into a gradient
           shard of 1/dp of the parameters.

Accumulation dtype (`parallel.grad_accum_dtype`, fp32 by default). In bf16/fp16 runs the parameters, so
autograd's gradients, are 16-bit; adding 16 micro-steps' gradients in 16 bits rounds every partial sum (bf16
keeps 8 significant bits), so the buffers that outlive a micro-step (stage 1's flat buffer, stage 2's shard)
are fp32 unless asked otherwise, as DDP, FSDP2 and DeepSpeed's bf16 path do. Stage 1 then adds each 16-bit
gradient into the fp32 buffer from a hook and frees it; stage 2 adds each reduced 16-bit bucket into its
fp32 shard.

Each rank's AdamW steps only its shard: fp32 master weights (in bf16/fp16 runs; in fp32 runs the shard of
the parameters itself) and moments for 1/dp of the parameters. Then every bucket is all-gathered.
Reduce-scatter plus all-gather moves the same bytes as one all-reduce.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from dist_llm.config import Config
from dist_llm.parallel import comm
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.shards import range_rectangles
from dist_llm.parallel.tensor.checkpoint import TensorParallelState
from dist_llm.parallel.data.base import (DataParallel, optimizer_state_tensors, parameter_owners, quantised_bytes,
                                        replace_meta_parameter, tensor_bytes)
from dist_llm.optim import adamw, decays, guarded_step, set_lr
from dist_llm.precision import DTYPES



@dataclass
class Entry:
    name: str
    param: nn.Parameter
    offset: int  # in the flat buffer
    numel: int


@dataclass
class Bucket:
    index: int
    start: int  # in the flat buffer
    numel: int  # padded to a multiple of dp
    shard_numel: int  # numel / dp: each rank's slice
    shard_start: int  # where this bucket's slice sits in a rank's shard
    entries: list[Entry] = field(default_factory=list)


@dataclass
class Segment:
    """The part of one parameter inside this rank's slice of one bucket, in flat-buffer coordinates."""

    entry: Entry
    bucket: Bucket
    lo: int
    hi: int

    def shard_range(self, rank: int) -> tuple[int, int]:
        base = self.bucket.start + rank * self.bucket.shard_numel
        return self.bucket.shard_start + self.lo - base, self.bucket.shard_start + self.hi - base


def plan_buckets(named_params: list[tuple[str, nn.Parameter]], dp: int, bucket_numel: int,
                 alone: frozenset[str] = frozenset()) -> list[Bucket]:
    """Pack parameters (in the given order) into buckets of at least `bucket_numel`, each padded to dp;
    the parameters named in `alone` get a bucket of their own."""
    buckets: list[Bucket] = []
    offset = shard_offset = 0
    current: list[tuple[str, nn.Parameter]] = []

    def close() -> None:
        nonlocal offset, shard_offset, current
        size = sum(p.numel() for _, p in current)
        padded = -(-size // dp) * dp
        b = Bucket(index=len(buckets), start=offset, numel=padded, shard_numel=padded // dp, shard_start=shard_offset)
        at = offset
        for name, p in current:
            b.entries.append(Entry(name, p, at, p.numel()))
            at += p.numel()
        buckets.append(b)
        offset += padded
        shard_offset += padded // dp
        current = []

    for name, p in named_params:
        if name in alone and current:
            close()
        current.append((name, p))
        if name in alone or sum(q.numel() for _, q in current) >= bucket_numel:
            close()
    if current:
        close()
    return buckets


def rank_segments(buckets: list[Bucket], rank: int) -> list[Segment]:
    """The pieces of parameters that fall in `rank`'s slice of each bucket (one optimizer tensor each)."""
    out = []
    for b in buckets:
        lo, hi = b.start + rank * b.shard_numel, b.start + (rank + 1) * b.shard_numel
        for e in b.entries:
            s, t = max(lo, e.offset), min(hi, e.offset + e.numel)
            if s < t:
                out.append(Segment(e, b, s, t))
    return out


def bucket_numel(bucket_mb: float, dtype: torch.dtype) -> int:
    return max(1, int(bucket_mb * 2**20 / torch.tensor([], dtype=dtype).element_size()))


def buffer_numels(buckets: list[Bucket]) -> tuple[int, int]:
    """ZeRO-2's two bucket buffers: bucket i passes through buffer i % 2, so each is as long as its largest."""
    return (max((b.numel for b in buckets[0::2]), default=0), max((b.numel for b in buckets[1::2]), default=0))


def accum_dtype(cfg: Config) -> torch.dtype:
    """The dtype ZeRO-1/2 accumulate gradients in (config.py allows 16 bits only in a run of that precision)."""
    return DTYPES[cfg.parallel.grad_accum_dtype]


def tied_alone(cfg: Config, pp: int, model: nn.Module) -> str | None:
    """Under a pipeline the tied embedding lives on the first and the last stage, whose buckets otherwise
    differ; alone in its bucket it is sharded alike on both, so its gradient shards can be summed."""
    return "wte.weight" if pp > 1 and cfg.model.tie_embeddings and getattr(model, "wte", None) is not None else None


@dataclass
class ZeroPart:
    """Which parameters one ZeRO form holds and over which ranks it shards them (expert parallelism keeps the
    experts in a form of their own over the expert-dp group): `names`, the group with its size and this rank's
    place in it, and what the summed gradients are divided by."""

    names: frozenset[str]
    group: Any
    size: int
    rank: int
    divisor: int


class ZeroDataParallel(DataParallel):
    def __init__(self, model: nn.Module, cfg: Config, ctx: ParallelContext, *, stage: int,
                 part: ZeroPart | None = None, draw: Callable[[str], None] | None = None) -> None:
        self.stage = stage
        self.name = f"zero{stage}"
        self.cfg, self.ctx = cfg, ctx
        self.module = self.model = model
        # sharded over dp x cp: the parameters are replicated over both (ctx.dp_cp_group is the dp group at cp=1)
        self.dp, self.rank, self.group = ctx.dp_cp, ctx.dp_cp_rank, ctx.dp_cp_group
        self.divisor = ctx.dp_cp  # the replicas' gradients are averaged
        if part is not None:  # expert parameters under ep (cp = 1 there)
            self.dp, self.rank, self.group, self.divisor = part.size, part.rank, part.group, part.divisor
        device = ctx.device
        self.mixed = cfg.train.precision != "fp32"
        self.param_dtype = DTYPES[cfg.train.precision]

        named = [(n, p) for n, p in model.named_parameters()
                 if p.requires_grad and (part is None or n in part.names)][::-1]
        self.tied = tied_alone(cfg, ctx.pp, model)
        self.buckets = plan_buckets(named, self.dp, bucket_numel(cfg.parallel.bucket_mb, self.param_dtype),
                                    frozenset([self.tied] if self.tied else []))
        self.entries = [e for b in self.buckets for e in b.entries]
        total = sum(b.numel for b in self.buckets)
        self.shard_numel = total // self.dp

        # Parameters become views of one flat buffer, in the compute dtype (16-bit in mixed precision), and in mixed
        # precision the fp32 masters (in fp32 runs the parameter shard is its own master) are taken from them. In
        # two passes, so that the fp32 model and the whole buffer are never held at once (6 bytes a parameter on an
        # accelerator, where `empty` takes the whole buffer at once): first each parameter gives this rank's
        # segments of it to the masters and is cast on its own, its fp32 storage freed; then the buffer is made and
        # each is copied in and its own storage freed. The peak is the model in fp32, or in 16 bits twice
        # (memory/transients.py counts it). On the CPU the pages of `empty` become resident only as they are
        # written, so there the buffer adds about one parameter at a time; only its padding is zeroed. A model
        # built on the meta device (`draw` given) skips the fp32 model: each parameter is drawn on its own.
        self.segments = rank_segments(self.buckets, self.rank)
        self.master = torch.zeros(self.shard_numel, dtype=torch.float32, device=device) if self.mixed else None
        if draw is not None:
            self._build_from_meta(draw, total, device)
        else:
            self._build_from_model(total, device)

        self.accum_dtype = accum_dtype(cfg)
        self.flat_grads: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        if stage == 1:
            self.flat_grads = torch.zeros(total, dtype=self.accum_dtype, device=device)
            if self.accum_dtype == self.param_dtype:  # autograd accumulates straight into the flat buffer
                for e in self.entries:
                    e.param.grad = self.flat_grads[e.offset : e.offset + e.numel].view_as(e.param)
            else:  # a .grad must have its parameter's dtype: add each micro-step's 16-bit gradient in fp32
                for e in self.entries:
                    e.param.register_post_accumulate_grad_hook(lambda p, e=e: self._accumulate(e))
        else:
            self.grad_shard = torch.zeros(self.shard_numel, dtype=self.accum_dtype, device=device)
            # two buffers, reused: bucket i goes through buffer i % 2, so one fills while the other's reduce-scatter
            # runs; each sized for its largest bucket, made at a micro-step's first bucket and freed at its end
            self._buffer_numel = buffer_numels(self.buckets)
            self._buffers: list[torch.Tensor | None] = [None, None]
            self._ready = [0] * len(self.buckets)
            self._launched = [False] * len(self.buckets)
            self._pending: deque[tuple[Bucket, Any, int]] = deque()  # (bucket, handle, buffer index), oldest first
            bucket_of = {id(e.param): b for b in self.buckets for e in b.entries}
            for e in self.entries:
                e.param.register_post_accumulate_grad_hook(lambda p, b=bucket_of[id(e.param)]: self._grad_ready(b))

        self.optimizer = self.build_optimizer()
        self.tp_layout = TensorParallelState(model, ctx)  # where each tp slice sits in its full tensor

    def _segments_by_entry(self) -> dict[int, list[Segment]]:
        mine: dict[int, list[Segment]] = {}
        for seg in self.segments:
            mine.setdefault(id(seg.entry), []).append(seg)
        return mine

    def _build_from_model(self, total: int, device: torch.device) -> None:
        """From a materialised model, in two passes (see __init__)."""
        if self.master is not None:
            mine = self._segments_by_entry()
            for e in self.entries:
                src = e.param.detach().reshape(-1)
                for seg in mine.get(id(e), []):
                    a, z = seg.shard_range(self.rank)
                    self.master[a:z].copy_(src[seg.lo - e.offset : seg.hi - e.offset])
                del src
                e.param.data = e.param.data.to(self.param_dtype)
        self.flat_params = torch.empty(total, dtype=self.param_dtype, device=device)
        for b in self.buckets:
            end = b.start + sum(e.numel for e in b.entries)
            self.flat_params[end : b.start + b.numel].zero_()
            for e in b.entries:
                self.flat_params[e.offset : e.offset + e.numel].copy_(e.param.detach().reshape(-1))
                e.param.data = self.flat_params[e.offset : e.offset + e.numel].view_as(e.param)

    @torch.no_grad()
    def _build_from_meta(self, draw: Callable[[str], None], total: int, device: torch.device) -> None:
        """From a model built on the meta device (a random start, `builds_flat_on_meta`): the flat buffer first,
        then each parameter in turn allocated whole in fp32, drawn (`draw(name)`, as one process draws it), its
        segments given to the masters and cast into its view. Peak: the buffer, the masters and one parameter in
        fp32, never the fp32 model. In fp32 runs each parameter is drawn straight into its view."""
        mine = self._segments_by_entry()
        owners = parameter_owners(self.module)
        self.flat_params = torch.empty(total, dtype=self.param_dtype, device=device)
        for b in self.buckets:
            end = b.start + sum(e.numel for e in b.entries)
            self.flat_params[end : b.start + b.numel].zero_()
            for e in b.entries:
                meta = e.param
                if not meta.is_meta:
                    raise RuntimeError(f"ZeRO-{self.stage} meta build: {e.name} is already materialised")
                view = self.flat_params[e.offset : e.offset + e.numel].view(meta.shape)
                fp32 = view if self.master is None else torch.empty(meta.shape, dtype=torch.float32, device=device)
                e.param = replace_meta_parameter(meta, fp32, owners)
                draw(e.name)
                if self.master is None:
                    continue
                src = fp32.reshape(-1)
                for seg in mine.get(id(e), []):
                    a, z = seg.shard_range(self.rank)
                    self.master[a:z].copy_(src[seg.lo - e.offset : seg.hi - e.offset])
                view.copy_(fp32)
                del src, fp32
                e.param.data = view

    # -- layout helpers -----------------------------------------------------------------------------------
    def _piece(self, flat: torch.Tensor, b: Bucket) -> torch.Tensor:
        """This rank's slice of bucket `b` in a full flat buffer."""
        lo = b.start + self.rank * b.shard_numel
        return flat[lo : lo + b.shard_numel]

    def _shard_of(self, b: Bucket, shard: torch.Tensor) -> torch.Tensor:
        return shard[b.shard_start : b.shard_start + b.shard_numel]

    def _grad_shard_view(self, seg: Segment) -> torch.Tensor:
        if self.flat_grads is not None:
            return self.flat_grads[seg.lo : seg.hi]
        a, z = seg.shard_range(self.rank)
        return self.grad_shard[a:z]

    # -- optimizer over the shard ---------------------------------------------------------------------------
    def build_optimizer(self) -> torch.optim.Optimizer:
        o = self.cfg.optim
        decay, no_decay = [], []
        self._opt_params: list[torch.Tensor] = []
        for seg in self.segments:
            if self.master is not None:
                a, z = seg.shard_range(self.rank)
                view = self.master[a:z]
            else:
                view = self.flat_params[seg.lo : seg.hi]
            p = nn.Parameter(view)  # aliases the shard's storage: stepping it updates the shard in place
            if self.master is None:
                p.grad = self._grad_shard_view(seg)
            self._opt_params.append(p)
            (decay if decays(seg.entry.param) else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return adamw(groups, o, self.ctx.device)

    # -- gradients ------------------------------------------------------------------------------------------
    def _grad_ready(self, b: Bucket) -> None:
        self._ready[b.index] += 1
        if self._ready[b.index] == len(b.entries):
            self._launch(b)

    def _accumulate(self, e: Entry) -> None:
        """Stage 1 with an fp32 accumulator: add the gradient autograd just produced, then free it."""
        assert self.flat_grads is not None
        self.flat_grads[e.offset : e.offset + e.numel].add_(e.param.grad.reshape(-1))
        e.param.grad = None

    def _launch(self, b: Bucket) -> None:
        """Stage 2: gather the bucket's gradients into a free buffer, free them, start its reduce-scatter."""
        index = b.index % 2
        while any(i == index for _, _, i in self._pending):  # its buffer in flight: land it (and any older one)
            self._complete_oldest()
        if self._buffers[index] is None:
            self._buffers[index] = torch.empty(self._buffer_numel[index], dtype=self.param_dtype, device=self.ctx.device)
        buffer = self._buffers[index][: b.numel]
        for e in b.entries:
            piece = buffer[e.offset - b.start : e.offset - b.start + e.numel]
            if e.param.grad is not None:
                piece.copy_(e.param.grad.reshape(-1))
                e.param.grad = None
            else:  # no gradient this micro-step (an unused parameter): the buffer holds an older bucket's values
                piece.zero_()
        buffer[sum(e.numel for e in b.entries) :].zero_()  # the padding to a multiple of dp
        buffer.div_(self.divisor)  # divide before summing, as DDP does: an fp16 sum of dp gradients could overflow
        # in place: this rank's chunk of the buffer receives its reduced slice (NCCL allows exactly this aliasing)
        handle = comm.reduce_scatter(self._piece_of_bucket(buffer, b), buffer, self.group, self.ctx.comm, async_op=True)
        self._pending.append((b, handle, index))
        self._launched[b.index] = True

    def _piece_of_bucket(self, buffer: torch.Tensor, b: Bucket) -> torch.Tensor:
        return buffer[self.rank * b.shard_numel : (self.rank + 1) * b.shard_numel]

    def _complete_oldest(self) -> None:
        """Wait for the oldest reduce-scatter in flight and add its slice into the gradient shard (upcast to the
        accumulation dtype by add_); its buffer is free again."""
        b, handle, index = self._pending.popleft()
        if handle is not None:
            handle.wait()
        self._shard_of(b, self.grad_shard).add_(self._piece_of_bucket(self._buffers[index][: b.numel], b))

    @contextlib.contextmanager
    def _stage2_micro_step(self) -> Iterator[None]:
        self._ready = [0] * len(self.buckets)
        self._launched = [False] * len(self.buckets)
        yield
        for b in self.buckets:  # buckets with parameters that got no gradient this time
            if not self._launched[b.index]:
                self._launch(b)
        # the last reduce-scatters overlapped this backward; then the buffers go until the next backward, so
        # that between micro-steps (forward, the optimizer step) a rank holds only the 1/dp gradient shard
        self._drain()
        self._buffers = [None, None]

    def micro_step(self, *, last: bool) -> contextlib.AbstractContextManager:
        return self._stage2_micro_step() if self.stage == 2 else contextlib.nullcontext()

    def finish_grads(self) -> None:
        if self.stage == 1:
            self.flat_grads.div_(self.divisor)  # divide before summing (see _launch)
            for b in self.buckets:
                full = self.flat_grads[b.start : b.start + b.numel]
                comm.reduce_scatter(self._piece(self.flat_grads, b), full, self.group, self.ctx.comm)
            return
        self._drain()

    def _drain(self) -> None:
        """Stage 2: wait for the reduce-scatters still in flight and add them into the gradient shard."""
        while self._pending:
            self._complete_oldest()

    dp_sharded_grads = True

    def tied_embedding_grad(self) -> torch.Tensor:
        bucket = next(b for b in self.buckets if b.entries[0].name == self.tied)
        return self._piece(self.flat_grads, bucket) if self.flat_grads is not None else self._shard_of(bucket, self.grad_shard)

    def grad_shards(self) -> list[tuple[nn.Parameter, torch.Tensor, int]]:
        return [(seg.entry.param, self._grad_shard_view(seg), seg.lo - seg.entry.offset) for seg in self.segments]

    # -- the step -------------------------------------------------------------------------------------------
    def step(self, lr: float, found_inf: torch.Tensor) -> torch.Tensor | None:
        set_lr(self.optimizer, lr)
        if self.master is not None:
            # the optimizer works in fp32: the fp32 accumulator's views as they are, a 16-bit one's fp32 copies
            for seg, p in zip(self.segments, self._opt_params):
                p.grad = self._grad_shard_view(seg).float()
        guarded_step(self.optimizer, found_inf)  # (a skipped step leaves the masters, so the copy below restores)
        if self.master is not None:
            for p in self._opt_params:
                p.grad = None
            for b in self.buckets:
                self._piece(self.flat_params, b).copy_(self._shard_of(b, self.master))
        for b in self.buckets:
            piece = self._piece(self.flat_params, b).clone()
            comm.all_gather(self.flat_params[b.start : b.start + b.numel], piece, self.group, self.ctx.comm)
        return None

    def zero_grad(self) -> None:
        if self.flat_grads is not None:
            self.flat_grads.zero_()
        else:
            self.grad_shard.zero_()

    # -- checkpoints: this rank's shard as chunks of the full per-parameter tensors, the format every layout reads --
    # Each segment is a 1-D range of a flattened tp-local parameter: cut into rectangles (a partial first row,
    # full rows, a partial last row), placed in the full tensor by the tp layout. The chunks view the fp32
    # masters (in fp32 runs the flat parameters' own piece) and the moments: DCP writes them as they are and
    # loads straight into them. Nothing is gathered.
    def _ensure_state(self) -> None:
        """The optimizer's state for every shard tensor, made now if no step made it yet (a resume loads into
        it): AdamW's own first step would make the same zeros and step 0."""
        step_device = self._opt_params[0].device if self.optimizer.defaults.get("fused") else "cpu"
        for p in self._opt_params:
            if not self.optimizer.state.get(p):
                self.optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=step_device),
                                           "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                           "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}

    def _chunked(self, e: Entry, pieces: list[tuple[Segment, torch.Tensor]]) -> torch.Tensor:
        """Parameter `e`'s full tensor, of which this rank holds `pieces`: (segment, its flat fp32 values)."""
        views, device = [], self.ctx.device
        for seg, flat in pieces:
            device = flat.device
            at = 0
            for rect in range_rectangles(e.param.shape, seg.lo - e.offset, seg.hi - e.offset):
                n = math.prod(rect[1])
                views.append((flat[at : at + n].view(rect[1]), rect))
                at += n
        return self.tp_layout.chunked(e.name, views, e.param.shape, torch.float32, device)

    def checkpoint_state(self) -> dict[str, Any]:
        self._ensure_state()
        model_sd = get_model_state_dict(self.module)  # the frozen (PEFT) parameters' values are the module's own
        by_entry: dict[int, list[tuple[Segment, torch.nn.Parameter]]] = {}
        for seg, p in zip(self.segments, self._opt_params):
            by_entry.setdefault(id(seg.entry.param), []).append((seg, p))

        def master(seg: Segment, p: torch.Tensor) -> torch.Tensor:
            return p.detach() if self.master is not None else self.flat_params[seg.lo : seg.hi]

        step = next(iter(self.optimizer.state[p]["step"] for p in self._opt_params), torch.tensor(0.0))
        optim: dict[str, Any] = {}
        entry_of = {id(e.param): e for e in self.entries}
        # every name of a parameter, tied aliases (lm_head.weight = wte.weight) too, gets the fp32 master
        for name, param in self.module.named_parameters(remove_duplicate=False):
            e = entry_of.get(id(param))
            if e is None:  # frozen (PEFT): not in ZeRO's buffers
                continue
            mine = by_entry.get(id(param), [])
            model_sd[name] = self._chunked(e, [(seg, master(seg, p)) for seg, p in mine])
            if name == e.name:
                optim[name] = {"step": step.detach().to("cpu", torch.float32, copy=True),
                               **{k: self._chunked(e, [(seg, self.optimizer.state[p][k]) for seg, p in mine])
                                  for k in ("exp_avg", "exp_avg_sq")}}
        return {"model": model_sd, "optim": {"state": optim}}

    @torch.no_grad()
    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """After DCP filled the chunks of `checkpoint_state()`'s tensors (this rank's masters and moments, in
        place): the step count, the compute-dtype parameters, and every bucket all-gathered, as after a step."""
        optim = state["optim"]["state"]
        step = next(iter(optim.values()))["step"] if optim else torch.tensor(0.0)
        for p in self._opt_params:
            self.optimizer.state[p]["step"].copy_(step)
        if self.master is not None:
            for b in self.buckets:
                self._piece(self.flat_params, b).copy_(self._shard_of(b, self.master))
        for b in self.buckets:
            piece = self._piece(self.flat_params, b).clone()
            comm.all_gather(self.flat_params[b.start : b.start + b.numel], piece, self.group, None)

    def model_state_bytes(self) -> dict[str, int]:
        grads = self.flat_grads if self.flat_grads is not None else self.grad_shard
        frozen = [p for p in self.module.parameters() if not p.requires_grad]  # PEFT's base, outside the buffers
        return {"params": tensor_bytes([self.flat_params]) + tensor_bytes(frozen) + quantised_bytes(self.module),
                "grads": tensor_bytes([grads]),
                "master": tensor_bytes([self.master]) if self.master is not None else 0,
                "optimizer": tensor_bytes(optimizer_state_tensors(self.optimizer))}
