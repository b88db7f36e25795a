"""Runs any schedule of schedule.py on this stage: one executor, every schedule.

Activations and their gradients travel between neighbour stages point to point in the compute dtype. Each
`Exchange` of the plan (schedule.build_plans: a stage's sends and receives between two computations with one
neighbour, such as 1F1B's send-forward-receive-backward) is one `batch_isend_irecv`, all of whose works complete
before the stage goes on, or with parallel.pp_overlap_p2p before the computation that uses what it receives:
under NCCL, where a send waits for its receive and a communicator's calls run one after another, the plans are
checked free of circular waits under either rule (schedule.simulate). Shapes are known ahead from the config (micro batch, sequence or its 1/tp
slice under sequence parallelism, width), so there is no shape handshake; the sender checks its tensor against
the shape the receiver posts. With tp > 1 every tp rank exchanges with the same tp rank of the neighbour stage.

Each step also records when this stage computed (forward and backward actions) against the step's wall
time: the rest is the pipeline bubble plus waiting on communication.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from dist_llm.parallel import comm
from dist_llm.parallel.pipeline.balancing import attach_balancing, stage_moe_layers
from dist_llm.parallel.pipeline.schedule import Action, Exchange, Step
from dist_llm.parallel.pipeline.split_backward import WeightWork, backward_input, backward_weights
from dist_llm.profiling import span


@dataclass
class StageModel:
    """This stage's part of the GPT: embedding on the first stage, blocks `layers`, head and loss on the last."""

    model: nn.Module
    layers: range
    first: bool
    last: bool
    #: run the part through the model's own call (`model(inp, part=...)`), so that hooks on the whole model run
    #: around it: FSDP2's root unit gathers the embedding / head it holds there, and hooks the backward's end
    through_call: bool = False
    #: the residual stream's dtype (DataParallel.stream_dtype), fixed for the run. None: the first parameter's at
    #: each call, for a plain module whose parameters never change dtype (FSDP2's do: sharded fp32, gathered bf16)
    stream_dtype: torch.dtype | None = None

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return self.model(inp, part=self._run) if self.through_call else self._run(inp)

    def _run(self, inp: torch.Tensor) -> torch.Tensor:
        # Activations arrive in the compute dtype; the residual stream goes on in the parameters' dtype (fp32
        # under autocast with fp32 weights), as it would with one stage, rounded only at the boundary.
        x = self.model.embed(inp) if self.first else inp.to(self.stream_dtype or next(self.model.parameters()).dtype)
        for i in self.layers:
            x = self.model.blocks[i](x)
        return self.model.head(x) if self.last else x


@dataclass
class PointToPoint:
    """Exchanges with the previous and next stage (their global ranks) over the pipeline group, bytes sent
    counted as 'p2p'."""

    prev: int | None
    next: int | None
    stats: comm.CommStats
    #: the pipeline group (ctx.pp_group): the exchanges run on its communicator, whose order of calls the plans
    #: are checked under (schedule.simulate), not on the world's, which other calls on the default group share
    group: dist.ProcessGroup | None

    def post(self, ops: list[tuple[bool, torch.Tensor, int]]) -> list[dist.Work]:
        """Post (is_send, tensor, peer) operations as ONE `batch_isend_irecv`; their works, to wait for. Posted
        calls run one after another (on NCCL in the communicator's stream), so an exchange posted before the last
        one completed starts only once it has: the plans are checked free of circular waits under that order."""
        for is_send, t, _ in ops:
            if is_send:
                self.stats.add("p2p", t.numel() * t.element_size())
        with span("comm.p2p"):
            return dist.batch_isend_irecv([dist.P2POp(dist.isend if is_send else dist.irecv, t, peer, self.group)
                                           for is_send, t, peer in ops])  # (P2POp's peer: a global rank)


class StageClock:
    """When this stage computed during one step, from the start of its schedule to `end` (the trainer moves
    it to the step's first synchronisation of all stages). On CUDA the marks are events, read only when asked (at log
    steps), so timing adds no host sync to the step; on CPU they are wall-clock readings."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[Any, Any]] = []
        self.actions: list[Action] = []  # each span's action
        self.exchanges: list[tuple[Any, Any]] = []  # when the stage sat in a batch_isend_irecv or a wait (idle)
        # each exchange of the plan, in order: (posted, waited for); without overlap the same spans as `exchanges`
        self.exchange_times: list[tuple[Any, Any]] = []
        self.exchange_posts: list[tuple[Any, Any]] = []  # each exchange's posting: its tensors and the call
        self.action: Action | None = None  # the action running now (set by the executor before each computation)
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

    def breakdown(self) -> dict[str, float]:
        """Where the step's seconds went: seconds per action kind ("F", "B", "W"; "F1", "B1" ... for the
        interleaved schedule's later chunks), "exchange" (posting exchanges and waiting for them: the
        neighbour, the transfers; with overlap the waits before the computations that need them), "tail" (the last computation or exchange to `end`: the flush's wait, gradient
        completion and the norm), and "other" (the rest: the executor's own work between actions).
        "count_<kind>" is how many of each action ran."""
        out: dict[str, float] = {}
        for kind, _, seconds in self.action_seconds():
            out[kind] = out.get(kind, 0.0) + seconds
            out[f"count_{kind}"] = out.get(f"count_{kind}", 0.0) + 1
        out["exchange"] = sum(self._seconds(a, b) for a, b in self.exchanges)
        last = max([b for _, b in self.spans + self.exchanges], key=lambda b: self._seconds(self.start, b),
                   default=self.start)
        out["tail"] = self._seconds(last, self.end)
        total = self._seconds(self.start, self.end)
        out["other"] = total - out["tail"] - out["exchange"] - sum(v for k, v in out.items()
                                                                    if k[0] in "FBW" and not k.startswith("count"))
        return out

    def action_seconds(self) -> list[tuple[str, int, float]]:
        """(kind with its chunk as in `breakdown`, micro-batch, seconds) of each computation, in order: what
        `schedule.simulate(costs=...)` replays."""
        return [(a.kind + (str(a.chunk) if a.chunk else ""), a.micro, self._seconds(s, e))
                for (s, e), a in zip(self.spans, self.actions)]


@contextlib.contextmanager
def _computing(clock: StageClock):  # type: ignore[no-untyped-def]
    start = clock.mark()
    yield
    clock.spans.append((start, clock.mark()))
    clock.actions.append(clock.action)  # type: ignore[arg-type]


Key = tuple[int, int]  # (micro-batch, chunk)


def run_schedule(plan: list[Step], stage: StageModel | list[StageModel], p2p: PointToPoint, *,
                 batches: list[tuple[torch.Tensor, torch.Tensor]], act_shape: tuple[int, ...], act_dtype: torch.dtype,
                 loss_fn: Callable[[torch.Tensor], torch.Tensor],
                 backward: Callable[[torch.Tensor], None],
                 micro_step: Callable[[bool], contextlib.AbstractContextManager],
                 autocast: Callable[[], contextlib.AbstractContextManager],
                 device: torch.device, train: bool = True, overlap: bool = False) -> tuple[torch.Tensor, StageClock]:
    """Perform this stage's actions for one step; return the sum of the micro-batches' token losses on the
    last stage (zero elsewhere) and when the stage computed. `stage` is one StageModel, or one per chunk under
    the interleaved schedule (an action's `chunk` picks it). `loss_fn(loss)` makes the tensor to backward from
    a micro-batch's token-loss sum (divided by the global count, scaled); `micro_step(last)` is the
    data-parallel context around each action that produces weight gradients (B, or W where the plan splits
    the backward: there B computes the input gradient alone, split_backward.py). `overlap`
    (parallel.pp_overlap_p2p): each exchange is posted and not waited for; a computation waits for the exchange
    that receives its input (F an activation, B a gradient), and the step's end for the rest (schedule.simulate
    with overlap checks the plans under that rule)."""
    chunks = stage if isinstance(stage, list) else [stage]
    moe_of = [stage_moe_layers(c.model, c.layers) for c in chunks]
    inputs: dict[Key, torch.Tensor] = {}
    outputs: dict[Key, torch.Tensor] = {}
    out_grads: dict[Key, torch.Tensor] = {}
    weight_work: dict[Key, WeightWork] = {}
    loss_sum = torch.zeros((), device=device)
    split = any(isinstance(a, Action) and a.kind == "W" for a in plan)
    grads_at = "W" if split else "B"
    last_grads = ([a for a in plan if isinstance(a, Action) and a.kind == grads_at] or [None])[-1]
    clock = StageClock(device)
    pending: dict[tuple[str, int, int], _Posted] = {}  # overlap: receives posted, not yet waited for
    unwaited: list[_Posted] = []  # overlap: the exchanges posted and not yet waited for, in order

    def wait_for(posted: _Posted) -> None:
        """Wait for `posted` and every exchange posted before it: NCCL completes a rank's calls in order anyway,
        so the earlier ones cost nothing more, and waiting for them lets their tensors go (a send's, above all the
        warm-up's and cool-down's sends that nothing else waits for) instead of holding them to the step's end."""
        start = clock.mark()
        upto = unwaited.index(posted) + 1
        for earlier in unwaited[:upto]:
            earlier.complete(inputs, out_grads, train)
        end = clock.mark()
        clock.exchanges.append((start, end))
        for earlier in unwaited[:upto]:
            clock.exchange_times[earlier.index] = (clock.exchange_times[earlier.index][0], end)
            for op in earlier.receives:
                del pending[op.kind[-1], op.micro, op.chunk]
        del unwaited[:upto]

    for a in plan:
        if isinstance(a, Exchange):
            if unwaited and not unwaited[-1].receives:
                # the last call only sends (a first stage's, a warm-up's): nothing would wait for it before a
                # later receive, maybe not before the step's end, so let its tensors go now (on NCCL it has
                # completed by the time this one could start anyway)
                wait_for(unwaited[-1])
            start = clock.mark()
            posted = _post(a, p2p, outputs, inputs, shape=act_shape, dtype=act_dtype, device=device, train=train)
            posted.index = len(clock.exchange_times)
            clock.exchange_times.append((start, None))
            clock.exchange_posts.append((start, clock.mark()))
            clock.exchanges.append(clock.exchange_posts[-1])
            pending.update({(op.kind[-1], op.micro, op.chunk): posted for op in posted.receives})
            unwaited.append(posted)
            if not overlap:  # (with overlap: where a computation needs what it receives, the rest at the end)
                wait_for(posted)
            continue
        m, key, st = a.micro, (a.micro, a.chunk), chunks[a.chunk]
        if (a.kind, m, a.chunk) in pending:
            wait_for(pending[a.kind, m, a.chunk])
        clock.action = a
        label = f"{m}/{a.chunk}" if a.chunk else f"{m}"
        if a.kind not in ("F", "B", "W"):
            raise ValueError(f"{a} outside an Exchange: run the plans of schedule.build_plans")
        elif a.kind == "F":
            x, y = batches[m]
            with _computing(clock), span(f"forward {label}"), autocast(), \
                    (contextlib.nullcontext() if train else torch.no_grad()):
                out = st.forward(x if st.first else inputs[key])
                if st.last:
                    loss = st.model.loss(out, y, reduction="sum")  # the trainer divides (by the global count)
                    loss_sum += loss.detach().float()
                    out = loss_fn(loss)
                    del loss  # (only the root may hold the loss's graph: a split B frees it, below)
                if train:  # this stage's MoE balancing losses join its backward (balancing.py)
                    out = attach_balancing(out, moe_of[a.chunk], y, loss_fn)
            if train or not st.last:
                outputs[key] = out
            if not train:
                inputs.pop(key, None)
        elif a.kind == "B" and split:  # the input gradient only; W m accumulates the weights' later
            with _computing(clock), span(f"backward-input {label}"):
                out = outputs.pop(key)
                grad = None if st.last else out_grads.pop(key).to(out.dtype)
                inp = None if st.first else inputs[key]
                d_inp, weight_work[key] = backward_input(out, grad, inp, list(st.model.parameters()))
                if inp is not None:
                    inp.grad = d_inp
                # W needs the graph from its weight ops down only: dropping the root now frees what lies above
                # them (the loss's log-softmax over the vocabulary on the last stage), not at the next forward
                del out
        elif a.kind == "B":
            with _computing(clock), span(f"backward {label}"), micro_step(a == last_grads):
                if st.last:
                    backward(outputs.pop(key))
                else:
                    out = outputs.pop(key)
                    torch.autograd.backward(out, out_grads.pop(key).to(out.dtype))
        else:
            with _computing(clock), span(f"backward-weights {label}"), micro_step(a == last_grads):
                backward_weights(weight_work.pop(key))
    if unwaited:  # the sends nobody waited for (and, in a broken plan, receives nobody used)
        wait_for(unwaited[-1])
    clock.end = clock.mark()
    if inputs or outputs or out_grads or weight_work:
        raise RuntimeError(f"pipeline stashes not empty after the step: inputs {sorted(inputs)}, "
                           f"outputs {sorted(outputs)}, gradients {sorted(out_grads)}, "
                           f"weight gradients {sorted(weight_work)}")
    return loss_sum, clock


@dataclass(eq=False)  # (found by identity: comparing works or tensors means nothing)
class _Posted:
    """One exchange posted: its works, the buffers its receives fill, and its sends' tensors (kept alive until
    the works complete)."""

    works: list[Any]
    received: list[tuple[Action, torch.Tensor]]
    sent: list[torch.Tensor]
    index: int = 0  # its place among the plan's exchanges

    def __post_init__(self) -> None:
        self.receives = [op for op, _ in self.received]  # (what it receives, kept once the buffers are handed on)

    def complete(self, inputs: dict[Key, torch.Tensor], out_grads: dict[Key, torch.Tensor], train: bool) -> None:
        """Wait for the works, hand the received buffers to the stashes and let go of every tensor."""
        with span("comm.p2p"):
            for work in self.works:
                work.wait()
        for op, buf in self.received:
            if op.kind == "RECV_F":
                inputs[op.micro, op.chunk] = buf.requires_grad_(train)
            else:
                out_grads[op.micro, op.chunk] = buf
        self.works, self.received, self.sent = [], [], []


def _post(x: Exchange, p2p: PointToPoint, outputs: dict[Key, torch.Tensor], inputs: dict[Key, torch.Tensor], *,
          shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, train: bool) -> _Posted:
    """One exchange with the neighbours: its sends and receives posted together. Under the interleaved schedule
    the neighbours are those round the ring (the last rank's next is the first)."""
    ops: list[tuple[bool, torch.Tensor, int]] = []
    received: list[tuple[Action, torch.Tensor]] = []
    for op in x.ops:
        key = (op.micro, op.chunk)
        if op.kind == "SEND_F":
            out = outputs[key] if train else outputs.pop(key)  # training keeps it for the backward
            ops.append((True, _outgoing(out.detach(), op, shape, dtype), p2p.next))
        elif op.kind == "SEND_B":
            ops.append((True, _outgoing(inputs.pop(key).grad, op, shape, dtype), p2p.prev))
        else:  # the buffer's shape and dtype are the arguments the sender checks against
            buf = torch.empty(shape, dtype=dtype, device=device)
            ops.append((False, buf, p2p.prev if op.kind == "RECV_F" else p2p.next))
            received.append((op, buf))
    return _Posted(p2p.post(ops), received, [t for is_send, t, _ in ops if is_send])


def _outgoing(t: torch.Tensor, op: Action, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor to send, in the compute dtype. The receiver posts a buffer of `shape`: on NCCL a size that
    differs would hang or corrupt it, so say so here instead."""
    if tuple(t.shape) != tuple(shape):
        raise RuntimeError(f"pipeline {op}: the tensor to send is {tuple(t.shape)}, the neighbour stage expects "
                           f"{tuple(shape)} (train.micro_batch_size x model.block_size[/tp] x model.n_embd)")
    return t.to(dtype).contiguous()
