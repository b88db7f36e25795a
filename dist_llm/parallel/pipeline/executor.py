"""Runs any schedule of schedule.py on this stage: one executor, every schedule.

Activations and their gradients travel between neighbour stages point to point. Shapes are known ahead
from the config (micro batch, sequence or its 1/tp slice under sequence parallelism, width), so there is
no shape handshake. Sends are asynchronous and completed at the end of the step; receives block, which the
schedules are checked to allow (schedule.simulate). With tp > 1 every tp rank exchanges with the same tp
rank of the neighbour stage.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from dist_llm.parallel import comm
from dist_llm.parallel.pipeline.schedule import Action


@dataclass
class StageModel:
    """This stage's part of the GPT: embedding on the first stage, blocks `layers`, head and loss on the last."""

    model: nn.Module
    layers: range
    first: bool
    last: bool

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        x = self.model.embed(inp) if self.first else inp
        for i in self.layers:
            x = self.model.blocks[i](x)
        return self.model.head(x) if self.last else x


@dataclass
class PointToPoint:
    """Sends and receives with the previous and next stage, bytes counted as 'p2p'."""

    prev: int | None
    next: int | None
    stats: comm.CommStats
    pending: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)

    def send(self, t: torch.Tensor, to: int) -> None:
        t = t.contiguous()
        self.stats.add("p2p", t.numel() * t.element_size())
        self.pending.append((dist.isend(t, to), t))  # the tensor lives until the send completes

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src)
        return t

    def finish(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def run_schedule(plan: list[Action], stage: StageModel, p2p: PointToPoint, *,
                 batches: list[tuple[torch.Tensor, torch.Tensor]], act_shape: tuple[int, ...], act_dtype: torch.dtype,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 backward: Callable[[torch.Tensor], None],
                 micro_step: Callable[[bool], contextlib.AbstractContextManager],
                 autocast: Callable[[], contextlib.AbstractContextManager],
                 device: torch.device, train: bool = True) -> torch.Tensor:
    """Perform this stage's actions for one step; return the sum of the micro-batches' losses on the last
    stage (zero elsewhere). `loss_fn(loss)` makes the tensor to backward from (scaled, divided by the
    micro-batch count); `micro_step(last)` is the data-parallel context around each backward."""
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    out_grads: dict[int, torch.Tensor] = {}
    loss_sum = torch.zeros((), device=device)
    last_backward = max((a.micro for a in plan if a.kind == "B"), default=-1)
    for a in plan:
        m = a.micro
        if a.kind == "RECV_F":
            inputs[m] = p2p.recv(act_shape, act_dtype, device, p2p.prev).requires_grad_(train)
        elif a.kind == "F":
            x, y = batches[m]
            with autocast(), (contextlib.nullcontext() if train else torch.no_grad()):
                out = stage.forward(x if stage.first else inputs[m])
                if stage.last:
                    loss = stage.model.loss(out, y)
                    loss_sum += loss.detach().float()
                    out = loss_fn(loss)
            if train or not stage.last:
                outputs[m] = out
            if not train:
                inputs.pop(m, None)
        elif a.kind == "SEND_F":
            p2p.send((outputs.pop(m) if not train else outputs[m]).detach().to(act_dtype), p2p.next)
        elif a.kind == "RECV_B":
            out_grads[m] = p2p.recv(act_shape, act_dtype, device, p2p.next)
        elif a.kind == "B":
            with micro_step(m == last_backward):
                if stage.last:
                    backward(outputs.pop(m))
                else:
                    out = outputs.pop(m)
                    torch.autograd.backward(out, out_grads.pop(m).to(out.dtype))
        elif a.kind == "SEND_B":
            p2p.send(inputs.pop(m).grad, p2p.prev)
    p2p.finish()
    if inputs or outputs or out_grads:
        raise RuntimeError(f"pipeline stashes not empty after the step: inputs {sorted(inputs)}, "
                           f"outputs {sorted(outputs)}, gradients {sorted(out_grads)}")
    return loss_sum


def forward_only(stages: int, stage: int, micro_batches: int) -> list[Action]:
    """The forward half of a schedule (evaluation): receive, forward, send each micro-batch in turn."""
    acts = []
    for m in range(micro_batches):
        if stage > 0:
            acts.append(Action("RECV_F", m))
        acts.append(Action("F", m))
        if stage < stages - 1:
            acts.append(Action("SEND_F", m))
    return acts
