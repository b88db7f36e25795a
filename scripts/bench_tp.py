"""Tensor parallelism on CPU: tp=1 against tp=2 and tp=2 with sequence parallelism, through dist_llm's Trainer.

    python scripts/bench_tp.py [--layers 8] [--width 768] [--heads 12] [--mlp gelu] [--seq 256] [--micro-batch 4]
                               [--steps 5] [--warmup 1] [--rounds 1] [--dropout 0.1] [--json PATH]

What it measures, for one GPT (vocab 256, fp32, dp=1, one micro-batch a step, AdamW, clip 1.0):
  step time and tokens/s  `Trainer.train_step()` itself (the trainer prepares the stdlib byte corpus; tp=1 and tp=2
                          train on the same batches from the same initial weights, so their step-1 losses agree).
                          For a fair split of the 2 cores, tp=1 runs as ONE process with 2 threads and tp=2 as TWO
                          processes with 1 thread each. A reference row, tp1-1t, runs tp=1 with ONE thread (on a
                          machine other jobs load, two spinning OpenMP threads can be slower than one).
  tensor-parallel bytes   what ctx.comm counted in a step, by kind, beside Megatron's count for the activations:
                          (4*n_layer + 2) * b*s*h * 4 bytes, times 2(tp-1)/tp for ring collectives (with sequence
                          parallelism each all-reduce becomes a reduce-scatter + all-gather, and the 2*n_layer + 1
                          column inputs are all-gathered again in backward: only their local slice is kept).
  peak memory             the most any rank's memory (CPU: peak resident set) rose above where it stood before the
                          trainer was built, over building it and all its steps.
  activation memory       for one forward of one micro-batch in training mode (a copy of the model built with
                          model.dropout=--dropout, so dropout saves its masks), the bytes autograd saves for backward
                          per rank (torch.autograd.graph.saved_tensors_hooks; each storage counted once, parameters
                          left out), attributed to the innermost module that saved them (norm, dropout, linear
                          inputs, attention core, MLP activation, loss) and counted by shape: (b, s, h) tensors
                          against (b, s/tp, h) ones. With sequence parallelism the norm/dropout part falls by ~tp.

The script starts its own workers: for each round it runs `python -m torch.distributed.run --standalone` once per
layout: 1 process (tp1, OMP_NUM_THREADS=2), 1 process (tp1-1t, OMP_NUM_THREADS=1; --no-tp1-1thread drops it) and
2 processes (tp2 then tp2-sp, OMP_NUM_THREADS=1 each); the order of the launches and of the two tp=2 scenarios is
reversed on odd rounds. Rank 0 of each launch writes its results to a part file; this process merges them and
prints the tables. A timed step sits between two barriers and is timed on rank 0; the table gives the median and
the min over the timed steps of all rounds, and the median of the CPU time per step summed over all ranks (all
their threads, barriers excluded). (Self-contained: scripts/ is not a package, so nothing is imported from
bench_dp.py, whose structure this follows.)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# name -> (tensor-parallel degree, sequence parallel, threads per process); tp1-1t is a reference only
SCENARIOS: dict[str, tuple[int, bool, int]] = {"tp1": (1, False, 2), "tp1-1t": (1, False, 1), "tp2": (2, False, 1),
                                               "tp2-sp": (2, True, 1)}
LOSS_RTOL = 1e-4  # step-1 loss: same weights, same batch, different reduction orders


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8, help="model.n_layer")
    p.add_argument("--width", type=int, default=768, help="model.n_embd")
    p.add_argument("--heads", type=int, default=12, help="model.n_head (a multiple of 2)")
    p.add_argument("--mlp", choices=["gelu", "swiglu"], default="gelu", help="model.mlp")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence (model.block_size; even)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per step (dp=1: the global batch)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per scenario per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per scenario per round (at least 1)")
    p.add_argument("--rounds", type=int, default=1, help="rounds over all scenarios, order reversed on odd rounds")
    p.add_argument("--dropout", type=float, default=0.1,
                   help="model.dropout of the model whose activations are measured (training runs at 0.0)")
    p.add_argument("--tp1-1thread", action=argparse.BooleanOptionalAction, default=True,
                   help="also time tp=1 as one process with ONE thread (a reference: on a loaded 2-core machine "
                        "two OpenMP threads can be slower than one)")
    p.add_argument("--tp-overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="sequence-parallel layers overlap their collectives (forward, row backward) with the "
                        "matmuls by the ring (parallel/tensor/overlap.py); --no-tp-overlap times the plain path")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--order", default="", help=argparse.SUPPRESS)  # the worker's scenarios, comma-separated
    p.add_argument("--part", type=Path, help=argparse.SUPPRESS)  # where the worker's rank 0 writes its results
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 1 or args.rounds < 1:
        p.error("--steps, --warmup and --rounds must be at least 1")
    if args.width % args.heads or args.heads % 2 or args.seq % 2:
        p.error("--heads must divide --width and be even; --seq must be even (tp=2 splits heads and the sequence)")
    if not 0.0 <= args.dropout < 1.0:
        p.error("--dropout must be in [0, 1)")
    return args


# -- the launcher ---------------------------------------------------------------------------------------------
def launch(argv: list[str], args: argparse.Namespace) -> int:
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        print(f"note: only {cores} core(s) available; tp=2 will oversubscribe them", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench_tp_"))
    results: dict[str, dict[str, Any]] = {}
    meta: dict[str, Any] = {}
    t_start = time.perf_counter()
    rc = 0
    try:
        for rnd in range(args.rounds):
            launches = [["tp1"], ["tp1-1t"], ["tp2", "tp2-sp"]] if args.tp1_1thread else [["tp1"], ["tp2", "tp2-sp"]]
            if rnd % 2:
                launches = [order[::-1] for order in launches[::-1]]
            for i, order in enumerate(launches):
                nproc, _, threads = SCENARIOS[order[0]]  # processes = tp (dp=1)
                env = dict(os.environ, OMP_NUM_THREADS=str(threads))
                part = tmp / f"round{rnd}-{i}.json"
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                       str(Path(__file__).resolve()), *argv, "--worker", "--order", ",".join(order),
                       "--part", str(part)]
                print(f"round {rnd + 1}/{args.rounds}: {nproc} process(es) x {threads} thread(s): {', '.join(order)}",
                      flush=True)
                code = subprocess.run(cmd, env=env, cwd=ROOT).returncode
                if code or not part.exists():
                    print(f"  launch failed (exit {code})", flush=True)
                    rc = rc or code or 1
                    for name in order:
                        results.setdefault(name, {}).setdefault("error", f"launch exited {code}")
                    continue
                data = json.loads(part.read_text())
                meta.update(data["meta"])
                for name, r in data["scenarios"].items():
                    merge(results.setdefault(name, {}), r)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if meta:
        report(args, meta, results)
    print(f"wall time {time.perf_counter() - t_start:.0f} s (exit {rc})", flush=True)
    return rc


def merge(into: dict[str, Any], r: dict[str, Any]) -> None:
    """Timings extend over rounds; the rest (losses, bytes, memory) comes from the first round that had it."""
    for key in ("times", "cpu"):
        into.setdefault(key, []).extend(r.get(key, []))
    for key, value in r.items():
        if key not in ("times", "cpu"):
            into.setdefault(key, value)


# -- the worker -----------------------------------------------------------------------------------------------
def measure_saved_activations(model: Any, x: Any, y: Any, *, b: int, s: int, h: int, tp: int) -> dict[str, Any]:
    """Bytes autograd saves for backward in one training-mode forward of (x, y), by region and by shape."""
    import torch
    from torch import nn

    from dist_llm.model.gpt import MLP, Attention

    def region(module: nn.Module | None) -> str:
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            return "norm"
        if isinstance(module, nn.Dropout):
            return "dropout"
        if isinstance(module, Attention):
            return "attention core"  # saved by attention itself, outside its linears: SDPA, RoPE
        if isinstance(module, MLP):
            return "mlp activation"
        if module is None or module is model:
            return "loss"  # the cross-entropy runs in GPT.forward after the head
        return "linear/embedding inputs"  # column/row/vocab-parallel layers, nn.Linear, nn.Embedding

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack: list[nn.Module] = []
    handles = []

    def enter(module: nn.Module, _inputs: Any) -> None:
        stack.append(module)

    def leave(_module: nn.Module, _inputs: Any, _output: Any) -> None:
        stack.pop()  # (a hook that returns something replaces the module's output)

    for m in model.modules():
        handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    seen: dict[int, tuple[int, str, tuple[int, ...]]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() and ptr not in params and ptr not in seen:
            seen[ptr] = (storage.nbytes(), region(stack[-1] if stack else None), tuple(t.shape))
        return t

    model.train()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(x, y)
    finally:
        for hd in handles:
            hd.remove()
    del loss
    by_region: dict[str, int] = {}
    for nbytes, reg, _ in seen.values():
        by_region[reg] = by_region.get(reg, 0) + nbytes
    # by shape: h wide with b*s rows, or b*s/tp rows (linear layers save their inputs flattened to (b*s, h))
    shape_count = {"full": [0, 0], "sliced": [0, 0]}  # [tensors, bytes]
    for nbytes, _, shape in seen.values():
        rows = math.prod(shape[:-1]) if shape and shape[-1] == h else 0
        key = "full" if rows == b * s else "sliced" if rows == b * s // tp else None
        if key:
            shape_count[key][0] += 1
            shape_count[key][1] += nbytes
    return {"total": sum(by_region.values()), "by_region": dict(sorted(by_region.items())),
            "bsh_tensors": shape_count["full"][0], "bsh_bytes": shape_count["full"][1],
            "bsh_over_tp_tensors": shape_count["sliced"][0] if tp > 1 else 0,
            "bsh_over_tp_bytes": shape_count["sliced"][1] if tp > 1 else 0}


def worker(args: argparse.Namespace) -> int:
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=".*(reduce_scatter_tensor|all_gather_into_tensor).*")
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    from dist_llm import perf
    from dist_llm.config import load_config
    from dist_llm.model import GPT
    from dist_llm.parallel.context import ParallelContext
    from dist_llm.parallel.tensor import overlap
    from dist_llm.train.trainer import Trainer, build_model

    overlap.ENABLED = args.tp_overlap

    logging.getLogger("dist_llm").setLevel(logging.WARNING)
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    # the trainer's out_dir (metrics only: no checkpoint is saved), under the launcher's temporary folder
    out_root = args.part.parent / "runs" if args.part else Path(tempfile.mkdtemp(prefix="bench_tp_run_"))
    base = [f"model.n_layer={args.layers}", f"model.n_embd={args.width}", f"model.n_head={args.heads}",
            "model.vocab_size=256", f"model.block_size={args.seq}", "model.dropout=0.0", f"model.mlp={args.mlp}",
            f"train.micro_batch_size={args.micro_batch}", f"train.global_batch_size={args.micro_batch}",
            "train.device=cpu", "train.precision=fp32", "train.resume=never", "train.eval_interval=0",
            "optim.grad_clip=1.0", "parallel.timeout_s=300", "parallel.dp=1"]
    b, s, h = args.micro_batch, args.seq, args.width
    results: dict[str, dict[str, Any]] = {}
    meta: dict[str, Any] = {}
    rank = int(os.environ.get("RANK", "0"))
    with torch.device("meta"):  # the whole (unsharded) model's count, without allocating it
        meta["n_params"] = GPT(load_config(None, base).model).num_params()
    meta["torch"] = torch.__version__

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    for name in args.order.split(","):
        tp, sp, _ = SCENARIOS[name]
        overrides = [*base, f"parallel.tp={tp}", f"parallel.sequence_parallel={str(sp).lower()}",
                     f"train.out_dir={out_root / name}"]
        cfg = load_config(None, overrides)
        ctx = ParallelContext.from_config(cfg)
        res: dict[str, Any] = {"times": [], "cpu": [], "losses": []}

        # activation memory: one forward of one micro-batch, on a copy built with dropout on
        mem_cfg = load_config(None, [*overrides, f"model.dropout={args.dropout}"])
        model = build_model(mem_cfg, ctx)
        gen = torch.Generator().manual_seed(1234)
        x = torch.randint(0, 256, (b, s), generator=gen)
        y = torch.randint(0, 256, (b, s), generator=gen)
        res["memory"] = measure_saved_activations(model, x, y, b=b, s=s, h=h, tp=tp)
        del model
        gc.collect()

        perf.reset_peak_memory(ctx.device)
        start_bytes = perf.memory_bytes(ctx.device)
        trainer = Trainer(cfg, ctx)
        say(f"  {name}: {trainer.module.num_params():,} parameters on rank 0; "
            f"{args.warmup} warm-up + {args.steps} timed steps")
        for i in range(args.warmup + args.steps):
            timed = i >= args.warmup
            ctx.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            out = trainer.train_step()
            loss = float(out.loss)  # waits for the step on every rank
            c1 = time.process_time()
            ctx.barrier()
            if timed:
                res["times"].append(time.perf_counter() - t0)
                res["cpu"].append(c1 - c0)
            if i < 2:
                res["losses"].append(loss)
        peak = torch.tensor([perf.peak_memory_bytes(ctx.device) - start_bytes], dtype=torch.int64)
        if dist.is_initialized():
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        res["peak_bytes"] = int(peak)  # the most any rank's memory rose above where it stood before the trainer
        res["comm"] = dict(trainer.comm_bytes)
        res["comm_calls"] = dict(ctx.comm.calls)
        # CPU time per step summed over the ranks (each rank's own process time)
        cpu = torch.tensor(res["cpu"], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(cpu)
        res["cpu"] = cpu.tolist()
        trainer.metrics.close()
        results[name] = res
        del trainer, out
        gc.collect()
        ctx.barrier()

    if rank == 0 and args.part:
        meta.update(threads=threads)
        args.part.write_text(json.dumps({"meta": meta, "scenarios": results}))
    if not args.part:
        shutil.rmtree(out_root, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


# -- the report -----------------------------------------------------------------------------------------------
def theory_bytes(args: argparse.Namespace, tp: int, sp: bool = False) -> float:
    """Megatron's tensor-parallel traffic per step and rank: (4L + 2) all-reduces of b*s*h fp32 activations
    (per layer 2 in forward, 2 in backward; the embedding's in forward, the LM head's input gradient in backward),
    each 2(tp-1)/tp of the tensor on a ring. Sequence parallelism moves the same bytes as AG + RS pairs, plus
    the backward's re-gather of each column input (2L + 1: qkv's, the MLP's, the head's), of which only the
    local slice was kept."""
    if tp == 1:
        return 0.0
    bsh = args.micro_batch * args.seq * args.width * 4
    regather = (2 * args.layers + 1) * bsh * (tp - 1) / tp if sp else 0.0
    return (4 * args.layers + 2) * bsh * 2 * (tp - 1) / tp + regather


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def report(args: argparse.Namespace, meta: dict[str, Any], results: dict[str, dict[str, Any]]) -> None:
    n = meta["n_params"]
    tokens = args.micro_batch * args.seq
    print(f"\ntorch {meta.get('torch', '?')} | GPT {n:,} parameters ({n / 1e6:.1f}M): {args.layers} layers, "
          f"{args.width} wide, {args.heads} heads, vocab 256, seq {args.seq} | micro batch {args.micro_batch} "
          f"(dp=1: {tokens:,} tokens/step), fp32, AdamW, clip 1.0 | CPU, gloo | tp1: 1 process x 2 threads; "
          f"tp1-1t: 1 process x 1 thread; tp2, tp2-sp: 2 processes x 1 thread | {args.warmup} warm-up + "
          f"{args.steps} timed steps x {args.rounds} round(s)")
    ok = {k: r for k, r in results.items() if r.get("times") and not r.get("error")}
    med = {k: statistics.median(r["times"]) for k, r in ok.items()}

    print("\nstep-1 loss (same weights, same batch) and step-2 loss (after one step), rank 0:")
    anchor = ok.get("tp1", {}).get("losses")
    for k in SCENARIOS:
        r = results.get(k, {})
        if len(r.get("losses", [])) < 2:
            print(f"  {k:<7} (no loss: {r.get('error', 'not run')})")
            continue
        line = f"  {k:<7} step 1 {r['losses'][0]:.6f}   step 2 {r['losses'][1]:.6f}"
        if anchor and k != "tp1":
            d1 = abs(r["losses"][0] - anchor[0]) / abs(anchor[0])
            d2 = abs(r["losses"][1] - anchor[1]) / abs(anchor[1])
            line += f"   rel diff vs tp1 {d1:.1e} / {d2:.1e}" + (
                f"   WARNING: step-1 loss differs by more than {LOSS_RTOL:g}" if d1 > LOSS_RTOL else "")
        print(line)

    print(f"\nspeed: {tokens:,} tokens/step; cpu s = CPU seconds per step summed over all ranks (median)")
    header = (f"{'scenario':<8} {'step ms (med)':>13} {'step ms (min)':>13} {'tokens/s':>9} {'vs tp1':>7} "
              f"{'cpu s':>6} {'peak MiB':>8} {'tp MiB/step':>11} {'Megatron MiB':>12} {'meas/theory':>11}  comm by kind (MiB, calls)")
    print(header)
    print("-" * len(header))
    rows = {}
    for k, (tp, sp, _) in SCENARIOS.items():
        r = results.get(k, {})
        if k not in ok:
            print(f"{k:<8} FAILED: {r.get('error', 'no timed steps')}")
            continue
        comm_total = sum(r["comm"].values())
        theory = theory_bytes(args, tp, sp)
        ratio = f"{comm_total / theory:.3f}" if theory else ""
        speedup = f"{med['tp1'] / med[k]:.2f}x" if "tp1" in med else ""
        kinds = ", ".join(f"{kind} {mib(v) if v >= 2**20 / 100 else f'{v} B'} ({r['comm_calls'].get(kind, 0)})"
                          for kind, v in r["comm"].items()) or "none"
        print(f"{k:<8} {med[k] * 1e3:>13.0f} {min(r['times']) * 1e3:>13.0f} {tokens / med[k]:>9,.0f} {speedup:>7} "
              f"{statistics.median(r['cpu']):>6.2f} {mib(r['peak_bytes']):>8} {mib(comm_total):>11} {mib(theory):>12} {ratio:>11}  {kinds}")
        rows[k] = {"step_ms_median": med[k] * 1e3, "step_ms_min": min(r["times"]) * 1e3,
                   "tokens_per_s": tokens / med[k], "cpu_s_median": statistics.median(r["cpu"]),
                   "comm_bytes": r["comm"], "comm_calls": r["comm_calls"], "comm_total": comm_total,
                   "theory_bytes": theory, "peak_bytes": r["peak_bytes"]}

    b, s, h = args.micro_batch, args.seq, args.width
    print(f"\nactivation memory per rank: bytes saved for backward by one training forward of one micro-batch "
          f"(model.dropout={args.dropout}; parameters excluded; each storage once), MiB")
    regions = ["norm", "dropout", "linear/embedding inputs", "attention core", "mlp activation", "loss"]
    header = (f"{'scenario':<8} {'total':>8} {'norm+drop':>9} " + " ".join(f"{r[:12]:>12}" for r in regions)
              + f"  {'(b,s,h): n = MiB':>17} {'(b,s/tp,h): n = MiB':>20}")
    print(header)
    print("-" * len(header))
    for k in SCENARIOS:
        m = results.get(k, {}).get("memory")
        if not m or k == "tp1-1t":  # the same model and bytes as tp1
            continue
        reg = m["by_region"]
        nd = reg.get("norm", 0) + reg.get("dropout", 0)
        rows.setdefault(k, {})["memory"] = {**m, "norm_dropout": nd}
        print(f"{k:<8} {mib(m['total']):>8} {mib(nd):>9} " + " ".join(f"{mib(reg.get(r, 0)):>12}" for r in regions)
              + f"  {m['bsh_tensors']:>4} = {mib(m['bsh_bytes']):>9} {m['bsh_over_tp_tensors']:>4} = "
                f"{mib(m['bsh_over_tp_bytes']):>12}")
    print(f"(b, s, h) = ({b}, {s}, {h}); shape columns count saved tensors h wide with b*s rows and with b*s/tp rows "
          "(norm inputs, dropout masks, linear inputs); under sequence parallelism the column-parallel layers keep "
          "their input's (b, s/tp, h) slice and all-gather it again in backward")

    print("\nkey ratios:")
    summary: dict[str, float] = {}
    if "tp1" in med:
        for k in ("tp2", "tp2-sp"):
            if k in med:
                summary[f"{k}/tp1 tokens/s"] = med["tp1"] / med[k]
                print(f"  {k} / tp1 tokens/s (median): {med['tp1'] / med[k]:.2f}   "
                      f"(min-based {min(ok['tp1']['times']) / min(ok[k]['times']):.2f})")
    for k in ("tp2", "tp2-sp"):
        if k in rows and rows[k].get("theory_bytes"):
            summary[f"{k} measured/theory bytes"] = rows[k]["comm_total"] / rows[k]["theory_bytes"]
            print(f"  {k} measured / Megatron bytes: {rows[k]['comm_total'] / rows[k]['theory_bytes']:.4f}")
    mem = {k: rows[k]["memory"] for k in SCENARIOS if "memory" in rows.get(k, {})}
    if "tp2" in mem and "tp2-sp" in mem:
        a, c = mem["tp2"], mem["tp2-sp"]
        if c["norm_dropout"]:
            summary["norm+dropout bytes tp2 / tp2-sp"] = a["norm_dropout"] / c["norm_dropout"]
            print(f"  norm+dropout saved bytes per rank: tp2 {mib(a['norm_dropout'])} MiB vs tp2-sp "
                  f"{mib(c['norm_dropout'])} MiB = {a['norm_dropout'] / c['norm_dropout']:.2f}x less with SP")
        summary["total activation bytes tp2 / tp2-sp"] = a["total"] / c["total"]
        print(f"  total saved bytes per rank: tp2 {mib(a['total'])} MiB vs tp2-sp {mib(c['total'])} MiB = "
              f"{a['total'] / c['total']:.2f}x")
    if "tp1-1t" in med and "tp2" in med:
        summary["tp2/tp1-1t tokens/s"] = med["tp1-1t"] / med["tp2"]
        print(f"  reference: tp2 / tp1-1t (one process, one thread) tokens/s (median): "
              f"{med['tp1-1t'] / med['tp2']:.2f}; tp1-1t / tp1 (1 vs 2 threads): {med['tp1'] / med['tp1-1t']:.2f}")
    if "tp1" in mem and "tp2" in mem:
        print(f"  total saved bytes per rank: tp1 {mib(mem['tp1']['total'])} MiB vs tp2 {mib(mem['tp2']['total'])} "
              f"MiB = {mem['tp1']['total'] / mem['tp2']['total']:.2f}x")
    noisy = [k for k, r in ok.items() if max(r["times"]) / min(r["times"]) > 1.15]
    if noisy:
        print(f"note: step times vary more than 15% (max/min) in {', '.join(noisy)}: the machine was busy; compare "
              "the min column and 'cpu s' too, or rerun with more --steps/--rounds")
    if args.json:
        args.json.write_text(json.dumps({
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                     if k not in ("worker", "order", "part")},
            "n_params": meta["n_params"], "tokens_per_step": tokens, "summary": summary,
            "scenarios": {k: {**rows.get(k, {}), "step_ms_all": [t * 1e3 for t in r.get("times", [])],
                              "cpu_s_all": r.get("cpu", []), "losses": r.get("losses", []),
                              "error": r.get("error", "")} for k, r in results.items()}}, indent=2))
        print(f"wrote {args.json}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    return worker(args) if args.worker else launch(argv, args)


if __name__ == "__main__":
    raise SystemExit(main())
