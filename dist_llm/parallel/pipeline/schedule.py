"""Pipeline schedules as data: for each stage, the ordered list of actions it performs in one step.

A schedule is a pure function of (stages, micro-batches) and knows nothing of processes, so it can be
checked (every micro-batch forward then backward once per stage, no deadlock, the bubble) without any.
One executor runs any schedule: it performs the actions in order, the receives and sends blocking on the
neighbour stage.

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


def simulate(plans: list[list[Action]], *, forward_cost: float = 1.0,
             backward_cost: float = 2.0) -> tuple[float, list[float]]:
    """Run the plans on an idealised machine (sends cost nothing, a receive waits for its send) and return
    the makespan and each stage's busy time. Raises ValueError if the plans deadlock."""
    stages = len(plans)
    clock = [0.0] * stages
    busy = [0.0] * stages
    pos = [0] * stages
    sent: dict[tuple[str, int, int], float] = {}  # (direction, receiving stage, micro) -> time available
    while any(pos[s] < len(plans[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while pos[s] < len(plans[s]):
                a = plans[s][pos[s]]
                if a.kind in ("RECV_F", "RECV_B"):
                    key = (a.kind[-1], s, a.micro)
                    if key not in sent:
                        break  # blocked until the neighbour sends
                    clock[s] = max(clock[s], sent.pop(key))
                elif a.kind in ("F", "B"):
                    cost = forward_cost if a.kind == "F" else backward_cost
                    clock[s] += cost
                    busy[s] += cost
                elif a.kind == "SEND_F":
                    sent[("F", s + 1, a.micro)] = clock[s]
                else:
                    sent[("B", s - 1, a.micro)] = clock[s]
                pos[s] += 1
                progressed = True
        if not progressed:
            waiting = [plans[s][pos[s]] for s in range(stages) if pos[s] < len(plans[s])]
            raise ValueError(f"the schedule deadlocks at actions {waiting}")
    return max(clock), busy


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
