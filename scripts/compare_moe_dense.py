"""MoE against dense at equal wall time (issue 19's "Done when"): configs/moe.yaml and configs/tiny.yaml (the same
active parameters) each trained for the same seconds on the default corpus; both val losses and steps done.

    python scripts/compare_moe_dense.py [--seconds 600] [--nproc 1] [--json out.json]

Each model first runs a short probe (--probe-steps) to measure its seconds per step; its real run then gets
max_steps = seconds / that (so its LR schedule decays within the budget, as a run planned for that time would)
and train.max_time_s = seconds (the hard cap: the run ends at the first step past it, evaluated there). A
warm-up longer than a tenth of those steps is cut to a tenth, for both alike. Everything else is the config's.
The run's threads: the machine's cores over --nproc.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml
from bench_runs import ROOT, train_run

MODELS = {"dense": "configs/tiny.yaml", "moe": "configs/moe.yaml"}


def planned(config: str, seconds: float, seconds_per_step: float) -> list[str]:
    steps = max(10, int(seconds / seconds_per_step))
    warmup = yaml.safe_load((ROOT / config).read_text())["optim"]["warmup_steps"]
    return [f"train.max_steps={steps}", f"train.max_time_s={seconds}", f"train.eval_interval={steps}",
            f"optim.warmup_steps={min(warmup, steps // 10)}", "train.log_interval=10"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=600.0, help="training seconds of each model")
    ap.add_argument("--nproc", type=int, default=1, help="processes of each run (data parallel)")
    ap.add_argument("--probe-steps", type=int, default=8)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="compare_moe_dense_") as tmp:
        for name, config in MODELS.items():
            probe = train_run(config, [f"train.max_steps={args.probe_steps}", "optim.warmup_steps=1"], args.nproc,
                              Path(tmp) / f"{name}-probe", threads=threads)
            cfg = yaml.safe_load((ROOT / config).read_text())
            per_step = cfg["train"]["global_batch_size"] * cfg["model"]["block_size"] / probe["tokens_per_s"]
            overrides = planned(config, args.seconds, per_step)
            print(f"{name}: {per_step:.3f} s a step in the probe; {' '.join(overrides)}", flush=True)
            run = train_run(config, overrides, args.nproc, Path(tmp) / name, threads=threads)
            results[name] = {**run, "config": config, "overrides": overrides, "probe_s_per_step": per_step}
    print(f"\n{'model':<6} {'config':<18} {'steps':>6} {'seconds':>8} {'tokens/s':>9} {'val loss':>9}")
    for name, r in results.items():
        print(f"{name:<6} {r['config']:<18} {r['steps']:>6} {r['elapsed_s']:>8.1f} {r['tokens_per_s']:>9,.0f} "
              f"{r['val_loss']:>9.4f}")
    moe, dense = results["moe"]["val_loss"], results["dense"]["val_loss"]
    print(f"{'PASS' if moe <= dense else 'FAIL'}: moe val loss {moe:.4f} {'<=' if moe <= dense else '>'} dense "
          f"{dense:.4f} at {args.seconds:g} s each (issue 19: at or below)")
    if args.json:
        args.json.write_text(json.dumps({"seconds": args.seconds, "nproc": args.nproc, "results": results}, indent=1))


if __name__ == "__main__":
    main()
