"""MoE against dense at equal wall time (issue 19's "Done when"): configs/moe.yaml and configs/tiny.yaml (the same
active parameters) each trained for the same seconds on the default corpus; both val losses and steps done.

    python scripts/compare_moe_dense.py [--seconds 600] [--nproc 1] [--json out.json] [--moe-override KEY=VALUE]

Both models first run a short probe (--probe-steps), one after the other before either real run (so both
speeds are read under the same machine load), to measure their seconds per step (the tokens of a step of the
run's resolved config, overrides included, over the probe's tokens/s); each real run then gets
max_steps = seconds / that (so its LR schedule decays within the budget, as a run planned for that time would)
and train.max_time_s = seconds (the hard cap: the run ends at the first step past it, evaluated there). A
warm-up longer than a tenth of those steps is cut to a tenth, for both alike. Everything else is the config's
(--moe-override, repeatable, changes the MoE run's config, probe and plan included: a candidate moe.yaml without
editing it).
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
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench_runs import ROOT, train_run

if TYPE_CHECKING:
    from dist_llm.config import Config

MODELS = {"dense": "configs/tiny.yaml", "moe": "configs/moe.yaml"}


@dataclass(frozen=True)
class Plan:
    """A real run's plan from its probe: the seconds a step took and the overrides that fit the run in `seconds`."""

    seconds_per_step: float
    steps: int
    overrides: list[str]


def resolved(config: str, extra: list[str]) -> Config:
    """The config a run of `config` with overrides `extra` trains with (file, overrides, an hf: start's
    architecture): where its tokens per step and warm-up come from, not the file alone (an override of
    train.global_batch_size or model.block_size changes the step the probe timed)."""
    from dist_llm.config import load_config
    from dist_llm.train.init_from import resolve_architecture

    return resolve_architecture(load_config(ROOT / config, extra))


def plan(cfg: Config, seconds: float, probe_tokens_per_s: float) -> Plan:
    """Plan a run of the resolved config `cfg` for `seconds` from its probe's tokens/s: a step is
    global_batch_size * block_size tokens (the trainer's tokens per step, of which it reports tokens/s); the LR
    schedule is set to decay over the steps that fit, its warm-up cut to a tenth of them."""
    per_step = cfg.train.global_batch_size * cfg.model.block_size / probe_tokens_per_s
    steps = max(10, int(seconds / per_step))
    return Plan(per_step, steps, [f"train.max_steps={steps}", f"train.max_time_s={seconds}",
                                  f"train.eval_interval={steps}",
                                  f"optim.warmup_steps={min(cfg.optim.warmup_steps, steps // 10)}",
                                  "train.log_interval=10"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=600.0, help="training seconds of each model")
    ap.add_argument("--nproc", type=int, default=1, help="processes of each run (data parallel)")
    ap.add_argument("--probe-steps", type=int, default=8)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--moe-override", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override of the MoE run (repeatable), e.g. model.moe_every=2")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))  # (the plan reads configs with this checkout's dist_llm, which the runs train)
    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    extra = {"dense": [], "moe": list(args.moe_override)}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="compare_moe_dense_") as tmp:
        plans: dict[str, Plan] = {}
        for name, config in MODELS.items():  # (both probes first: the same machine load for both)
            probe = train_run(config, [*extra[name], f"train.max_steps={args.probe_steps}", "optim.warmup_steps=1"],
                              args.nproc, Path(tmp) / f"{name}-probe", threads=threads)
            plans[name] = plan(resolved(config, extra[name]), args.seconds, probe["tokens_per_s"])
            print(f"{name}: {plans[name].seconds_per_step:.3f} s a step in the probe; "
                  f"{' '.join([*extra[name], *plans[name].overrides])}", flush=True)
        for name, config in MODELS.items():  # (the plan's keys after the run's own: they are the method)
            p = plans[name]
            overrides = [*extra[name], *p.overrides]
            run = train_run(config, overrides, args.nproc, Path(tmp) / name, threads=threads)
            results[name] = {**run, "config": config, "overrides": overrides, "probe_s_per_step": p.seconds_per_step,
                             "planned_steps": p.steps}
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
