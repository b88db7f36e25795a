"""Start-up cost of building the model: wall time and peak host memory per rank (a benchmark, not a test).

For a ~100M-parameter GPT (12 x 768, vocabulary 16384, 1024 positions) at one process, tp=2, pp=2,
ZeRO-3 dp=2 and ZeRO-2 dp=4 in bf16 on gloo/CPU, each rank builds what the Trainer builds (the model, its stage cut and its
data-parallel form; no data, no step) and reports:
  build_s     wall seconds of the build (the process group already up)
  peak_mib    the rise of the process's peak resident memory (VmHWM, reset before the build through
              /proc/self/clear_refs) over its resident memory just before the build
  own_mib     bytes of the parameters this rank holds after the build (local shards)
The code measured is whichever dist_llm is first on the path, so before/after is
  PYTHONPATH=/path/to/old/checkout python scripts/bench_build.py    (build_model + cut + wrap)
  PYTHONPATH=$PWD python scripts/bench_build.py                     (parallelize on the meta device)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

LAYOUTS = {"one": (1, {}), "tp2": (2, {"parallel.tp": 2}), "pp2": (2, {"parallel.pp": 2}),
           "zero3-dp2": (2, {"parallel.dp": 2, "parallel.zero_stage": 3}),
           "zero2-dp4-bf16": (4, {"parallel.dp": 4, "parallel.zero_stage": 2, "train.precision": "bf16",
                                  "train.global_batch_size": 4})}
MODEL = {"model.n_layer": 12, "model.n_head": 12, "model.n_embd": 768, "model.block_size": 1024,
         "model.vocab_size": 16384, "model.bias": False, "train.micro_batch_size": 1, "train.global_batch_size": 2}


def _status(key: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def rank_main(layout: str, out_dir: str) -> None:
    import torch

    from dist_llm.config import load_config
    from dist_llm.parallel.context import ParallelContext

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", "1"))))
    overrides = {**MODEL, **LAYOUTS[layout][1], "train.out_dir": out_dir}
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    ctx = ParallelContext.from_config(cfg)
    # everything imported before the measurement: the build's own cost, not the modules'
    from dist_llm.parallel.data import build_data_parallel
    from dist_llm.parallel.data.fsdp import FSDPDataParallel  # noqa: F401
    from dist_llm.parallel.pipeline.stage import cut_to_stage
    from dist_llm.train.init_from import load_initial_weights
    from dist_llm.train.trainer import build_model

    try:
        from dist_llm.parallel.parallelize import meta_model, parallelize
    except ImportError:  # the code before the meta-device build
        parallelize = None
    ctx.barrier()
    rss_before = _status("VmRSS")
    exact = _reset_peak()
    start = time.perf_counter()
    if parallelize is not None:
        impl = "parallelize"
        module = parallelize(meta_model(cfg, ctx), cfg, ctx, load=load_initial_weights).dp.module
    else:
        impl = "build_model"
        model = build_model(cfg, ctx)
        if ctx.pp > 1:
            cut_to_stage(model, cfg, ctx.pp, ctx.pp_rank)
        module = build_data_parallel(model, cfg, ctx).module
    build_s = time.perf_counter() - start
    peak = _status("VmHWM")
    own = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in module.parameters())
    ctx.barrier()
    print(json.dumps({"layout": layout, "rank": ctx.rank, "impl": impl, "build_s": round(build_s, 2),
                      "peak_mib": round((peak - rss_before) / 2**20, 1), "exact_peak": exact,
                      "own_mib": round(own / 2**20, 1)}), flush=True)
    ctx.destroy()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(layout: str, out_dir: Path) -> list[dict]:
    world_size = LAYOUTS[layout][0]
    port = _free_port()
    procs = []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank-main", layout, "--out", str(out_dir)],
                                      env=env, stdout=subprocess.PIPE, text=True))
    rows = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"{layout}: a rank exited with {p.returncode}")
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--out", default="/tmp/bench_build", help="train.out_dir (nothing is written there)")
    ap.add_argument("--rank-main", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        rank_main(args.rank_main, args.out)
        return
    import dist_llm

    print(f"dist_llm from {Path(dist_llm.__file__).parent}")
    print(f"{'layout':<10} {'rank':>4} {'impl':<12} {'build_s':>8} {'peak_MiB':>9} {'own_MiB':>8}")
    for layout in args.layouts.split(","):
        for r in sorted(run_layout(layout, Path(args.out)), key=lambda r: r["rank"]):
            print(f"{r['layout']:<10} {r['rank']:>4} {r['impl']:<12} {r['build_s']:>8.2f} "
                  f"{r['peak_mib']:>9.1f} {r['own_mib']:>8.1f}{'' if r['exact_peak'] else ' (peak not reset)'}")


if __name__ == "__main__":
    main()
