"""`dist-llm memory --suggest` on configs/3d.yaml at 32 ranks: how long it takes (a benchmark, not a test).

Issue 18 item 11: the command took 13 minutes; the target is under 10 s. Runs the command as a user does
(`python -m dist_llm.cli memory ...`, a process of its own, so Python's and torch's imports count) `--repeat`
times and prints, per run, the wall seconds and the CPU seconds (user + system: what the process itself spent,
which a busy machine does not inflate as it does wall time), then the best and the median of each, and one
JSON line. The code measured is whichever dist_llm is first on the path, so before/after is
  PYTHONPATH=/path/to/old/checkout python scripts/bench_suggest.py --repeat 1
  PYTHONPATH=$PWD python scripts/bench_suggest.py
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_once(args: list[str], timeout: float) -> tuple[float, float, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "dist_llm.cli", "memory", *args], capture_output=True, text=True,
                         timeout=timeout, cwd=REPO, env=os.environ.copy())
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if out.returncode != 0:
        raise SystemExit(f"bench_suggest: the command failed ({out.returncode}): {out.stderr.strip()}")
    return wall, cpu, out.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/3d.yaml")
    parser.add_argument("--world-size", type=int, default=32)
    parser.add_argument("--gpu-memory", default="80GiB")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--show", action="store_true", help="print the command's output once")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="config overrides, e.g. parallel.pp_schedule=interleaved parallel.pp_virtual=2 (each "
                             "schedule counts its own activations and bubble)")
    a = parser.parse_args()
    args = ["--config", a.config, "--world-size", str(a.world_size), "--gpu-memory", a.gpu_memory, "--suggest",
            *a.overrides]
    walls, cpus = [], []
    for i in range(a.repeat):
        wall, cpu, stdout = run_once(args, a.timeout)
        walls.append(wall)
        cpus.append(cpu)
        print(f"run {i + 1}: {wall:.2f} s wall, {cpu:.2f} s CPU", flush=True)
        if a.show and i == 0:
            print(stdout)
    print(f"dist-llm memory {' '.join(args)}: best {min(walls):.2f} s wall ({min(cpus):.2f} s CPU), median "
          f"{statistics.median(walls):.2f} s wall ({statistics.median(cpus):.2f} s CPU); target < 10 s")
    print(json.dumps({"bench": "suggest", "args": args, "wall_s": walls, "cpu_s": cpus,
                      "load_avg": os.getloadavg()[0], "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
