"""Pipeline parallelism on CPU: each stage's bubble beside the simulator's, and the first stage's activation memory,
for GPipe, 1F1B, ZB-H1 (zb1) and interleaved 1F1B.

    python scripts/bench_pp.py [--pp 2 4] [--micro-batches 4 8 16] [--schedules gpipe 1f1b [zb1] [interleaved]]
                               [--virtual 2] [--layers 8] [--width 256] [--seq 128] [--micro-batch 2] [--steps 3]
                               [--json PATH]

What it measures, through dist_llm's Trainer (fp32, dp=1, tp=1, one process per stage, 1 thread each):
  busy / idle     per stage, the seconds of a step it spent in forward, backward (B, W) actions and the rest
                  (`Trainer.pipeline_times()`, the stage clock metrics.jsonl carries as pp_busy_s/pp_idle_s), the
                  median over --steps timed steps after one warm-up step; the idle fraction beside the simulator's
                  for the same plans (schedule.simulate: a backward twice a forward, W half of it, chunks 1/v of a
                  stage, sends that wait for their receive) and the closed form ((p-1)/(m+p-1) for GPipe and 1F1B,
                  (p-1)/(v*m+p-1) interleaved, 2(p-1)/(3m+2(p-1)) ZB-H1). The stages are balanced by training FLOPs,
                  not by time, and point-to-point latency counts as idle, so the measured figures sit above.
  activations     the most bytes autograd held saved for backward on the first stage during the first step
                  (saved_tensors_hooks, each storage once, parameters and buffers left out), and that figure in
                  micro-batches: divided by the same count at m=1 (not for interleaved, whose m must be a
                  multiple of p); beside the schedule's peak (GPipe m, 1F1B and ZB-H1 min(m, p)).
  peak memory     per stage, the most its memory (the peak resident set on the CPU) rose over the steps above where
                  it stood once the trainer was built: optimizer states, gradients, saved activations, buffers.

With --pp larger than the cores, stages share cores and the idle figures mean little (the table says so).
The script starts its own workers with `python -m torch.distributed.run --standalone`, one launch per --pp value;
rank 0 prints the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, nargs="+", default=[2], help="pipeline stages (processes), one run per value")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16], help="m values")
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"],
                   help="any of gpipe 1f1b zb1 interleaved (the default keeps scripts/bench.py's rows)")
    p.add_argument("--virtual", type=int, default=2, help="chunks per stage for interleaved (parallel.pp_virtual)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--steps", type=int, default=3, help="timed steps per (schedule, m)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # set when started under torchrun
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    from dist_llm import perf
    from dist_llm.config import load_config
    from dist_llm.parallel.context import ParallelContext
    from dist_llm.train.saved_tensors import SavedTensorMeter
    from dist_llm.train.trainer import Trainer

    from dist_llm.parallel.pipeline.schedule import bubble_fraction, build_plans, simulate

    pp = int(os.environ["WORLD_SIZE"])
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in args.schedules:
            v = args.virtual if schedule == "interleaved" else 1
            ms = set(args.micro_batches) | ({1} if v == 1 else set())
            for m in sorted(x for x in ms if v == 1 or x % pp == 0):
                cfg = load_config(ROOT / "configs" / "tiny.yaml", [
                    f"model.n_layer={args.layers}", f"model.n_embd={args.width}", f"model.n_head={args.heads}",
                    f"model.block_size={args.seq}", f"train.micro_batch_size={args.micro_batch}",
                    f"train.global_batch_size={args.micro_batch * m}", f"parallel.pp={pp}",
                    f"parallel.pp_schedule={schedule}", f"parallel.pp_virtual={v}", "train.max_steps=100",
                    "train.eval_interval=0", "train.device=cpu", f"train.out_dir={tmp}/{schedule}{m}",
                    "train.resume=never"])
                ctx = ParallelContext.from_config(cfg)
                trainer = Trainer(cfg, ctx)
                perf.reset_peak_memory(ctx.device)
                start_bytes = perf.memory_bytes(ctx.device)
                module = trainer.module
                with SavedTensorMeter([*module.parameters(), *module.buffers()]) as meter:
                    trainer.train_step()  # also the warm-up step
                idle: list[list[float]] = []
                busy: list[list[float]] = []
                idle_s: list[list[float]] = []
                for _ in range(args.steps):
                    ctx.barrier()
                    trainer.train_step()
                    times = trainer.pipeline_times()
                    idle.append(times["pp_idle_fraction"])
                    busy.append(times["pp_busy_s"])
                    idle_s.append(times["pp_idle_s"])
                makespan, sim_busy = simulate(build_plans(schedule, pp, m, v), forward_cost=1 / v,
                                              backward_cost=2 / v)
                held = torch.tensor([meter.peak_bytes], dtype=torch.float64)
                torch.distributed.broadcast(held, src=0)  # the first stage's figure
                peaks = torch.zeros(pp, dtype=torch.int64)  # each stage's memory rise over the trainer's life
                torch.distributed.all_gather_into_tensor(
                    peaks, torch.tensor([perf.peak_memory_bytes(ctx.device) - start_bytes], dtype=torch.int64))
                del trainer
                gc.collect()
                rows.append({"schedule": schedule, "m": m, "p": pp, "v": v,
                             "idle_fraction": [statistics.median(s[i] for s in idle) for i in range(pp)],
                             "busy_s": [statistics.median(s[i] for s in busy) for i in range(pp)],
                             "idle_s": [statistics.median(s[i] for s in idle_s) for i in range(pp)],
                             "predicted_idle_fraction": [round(1 - b / makespan, 4) for b in sim_busy],
                             "formula": bubble_fraction(pp, m, schedule=schedule, chunks=v),
                             "first_stage_saved_bytes": int(held.item()), "peak_bytes": peaks.tolist()})
    if int(os.environ["RANK"]) == 0:
        args.worker.write_text(json.dumps(rows))
    torch.distributed.destroy_process_group()


def table(rows: list[dict[str, Any]], pp: int, wanted: list[int]) -> str:
    from dist_llm.parallel.pipeline.schedule import SCHEDULES, interleaved, peak_in_flight

    one = {r["schedule"]: r["first_stage_saved_bytes"] for r in rows if r["m"] == 1}
    head = (f"{'schedule':>15} {'m':>3}  {'busy s per stage':>{8 * pp}}  {'idle s per stage':>{8 * pp}}  "
            f"{'idle fraction':>{8 * pp}}  {'simulated':>{8 * pp}}  {'formula':>7}  "
            f"{'stage-0 saved MiB':>17} {'in micro-batches':>16} {'expected':>8}  peak MiB per stage")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["m"] not in wanted:
            continue
        cols = [" ".join(f"{x:7.3f}" for x in r[k]) for k in ("busy_s", "idle_s", "idle_fraction",
                                                            "predicted_idle_fraction")]
        v = r.get("v", 1)
        plans = interleaved(pp, r["m"], v) if r["schedule"] == "interleaved" else SCHEDULES[r["schedule"]](pp, r["m"])
        plan = plans[0]
        expected = peak_in_flight(plan) / v
        held = (f"{r['first_stage_saved_bytes'] / one[r['schedule']]:>16.2f}" if r["schedule"] in one else f"{'-':>16}")
        name = r["schedule"] + (f" v={v}" if v > 1 else "")
        lines.append(f"{name:>15} {r['m']:>3}  " + "  ".join(f"{c:>{8 * pp}}" for c in cols)
                     + f"  {r['formula']:>7.3f}  {r['first_stage_saved_bytes'] / 2**20:>17.2f} {held}"
                     + f" {expected:>8.2f}  "
                     + " ".join(f"{b / 2**20:.1f}" for b in r["peak_bytes"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    cores = os.cpu_count() or 1
    every: list[dict[str, Any]] = []
    for pp in args.pp:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={pp}",
                   str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:]), "--worker", str(out)]
            subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            rows = json.loads(out.read_text())
        print(f"\npipeline, p={pp} stages on {cores} cores{' (OVERSUBSCRIBED: idle figures unreliable)' if pp > cores else ''}; "
              f"GPT n_layer={args.layers} n_embd={args.width} seq={args.seq}, micro-batch {args.micro_batch}, fp32")
        print(table(rows, pp, args.micro_batches))
        every += rows
    if args.json:
        args.json.write_text(json.dumps(every, indent=1))


if __name__ == "__main__":
    main()
