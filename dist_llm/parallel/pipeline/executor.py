"""Runs any schedule of schedule.py on this stage: one executor, every schedule.

Activations and their gradients travel between neighbour stages point to point (`batch_isend_irecv`), in
the compute dtype. Shapes are known ahead from the config (micro batch, sequence or its 1/tp slice under
sequence parallelism, width), so there is no shape handshake. Sends are asynchronous and completed at the
end of the step; receives block, which the schedules are checked to allow (schedule.simulate). With tp > 1
every tp rank exchanges with the same tp rank of the neighbour stage.

Each step also records when this stage computed (forward and backward actions) against the step's wall
time: the rest is the pipeline bubble plus waiting on communication.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from dist_llm.parallel import comm
from dist_llm.parallel.pipeline.schedule import Action
from dist_llm.profiling import span


@dataclass
class StageModel:
    """This stage's part of the GPT: embedding on the first stage, blocks `layers`, head and loss on the last."""

    model: nn.Module
    layers: range
    first: bool
    last: bool

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        # Activations arrive in the compute dtype; the residual stream goes on in the parameters' dtype (fp32
        # under autocast with fp32 weights), as it would with one stage, rounded only at the boundary.
        x = self.model.embed(inp) if self.first else inp.to(next(self.model.parameters()).dtype)
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
        with span("comm.p2p_send"):
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, to)]):
                self.pending.append((work, t))  # the tensor lives until the send completes

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=device)
        with span("comm.p2p_recv"):
            for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, src)]):
                work.wait()
        return t

    def finish(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


class StageClock:
    """When this stage computed during one step, from the start of its schedule to `end` (the trainer moves
    it to the step's first synchronisation of all stages). On CUDA the marks are events, read only when asked (at log
    steps), so timing adds no host sync to the step; on CPU they are wall-clock readings."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[Any, Any]] = []
        self.start = self.end = self.mark()

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _seconds(self, a: Any, b: Any) -> float:
        if not self.cuda:
            return b - a
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    def busy_idle(self) -> tuple[float, float]:
        """(seconds computing, seconds not computing) of the step."""
        busy = sum(self._seconds(a, b) for a, b in self.spans)
        return busy, max(0.0, self._seconds(self.start, self.end) - busy)


@contextlib.contextmanager
def _computing(clock: StageClock):  # type: ignore[no-untyped-def]
    start = clock.mark()
    yield
    clock.spans.append((start, clock.mark()))


def run_schedule(plan: list[Action], stage: StageModel, p2p: PointToPoint, *,
                 batches: list[tuple[torch.Tensor, torch.Tensor]], act_shape: tuple[int, ...], act_dtype: torch.dtype,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 backward: Callable[[torch.Tensor], None],
                 micro_step: Callable[[bool], contextlib.AbstractContextManager],
                 autocast: Callable[[], contextlib.AbstractContextManager],
                 device: torch.device, train: bool = True) -> tuple[torch.Tensor, StageClock]:
    """Perform this stage's actions for one step; return the sum of the micro-batches' token losses on the
    last stage (zero elsewhere) and when the stage computed. `loss_fn(loss)` makes the tensor to backward from
    a micro-batch's token-loss sum (divided by the global count, scaled); `micro_step(last)` is the
    data-parallel context around each backward."""
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    out_grads: dict[int, torch.Tensor] = {}
    loss_sum = torch.zeros((), device=device)
    last_backward = max((a.micro for a in plan if a.kind == "B"), default=-1)
    clock = StageClock(device)
    for a in plan:
        m = a.micro
        if a.kind == "RECV_F":
            inputs[m] = p2p.recv(act_shape, act_dtype, device, p2p.prev).requires_grad_(train)
        elif a.kind == "F":
            x, y = batches[m]
            with _computing(clock), span(f"forward {m}"), autocast(), \
                    (contextlib.nullcontext() if train else torch.no_grad()):
                out = stage.forward(x if stage.first else inputs[m])
                if stage.last:
                    loss = stage.model.loss(out, y, reduction="sum")  # the trainer divides (by the global count)
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
            with _computing(clock), span(f"backward {m}"), micro_step(m == last_backward):
                if stage.last:
                    backward(outputs.pop(m))
                else:
                    out = outputs.pop(m)
                    torch.autograd.backward(out, out_grads.pop(m).to(out.dtype))
        elif a.kind == "SEND_B":
            p2p.send(inputs.pop(m).grad.to(act_dtype), p2p.prev)
    p2p.finish()
    clock.end = clock.mark()
    if inputs or outputs or out_grads:
        raise RuntimeError(f"pipeline stashes not empty after the step: inputs {sorted(inputs)}, "
                           f"outputs {sorted(outputs)}, gradients {sorted(out_grads)}")
    return loss_sum, clock


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
