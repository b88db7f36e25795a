"""MoE against dense at equal wall time (issue 19's "Done when"): configs/moe.yaml and configs/tiny.yaml (the same
active parameters) each trained for the same seconds on the default corpus; both val losses and steps done.

    python scripts/compare_moe_dense.py [--seconds 600] [--nproc 1] [--json out.json] [--moe-override KEY=VALUE]

Both models first run a short probe (--probe-steps), one after the other before either real run (so both
speeds are read under the same machine load), to measure their seconds per step; each real run then gets
max_steps = seconds / that (so its LR schedule decays within the budget, as a run planned for that time would)
and train.max_time_s = seconds (the hard cap: the run ends at the first step past it, evaluated there). A
warm-up longer than a tenth of those steps is cut to a tenth, for both alike. Everything else is the config's
(--moe-override, repeatable, changes the MoE run's config: a candidate moe.yaml without editing it).
The run's threads: the machine's cores over --nproc.

The table says, per run, the steps done against those planned: a run cut by the time cap before its planned
steps ended with its learning rate not yet decayed to min_lr (the probe was optimistic: it is disadvantaged);
one that finished early left seconds unused. Either way the comparison is off by that much: rerun on a quieter
machine or with more --probe-steps.
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
    ap.add_argument("--moe-override", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override of the MoE run (repeatable), e.g. model.moe_every=2")
    args = ap.parse_args()
    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    extra = {"dense": [], "moe": list(args.moe_override)}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="compare_moe_dense_") as tmp:
        plans: dict[str, tuple[float, list[str]]] = {}
        for name, config in MODELS.items():  # (both probes first: the same machine load for both)
            probe = train_run(config, [f"train.max_steps={args.probe_steps}", "optim.warmup_steps=1", *extra[name]],
                              args.nproc, Path(tmp) / f"{name}-probe", threads=threads)
            cfg = yaml.safe_load((ROOT / config).read_text())
            per_step = cfg["train"]["global_batch_size"] * cfg["model"]["block_size"] / probe["tokens_per_s"]
            plans[name] = (per_step, [*planned(config, args.seconds, per_step), *extra[name]])
            print(f"{name}: {per_step:.3f} s a step in the probe; {' '.join(plans[name][1])}", flush=True)
        for name, config in MODELS.items():
            per_step, overrides = plans[name]
            run = train_run(config, overrides, args.nproc, Path(tmp) / name, threads=threads)
            results[name] = {**run, "config": config, "overrides": overrides, "probe_s_per_step": per_step,
                             "planned_steps": int(overrides[0].split("=")[1])}
    print(f"\n{'model':<6} {'config':<18} {'steps':>6} {'planned':>7} {'seconds':>8} {'tokens/s':>9} {'val loss':>9}")
    for name, r in results.items():
        print(f"{name:<6} {r['config']:<18} {r['steps']:>6} {r['planned_steps']:>7} {r['elapsed_s']:>8.1f} "
              f"{r['tokens_per_s']:>9,.0f} {r['val_loss']:>9.4f}")
    for name, r in results.items():
        if r["steps"] < r["planned_steps"]:
            print(f"note: {name} was cut by the time cap at step {r['steps']} of {r['planned_steps']} (its learning "
                  f"rate not yet at min_lr: the probe was optimistic)")
        elif r["elapsed_s"] < 0.95 * args.seconds:
            print(f"note: {name} finished its {r['steps']} steps in {r['elapsed_s']:.0f} s of {args.seconds:g} "
                  f"(the probe was pessimistic: seconds unused)")
    moe, dense = results["moe"]["val_loss"], results["dense"]["val_loss"]
    print(f"{'PASS' if moe <= dense else 'FAIL'}: moe val loss {moe:.4f} {'<=' if moe <= dense else '>'} dense "
          f"{dense:.4f} at {args.seconds:g} s each (issue 19: at or below)")
    if args.json:
        args.json.write_text(json.dumps({"seconds": args.seconds, "nproc": args.nproc, "results": results}, indent=1))


if __name__ == "__main__":
    main()
