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
  W m        the weight gradients of micro-batch m (zero-bubble schedules only: there B computes the input
             gradient alone, which the previous stage waits for, and W the rest, later, where a stage would idle)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

Kind = Literal["RECV_F", "F", "SEND_F", "RECV_B", "B", "SEND_B", "W"]


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


def zb1(stages: int, micro_batches: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B's order of forwards and backwards, each
    backward split into B (the input gradient, which the previous stage waits for) and W (the weight gradients,
    which nobody waits for). Stage s holds back the W of its first s micro-batches and runs them late, where
    1F1B would wait on a neighbour; so it holds at most `stages` micro-batches' activations, 1F1B's peak (its
    first stage's), and its stages' critical path shrinks to F + B per hop.

    Where a W goes was chosen with `simulate` (rendezvous sends, exchanges posted as one): on the first stage
    right after its B; on the middle stages between B and the send of its input gradient (a W after that send
    would split the send-backward-receive-forward exchange the previous stage posts as one); on the last
    stage after that exchange. Under those semantics it recovers about half of the ideal saving of (p-1)(F+B-W)
    over 1F1B's (p-1)(F+B+W): test_pipeline_schedule checks the figures."""
    plans = []
    for s in range(stages):
        warmup = min(stages - 1 - s, micro_batches)
        order = [("F", m) for m in range(warmup)]
        for i in range(micro_batches - warmup):
            order += [("F", warmup + i), ("B", i)]
        order += [("B", m) for m in range(micro_batches - warmup, micro_batches)]
        acts: list[Action] = []
        due: list[Action] = []  # W's to place after the coming exchange (last stage)
        weights = backwards = 0
        for kind, m in order:
            if kind == "F":
                head = _forward(s, stages, m)
                acts += head[:1] if head[0].kind == "RECV_F" else []
                acts += due + head[1:] if head[0].kind == "RECV_F" else due + head
                due = []
                continue
            acts += due
            due = []
            back = _backward(s, stages, m)
            backwards += 1
            ws = []
            while backwards - weights > s:
                ws.append(Action("W", weights))
                weights += 1
            if s == 0:
                acts += back + ws
            elif s < stages - 1:  # before the send of the input gradient
                acts += back[:-1] + ws + back[-1:]
            else:  # after the exchange that follows (the send, and the next forward's receive)
                acts += back
                due = ws
        acts += due + [Action("W", m) for m in range(weights, micro_batches)]
        plans.append(acts)
    return plans


SCHEDULES: dict[str, Callable[[int, int], list[list[Action]]]] = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb1": zb1}


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


def simulate(plans: list[list[Step]], *, forward_cost: float = 1.0, backward_cost: float = 2.0,
             weight_cost: float | None = None,
             trace: list[tuple[int, Action, float]] | None = None) -> tuple[float, list[float]]:
    """Run the plans on an idealised machine with NCCL's rendezvous semantics and return the makespan and each
    stage's busy time. Raises ValueError if the plans deadlock or a receive would get another message.

    `backward_cost` is a whole backward; where a plan splits it (W actions), W costs `weight_cost` (half of it
    unless given: the weight-gradient matmuls are as many as the input-gradient ones) and B the rest.

    An `Exchange` posts its actions together and the stage waits until all of them complete; a bare
    send or receive action is an exchange of its own (one `batch_isend_irecv` per action). A send completes
    only when the peer has posted the matching receive, and a receive when the send is posted (transfers cost
    nothing). Messages between two stages pair in the order posted (NCCL has no tags)."""
    stages = len(plans)
    w_cost = backward_cost / 2 if weight_cost is None else weight_cost
    costs = [{"F": forward_cost, "W": w_cost,
              "B": backward_cost - w_cost if any(isinstance(x, Action) and x.kind == "W" for x in p) else backward_cost}
             for p in plans]
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
                    cost = costs[s][x.kind]
                    if trace is not None:  # (stage, computation, its start)
                        trace.append((s, x, clock[s]))
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
    """The most micro-batches whose activations a stage holds at once (forwarded, their backward not done)."""
    frees = "W" if any(a.kind == "W" for a in plan) else "B"  # W still needs the saved activations
    held = peak = 0
    for a in plan:
        if a.kind == "F":
            held += 1
            peak = max(peak, held)
        elif a.kind == frees:
            held -= 1
    return peak


def bubble_fraction(stages: int, micro_batches: int, *, schedule: str = "1f1b") -> float:
    """The idle share of a step with equal stages, a backward twice a forward, W half of it (as `simulate`):
    GPipe and 1F1B (p-1)/(m+p-1); ZB-H1 2(p-1)/(3m+2(p-1)), its bubble (p-1)(F+B) instead of (p-1)(F+B+W)
    (at m = p one forward less)."""
    p, m = stages, micro_batches
    if schedule == "zb1":
        return 2 * (p - 1) / (3 * m + 2 * (p - 1))
    return (p - 1) / (m + p - 1)
