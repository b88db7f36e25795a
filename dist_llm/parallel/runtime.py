"""What a step runs on this rank's part of the model, whatever the layout: built once after `parallelize`.

The runtime owns the pipeline stage (its StageModel and the point-to-point links to its neighbours) and the
data-parallel form. `forward_backward` runs one step's micro-batches, one after another or through the
pipeline schedule; `finish_grads` completes the gradients (the data-parallel reduction, the tied embedding's
sum across the first and last stages, the sequence-parallel sync). The trainer only orders the step around
these two calls; it knows nothing of stages, links or collectives.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from dist_llm.config import Config, check_interleaved, overlap_p2p
from dist_llm.parallel import comm
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.data import DataParallel
from dist_llm.parallel.parallelize import Parallelized
from dist_llm.parallel.pipeline.executor import PointToPoint, StageClock, StageModel, run_schedule
from dist_llm.parallel.pipeline.schedule import build_plans
from dist_llm.parallel.tensor import sync_sequence_parallel_grads
from dist_llm.precision import DTYPES, autocast
from dist_llm.profiling import span

MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]
#: from a micro-batch's token-loss sum, the tensor its backward starts from (divided, scaled)
LossFn = Callable[[torch.Tensor], torch.Tensor]


class ParallelRuntime:
    """This rank's part of the model with its stage cut, point-to-point links and data-parallel form."""

    def __init__(self, built: Parallelized, cfg: Config, ctx: ParallelContext) -> None:
        assert built.dp is not None, "the runtime runs a data-parallel form: parallelize(..., wrap=True)"
        self.cfg, self.ctx, self.device = cfg, ctx, ctx.device
        self.dp: DataParallel = built.dp
        self.model = self.dp.model  # what forward calls (a DDP/FSDP wrapper, or the GPT itself)
        self.module = self.dp.module  # the GPT
        self.stage: StageModel | None = None
        self.p2p: PointToPoint | None = None
        self.chunks: list[StageModel] = []  # interleaved: one StageModel per model chunk this rank holds
        if built.stage is not None:  # this pipeline stage's part of the model, and its neighbours' addresses
            blocks, first, last = built.stage
            stream = self.dp.stream_dtype()
            if isinstance(blocks, range):
                self.stage = StageModel(built.model, blocks, first, last, self.dp.hooks_on_model_call, stream)
                self.p2p = PointToPoint(*ctx.pp_neighbours(), stats=ctx.comm, group=ctx.pp_group)
            else:  # chunk c is virtual stage c * pp + pp_rank: the embedding in the first, the head in the last
                check_interleaved(cfg, ctx.dp)
                self.chunks = [StageModel(built.model, r, first and c == 0, last and c == len(blocks) - 1,
                                          self.dp.hooks_on_model_call, stream) for c, r in enumerate(blocks)]
                self.stage = self.chunks[0]
                ranks = torch.distributed.get_process_group_ranks(ctx.pp_group)  # round the ring
                self.p2p = PointToPoint(ranks[ctx.pp_rank - 1], ranks[(ctx.pp_rank + 1) % ctx.pp], stats=ctx.comm,
                                        group=ctx.pp_group)
        self.stage_clock: StageClock | None = None  # when this stage computed in the last training step

    def _autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.cfg.train.precision, self.device)

    def forward_backward(self, micro_batches: MicroBatches, *, loss_fn: LossFn) -> torch.Tensor:
        """Forward and backward over one step's micro-batches; the sum of their token losses (on the last
        stage under pp, zero on the others). Gradients accumulate until `finish_grads`."""
        if self.stage is not None:
            return self._pipeline(micro_batches, train=True, loss_fn=loss_fn)
        loss_sum = torch.zeros((), device=self.device)  # this rank's sum of token losses
        for i, (x, y) in enumerate(micro_batches):
            with self.dp.micro_step(last=i == len(micro_batches) - 1):
                with span("forward"), self._autocast():
                    loss = self.model(x, y, reduction="sum")
                loss_sum += loss.detach()
                with span("backward"):
                    self.dp.backward(loss_fn(loss))
        return loss_sum

    def finish_grads(self) -> None:
        """Every gradient complete and reduced as the data-parallel form leaves it (sharded or whole)."""
        with span("grad_sync"):
            self.dp.finish_grads()
        if (self.ctx.embedding_group is not None and self.cfg.model.tie_embeddings
                and self.module.wte.weight.requires_grad):  # (frozen under PEFT)
            # the first stage's embedding and the last stage's head are one weight: sum their gradients
            comm.all_reduce(self.dp.tied_embedding_grad(), self.ctx.embedding_group, self.ctx.comm)
        if self.cfg.parallel.sequence_parallel or (self.ctx.tp > 1 and self.cfg.model.n_experts):
            # (MoE layers under tp see 1/tp of the tokens with or without SP: parallel/tensor/moe.py)
            sync_sequence_parallel_grads(self.dp.grad_shards(), self.ctx, bucket_mb=self.cfg.parallel.bucket_mb)

    def mark_step_end(self) -> None:
        """Under pp: the step's common end (the grad norm's all-reduce over the stages) for the stage clock. A
        stage that finished its schedule early waits there, and that wait is its share of the pipeline flush."""
        if self.stage_clock is not None:
            self.stage_clock.end = self.stage_clock.mark()

    @torch.no_grad()
    def add_eval_losses(self, micro_batches: MicroBatches, total: torch.Tensor) -> None:
        """Add the token-loss sums of an evaluation batch's micro-batches into `total` (one by one, as the
        validation loss always summed them)."""
        if self.stage is not None:  # evaluation runs the forward half, batched into exchanges alike
            total += self._pipeline(micro_batches, train=False, loss_fn=lambda loss: loss)
            return
        for x, y in micro_batches:
            with self._autocast():
                total += self.model(x, y, reduction="sum").float()

    def _pipeline(self, micro_batches: MicroBatches, *, train: bool, loss_fn: LossFn) -> torch.Tensor:
        """One step's (or one eval batch's) micro-batches through the pipeline; the sum of token losses on the
        last stage."""
        ctx, t, m = self.ctx, self.cfg.train, self.cfg.model
        assert self.stage is not None and self.p2p is not None
        name = self.cfg.parallel.pp_schedule if train else "forward"
        overlap = overlap_p2p(self.cfg)
        plan = build_plans(name, ctx.pp, len(micro_batches), len(self.chunks) or 1, overlap=overlap)[ctx.pp_rank]
        seq = m.block_size // ctx.cp  # (this rank's part of each sequence under context parallelism)
        seq = seq // ctx.tp if self.cfg.parallel.sequence_parallel else seq
        loss_sum, clock = run_schedule(
            plan, self.chunks or self.stage, self.p2p, batches=micro_batches,
            act_shape=(t.micro_batch_size, seq, m.n_embd), act_dtype=DTYPES[t.precision],
            loss_fn=loss_fn, backward=self.dp.backward, micro_step=lambda last: self.dp.micro_step(last=last),
            autocast=self._autocast, device=self.device, train=train, overlap=overlap)
        if train:
            self.stage_clock = clock
        return loss_sum

    def pipeline_times(self) -> dict[str, list[float]]:
        """Every stage's busy and idle seconds in the last training step (a collective over the pp group)."""
        assert self.stage_clock is not None
        busy, idle = self.stage_clock.busy_idle()
        mine = torch.tensor([busy, idle], dtype=torch.float64, device=self.device)
        every = torch.zeros(self.ctx.pp * 2, dtype=torch.float64, device=self.device)
        comm.all_gather(every, mine, self.ctx.pp_group, None)
        busy_s, idle_s = every[0::2].tolist(), every[1::2].tolist()
        return {"pp_busy_s": [round(b, 6) for b in busy_s], "pp_idle_s": [round(i, 6) for i in idle_s],
                "pp_idle_fraction": [round(i / (b + i), 4) if b + i else 0.0 for b, i in zip(busy_s, idle_s)]}

    def from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        """The loss lives on the last pipeline stage: hand it to every stage (rank 0 writes the metrics)."""
        if self.ctx.pp > 1:
            t = t.detach().clone()
            torch.distributed.broadcast(t, src=self.ctx.pp_last_rank, group=self.ctx.pp_group)
        return t
