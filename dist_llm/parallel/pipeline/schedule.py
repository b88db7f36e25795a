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
from typing import Callable, Literal, Mapping, Sequence

Kind = Literal["RECV_F", "F", "SEND_F", "RECV_B", "B", "SEND_B", "W"]


@dataclass(frozen=True)
class Action:
    kind: Kind
    micro: int
    chunk: int = 0  # which of the rank's model chunks (interleaved schedules; 0 elsewhere)

    def __repr__(self) -> str:
        return f"{self.kind} {self.micro}" + (f"/{self.chunk}" if self.chunk else "")


def _forward(stage: int, stages: int, m: int, chunk: int = 0, chunks: int = 1) -> list[Action]:
    """`stage` of `stages` ranks; with chunks > 1, virtual stage chunk * stages + stage of stages * chunks."""
    v = chunk * stages + stage
    acts = [] if v == 0 else [Action("RECV_F", m, chunk)]
    acts.append(Action("F", m, chunk))
    if v < stages * chunks - 1:
        acts.append(Action("SEND_F", m, chunk))
    return acts


def _backward(stage: int, stages: int, m: int, chunk: int = 0, chunks: int = 1) -> list[Action]:
    v = chunk * stages + stage
    acts = [] if v == stages * chunks - 1 else [Action("RECV_B", m, chunk)]
    acts.append(Action("B", m, chunk))
    if v > 0:
        acts.append(Action("SEND_B", m, chunk))
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


def zb1(stages: int, micro_batches: int, *, overlap: bool = False) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B's order of forwards and backwards, each
    backward split into B (the input gradient, which the previous stage waits for) and W (the weight gradients,
    which nobody waits for). Stage s holds back the W of its first s micro-batches and runs them late, where
    1F1B would wait on a neighbour; so it holds at most `stages` micro-batches' activations, 1F1B's peak (its
    first stage's), and its stages' critical path shrinks to F + B per hop.

    Where a W goes was chosen with `simulate` (rendezvous sends, exchanges posted as one): on the first stage
    right after its B; on the middle stages between B and the send of its input gradient (a W after that send
    would split the send-backward-receive-forward exchange the previous stage posts as one); on the last
    stage after that exchange. Under those semantics it recovers about half of the ideal saving of (p-1)(F+B-W)
    over 1F1B's (p-1)(F+B+W): test_pipeline_schedule checks the figures. With `overlap` (exchanges waited for
    only where their receive is used) the middle stages too run their W's after that exchange, as the last stage
    does, so a stage computes W while its exchange waits for the neighbours (test_zb1_with_overlap)."""
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
            elif s < stages - 1 and not overlap:  # before the send of the input gradient
                acts += back[:-1] + ws + back[-1:]
            else:  # after the exchange that follows (the send, and the next forward's receive)
                acts += back
                due = ws
        acts += due + [Action("W", m) for m in range(weights, micro_batches)]
        plans.append(acts)
    return plans


def interleaved(stages: int, micro_batches: int, chunks: int, *, overlap: bool = False) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021; Megatron's virtual pipeline): rank r holds `chunks` model chunks,
    virtual stages r, r + p, ..., so a micro-batch passes every rank `chunks` times and the bubble shrinks to
    (p-1)/(v*m + p-1) of a step. Each rank runs its chunks' forwards in groups of p micro-batches (chunk 0 of
    micro-batches 0..p-1, then chunk 1 of them, ...), the backwards likewise from the last chunk, warming up
    with 2(p-1-r) + (v-1)p forwards. It needs m divisible by p (config.py refuses other m).

    Its point-to-point actions come as Megatron posts them, one exchange after each computation (or forward-
    backward pair in the steady state) with every message of that moment, in both directions round the ring:
    the send of what was computed and the receive of what is computed next. With `overlap` (Megatron's
    overlap_p2p_comm) the steady state's messages go after the computation they belong to instead: the forward's
    send with the next forward's receive right after the forward, the backward's likewise after the backward,
    so that each exchange has a whole computation of the other kind to complete behind before it is waited on
    (build_plans keeps the two directions apart, the executor waits where a computation needs its input)."""
    p, m, v = stages, micro_batches, chunks
    if m % p:
        raise ValueError(f"interleaved schedule: {m} micro-batches are not a multiple of {p} stages")
    total = m * v

    def fwd(r: int, k: int) -> list[Action]:  # the rank's k-th forward: [RECV_F], F, [SEND_F]
        return _forward(r, p, (k // (p * v)) * p + k % p, (k // p) % v, v)

    def bwd(r: int, k: int) -> list[Action]:
        return _backward(r, p, (k // (p * v)) * p + k % p, v - 1 - (k // p) % v, v)

    def sends(acts: list[Action]) -> list[Action]:
        return [a for a in acts if a.kind.startswith("SEND")]

    def recvs(acts: list[Action]) -> list[Action]:
        return [a for a in acts if a.kind.startswith("RECV")]

    def computes(acts: list[Action]) -> list[Action]:
        return [a for a in acts if a.kind not in _COMM]

    plans = []
    for r in range(p):
        warmup = total if m == p else min(total, 2 * (p - 1 - r) + (v - 1) * p)
        acts = recvs(fwd(r, 0))
        for k in range(warmup):
            after = sends(fwd(r, k)) + (recvs(fwd(r, k + 1)) if k + 1 < total else [])
            if k == warmup - 1:  # the first backward's gradient, with the last warm-up forward's messages
                after += recvs(bwd(r, 0))
            acts += computes(fwd(r, k)) + after
        for i in range(total - warmup):
            k = warmup + i
            next_f, next_b = (recvs(fwd(r, k + 1)) if k + 1 < total else []), recvs(bwd(r, i + 1))
            if overlap:
                acts += computes(fwd(r, k)) + sends(fwd(r, k)) + next_f
                acts += computes(bwd(r, i)) + sends(bwd(r, i)) + next_b
            else:
                acts += computes(fwd(r, k)) + computes(bwd(r, i)) + sends(fwd(r, k)) + sends(bwd(r, i)) + next_f + next_b
        for i in range(total - warmup, total):
            acts += computes(bwd(r, i)) + sends(bwd(r, i)) + (recvs(bwd(r, i + 1)) if i + 1 < total else [])
        plans.append(acts)
    return plans


SCHEDULES: dict[str, Callable[[int, int], list[list[Action]]]] = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb1": zb1}


def forward_only(stages: int, micro_batches: int, chunks: int = 1) -> list[list[Action]]:
    """The forward half of a schedule (evaluation): receive, forward, send each micro-batch in turn (with
    chunks > 1, through each chunk in turn: a micro-batch goes round the ring `chunks` times)."""
    p, m, v = stages, micro_batches, chunks
    # (interleaved: chunk by chunk in groups of p micro-batches, as its forwards, so the ring stays busy)
    order = ([((k // (p * v)) * p + k % p, (k // p) % v) for k in range(m * v)] if v > 1 and m % p == 0
             else [(i, c) for i in range(m) for c in range(v)])
    return [[a for i, c in order for a in _forward(s, p, i, c, v)] for s in range(p)]


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


def exchanges(plan: list[Action], *, both_neighbours: bool = False, by_direction: bool = False) -> list[Step]:
    """Group a stage's point-to-point actions into exchanges: the actions between two computations that talk
    to the same neighbour go together (a send and the receive that pairs with it), others apart; with
    `both_neighbours` all of them (interleaved schedules, whose ranks talk around a ring, post a chunk's
    send-forward with another chunk's receive-backward, as Megatron's batched p2p does); with `by_direction`
    the forward messages (activations) apart from the backward ones (gradients), so that a computation waits
    only for its own kind (interleaved with overlap: a stage's last warm-up forward posts its activation's send
    and the next forward's receive apart from the first backward's receive)."""
    steps: list[Step] = []
    for a in plan:
        last = steps[-1] if steps else None
        if a.kind not in _COMM:
            steps.append(a)
        elif (isinstance(last, Exchange)
              and (both_neighbours or peer_offset(last.ops[0].kind) == peer_offset(a.kind))
              and not (by_direction and last.ops[-1].kind[-1] != a.kind[-1])):
            steps[-1] = Exchange((*last.ops, a))
        else:
            steps.append(Exchange((a,)))
    return steps


def build_plans(name: str, stages: int, micro_batches: int, chunks: int = 1, *,
                overlap: bool = False) -> list[list[Step]]:
    """Every stage's steps for schedule `name` ("forward" for evaluation; "interleaved" with `chunks` model
    chunks per rank), as the executor runs them. `overlap` (parallel.pp_overlap_p2p): the executor posts each
    exchange without waiting and waits for a receive only before the computation that uses it; the interleaved
    schedule then orders and groups its messages for that (`interleaved`)."""
    if name == "interleaved" or (name == "forward" and chunks > 1):
        plans = (interleaved(stages, micro_batches, chunks, overlap=overlap) if name == "interleaved"
                 else forward_only(stages, micro_batches, chunks))
        return [exchanges(p, both_neighbours=True, by_direction=overlap) for p in plans]
    if name == "zb1":
        return [exchanges(p) for p in zb1(stages, micro_batches, overlap=overlap)]
    make = forward_only if name == "forward" else SCHEDULES[name]
    return [exchanges(p) for p in make(stages, micro_batches)]


def simulate(plans: list[list[Step]], *, forward_cost: float = 1.0, backward_cost: float = 2.0,
             weight_cost: float | None = None,
             costs: Sequence[Mapping[str | tuple[str, int], float]] | None = None,
             exchange_cost: float | Mapping[int, float] = 0.0, overlap: bool = False,
             post_cost: float | Sequence[float | Sequence[float]] = 0.0,
             trace: list[tuple[int, Action, float]] | None = None) -> tuple[float, list[float]]:
    """Run the plans on an idealised machine with NCCL's rendezvous semantics and return the makespan and each
    stage's busy time. Raises ValueError if the plans deadlock or a receive would get another message.

    `backward_cost` is a whole backward; where a plan splits it (W actions), W costs `weight_cost` (half of it
    unless given: the weight-gradient matmuls are as many as the input-gradient ones) and B the rest.
    `costs` replaces those unit costs with one table per stage, such as the seconds each action took on a real
    run (StageClock.breakdown): "F", "B", "W", and under the interleaved schedule "F1", "B1" ... for chunk 1 ...
    (a chunk without its own entry costs the plain kind's); a key (kind, micro-batch), such as ("B1", 3), costs
    that one action (a replay of a step's own durations, StageClock.action_seconds). Each table needs the plain
    kinds its plan has ("F", "B", and "W" under ZB-H1), the fallback of actions without their own key.

    An `Exchange` posts its actions together (a bare send or receive action is an exchange of its own). A
    stage's exchanges run one after another, as NCCL runs a communicator's calls in its stream: one starts once it
    is posted and the one before it has completed. A send completes only when the peer's exchange holding the
    matching receive has started, and a receive when the send's has; the exchange completes `exchange_cost`
    after the last of its messages could (a transfer's latency; 0: free), or, given a mapping, the cost of an
    exchange of that many messages (the real cost grows with them: several transfers and wake-ups, measured by
    bench_pp; a count without an entry costs the nearest one below it, or above). Messages between two stages
    pair in the order posted (NCCL has no tags). Without `overlap` a stage waits for each exchange as it posts
    it; with it (the executor's parallel.pp_overlap_p2p) it goes on, waits for a receive only before the
    computation that uses it (F for an activation, B for a gradient), for a call that only sends before it posts
    the next (so that its tensors go), and for the rest at its plan's end.
    `post_cost` is the time a stage spends posting an exchange (preparing its tensors, the call), idle, before the
    exchange counts as posted: one figure, or per stage one figure or a list with one per exchange of its plan in
    order (a replay of a step's own posts); 0 leaves posting free."""
    stages = len(plans)
    if costs is not None:
        if len(costs) != stages:
            raise ValueError(f"simulate: {len(costs)} cost tables for {stages} stages")
        for s, (plan, table) in enumerate(zip(plans, costs)):
            kinds = {x.kind for x in plan if isinstance(x, Action) and x.kind in ("F", "B", "W")}
            missing = sorted(k for k in kinds if k not in table)
            if missing:
                raise ValueError(f"simulate: stage {s}'s cost table has no {', '.join(missing)} (its plan has "
                                 f"{', '.join(sorted(kinds))} actions)")
    else:
        w_cost = backward_cost / 2 if weight_cost is None else weight_cost
        costs = [{"F": forward_cost, "W": w_cost,
                  "B": backward_cost - w_cost if any(isinstance(x, Action) and x.kind == "W" for x in p)
                  else backward_cost} for p in plans]
    steps = [[x if isinstance(x, Exchange) or x.kind not in _COMM else Exchange((x,)) for x in p] for p in plans]
    if not isinstance(post_cost, (int, float)):
        for s, (plan, mine) in enumerate(zip(steps, post_cost, strict=True)):
            count = sum(isinstance(x, Exchange) for x in plan)
            if not isinstance(mine, (int, float)) and len(mine) != count:
                raise ValueError(f"simulate: stage {s}'s post costs are {len(mine)}, its plan has {count} exchanges")
    clock = [0.0] * stages  # when each stage's next computation could start (its host's time)
    busy = [0.0] * stages
    pos = [0] * stages
    # each stage's exchanges in the order posted: [exchange, posted at, started, completed at or None]
    queue: list[list[list]] = [[] for _ in range(stages)]
    head = [0] * stages  # the exchange now running (or next to run) in each stage's stream
    home: list[dict[tuple[str, int, int], int]] = [{} for _ in range(stages)]  # a receive's exchange (queue index)
    done: list[list[float]] = [[] for _ in range(stages)]  # when the running exchange's messages could complete
    # (from, to) -> the sends of that direction posted and not yet paired: (stage, action, time); and receives
    sends: dict[tuple[int, int], list[tuple[int, Action, float]]] = {}
    recvs: dict[tuple[int, int], list[tuple[int, Action, float]]] = {}

    def ready(s: int, index: int | None) -> bool:
        """Whether stage s may go on past a wait for exchange `index` (None: nothing to wait for); if so, its
        clock moves to that exchange's completion."""
        if index is None:
            return True
        completed = queue[s][index][3]
        if completed is None:
            return False
        clock[s] = max(clock[s], completed)
        return True

    received = [{(a.kind[-1], a.micro, a.chunk) for x in p if isinstance(x, Exchange) for a in x.ops
                 if a.kind.startswith("RECV")} for p in steps]

    def waits_for(s: int, x: Action) -> int | None:
        key = (x.kind, x.micro, x.chunk)
        if key not in received[s]:
            return None  # (W; the first stage's forwards, the last stage's backwards)
        if key not in home[s]:
            raise ValueError(f"stage {s}: {x} comes before the receive of its input")
        return home[s][key]

    while any(pos[s] < len(steps[s]) or head[s] < len(queue[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while head[s] < len(queue[s]):  # the stream: start the next exchange, or complete the running one
                entry = queue[s][head[s]]
                if not entry[2]:
                    previous = queue[s][head[s] - 1][3] if head[s] else 0.0
                    entry[2] = True
                    _post(s, entry[0], max(entry[1], previous), stages, sends, recvs)
                    _pair(sends, recvs, done)
                elif len(done[s]) < len(entry[0].ops):
                    break  # waiting on a peer to post its side
                else:
                    entry[3] = max(done[s]) + _exchange_cost(exchange_cost, len(entry[0].ops))
                    done[s] = []
                    head[s] += 1
                progressed = True
            while pos[s] < len(steps[s]):
                x = steps[s][pos[s]]
                if not overlap and pos[s] and isinstance(steps[s][pos[s] - 1], Exchange):
                    if not ready(s, len(queue[s]) - 1):
                        break  # waiting for the exchange it just posted
                if isinstance(x, Exchange):
                    if overlap and queue[s] and not any(a.kind.startswith("RECV") for a in queue[s][-1][0].ops):
                        if not ready(s, len(queue[s]) - 1):
                            break  # the executor waits for a call that only sends before it posts the next
                    clock[s] += _post_cost(post_cost, s, len(queue[s]))
                    for a in x.ops:
                        if a.kind.startswith("RECV"):
                            home[s][(a.kind[-1], a.micro, a.chunk)] = len(queue[s])
                    queue[s].append([x, clock[s], False, None])
                    pos[s] += 1
                    progressed = True
                    if not overlap:
                        break  # (its stream starts it; the wait comes at the next look)
                    continue
                if not ready(s, waits_for(s, x)):  # type: ignore[arg-type]  # (without overlap: done already)
                    break  # waiting for a receive this computation needs
                cost = _cost(costs[s], x)
                if trace is not None:  # (stage, computation, its start)
                    trace.append((s, x, clock[s]))
                clock[s] += cost
                busy[s] += cost
                pos[s] += 1
                progressed = True
        if not progressed:
            waiting = {s: queue[s][head[s]][0] if head[s] < len(queue[s]) else steps[s][pos[s]]
                       for s in range(stages) if pos[s] < len(steps[s]) or head[s] < len(queue[s])}
            raise ValueError(f"the schedule deadlocks: stages wait on {waiting}")
    for s in range(stages):  # a stage's step ends when its last exchange has completed (its sends too)
        clock[s] = max([clock[s]] + [entry[3] for entry in queue[s]])
    return max(clock, default=0.0), busy


def _post_cost(cost: float | Sequence[float | Sequence[float]], stage: int, index: int) -> float:
    if isinstance(cost, (int, float)):
        return float(cost)
    mine = cost[stage]
    return float(mine) if isinstance(mine, (int, float)) else float(mine[index])


def _exchange_cost(cost: float | Mapping[int, float], messages: int) -> float:
    if not isinstance(cost, Mapping):
        return cost
    if not cost:
        return 0.0
    below = [n for n in cost if n <= messages]
    return cost[max(below)] if below else cost[min(cost)]


def _cost(table: Mapping[str | tuple[str, int], float], a: Action) -> float:
    name = f"{a.kind}{a.chunk}" if a.chunk else a.kind
    if (name, a.micro) in table:
        return table[name, a.micro]
    return table[name] if name in table else table[a.kind]


def _post(s: int, x: Exchange, now: float, stages: int, sends: dict[tuple[int, int], list[tuple[int, Action, float]]],
          recvs: dict[tuple[int, int], list[tuple[int, Action, float]]]) -> None:
    for a in x.ops:
        peer = s + peer_offset(a.kind)
        if not 0 <= peer < stages:
            if a.chunk == 0 and not (a.kind == "SEND_F" or a.kind == "RECV_B"):
                raise ValueError(f"stage {s}: {a} has no neighbour stage {peer}")
            peer %= stages  # interleaved: the ring's next chunk (last rank to the first) or previous one
        if peer == s:
            raise ValueError(f"stage {s}: {a} has no neighbour stage {s + peer_offset(a.kind)}")
        if a.kind.startswith("SEND"):
            sends.setdefault((s, peer), []).append((s, a, now))
        else:
            recvs.setdefault((peer, s), []).append((s, a, now))


def _pair(sends: dict[tuple[int, int], list[tuple[int, Action, float]]],
          recvs: dict[tuple[int, int], list[tuple[int, Action, float]]], done: list[list[float]]) -> None:
    """Pair the posted sends and receives of each direction in order; both can complete once the later is
    posted (the exchange's cost comes on top)."""
    stages = len(done)
    for key, queue in sends.items():
        waiting = recvs.get(key, [])
        while queue and waiting:
            (src, send, t_send), (dst, recv, t_recv) = queue.pop(0), waiting.pop(0)
            # the receiver's virtual stage (chunk * stages + stage) must be the sender's next (F) or previous (B)
            step = 1 if send.kind == "SEND_F" else -1
            if ((send.kind[-1], send.micro, send.chunk * stages + src + step)
                    != (recv.kind[-1], recv.micro, recv.chunk * stages + dst)):
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


def peak_pending_weights(plan: list[Action]) -> int:
    """The most micro-batches a split stage has run B for and not yet W: each keeps its W's state (the gradient
    that reached every weight's op, split_backward.WeightWork) beside its graph. For ZB-H1, stage s holds back s
    W's, and on the last stage the one due runs only after the exchange following the next B: s + 1 at once
    (with m >= p). That moment, the end of a B, is also when the stage holds `peak_in_flight` micro-batches'
    graphs (checked for p <= 8 in test_pipeline_schedule), so the two peaks add."""
    pending = peak = 0
    for a in plan:
        if a.kind == "B":
            pending += 1
            peak = max(peak, pending)
        elif a.kind == "W":
            pending -= 1
    return peak if any(a.kind == "W" for a in plan) else 0


def bubble_fraction(stages: int, micro_batches: int, *, schedule: str = "1f1b", chunks: int = 1,
                    overlap: bool = False) -> float:
    """The idle share of a step with equal stages, a backward twice a forward, W half of it (as `simulate`):
    GPipe and 1F1B (p-1)/(m+p-1); interleaved with v chunks per stage (p-1)/(v*m+p-1); ZB-H1
    2(p-1)/(3m+2(p-1)), its bubble (p-1)(F+B) instead of (p-1)(F+B+W) (at m = p one forward less), and with
    `overlap` (its W's run while exchanges wait) the paper's (p-1)(F+B-W): (p-1)/(3m+p-1) for m >= p (fewer
    micro-batches than stages: the simulator's figure)."""
    p, m = stages, micro_batches
    if schedule == "zb1" and overlap:
        if m >= p:
            return (p - 1) / (3 * m + p - 1)
        makespan, busy = simulate(build_plans("zb1", p, m, overlap=True), overlap=True)
        return 1 - busy[0] / makespan
    if schedule == "zb1":
        return 2 * (p - 1) / (3 * m + 2 * (p - 1))
    return (p - 1) / (chunks * m + p - 1)
