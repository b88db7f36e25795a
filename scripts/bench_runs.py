"""`dist-llm train` as a benchmark: one run of a config on N processes, its throughput and memory from metrics.jsonl.

Shared by bench.py's scaling scenario and bench_moe.py's model comparison (imported from the scripts folder).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
# every run's bookkeeping off unless the caller's overrides say otherwise: one log line a step, no evaluation, no
# checkpoint but the last
QUIET = ["train.log_interval=1", "train.eval_interval=0", "train.ckpt_interval=0", "train.resume=never"]


def train_run(config: str, overrides: list[str], nproc: int, out_dir: Path, *, threads: int = 1) -> dict[str, Any]:
    """Train `config` (a path under the repository, or absolute) with `overrides` on `nproc` processes of
    `threads` threads each (by default one: N processes use N cores, as in a job with a device per rank).
    Tokens/s is the median over the logged steps after the first (which carries the warm-up), or the one
    logged."""
    cmd = [sys.executable, "-m", "dist_llm.cli", "train", "--config", str(ROOT / config), *QUIET, *overrides,
           f"train.out_dir={out_dir}"]
    if nproc > 1:
        cmd[4:4] = ["--nproc-per-node", str(nproc)]  # after "train"
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**ENV, "OMP_NUM_THREADS": str(threads)})
    if proc.returncode != 0:
        raise RuntimeError(f"{config} {' '.join(overrides)} on {nproc} process(es) failed:\n{proc.stderr[-2000:]}")
    records = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in records if "val_loss" in r and "loss" not in r]
    logged = [r for r in records if "tokens_per_s" in r]
    steps = logged[1:] or logged  # (a run of one logged step: that one, warm-up and all)
    if not steps:
        raise RuntimeError(f"{config}: no step logged in {out_dir / 'metrics.jsonl'}")
    return {"procs": nproc, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
            "peak_bytes": max(max(r["peak_memory_bytes"]) for r in steps), "comm_bytes": steps[-1]["comm_bytes"],
            "activation_bytes": steps[-1].get("activation_bytes"), "loss": steps[-1]["loss"],
            "steps": logged[-1]["step"], "elapsed_s": logged[-1]["elapsed_s"], "val_loss": val[-1] if val else None,
            "wall_s": time.perf_counter() - start, "oversubscribed": nproc > (os.cpu_count() or 1)}
