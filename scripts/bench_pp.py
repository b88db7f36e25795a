"""Pipeline parallelism on CPU: each stage's bubble beside the simulator's, and the first stage's activation memory,
for GPipe, 1F1B, ZB-H1 (zb1) and interleaved 1F1B.

    python scripts/bench_pp.py [--pp 2 4] [--micro-batches 4 8 16] [--schedules gpipe 1f1b [zb1] [interleaved]
                               [zb1+overlap] [interleaved+overlap]]
                               [--virtual 2] [--layers 8] [--width 256] [--seq 128] [--micro-batch 2] [--steps 3]
                               [--threads N] [--predict measured|units] [--exchange-cost fitted|measured|latency]
                               [--until-decided [--max-minutes 10]] [--json PATH]

What it measures, through dist_llm's Trainer (fp32, dp=1, tp=1, one process per stage, cores // stages torch
threads each unless --threads: one on a 2-core machine at p=2). A schedule runs with parallel.pp_overlap_p2p=false
(each exchange waited for as it is posted) unless named with +overlap (posted without waiting, each receive waited
for by the computation that uses it; simulated alike):
  busy / idle     per stage, the seconds of a step it spent in forward, backward (B, W) actions and the rest
                  (`Trainer.pipeline_times()`, the stage clock metrics.jsonl carries as pp_busy_s/pp_idle_s), the
                  median over --steps timed steps after two warm-up steps (the schedules at one m built together,
                  one untimed round of their steps in turn, then their timed steps in turn, unless --sequential),
                  beside three figures of the simulator
                  (schedule.simulate, the same plans, sends that wait for their receive):
                  simulated  unit costs: a backward twice a forward, W half of it, chunks 1/v of a stage (and the
                             closed form beside: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) interleaved,
                             2(p-1)/(3m+2(p-1)) ZB-H1);
                  predicted  each stage's measured seconds per action (mean of its F, B, W; F1, B1 ... for later
                             chunks) and per exchange posting (its tensors and the batch_isend_irecv call: the
                             stage's own time, idle), each exchange's cost and the work after the schedule
                             (gradient completion, the norm: the shortest stage tail). An exchange's cost is what
                             it takes after the last of its sides' postings ended (the transfers, the wake-ups),
                             charged as (--exchange-cost) fitted: its messages times the
                             cost per message of 1F1B's exchanges at the same m (their excess in all over their
                             messages in all), so every other schedule's exchanges are charged a cost carried
                             over from 1F1B's steps, not taken from their own (at p=2 ZB-H1's have 1F1B's sizes, 1
                             and 2 messages, so its charge is close to its own; interleaved's also 3 and 4, an
                             extrapolation); measured: the
                             mean of this run's own exchanges of that size, which makes the replay an accounting
                             check (its exchange charge equals the measured one by construction); latency: the
                             ping-pong latency. Means, not medians: the costs are right-skewed, and the simulator
                             adds one cost per exchange, so the count-fold of the mean is the expected sum;
                  replayed   the same with each action's and each posting's own seconds in each step (the neighbours' jitter adds
                             waiting that means hide), median over the steps.
                  Then where each stage's idle went (posting and waiting for exchanges, after its last action,
                  executor overhead) and the seconds per action.
  margins         issue 20's target (scripts/pp_stats.py): each schedule's idle (mean of the stages) below 1F1B's at
                  the same m, per pair of timed steps (step i of the schedule and step i of 1F1B, taken one after
                  the other), the mean over the pairs with its 95% t interval; beside it the replayed margin of the
                  same pairs, the predicted one (means: one figure) and the simulated one (units), each with the
                  ratio measured / predicted and its 95% interval (Fieller's: the ratios the paired t-test does
                  not reject; unbounded when the prediction is not clearly away from zero), and the step seconds
                  (a schedule can idle less only because its actions got slower). The verdict, from the ratio to
                  the replayed margin (--predict measured: the simulator on the same two steps' own action
                  seconds, so the jitter that moves a measured pair moves its prediction too and the pairs'
                  covariance narrows the interval; the means-based figure is one number whose own uncertainty its
                  interval leaves out) or to the unit-cost one (--predict units): "met" when the interval lies
                  inside [0.8, 1.2], "not met" when it misses it, "undecided" otherwise; and how many pairs would
                  make the interval +-0.2 (what decides a ratio of 1) or decide at the current estimate, with the
                  minutes those rounds take. --until-decided adds rounds at each m until every verdict is met or
                  not met on 99% intervals with at least 10 pairs (it looks again and again: at 95% a ratio on the
                  target's edge would be decided wrongly in 13-21% of runs, pp_stats.STOP_LEVEL), within
                  --max-minutes of the worker (per --pp value; each m may use its share of what is left, so one
                  decided early leaves its time to the next). With --sequential a pair's two steps are not side by
                  side and load that comes and goes does not cancel in its margin.
  p2p latency     half the median round trip of one activation between ranks 0 and 1 (batch_isend_irecv, gloo).
  activations     the most bytes autograd held saved for backward on the first stage during the first step
                  (saved_tensors_hooks, each storage once, parameters and buffers left out), and that figure in
                  micro-batches: divided by the same count at m=1 (not for interleaved, whose m must be a
                  multiple of p); beside the schedule's peak (GPipe m, 1F1B and ZB-H1 min(m, p)).
  peak memory     per stage, the most its memory (the peak resident set on the CPU) rose over the two warm-up steps
                  above where it stood once the trainer was built: optimizer states, gradients, saved activations,
                  buffers.

With more threads than cores (stages x threads), stages share cores and the idle figures mean little (the table
says so). The script starts its own workers with `python -m torch.distributed.run --standalone`, one launch per
--pp value; rank 0 prints the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, nargs="+", default=[2], help="pipeline stages (processes), one run per value")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16], help="m values")
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"],
                   help="any of gpipe 1f1b zb1 interleaved (the default keeps scripts/bench.py's rows), each also "
                        "with +overlap (parallel.pp_overlap_p2p=true), such as interleaved+overlap")
    p.add_argument("--virtual", type=int, default=2, help="chunks per stage for interleaved (parallel.pp_virtual)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--steps", type=int, default=3, help="timed steps per (schedule, m)")
    p.add_argument("--sequential", action="store_true",
                   help="time each (schedule, m) in one go, not the schedules' steps in turn at each m")
    p.add_argument("--threads", type=int, help="torch threads per stage (default: cores // stages, at least 1)")
    p.add_argument("--predict", choices=["measured", "units"], default="measured",
                   help="the margins' prediction: the simulator with each step's own per-action seconds and the "
                        "--exchange-cost charge (measured), or with unit costs (F 1, B 2, W half of B)")
    p.add_argument("--exchange-cost", choices=["fitted", "measured", "latency"], default="fitted",
                   help="what an exchange costs in the predicted and replayed figures: its messages times the cost "
                        "per message of 1F1B's exchanges at the same m (fitted: carried over to the other "
                        "schedules), what this run's exchanges of each size took beyond the rendezvous (measured: "
                        "an accounting check), or the ping-pong latency of one activation")
    p.add_argument("--until-decided", action="store_true",
                   help="after --steps rounds, take more rounds at each m until every margin's verdict is met or "
                        "not met (on 99%% intervals, 10 pairs at least), or --max-minutes runs out")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="with --until-decided: the worker's time budget per --pp value, default 10 (the m values "
                        "share what is left in turn)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # set when started under torchrun
    args = p.parse_args(argv)
    if args.max_minutes is not None and not args.until_decided:
        p.error("--max-minutes is the budget of --until-decided: give both, or neither")
    if args.max_minutes is not None and not (math.isfinite(args.max_minutes) and args.max_minutes > 0):
        p.error(f"--max-minutes: must be a number of minutes above 0, got {args.max_minutes}")
    if args.max_minutes is None:
        args.max_minutes = 10.0
    known = ("gpipe", "1f1b", "zb1", "interleaved")
    for name in args.schedules:
        if name.removesuffix("+overlap") not in known:
            p.error(f"--schedules: unknown {name!r}: any of {', '.join(known)}, each also with +overlap")
    if args.exchange_cost == "measured" and any(n.endswith("+overlap") for n in args.schedules):
        p.error("--exchange-cost measured charges a run's own exchanges, which +overlap does not time (an exchange "
                "is waited for only where a computation needs it): choose fitted or latency")
    if args.exchange_cost == "fitted" and "1f1b" not in args.schedules:
        p.error("--exchange-cost fitted charges 1F1B's cost per message: put 1f1b in --schedules, or choose "
                "measured or latency")
    return args


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    pp = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # (main sets it; say it, not rely on it)
    rows: list[dict[str, Any]] = []
    runs_of: dict[int, list[tuple[str, int]]] = {}  # m -> the (schedule, v) runs at that m
    for schedule in args.schedules:
        v = args.virtual if schedule.startswith("interleaved") else 1
        for m in set(args.micro_batches) | ({1} if v == 1 else set()):
            if v == 1 or m % pp == 0:
                runs_of.setdefault(m, []).append((schedule, v))
    deadline = time.perf_counter() + 60 * args.max_minutes  # (--until-decided)
    judged = [m for m in sorted(runs_of) if m in args.micro_batches]  # (m=1 is only the memory's unit)
    with tempfile.TemporaryDirectory() as tmp:
        for m in sorted(runs_of):
            # each judged m may use its share of the time left: one decided early leaves its time to the next
            now = time.perf_counter()
            until = now + ((deadline - now) / (len(judged) - judged.index(m)) if m in judged else 0.0)
            rows += measure(args, runs_of[m], m, pp, Path(tmp), until=until)
            gc.collect()  # (the trainers of this m)
    if int(os.environ["RANK"]) == 0:
        args.worker.write_text(json.dumps(rows))
    torch.distributed.destroy_process_group()


def measure(args: argparse.Namespace, schedules: list[tuple[str, int]], m: int, pp: int,
            tmp: Path, *, until: float = 0.0) -> list[dict[str, Any]]:
    """Every schedule at this m built and warmed up, then their timed steps taken in turn (round robin, unless
    --sequential): a load that comes and goes on a shared machine falls on each schedule alike, so their ratios
    hold better than the figures, and step i of each schedule is a pair with step i of 1F1B. With
    --until-decided, more rounds until every margin's verdict is decided or the next round would end after `until`
    (a time.perf_counter() reading)."""
    runs = [Run(args, schedule, v, m, pp, tmp) for schedule, v in schedules]
    latency = p2p_latency((args.micro_batch, args.seq, args.width))  # one activation's trip between two stages
    if not args.sequential:
        # one untimed round in turn: a schedule's first step after the others' faults in its memory again (~12k
        # pages), an outlier that a median left out but a mean over the pairs would not
        for run in runs:
            run.trainer.train_step()
    began = time.perf_counter()
    for run in runs if args.sequential else [None]:
        for i in range(args.steps):
            for r in [run] if run is not None else in_turn(runs, i):
                r.timed_step()
    if args.until_decided and m in args.micro_batches:
        more_rounds(args, runs, m, latency, until, round_s=(time.perf_counter() - began) / max(1, args.steps))
    return rows_of(runs, latency, args.exchange_cost)


def rows_of(runs: list[Run], latency: float, exchange_cost: str) -> list[dict[str, Any]]:
    """Each run's row. Under --exchange-cost fitted every run's exchanges are charged the cost per message of the
    1F1B run's at this m (its exchanges' excess in all over their messages in all): for the other schedules a
    cost carried over from 1F1B's steps, not taken from their own, which the replay then tests."""
    per_message = None
    if exchange_cost == "fitted":
        per_message = cost_per_message(next(r for r in runs if r.schedule == "1f1b").excess_by_size())
    return [run.row(latency, exchange_cost, per_message) for run in runs]


def cost_per_message(excess: dict[int, list[float]]) -> float:
    """Seconds per message: the exchanges' excess in all over the messages in them in all (exchanges by size)."""
    return sum(map(sum, excess.values())) / sum(n * len(x) for n, x in excess.items())


def exchange_charge(model: str, excess: dict[int, list[float]], *, per_message: float | None,
                    latency: float | None) -> dict[int, float]:
    """What the simulator charges an exchange of each size in `excess` (this run's, by size) under
    --exchange-cost `model`: fitted, n x `per_message` (the 1F1B run's); measured, this run's mean of that size;
    latency, the ping-pong `latency` whatever the size. Never below zero: the excess counts from the end of the
    last posting, and with gloo a transfer can finish before the sender's call returns, so a mean of small excesses
    can come out negative, where the exchange really cost nothing beyond its postings."""
    if model == "fitted":
        if per_message is None:
            raise ValueError("--exchange-cost fitted needs 1F1B's cost per message (rows_of)")
        return {n: n * max(0.0, per_message) for n in excess}
    if model == "measured":
        return {n: max(0.0, statistics.fmean(x)) for n, x in excess.items()}
    if model == "latency":
        return {n: latency or 0.0 for n in excess}
    raise ValueError(f"--exchange-cost: unknown {model!r}")


def in_turn(runs: list[Run], i: int) -> list[Run]:
    """Round i's order: the schedules forwards on even rounds, backwards on odd ones, so that what a step leaves to
    the next (the allocator's state, faults) falls on each schedule from both sides, not on one always."""
    return runs if i % 2 == 0 else runs[::-1]


def more_rounds(args: argparse.Namespace, runs: list[Run], m: int, latency: float, until: float, *,
                round_s: float) -> None:
    """--until-decided: rounds of timed steps in turn until pp_stats.undecided() names none of this m's margins,
    or the next round would end after `until`. Rank 0 decides (its clock, its rows) and tells every stage."""
    import torch

    from pp_stats import undecided

    pairs, check_at, left = args.steps, args.steps, ["?"]
    while True:
        go_on = torch.tensor([0], dtype=torch.int64)
        if int(os.environ["RANK"]) == 0:
            if pairs >= check_at:  # (a check replays every step so far: after every tenth more rounds, not each)
                left = undecided(rows_of(runs, latency, args.exchange_cost), args.predict)
                check_at = pairs + max(1, pairs // 10)
                print(f"bench_pp: m={m}, {pairs} pairs, undecided: {', '.join(left) or 'none'}", file=sys.stderr,
                      flush=True)  # (the progress of a long run)
            go_on[0] = int(bool(left) and time.perf_counter() + round_s < until)
            if left and not go_on.item():
                print(f"bench_pp: m={m}, time's up at {pairs} pairs", file=sys.stderr, flush=True)
        torch.distributed.broadcast(go_on, src=0)
        if not go_on.item():
            return
        start = time.perf_counter()
        for r in in_turn(runs, pairs):
            r.timed_step()
        round_s, pairs = time.perf_counter() - start, pairs + 1


class Run:
    """One (schedule, m) on this stage: its trainer, built and warmed up with the memory measured, then timed
    steps on demand."""

    def __init__(self, args: argparse.Namespace, schedule: str, v: int, m: int, pp: int, tmp: Path) -> None:
        import torch

        from dist_llm import perf
        from dist_llm.config import load_config
        from dist_llm.parallel import comm
        from dist_llm.parallel.context import ParallelContext
        from dist_llm.train.saved_tensors import SavedTensorMeter
        from dist_llm.train.trainer import Trainer

        self.schedule, self.v, self.m, self.pp = schedule, v, m, pp
        # (+overlap: the same schedule with parallel.pp_overlap_p2p, its plans built and simulated so)
        self.base, self.overlap = schedule.removesuffix("+overlap"), schedule.endswith("+overlap")
        cfg = load_config(ROOT / "configs" / "tiny.yaml", [
            f"model.n_layer={args.layers}", f"model.n_embd={args.width}", f"model.n_head={args.heads}",
            f"model.block_size={args.seq}", f"train.micro_batch_size={args.micro_batch}",
            f"train.global_batch_size={args.micro_batch * m}", f"parallel.pp={pp}",
            f"parallel.pp_schedule={self.base}", f"parallel.pp_virtual={v}",
            f"parallel.pp_overlap_p2p={str(self.overlap).lower()}", "train.max_steps=100",
            "train.eval_interval=0", "train.device=cpu", f"train.out_dir={tmp}/{schedule}{m}", "train.resume=never"])
        self.ctx = ParallelContext.from_config(cfg)
        self.trainer = Trainer(cfg, self.ctx)
        perf.reset_peak_memory(self.ctx.device)
        start_bytes = perf.memory_bytes(self.ctx.device)
        module = self.trainer.module
        with SavedTensorMeter([*module.parameters(), *module.buffers()]) as meter:
            self.trainer.train_step()  # also the first warm-up step
        self.trainer.train_step()
        held = torch.tensor([meter.peak_bytes], dtype=torch.float64)
        torch.distributed.broadcast(held, src=0)  # the first stage's figure
        self.held = int(held.item())
        peaks = torch.zeros(pp, dtype=torch.int64)  # each stage's memory rise over its two warm-up steps
        comm.all_gather(peaks, torch.tensor([perf.peak_memory_bytes(self.ctx.device) - start_bytes], dtype=torch.int64),
                        torch.distributed.group.WORLD, None)
        self.peaks = peaks.tolist()
        self.times: list[dict[str, list[float]]] = []  # per timed step, Trainer.pipeline_times()
        self.parts: list[list[dict[str, float]]] = []  # per timed step, every stage's clock breakdown
        self.timelines: list[list[list[tuple[str, int, float]]]] = []  # per step and stage, each action's seconds
        self.exchanges: list[list[list[tuple[float, float]]]] = []  # per step and stage, each exchange's (start, end)
        self.posts: list[list[list[tuple[float, float]]]] = []  # per step and stage, each exchange's posting

    def timed_step(self) -> None:
        import torch

        self.ctx.barrier()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        with gc_seconds() as in_gc:
            self.trainer.train_step()
        # pages touched for the first time in the step: memory that is not reused costs the kernel a fault each
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        self.times.append(self.trainer.pipeline_times())
        clock = self.trainer.runtime.stage_clock
        every: list[Any] = [None] * self.pp  # (CPU: perf_counter is one monotonic clock for the host)
        torch.distributed.all_gather_object(every, (clock.breakdown(), clock.action_seconds(), clock.start,
                                                    faults, in_gc[0], clock.exchange_times, clock.exchange_posts))
        first = min(e[2] for e in every)
        self.parts.append([{**b, "start_offset": start - first, "page_faults": f, "gc": g}
                           for b, _, start, f, g, _, _ in every])
        self.timelines.append([e[1] for e in every])
        self.exchanges.append([e[5] for e in every])
        self.posts.append([e[6] for e in every])

    def excess_by_size(self) -> dict[int, list[float]]:
        """Every timed step's exchanges' excess (exchange_excess, from the posts' ends), by their number of
        messages."""
        from dist_llm.parallel.pipeline.schedule import build_plans

        plans = build_plans(self.base, self.pp, self.m, self.v, overlap=self.overlap)
        excess: dict[int, list[float]] = {}
        for step, posts in zip(self.exchanges, self.posts):
            for n, seconds in exchange_excess(plans, step, posts).items():
                excess.setdefault(n, []).extend(seconds)
        return dict(sorted(excess.items()))

    def row(self, latency: float | None, exchange_cost: str = "measured",
            per_message: float | None = None) -> dict[str, Any]:
        import torch

        from dist_llm.parallel.pipeline.schedule import bubble_fraction, build_plans, simulate

        pp, m, v, schedule, overlap = self.pp, self.m, self.v, self.schedule, self.overlap
        plans = build_plans(self.base, pp, m, v, overlap=overlap)
        # what an exchange of n messages cost beyond waiting for the neighbour's side: the simulator's exchange
        # cost for `predicted` and `replayed`. Means, not medians: at p=2 every exchange is on the critical path,
        # so a step's makespan carries their sum, whose expectation is the count times the mean; the costs are
        # right-skewed (wake-ups on a loaded core), and the median charged ~0.5x-0.75x of it (1F1B's 2-message
        # exchanges 0.85 ms median, 1.53 ms mean at m=16). measured: this run's own mean per size (so the replay
        # accounts for the steps it replays); fitted: n times 1F1B's cost per message (rows_of); latency: the
        # ping-pong's, whatever the size
        excess = self.excess_by_size()
        per_size = exchange_charge("measured", excess, per_message=None, latency=None)  # (what they took)
        cost = exchange_charge(exchange_cost, excess, per_message=per_message, latency=latency)
        makespan, sim_busy = simulate(plans, forward_cost=1 / v, backward_cost=2 / v, overlap=overlap)
        parts = [{k: statistics.median(st[i].get(k, 0.0) for st in self.parts) for k in self.parts[0][i]}
                 for i in range(pp)]
        costs = [action_seconds(b) for b in parts]
        # the measured step also holds the work after the schedule (gradient completion, the norm) that the
        # stage finishing last did alone: its tail, the shortest
        post = min(b["tail"] for b in parts)
        # posting an exchange (its tensors, the call) is the stage's own time, as its actions are: each step's own
        # in the replay, each stage's mean in the prediction; what follows the post is the charge above
        post_s = [[[end - start for start, end in stage] for stage in step] for step in self.posts]
        post_mean = [statistics.fmean(x for step in post_s for x in step[i]) if post_s[0][i] else 0.0
                     for i in range(pp)]
        pred_span, pred_busy = simulate(plans, costs=costs, exchange_cost=cost, overlap=overlap, post_cost=post_mean)
        replayed = [replay(plans, costs, t, cost, post=min(b["tail"] for b in st), overlap=overlap, posts=ps)
                    for t, st, ps in zip(self.timelines, self.parts, post_s)]
        med = {k: [statistics.median(t[f"pp_{k}"][i] for t in self.times) for i in range(pp)]
               for k in ("idle_fraction", "busy_s", "idle_s")}
        return {"schedule": schedule, "m": m, "p": pp, "v": v, **med,
                "step_s": max(b + i for b, i in zip(med["busy_s"], med["idle_s"])),
                "predicted_idle_fraction": [round(1 - b / makespan, 4) for b in sim_busy],
                "formula": bubble_fraction(pp, m, schedule=self.base, chunks=v, overlap=overlap), "overlap": overlap,
                "measured_prediction": [round(1 - b / (pred_span + post), 4) for b in pred_busy],
                "predicted_step_s": pred_span + post, "action_s": costs, "breakdown": parts,
                "replayed": [statistics.median(r[i] for r in replayed) for i in range(pp)],
                # per timed step, every stage's figure: the margins' pairs (pp_stats)
                "idle_fraction_steps": [t["pp_idle_fraction"] for t in self.times], "replayed_steps": replayed,
                "p2p_latency_s": latency, "exchange_cost_model": exchange_cost, "post_s": post_mean,
                "exchange_charged_s": {str(n): c for n, c in cost.items()},
                "exchange_s": {str(n): c for n, c in per_size.items()},
                "exchange_median_s": {str(n): statistics.median(x) for n, x in sorted(excess.items())},
                # every exchange's excess, by size (all steps and stages): a run can be scored again another way
                "exchange_excess_s": {str(n): x for n, x in sorted(excess.items())},
                "exchange_count": {str(n): len(x) // (len(self.exchanges) * pp) for n, x in sorted(excess.items())},
                "threads": torch.get_num_threads(),
                "first_stage_saved_bytes": self.held, "peak_bytes": self.peaks}


@contextlib.contextmanager
def gc_seconds() -> Iterator[list[float]]:
    """Seconds Python's cyclic garbage collector ran inside the block (it pauses whatever action is running)."""
    total, began = [0.0], [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            total[0] += time.perf_counter() - began[0]

    gc.callbacks.append(callback)
    try:
        yield total
    finally:
        gc.callbacks.remove(callback)


def action_seconds(breakdown: dict[str, float]) -> dict[str, float]:
    """Seconds per action of each kind on one stage (F, B, W, chunks' F1, B1 ...) from StageClock.breakdown()."""
    return {k: breakdown[k] / breakdown[f"count_{k}"] for k in breakdown if f"count_{k}" in breakdown}


def exchange_excess(plans: list[list[Any]], exchanges: list[list[tuple[float, float]]],
                    posts: list[list[tuple[float, float]]] | None = None) -> dict[int, list[float]]:
    """Seconds each exchange of one step took after the last of its messages' other sides was posted (its own
    post or the neighbour's exchange holding the matching send or receive, paired in order per direction as
    NCCL and gloo pair them), by the number of messages in it: the transfers and the wake-ups that the simulator's
    rendezvous leaves out. `exchanges` is every stage's (start, end) per exchange, on one clock (the host's); with
    `posts`, each exchange's posting (start, end), an exchange counts as posted at its posting's end (the time
    spent posting is then charged apart, simulate's post_cost), else at its start."""
    from dist_llm.parallel.pipeline.schedule import Exchange, peer_offset

    p = len(plans)
    posted: dict[tuple[int, int], list[float]] = {}  # (from, to) -> post times of its sends, in order
    wanted: dict[tuple[int, int], list[float]] = {}  # (from, to) -> post times of the receives, in order
    mine: list[list[tuple[Exchange, float, float, list[tuple[bool, tuple[int, int], int]]]]] = []
    for s, (plan, times) in enumerate(zip(plans, exchanges)):
        xs = [x for x in plan if isinstance(x, Exchange)]
        if len(xs) != len(times):
            raise RuntimeError(f"stage {s}: {len(times)} exchanges timed, its plan has {len(xs)}")
        rows = []
        for j, (x, (start, end)) in enumerate(zip(xs, times)):
            at = posts[s][j][1] if posts is not None else start
            ops = []
            for a in x.ops:
                peer = (s + peer_offset(a.kind)) % p
                send = a.kind.startswith("SEND")
                key = (s, peer) if send else (peer, s)
                queue = (posted if send else wanted).setdefault(key, [])
                ops.append((send, key, len(queue)))
                queue.append(at)
            rows.append((x, at, end, ops))
        mine.append(rows)
    out: dict[int, list[float]] = {}
    for rows in mine:
        for x, start, end, ops in rows:
            # the other side of a send is the receive posted in the same place of that direction, and back
            ready = max([start] + [(wanted if send else posted)[key][i] for send, key, i in ops])
            out.setdefault(len(x.ops), []).append(end - ready)
    return out


def replay(plans: list[Any], means: list[dict[str, float]], timeline: list[list[tuple[str, int, float]]],
           latency: float | dict[int, float], *, post: float, overlap: bool = False,
           posts: list[list[float]] | None = None) -> list[float]:
    """Each stage's idle fraction had the step's plans run with the durations its actions and its exchanges'
    postings (`posts`, per stage in order) really took (not their means: the neighbours' ups and downs add
    waiting), the exchanges' cost and the work after the schedule."""
    from dist_llm.parallel.pipeline.schedule import simulate

    tables = [{**mean, **{(kind, micro): sec for kind, micro, sec in actions}}
              for mean, actions in zip(means, timeline)]
    span, busy = simulate(plans, costs=tables, exchange_cost=latency, overlap=overlap,
                          post_cost=posts if posts is not None else 0.0)
    return [round(1 - b / (span + post), 4) for b in busy]


def p2p_latency(shape: tuple[int, ...], *, trips: int = 30) -> float:
    """Seconds from both sides posting an exchange of one activation (the executor's batch_isend_irecv) to its
    completion, between ranks 0 and 1: half the median round trip of a ping-pong; every rank gets the figure."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    buf = torch.zeros(shape)
    times = []
    dist.barrier()
    if rank < 2:
        peer = 1 - rank
        for i in range(trips + 5):  # (5 warm-up trips)
            start = time.perf_counter()
            for sending in ((True, False) if rank == 0 else (False, True)):
                for work in dist.batch_isend_irecv([dist.P2POp(dist.isend if sending else dist.irecv, buf, peer)]):
                    work.wait()
            if i >= 5:
                times.append((time.perf_counter() - start) / 2)
    out = torch.tensor([statistics.median(times) if times else 0.0], dtype=torch.float64)
    dist.broadcast(out, src=0)
    return float(out.item())


def table(rows: list[dict[str, Any]], pp: int, wanted: list[int]) -> str:
    from dist_llm.parallel.pipeline.schedule import SCHEDULES, interleaved, peak_in_flight

    one = {r["schedule"]: r["first_stage_saved_bytes"] for r in rows if r["m"] == 1}
    head = (f"{'schedule':>23} {'m':>3}  {'busy s per stage':>{8 * pp}}  {'idle s per stage':>{8 * pp}}  "
            f"{'idle fraction':>{8 * pp}}  {'replayed':>{8 * pp}}  {'predicted':>{8 * pp}}  {'simulated':>{8 * pp}}  "
            f"{'formula':>7}  "
            f"{'stage-0 saved MiB':>17} {'in micro-batches':>16} {'expected':>8}  peak MiB per stage")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["m"] not in wanted:
            continue
        cols = [" ".join(f"{x:7.3f}" for x in r[k]) for k in ("busy_s", "idle_s", "idle_fraction", "replayed",
                                                            "measured_prediction", "predicted_idle_fraction")]
        v = r.get("v", 1)
        base = r["schedule"].removesuffix("+overlap")
        plans = interleaved(pp, r["m"], v) if base == "interleaved" else SCHEDULES[base](pp, r["m"])
        plan = plans[0]
        expected = peak_in_flight(plan) / v
        held = (f"{r['first_stage_saved_bytes'] / one[r['schedule']]:>16.2f}" if r["schedule"] in one else f"{'-':>16}")
        name = r["schedule"] + (f" v={v}" if v > 1 else "")
        lines.append(f"{name:>23} {r['m']:>3}  " + "  ".join(f"{c:>{8 * pp}}" for c in cols)
                     + f"  {r['formula']:>7.3f}  {r['first_stage_saved_bytes'] / 2**20:>17.2f} {held}"
                     + f" {expected:>8.2f}  "
                     + " ".join(f"{b / 2**20:.1f}" for b in r["peak_bytes"]))
    return "\n".join(lines)


def _name(r: dict[str, Any]) -> str:
    return r["schedule"] + (f" v={r['v']}" if r.get("v", 1) > 1 else "")


def actions(rows: list[dict[str, Any]], pp: int, wanted: list[int]) -> str:
    """Milliseconds per action on each stage (what `predicted` simulates), and where each stage's idle went."""
    lines = ["ms per action, per stage (chunk c of interleaved: F1, B1 ...); idle ms split into exch (posting "
             "exchanges and waiting for them; posting: ms an exchange's posting took, mean), tail (after the stage's last action to the step's end) and other (executor); "
             "start: ms after the first stage's schedule began; faults: minor page faults in the step; gc: ms in Python's garbage collector"]
    for r in rows:
        if r["m"] not in wanted:
            continue
        per = [" ".join(f"{k}={1e3 * v:.1f}" for k, v in sorted(a.items())) for a in r["action_s"]]
        idle = [f"exch {1e3 * b['exchange']:.0f} (posting {1e3 * ps:.2f} each) tail {1e3 * b['tail']:.0f} "
                f"other {1e3 * b['other']:.0f} start +{1e3 * b['start_offset']:.0f} "
                f"faults {b['page_faults'] / 1e3:.1f}k gc {1e3 * b['gc']:.0f}"
                for b, ps in zip(r["breakdown"], r["post_s"])]
        lines.append(f"{_name(r):>23} {r['m']:>3}  " + " | ".join(f"{a}; {i}" for a, i in zip(per, idle)))
        took = " (+overlap: from the post to its wait's end, computations between)" if r.get("overlap") else ""
        lines.append(f"{'':>27} exchanges a stage by messages in them{took}: " + ", ".join(
            f"{n}: {r['exchange_count'][n]} x {1e3 * c:.2f} ms (charged {1e3 * r['exchange_charged_s'][n]:.2f})"
            for n, c in r["exchange_s"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.until_decided and (args.sequential or "1f1b" not in args.schedules
                               or not {"zb1", "interleaved"} & {n.removesuffix("+overlap") for n in args.schedules}):
        sys.exit("bench_pp: --until-decided needs 1f1b and zb1 or interleaved in --schedules, and no --sequential "
                 "(it judges margins over 1F1B from steps taken in turn)")
    from pp_stats import EXCHANGE_COST, LEVEL, MIN_PAIRS, STOP_LEVEL, RatioCI, margin_stats, margins_table
    # --until-decided stopped on 99% intervals: its table, verdicts and JSON at that level (pp_stats.STOP_LEVEL)
    level, min_pairs = (STOP_LEVEL, MIN_PAIRS) if args.until_decided else (LEVEL, 2)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    every: list[dict[str, Any]] = []
    for pp in args.pp:
        # one stage's threads must not take another's core: on 2 cores at p=2, one thread each
        threads = args.threads or max(1, cores // pp)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={pp}",
                   str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:]), "--worker", str(out)]
            subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
            rows = json.loads(out.read_text())
        over = pp * threads > cores
        print(f"\npipeline, p={pp} stages on {cores} cores, {rows[0]['threads']} thread(s) each"
              f"{' (OVERSUBSCRIBED: idle figures unreliable)' if over else ''}; GPT n_layer={args.layers} "
              f"n_embd={args.width} seq={args.seq}, micro-batch {args.micro_batch}, fp32; p2p latency "
              f"{1e3 * rows[0]['p2p_latency_s']:.2f} ms (one activation, ranks 0-1); each exchange charged "
              f"{EXCHANGE_COST[args.exchange_cost]}")
        print(table(rows, pp, args.micro_batches))
        print(actions(rows, pp, args.micro_batches))
        print(margins_table(rows, args.micro_batches, args.predict, level, min_pairs))
        if args.sequential:
            print("(--sequential: a pair's two steps were not taken side by side, so load that came and went does "
                  "not cancel in its margin)")
        for e in margin_stats(rows, args.predict, level, min_pairs):  # (the JSON's rows carry their margin's figures)
            row = next(r for r in rows if (r["schedule"], r["m"]) == (e["schedule"], e["m"]))
            row["margin_vs_1f1b"] = {k: (v.__dict__ if isinstance(v, RatioCI) else v) for k, v in e.items()}
        every += rows
    if args.json:
        args.json.write_text(json.dumps(_finite(every), indent=1, allow_nan=False))


def _finite(x: Any) -> Any:
    """x with every nan or infinite float as None: strict JSON (an unbounded ratio set has no ends)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


if __name__ == "__main__":
    main()
