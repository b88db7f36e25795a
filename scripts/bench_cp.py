"""Context parallelism on this machine (issue 21): a small model at long block sizes, trained at cp = 1, 2 (4):
tokens/s, memory per rank, and the saved activations of the attention part against the predicted 1/cp.

    python scripts/bench_cp.py [--block-sizes 4096,8192] [--cp 1,2,4] [--layers 2] [--steps 3] [--json out.json]

Each (block size, cp) is one world of cp gloo ranks, one thread each (cp ranks use cp cores), training
configs/tiny.yaml's model (n_layer from --layers) on one sequence a step (global batch 1): cp=1 attends with SDPA,
cp>1 with the ring (zigzag layout). Every rank builds dist_llm's Trainer and runs its train_step:
  step 1   under the trainer's own meter (dist_llm.train.saved_tensors): the bytes saved for backward, all of them
  step 2   under the same meter entered only inside the model's Attention modules (q/k/v projection inputs,
           positions, the attention core, the output projection's input): the attention part
  steps 2+ timed: tokens/s of the whole job is block_size / the median step time
Memory per rank: the process's peak resident set (Linux VmHWM) and its rise over the steps above the resident
set before them (what the trainer reports as peak_memory_bytes on a CPU); `dist-llm memory`'s prediction of the
saved activations beside the measured.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
RATIO_TOLERANCE = 0.10  # the attention part's ratio cp=k / cp=1 at most 10% above 1/k
SAVED_SLACK = 1024  # each rank's saved activations against `dist-llm memory`'s: the loss's scalars


def ratio_ok(ratio: float, cp: int, tolerance: float = RATIO_TOLERANCE) -> bool:
    """Issue 21 asks the attention part's saved activations per rank to fall near 1/cp. Measured 0.447 at cp=2 and
    0.223 at cp=4 (2026-11-28), 10.6% under 1/cp: cp=1's SDPA keeps the whole qkv output through v's view where
    a ring rank keeps contiguous q, k and v, and one pair of RoPE tables serves all blocks. So the check is at
    most `tolerance` above 1/cp and at least half of it (a meter that lost the ring's tensors would fall below);
    the exact figure is checked per rank against `dist-llm memory` (`saved_ok`)."""
    return 0.5 <= ratio * cp <= 1 + tolerance


def saved_ok(saved_each: list[int], predicted: int) -> bool:
    """Every rank's saved activations equal `dist-llm memory`'s (the same for each cp rank) to `SAVED_SLACK` bytes."""
    return all(abs(saved - predicted) <= SAVED_SLACK for saved in saved_each)


def _attention_meter(model: torch.nn.Module, meter: Any) -> list[Any]:
    """Enter `meter`'s saved-tensor hooks for the duration of every Attention module's forward."""
    from dist_llm.model.gpt import Attention

    def enter(*_: Any) -> None:  # (a pre-hook's return value would replace the module's input)
        meter.__enter__()

    def leave(*_: Any) -> None:
        meter.__exit__(None, None, None)

    handles = []
    for m in model.modules():
        if isinstance(m, Attention):
            handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    if not handles:
        raise RuntimeError("no Attention module found: the model's attention class moved")
    return handles


def worker(rank: int, cp: int, port: int, args: argparse.Namespace, block: int, out_dir: str, queue: Any) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(cp), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(cp),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    from dist_llm import memory, perf
    from dist_llm.config import load_config
    from dist_llm.parallel.context import ParallelContext
    from dist_llm.train.saved_tensors import SavedTensorMeter
    from dist_llm.train.trainer import Trainer

    cfg = load_config(ROOT / "configs/tiny.yaml", [
        f"model.block_size={block}", f"model.n_layer={args.layers}", f"parallel.cp={cp}",
        "train.micro_batch_size=1", "train.global_batch_size=1", f"train.max_steps={args.steps}",
        "optim.warmup_steps=1", "train.eval_interval=0", "train.ckpt_interval=0", "train.resume=never",
        f"train.out_dir={out_dir}"])
    ctx = ParallelContext.from_config(cfg)
    sync = torch.distributed.barrier if cp > 1 else (lambda: None)
    try:
        trainer = Trainer(cfg, ctx)
        cpu = torch.device("cpu")
        held = [*trainer.module.parameters(), *trainer.module.buffers()]
        perf.reset_peak_memory(cpu)
        before = perf.memory_bytes(cpu)
        times = []
        whole, attention = SavedTensorMeter(held), SavedTensorMeter(held)
        for step in range(args.steps):
            handles = _attention_meter(trainer.module, attention) if step == 1 else []
            sync()
            start = time.perf_counter()
            if step == 0:
                with whole:
                    trainer.train_step()
            else:
                trainer.train_step()
            sync()
            times.append(time.perf_counter() - start)
            for h in handles:
                h.remove()
        peak = perf.peak_memory_bytes(cpu)
        result = {"rank": rank, "step_s": times, "saved_bytes": whole.peak_bytes,
                  "attention_saved_bytes": attention.peak_bytes, "peak_rss_bytes": peak, "rise_bytes": peak - before,
                  "ring_bytes": trainer.comm_bytes.get("ring", 0)}
        if rank == 0:
            result["predicted_saved_bytes"] = memory.predict(cfg, cp, pp_rank=0).activation_bytes
        queue.put(result)
    except BaseException:  # noqa: BLE001 - to the parent, which would wait for this rank otherwise
        import traceback

        queue.put({"rank": rank, "error": traceback.format_exc()})
    finally:
        ctx.destroy()


def run_world(args: argparse.Namespace, block: int, cp: int) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="bench_cp_") as out:
        procs = [ctx.Process(target=worker, args=(r, cp, port, args, block, out, queue)) for r in range(cp)]
        for p in procs:
            p.start()
        ranks = []
        for _ in procs:
            ranks.append(queue.get(timeout=args.timeout))
            if "error" in ranks[-1]:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"block {block}, cp={cp}: rank {ranks[-1]['rank']} failed:\n{ranks[-1]['error']}")
        for p in procs:
            p.join()
    ranks.sort(key=lambda r: r["rank"])
    timed = ranks[0]["step_s"][1:] or ranks[0]["step_s"]  # (the first step carries the warm-up)
    return {"block_size": block, "cp": cp, "tokens_per_s": block / statistics.median(timed), "ranks": ranks,
            "saved_bytes": max(r["saved_bytes"] for r in ranks), "saved_bytes_each": [r["saved_bytes"] for r in ranks],
            "attention_saved_bytes": max(r["attention_saved_bytes"] for r in ranks),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks), "rise_bytes": max(r["rise_bytes"] for r in ranks),
            "predicted_saved_bytes": ranks[0]["predicted_saved_bytes"], "oversubscribed": cp > (os.cpu_count() or 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-sizes", default="4096,8192")
    ap.add_argument("--cp", default="1,2", help="context-parallel sizes (cp ranks = processes)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="training steps per run (2 at least: the meters' two)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for a world's ranks")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps: 2 at least (step 1 meters everything saved, step 2 the attention part)")
    sizes, cps = [int(b) for b in args.block_sizes.split(",")], [int(c) for c in args.cp.split(",")]
    if 1 not in cps:
        ap.error("--cp: must include 1 (the reference of the ratios)")
    runs = []
    for block in sizes:
        for cp in cps:
            print(f"  block {block}, cp={cp}", flush=True)
            runs.append(run_world(args, block, cp))
    mib = 2**20
    print(f"\ntorch {torch.__version__}; tiny.yaml's model with {args.layers} layers, one sequence a step, fp32, one "
          f"thread a rank; memory: the worst rank's")
    print(f"{'block':>6} {'cp':>3} {'tokens/s':>9} {'saved MiB':>10} {'predicted':>10} {'attention':>10} "
          f"{'attn ratio':>10} {'1/cp':>6} {'peak RSS':>9} {'rise':>8}")
    for r in runs:
        one = next(x for x in runs if x["block_size"] == r["block_size"] and x["cp"] == 1)
        r["attention_ratio"] = r["attention_saved_bytes"] / one["attention_saved_bytes"]
        r["saved_ratio"] = r["saved_bytes"] / one["saved_bytes"]
        print(f"{r['block_size']:>6} {r['cp']:>3} {r['tokens_per_s']:>9,.0f} {r['saved_bytes'] / mib:>10.2f} "
              f"{r['predicted_saved_bytes'] / mib:>10.2f} {r['attention_saved_bytes'] / mib:>10.2f} "
              f"{r['attention_ratio']:>10.3f} {1 / r['cp']:>6.3f} {r['peak_rss_bytes'] / mib:>9,.0f} "
              f"{r['rise_bytes'] / mib:>8,.0f}" + (" (oversubscribed)" if r["oversubscribed"] else ""))
    for r in runs:
        if r["cp"] > 1:
            ok = ratio_ok(r["attention_ratio"], r["cp"])
            print(f"{'PASS' if ok else 'FAIL'}: block {r['block_size']} cp={r['cp']}: attention saved activations "
                  f"per rank {r['attention_ratio']:.3f} of cp=1's (target near 1/cp = {1 / r['cp']:.3f}: at most "
                  f"{RATIO_TOLERANCE:.0%} above, at least half)")
    for r in runs:
        ok = saved_ok(r["saved_bytes_each"], r["predicted_saved_bytes"])
        print(f"{'PASS' if ok else 'FAIL'}: block {r['block_size']} cp={r['cp']}: saved activations of each rank "
              f"{min(r['saved_bytes_each']):,} to {max(r['saved_bytes_each']):,} bytes, `dist-llm memory` "
              f"{r['predicted_saved_bytes']:,} (each within {SAVED_SLACK:,})")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "layers": args.layers, "tolerance": RATIO_TOLERANCE},
                                        indent=1))


if __name__ == "__main__":
    main()
