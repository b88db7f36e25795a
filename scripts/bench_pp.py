"""Pipeline parallelism on CPU: the bubble and the first stage's activation memory, GPipe against 1F1B.

    python scripts/bench_pp.py [--pp 2] [--micro-batches 1 4 8 16] [--layers 8] [--width 256] [--seq 128]
                               [--micro-batch 2] [--steps 3] [--json PATH]

What it measures, through dist_llm's Trainer (fp32, dp=1, tp=1, one process per stage, 1 thread each):
  idle fraction   per stage, the share of a step's wall time it did not spend in forward or backward actions
                  (`Trainer.pipeline_times()`, the same figures metrics.jsonl carries as pp_busy_s/pp_idle_s),
                  the median over --steps timed steps after one warm-up step, beside the bubble of the ideal
                  pipeline, (p-1)/(m+p-1). The stages are balanced by parameter count, not by time: the last one
                  also computes the logits and the loss, so the others wait a little on it and the first stage's
                  figure is the one to read against the formula. Point-to-point latency counts as idle too.
  activations     the most bytes autograd held saved for backward on the first stage during the first step
                  (saved_tensors_hooks, each storage once, parameters and buffers left out), and that figure in
                  micro-batches: divided by the same count at m=1. GPipe holds all m micro-batches, 1F1B at most p.
  peak memory     per stage, the most its memory (the peak resident set on the CPU) rose over the steps above where
                  it stood once the trainer was built: optimizer states, gradients, saved activations, buffers.

With --pp larger than the cores, stages share cores and the idle figures mean little (the table says so).
The script starts its own workers with `python -m torch.distributed.run --standalone`; rank 0 prints the table.
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
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (processes)")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4, 8, 16], help="m values")
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
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

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in args.schedules:
            for m in sorted(set(args.micro_batches) | {1}):
                cfg = load_config(ROOT / "configs" / "tiny.yaml", [
                    f"model.n_layer={args.layers}", f"model.n_embd={args.width}", f"model.n_head={args.heads}",
                    f"model.block_size={args.seq}", f"train.micro_batch_size={args.micro_batch}",
                    f"train.global_batch_size={args.micro_batch * m}", f"parallel.pp={args.pp}",
                    f"parallel.pp_schedule={schedule}", "train.max_steps=100", "train.eval_interval=0",
                    "train.device=cpu", f"train.out_dir={tmp}/{schedule}{m}", "train.resume=never"])
                ctx = ParallelContext.from_config(cfg)
                trainer = Trainer(cfg, ctx)
                perf.reset_peak_memory(ctx.device)
                start_bytes = perf.memory_bytes(ctx.device)
                module = trainer.module
                with SavedTensorMeter([*module.parameters(), *module.buffers()]) as meter:
                    trainer.train_step()  # also the warm-up step
                idle: list[list[float]] = []
                busy: list[list[float]] = []
                for _ in range(args.steps):
                    ctx.barrier()
                    trainer.train_step()
                    times = trainer.pipeline_times()
                    idle.append(times["pp_idle_fraction"])
                    busy.append(times["pp_busy_s"])
                held = torch.tensor([meter.peak_bytes], dtype=torch.float64)
                torch.distributed.broadcast(held, src=0)  # the first stage's figure
                peaks = torch.zeros(args.pp, dtype=torch.int64)  # each stage's memory rise over the trainer's life
                torch.distributed.all_gather_into_tensor(
                    peaks, torch.tensor([perf.peak_memory_bytes(ctx.device) - start_bytes], dtype=torch.int64))
                del trainer
                gc.collect()
                rows.append({"schedule": schedule, "m": m, "p": args.pp,
                             "idle_fraction": [statistics.median(s[i] for s in idle) for i in range(args.pp)],
                             "busy_s": [statistics.median(s[i] for s in busy) for i in range(args.pp)],
                             "formula": (args.pp - 1) / (m + args.pp - 1),
                             "first_stage_saved_bytes": int(held.item()), "peak_bytes": peaks.tolist()})
    if int(os.environ["RANK"]) == 0:
        args.worker.write_text(json.dumps(rows))
    torch.distributed.destroy_process_group()


def table(rows: list[dict[str, Any]], pp: int, wanted: list[int]) -> str:
    one = {r["schedule"]: r["first_stage_saved_bytes"] for r in rows if r["m"] == 1}
    head = (f"{'schedule':>8} {'m':>3}  {'idle fraction per stage':>{8 * pp}}  {'(p-1)/(m+p-1)':>13}  "
            f"{'stage-0 saved MiB':>17} {'in micro-batches':>16} {'expected':>8}  peak MiB per stage")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["m"] not in wanted:
            continue
        idle = " ".join(f"{x:7.3f}" for x in r["idle_fraction"])
        expected = r["m"] if r["schedule"] == "gpipe" else min(r["m"], pp)
        lines.append(f"{r['schedule']:>8} {r['m']:>3}  {idle:>{8 * pp}}  {r['formula']:>13.3f}  "
                     f"{r['first_stage_saved_bytes'] / 2**20:>17.2f} "
                     f"{r['first_stage_saved_bytes'] / one[r['schedule']]:>16.2f} {expected:>8}  "
                     + " ".join(f"{b / 2**20:.1f}" for b in r["peak_bytes"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.pp}",
               str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:]), "--worker", str(out)]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        rows = json.loads(out.read_text())
    print(f"\npipeline, p={args.pp} stages on {cores} cores{' (OVERSUBSCRIBED: idle figures unreliable)' if args.pp > cores else ''}; "
          f"GPT n_layer={args.layers} n_embd={args.width} seq={args.seq}, micro-batch {args.micro_batch}, fp32")
    print(table(rows, args.pp, args.micro_batches))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
