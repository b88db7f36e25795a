"""Profile tp=2 + sequence-parallel training steps on CPU (gloo), with the forward overlap off and on, and
measure from each trace how much communication ran while a matmul ran.

    python scripts/trace_tp.py --trace DIR [--layers 2] [--width 256] [--heads 4] [--seq 256] [--micro-batch 4]
                               [--steps 3]

Profiles the two paths in the order plain, overlap, overlap, plain (--steps steps each, after 2 warm-up steps)
and writes DIR/{plain0,overlap1,overlap2,plain3}_rank{0,1}.json (Chrome traces: chrome://tracing or ui.perfetto.dev) and prints, for
rank 0, per phase (the trainer's `forward` and `backward` spans, summed over the profiled steps): the time some
communication was in flight (the union of gloo's `gloo:*` spans: collectives on gloo's worker threads, and
point-to-point sends and receives from their posting to their completion), the time a matmul ran (aten::mm /
addmm / bmm, on the training thread), the time both did (the intersection of the two unions) and the
communication left exposed (in flight with no matmul beside it: waiting on it, or on a slower peer). "plain" is
the path without the ring (parallel/tensor/overlap.py ENABLED=False: one blocking all-gather before the column
matmuls, one reduce-scatter after the row matmul, one all-gather of the row layer's output gradient before its
backward matmuls); the column backward overlaps its re-gather and reduce-scatter in both.
One process per rank, one thread each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")
ORDER = ("plain", "overlap", "overlap", "plain")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, required=True, help="folder for the traces")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="profiled steps per path (after 2 warm-up steps)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    import logging

    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(ROOT))
    from dist_llm import profiling
    from dist_llm.config import load_config
    from dist_llm.parallel.context import ParallelContext
    from dist_llm.parallel.tensor import overlap
    from dist_llm.train.trainer import Trainer

    logging.getLogger("dist_llm").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    out = Path(tempfile.mkdtemp(prefix="trace_tp_"))
    cfg = load_config(None, [
        f"model.n_layer={args.layers}", f"model.n_embd={args.width}", f"model.n_head={args.heads}",
        "model.vocab_size=256", f"model.block_size={args.seq}", "model.dropout=0.0",
        f"train.micro_batch_size={args.micro_batch}", f"train.global_batch_size={args.micro_batch}",
        "train.device=cpu", "train.precision=fp32", "train.resume=never", "train.eval_interval=0",
        "parallel.tp=2", "parallel.sequence_parallel=true", f"train.out_dir={out}"])
    ctx = ParallelContext.from_config(cfg)
    trainer = Trainer(cfg, ctx)
    for i, mode in enumerate(ORDER):  # A B B A: the machine's load drifts alike over both paths
        overlap.ENABLED = mode == "overlap"
        for _ in range(2):  # warm-up: allocator, gloo connections
            trainer.train_step()
        ctx.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            profiling._active = True  # the trainer's and comm's spans, as train.profile_steps sets it
            try:
                for _ in range(args.steps):
                    float(trainer.train_step().loss)
            finally:
                profiling._active = False
        prof.export_chrome_trace(str(args.trace / f"{mode}{i}_rank{rank}.json"))
        ctx.barrier()
    trainer.metrics.close()
    ctx.destroy()


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _clip(spans: list[tuple[float, float]], window: list[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(max(a, c), min(b, d)) for a, b in spans for c, d in window if min(b, d) > max(a, c)]


def _total(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def analyse(paths: list[Path]) -> dict[str, dict[str, float]]:
    """Per phase: ms, comm ms, matmul ms, and ms where both ran, summed over traces."""
    out: dict[str, dict[str, float]] = {}
    for path in paths:
        for phase, r in _analyse(path).items():
            for key, v in r.items():
                out.setdefault(phase, {}).setdefault(key, 0.0)
                out[phase][key] += v
    return out


def _analyse(path: Path) -> dict[str, dict[str, float]]:
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    span = [(e["ts"], e["ts"] + e["dur"]) for e in events]
    comm = _union([s for e, s in zip(events, span) if e["name"].startswith("gloo:")])
    mm = _union([s for e, s in zip(events, span) if e["name"] in MATMULS])
    out = {}
    for phase in ("forward", "backward"):
        window = _union([s for e, s in zip(events, span) if e["name"] == phase])
        c, m = _clip(comm, window), _clip(mm, window)
        both = _union(_clip(c, m))
        out[phase] = {"ms": _total(window) / 1e3, "comm_ms": _total(c) / 1e3, "matmul_ms": _total(m) / 1e3,
                      "both_ms": _total(both) / 1e3}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    args.trace.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:]), "--worker"]
    code = subprocess.run(cmd, env=env, cwd=ROOT).returncode
    if code:
        print(f"workers exited {code}")
        return code
    print(f"tp=2 + sequence parallelism, {args.layers} layers, {args.width} wide, seq {args.seq}, micro batch "
          f"{args.micro_batch}, fp32, CPU gloo, rank 0, 2 x {args.steps} steps a path; traces in {args.trace}")
    print(f"{'path':<8} {'phase':<9} {'ms':>8} {'comm ms':>8} {'matmul ms':>9} {'both ms':>8} {'exposed ms':>10}"
          f" {'comm under mm':>13}")
    for mode in ("plain", "overlap"):
        paths = [args.trace / f"{m}{i}_rank0.json" for i, m in enumerate(ORDER) if m == mode]
        for phase, r in analyse(paths).items():
            hidden = r["both_ms"] / r["comm_ms"] if r["comm_ms"] else 0.0
            print(f"{mode:<8} {phase:<9} {r['ms']:>8.1f} {r['comm_ms']:>8.1f} {r['matmul_ms']:>9.1f} "
                  f"{r['both_ms']:>8.1f} {r['comm_ms'] - r['both_ms']:>10.1f} {hidden:>13.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
