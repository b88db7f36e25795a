"""Pipeline schedules as data: for each stage, the ordered list of actions it performs in one step.

A schedule is a pure function of (stages, micro-batches) and knows nothing of processes, so it can be
checked (every micro-batch forward then backward once per stage, no deadlock, the bubble) without any.
`exchanges` groups a stage's point-to-point actions into the batches the executor posts together
(`build_plans` gives every stage's, for a schedule or evaluation's forward half); `simulate` runs them with
NCCL's semantics, where a send waits for its receive. One executor runs any plan, in order.

  RECV_F m   receive micro-batch m's activation from the previous stage (not on the first stage)
  F m        forward micro-batch m (the last stage also computes its loss)
  SEND_F m   send micro-batch m's output activation to the next stage (not on the last stage)
  RECV_B m   receive the gradient of micro-batch m's output from the next stage (not on the last stage)
  B m        backward micro-batch m
  SEND_B m   send the gradient of micro-batch m's input to the previous stage (not on the first stage)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

Kind = Literal["RECV_F", "F", "SEND_F", "RECV_B", "B", "SEND_B"]


@dataclass(frozen=True)
class Action:
    kind: Kind
    micro: int

    def __repr__(self) -> str:
        return f"{self.kind} {self.micro}"


def _forward(stage: int, stages: int, m: int) -> list[Action]:
    acts = [] if stage == 0 else [Action("RECV_F", m)]
    acts.append(Action("F", m))
    if stage < stages - 1:
        acts.append(Action("SEND_F", m))
    return acts


def _backward(stage: int, stages: int, m: int) -> list[Action]:
    acts = [] if stage == stages - 1 else [Action("RECV_B", m)]
    acts.append(Action("B", m))
    if stage > 0:
        acts.append(Action("SEND_B", m))
    return acts


def gpipe(stages: int, micro_batches: int) -> list[list[Action]]:
    """GPipe: every forward, then every backward (holds all micro-batches' activations at once)."""
    return [[a for m in range(micro_batches) for a in _forward(s, stages, m)]
            + [a for m in range(micro_batches) for a in _backward(s, stages, m)]
            for s in range(stages)]


def one_f_one_b(stages: int, micro_batches: int) -> list[list[Action]]:
    """1F1B (PipeDream-Flush): stage s runs stages-1-s warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards. It holds at most stages - s micro-batches' activations."""
    plans = []
    for s in range(stages):
        warmup = min(stages - 1 - s, micro_batches)
        acts = [a for m in range(warmup) for a in _forward(s, stages, m)]
        for i in range(micro_batches - warmup):  # steady state: forward m, then the oldest backward
            acts += _forward(s, stages, warmup + i) + _backward(s, stages, i)
        for m in range(micro_batches - warmup, micro_batches):  # cool-down
            acts += _backward(s, stages, m)
        plans.append(acts)
    return plans


SCHEDULES: dict[str, Callable[[int, int], list[list[Action]]]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def forward_only(stages: int, micro_batches: int) -> list[list[Action]]:
    """The forward half of a schedule (evaluation): receive, forward, send each micro-batch in turn."""
    return [[a for m in range(micro_batches) for a in _forward(s, stages, m)] for s in range(stages)]


@dataclass(frozen=True)
class Exchange:
    """Point-to-point actions a stage posts together and waits for together: one `batch_isend_irecv`.

    On NCCL a send of more than its buffering completes only once the peer has posted the matching receive,
    and a rank's p2p calls run one after another. So in 1F1B's steady state "send F(i+1), then receive
    B(i)" on stage s against "send B(i), then receive F(i+1)" on stage s+1 is a circular wait; posted as
    one exchange each (Megatron's send_forward_recv_backward), both complete."""

    ops: tuple[Action, ...]

    def __repr__(self) -> str:
        return "{" + ", ".join(map(repr, self.ops)) + "}"


Step = Action | Exchange
_COMM = ("RECV_F", "SEND_F", "RECV_B", "SEND_B")


def peer_offset(kind: Kind) -> int:
    """Which neighbour a point-to-point action talks to: +1 the next stage, -1 the previous one."""
    return 1 if kind in ("SEND_F", "RECV_B") else -1


def exchanges(plan: list[Action]) -> list[Step]:
    """Group a stage's point-to-point actions into exchanges: the actions between two computations that talk
    to the same neighbour go together (a send and the receive that pairs with it), others apart."""
    steps: list[Step] = []
    for a in plan:
        last = steps[-1] if steps else None
        if a.kind not in _COMM:
            steps.append(a)
        elif isinstance(last, Exchange) and peer_offset(last.ops[0].kind) == peer_offset(a.kind):
            steps[-1] = Exchange((*last.ops, a))
        else:
            steps.append(Exchange((a,)))
    return steps


def build_plans(name: str, stages: int, micro_batches: int) -> list[list[Step]]:
    """Every stage's steps for schedule `name` ("forward" for evaluation), as the executor runs them."""
    make = forward_only if name == "forward" else SCHEDULES[name]
    return [exchanges(p) for p in make(stages, micro_batches)]


def simulate(plans: list[list[Step]], *, forward_cost: float = 1.0,
             backward_cost: float = 2.0) -> tuple[float, list[float]]:
    """Run the plans on an idealised machine with NCCL's rendezvous semantics and return the makespan and each
    stage's busy time. Raises ValueError if the plans deadlock or a receive would get another message.

    An `Exchange` posts its actions together and the stage waits until all of them complete; a bare
    send or receive action is an exchange of its own (one `batch_isend_irecv` per action). A send completes
    only when the peer has posted the matching receive, and a receive when the send is posted (transfers cost
    nothing). Messages between two stages pair in the order posted (NCCL has no tags)."""
    stages = len(plans)
    steps = [[x if isinstance(x, Exchange) or x.kind not in _COMM else Exchange((x,)) for x in p] for p in plans]
    clock = [0.0] * stages
    busy = [0.0] * stages
    pos = [0] * stages
    posted = [False] * stages
    done: list[list[float]] = [[] for _ in range(stages)]  # completion times of the current exchange's actions
    # (from, to) -> the sends of that direction posted and not yet paired: (stage, action, time); and receives
    sends: dict[tuple[int, int], list[tuple[int, Action, float]]] = {}
    recvs: dict[tuple[int, int], list[tuple[int, Action, float]]] = {}
    while any(pos[s] < len(steps[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while pos[s] < len(steps[s]):
                x = steps[s][pos[s]]
                if isinstance(x, Action):
                    cost = forward_cost if x.kind == "F" else backward_cost
                    clock[s] += cost
                    busy[s] += cost
                    pos[s] += 1
                elif not posted[s]:
                    posted[s] = True
                    _post(s, x, clock[s], stages, sends, recvs)
                    _pair(sends, recvs, done)
                elif len(done[s]) < len(x.ops):
                    break  # waiting on a peer to post its side
                else:
                    clock[s] = max(clock[s], *done[s])
                    posted[s], done[s] = False, []
                    pos[s] += 1
                progressed = True
        if not progressed:
            waiting = {s: steps[s][pos[s]] for s in range(stages) if pos[s] < len(steps[s])}
            raise ValueError(f"the schedule deadlocks: stages wait on {waiting}")
    return max(clock), busy


def _post(s: int, x: Exchange, now: float, stages: int, sends: dict[tuple[int, int], list[tuple[int, Action, float]]],
          recvs: dict[tuple[int, int], list[tuple[int, Action, float]]]) -> None:
    for a in x.ops:
        peer = s + peer_offset(a.kind)
        if not 0 <= peer < stages:
            raise ValueError(f"stage {s}: {a} has no neighbour stage {peer}")
        if a.kind.startswith("SEND"):
            sends.setdefault((s, peer), []).append((s, a, now))
        else:
            recvs.setdefault((peer, s), []).append((s, a, now))


def _pair(sends: dict[tuple[int, int], list[tuple[int, Action, float]]],
          recvs: dict[tuple[int, int], list[tuple[int, Action, float]]], done: list[list[float]]) -> None:
    """Pair the posted sends and receives of each direction in order; both complete when the later is posted."""
    for key, queue in sends.items():
        waiting = recvs.get(key, [])
        while queue and waiting:
            (src, send, t_send), (dst, recv, t_recv) = queue.pop(0), waiting.pop(0)
            if (send.kind[-1], send.micro) != (recv.kind[-1], recv.micro):
                raise ValueError(f"stage {dst}'s {recv} would receive stage {src}'s {send}")
            done[src].append(max(t_send, t_recv))
            done[dst].append(max(t_send, t_recv))


def peak_in_flight(plan: list[Action]) -> int:
    """The most micro-batches whose activations a stage holds at once (forwarded, not yet backwarded)."""
    held = peak = 0
    for a in plan:
        if a.kind == "F":
            held += 1
            peak = max(peak, held)
        elif a.kind == "B":
            held -= 1
    return peak


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The idle share of a synchronous pipeline with equal stages: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)
