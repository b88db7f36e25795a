"""Step time of dist_llm's data-parallel stages 0-3 beside plain PyTorch DDP, FSDP2 and DeepSpeed ZeRO 1-3.

    python scripts/bench_dp.py [--nproc 2] [--layers 6] [--width 512] [--seq 256] [--micro-batch 4]
                               [--steps 6] [--warmup 2] [--rounds 2] [--only SCENARIO,...]
                               [--deepspeed | --no-deepspeed] [--json PATH]

The script starts its own workers: it re-runs itself under `python -m torch.distributed.run --standalone`
(so DeepSpeed finds a torchrun environment) and rank 0 prints the table. CPU, gloo, fp32, one micro-step.

Scenarios (each builds the same GPT from the same seed, takes the same token batches, clips to 1.0 and steps
the same AdamW, torch's fused kernel, decay on matrices only):
  ours-zero0..3  dist_llm's `build_data_parallel` at parallel.zero_stage 0..3, driven in the order of
                 `Trainer.train_step`: micro_step context, forward under autocast, backward, finish_grads,
                 unscale (a no-op in fp32), clip_grad_norm_, step(lr, found_inf), zero_grad.
  torch-ddp      DistributedDataParallel (defaults) + torch AdamW + clip_grad_norm_.
  torch-fsdp2    fully_shard on each block, then the root (defaults) + torch AdamW + clip_grad_norm_.
  ds-zero1..3    deepspeed.initialize with a torch AdamW passed in (not DeepSpeed's JIT-built ops), ZeRO stage K
                 with DeepSpeed's default buckets; engine(x, y), engine.backward, engine.step.
The reference scenarios are written inline here and use no dist_llm data-parallel code.

Timing: every scenario is built, warmed up, timed and freed in turn; rounds alternate the order (reversed on odd
rounds) so drift falls on all alike. A timed step sits between two barriers and is timed on rank 0; the table
gives the median and the min over the timed steps of all rounds, and the median of rank 0's process CPU time per
step (all its threads, barriers excluded), which other load on a shared machine inflates less than wall time.
Ratios are step times, ours / reference (below 1: ours is faster). Correctness, cheaply: the step-1 loss (same
weights, same batch) must agree across scenarios; the step-2 loss (after one clipped AdamW step) is shown as a
check of the update.

Memory: "peak MiB" is the most a rank's memory rose above where it stood before the scenario was built, the
largest over ranks and rounds (CUDA: max_memory_allocated; CPU: the peak resident set, Linux's VmHWM reset per
scenario after the heap's free pages went back to the system, see dist_llm.perf.reset_peak_memory).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
OURS = ["ours-zero0", "ours-zero1", "ours-zero2", "ours-zero3"]
PLAIN = ["torch-ddp", "torch-fsdp2"]
DEEPSPEED = ["ds-zero1", "ds-zero2", "ds-zero3"]
# The order of a round: each of ours next to what it is compared with.
ORDER = ["ours-zero0", "torch-ddp", "ours-zero1", "ds-zero1", "ours-zero2", "ds-zero2", "ours-zero3", "torch-fsdp2",
         "ds-zero3"]
# (ours, reference, the largest step-time ratio ours/reference that meets the target)
TARGETS = [("ours-zero0", "torch-ddp", 1.05), ("ours-zero3", "torch-fsdp2", 1.10), ("ours-zero1", "ds-zero1", 1.0),
           ("ours-zero2", "ds-zero2", 1.0), ("ours-zero3", "ds-zero3", 1.0)]
LOSS_RTOL = 1e-4  # step-1 loss: same weights, same batch
LOSS2_RTOL = 1e-3  # step-2 loss: after one clipped AdamW step (reduction orders differ)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="worker processes (data-parallel ranks)")
    p.add_argument("--layers", type=int, default=6, help="model.n_layer")
    p.add_argument("--width", type=int, default=512, help="model.n_embd (heads: width // 64)")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence (model.block_size)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=6, help="timed steps per scenario per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per scenario per round (at least 1)")
    p.add_argument("--rounds", type=int, default=2, help="rounds over all scenarios, order reversed on odd rounds")
    p.add_argument("--only", default="", help=f"comma-separated scenarios (default all): {', '.join(ORDER)}")
    p.add_argument("--deepspeed", action=argparse.BooleanOptionalAction, default=None,
                   help="include the DeepSpeed scenarios (default: when deepspeed imports)")
    p.add_argument("--json", type=Path, help="also write the results here (rank 0)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 1 or args.rounds < 1 or args.nproc < 2:
        p.error("--steps, --warmup and --rounds must be at least 1, --nproc at least 2")
    if args.width % 64:
        p.error("--width must be a multiple of 64 (heads of 64)")
    wanted = [s.strip() for s in args.only.split(",") if s.strip()] or ORDER
    for s in wanted:
        if s not in ORDER:
            p.error(f"--only: unknown scenario {s!r}; choose from {', '.join(ORDER)}")
    if args.deepspeed is False:
        wanted = [s for s in wanted if s not in DEEPSPEED]
    args.scenarios = [s for s in ORDER if s in wanted]
    return args


# -- the launcher -------------------------------------------------------------------------------------------
def launch(argv: list[str], args: argparse.Namespace) -> int:
    cores = len(os.sched_getaffinity(0))
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // args.nproc)))  # also keeps torchrun from warning
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))  # DeepSpeed's JIT ops
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           str(Path(__file__).resolve()), "--worker", *argv]
    print("launching: " + " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, env=env, cwd=ROOT).returncode
    print(f"wall time {time.perf_counter() - t0:.0f} s (exit {rc})", flush=True)
    return rc


# -- what every scenario shares -------------------------------------------------------------------------------
@dataclass
class Built:
    """A scenario ready to run: `step(x, y)` is one optimizer step and returns the (detached) loss."""

    step: Callable[[Any, Any], Any]
    close: Callable[[], None] = lambda: None
    comm: Any = None  # dist_llm's CommStats (ours only)


@dataclass
class Result:
    times: list[float] = field(default_factory=list)  # seconds, rank 0
    cpu: list[float] = field(default_factory=list)  # rank 0's process CPU seconds over the same steps
    losses: list[float] = field(default_factory=list)  # rank 0's loss at steps 1 and 2 of the first round
    comm: dict[str, int] = field(default_factory=dict)
    peak_bytes: list[int] = field(default_factory=list)  # per rank: the most memory above the start, over rounds
    error: str = ""


def adamw_groups(model: Any, weight_decay: float) -> list[dict]:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def worker(args: argparse.Namespace) -> int:
    warnings.filterwarnings("ignore", message=".*(reduce_scatter_tensor|all_gather_into_tensor).*")
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    from dist_llm import perf
    from dist_llm.config import load_config
    from dist_llm.model import GPT
    from dist_llm.parallel.context import ParallelContext
    from dist_llm.parallel.data import build_data_parallel
    from dist_llm.precision import LossScaler, autocast

    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // args.nproc)
    torch.set_num_threads(threads)
    overrides = [f"model.n_layer={args.layers}", f"model.n_embd={args.width}", f"model.n_head={args.width // 64}",
                 "model.vocab_size=256", f"model.block_size={args.seq}", "model.dropout=0.0",
                 f"train.micro_batch_size={args.micro_batch}",
                 f"train.global_batch_size={args.micro_batch * args.nproc}",
                 "train.device=cpu", "train.precision=fp32", "optim.grad_clip=1.0", "parallel.timeout_s=300"]
    base_cfg = load_config(None, overrides)
    ctx0 = ParallelContext.from_config(base_cfg)  # creates the process group that every scenario reuses
    rank, world, device = ctx0.rank, ctx0.world_size, ctx0.device
    main = rank == 0
    o = base_cfg.optim
    lr = o.lr  # constant: every scenario steps with the same learning rate

    def say(msg: str) -> None:
        if main:
            print(msg, flush=True)

    ds = None
    scenarios = list(args.scenarios)
    if any(s in DEEPSPEED for s in scenarios):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        try:
            import deepspeed as ds
            from deepspeed.utils import logger as ds_logger

            ds_logger.setLevel(logging.WARNING)
        except Exception as e:  # noqa: BLE001 - any import failure means: no DeepSpeed here
            if args.deepspeed:
                raise
            say(f"DeepSpeed scenarios skipped: `import deepspeed` failed: {type(e).__name__}: {e}")
            scenarios = [s for s in scenarios if s not in DEEPSPEED]

    def make_model() -> GPT:
        torch.manual_seed(base_cfg.train.seed)
        return GPT(base_cfg.model)

    n_params = make_model().num_params()
    # The same token batches in every scenario: one global batch per step index, rank r takes its rows.
    gen = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(args.warmup + args.steps):
        seq = torch.randint(0, 256, (args.micro_batch * world, args.seq + 1), generator=gen)
        mine = seq[rank * args.micro_batch : (rank + 1) * args.micro_batch]
        batches.append((mine[:, :-1].contiguous(), mine[:, 1:].contiguous()))

    # -- ours: dist_llm's data parallelism, driven as Trainer.train_step drives it --------------------------
    def build_ours(stage: int) -> Built:
        cfg = load_config(None, [*overrides, f"parallel.zero_stage={stage}"])
        ctx = ParallelContext.from_config(cfg)
        dp = build_data_parallel(make_model(), cfg, ctx)
        scaler = LossScaler(enabled=False)
        accum_steps = cfg.train.global_batch_size // (cfg.train.micro_batch_size * ctx.dp)
        assert accum_steps == 1

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            dp.model.train()
            ctx.comm.reset()
            loss_sum = torch.zeros((), device=ctx.device)
            with dp.micro_step(last=True):
                with autocast(cfg.train.precision, ctx.device):
                    loss = dp.model(x, y)
                loss_sum += loss.detach()
                scaler.scale_loss(loss / accum_steps).backward()
            dp.finish_grads()
            scaler.unscale_(dp.local_grads())
            grad_norm = dp.clip_grad_norm_(cfg.optim.grad_clip or math.inf)
            found_inf = (~torch.isfinite(grad_norm)).float()  # the skip decided on the device, as the trainer does
            scaler.update(found_inf)
            dp.step(lr, found_inf)
            dp.zero_grad()
            return loss_sum / accum_steps

        return Built(step, comm=ctx.comm)

    # -- plain PyTorch references -------------------------------------------------------------------------
    def plain_training(model: torch.nn.Module) -> Built:
        """The textbook step over a wrapped model: forward, backward, clip, AdamW."""
        opt = torch.optim.AdamW(adamw_groups(model, o.weight_decay), lr=lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                fused=True)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return Built(step)

    def build_torch_ddp() -> Built:
        from torch.nn.parallel import DistributedDataParallel as DDP

        return plain_training(DDP(make_model()))

    def build_torch_fsdp2() -> Built:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        model = make_model()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return plain_training(model)

    def build_deepspeed(stage: int) -> Built:
        if not ds.comm.is_initialized():
            # its shared-memory all-reduce serves DeepSpeed's inference only: not built, as dist_llm's backend does
            from dist_llm.parallel.data.deepspeed import skip_inference_all_reduce_build

            skip_inference_all_reduce_build()
            t0 = time.perf_counter()
            ds.init_distributed(dist_backend="gloo")
            say(f"deepspeed.init_distributed took {time.perf_counter() - t0:.1f} s")
        model = make_model()
        opt = torch.optim.AdamW(adamw_groups(model, o.weight_decay), lr=lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                fused=True)
        config = {"train_batch_size": args.micro_batch * world, "train_micro_batch_size_per_gpu": args.micro_batch,
                  "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
                  "steps_per_print": 10**9, "wall_clock_breakdown": False}
        engine, *_ = ds.initialize(model=model, optimizer=opt, config=config)
        torch.set_num_threads(threads)  # in case DeepSpeed changed it

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss.detach()

        def close() -> None:
            if hasattr(engine, "destroy"):
                engine.destroy()

        return Built(step, close)

    builders: dict[str, Callable[[], Built]] = {
        **{f"ours-zero{k}": (lambda k=k: build_ours(k)) for k in range(4)},
        "torch-ddp": build_torch_ddp, "torch-fsdp2": build_torch_fsdp2,
        **{f"ds-zero{k}": (lambda k=k: build_deepspeed(k)) for k in (1, 2, 3)},
    }

    say(f"torch {torch.__version__}" + (f", deepspeed {ds.__version__}" if ds else "") + f" | {world} ranks (gloo), "
        f"{threads} thread(s) each on {cores} cores | GPT {n_params:,} parameters ({n_params / 1e6:.1f}M): "
        f"{args.layers} layers, {args.width} wide, {args.width // 64} heads, vocab 256, seq {args.seq} | micro batch "
        f"{args.micro_batch} per rank, global {args.micro_batch * world} x {args.seq} tokens, fp32, clip 1.0, AdamW "
        f"lr {lr:g} betas ({o.beta1}, {o.beta2}) wd {o.weight_decay} | {args.warmup} warm-up + {args.steps} timed "
        f"steps x {args.rounds} round(s)")
    results = {s: Result() for s in scenarios}
    for rnd in range(args.rounds):
        order = scenarios if rnd % 2 == 0 else scenarios[::-1]
        for name in order:
            res = results[name]
            if res.error:
                continue
            say(f"round {rnd + 1}/{args.rounds}: {name}")
            try:
                gc.collect()
                perf.reset_peak_memory(device)
                start_bytes = perf.memory_bytes(device)
                built = builders[name]()
                for i, (x, y) in enumerate(batches):
                    timed = i >= args.warmup
                    if timed:
                        dist.barrier()
                        t0, c0 = time.perf_counter(), time.process_time()
                    loss = built.step(x, y)
                    if timed:
                        c1 = time.process_time()
                        dist.barrier()
                        res.times.append(time.perf_counter() - t0)
                        res.cpu.append(c1 - c0)
                    if rnd == 0 and i < 2:
                        res.losses.append(float(loss))
                if built.comm is not None:
                    res.comm = built.comm.snapshot()
                peaks: list[int] = [0] * world
                dist.all_gather_object(peaks, perf.peak_memory_bytes(device) - start_bytes)
                res.peak_bytes = [max(a, b) for a, b in zip(res.peak_bytes, peaks)] if res.peak_bytes else peaks
                built.close()
            except Exception as e:  # noqa: BLE001 - report it and go on with the other scenarios
                res.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                print(f"[rank {rank}] {name} failed: {res.error}", flush=True)
            built = None
            gc.collect()
            dist.barrier()

    if main:
        report(args, results, n_params, world)
    dist.barrier()
    dist.destroy_process_group()
    return 0


# -- the report ---------------------------------------------------------------------------------------------
def theory_bytes(name: str, n_params: int, n: int) -> float:
    """Bytes a rank sends per step under ring collectives: 2(n-1)/n x params x 4 (an all-reduce, or a
    reduce-scatter plus an all-gather) for stages 0-2; 3(n-1)/n for stage 3 (all-gather in forward and again
    in backward, reduce-scatter)."""
    factor = 3 if name.endswith("zero3") or name == "torch-fsdp2" else 2
    return factor * (n - 1) / n * 4 * n_params


def report(args: argparse.Namespace, results: dict[str, Result], n_params: int, world: int) -> None:
    tokens = args.micro_batch * world * args.seq
    ref_of = {ours: ref for ours, ref, _ in TARGETS if ours != "ours-zero3" or ref == "torch-fsdp2"}
    med = {s: statistics.median(r.times) for s, r in results.items() if r.times and not r.error}

    print("\nstep-1 loss (same weights, same batch) and step-2 loss (after one clipped AdamW step), rank 0:")
    ran = [s for s, r in results.items() if len(r.losses) == 2]
    anchor = "torch-ddp" if "torch-ddp" in ran else (ran[0] if ran else "")
    anchor_losses = results[anchor].losses if anchor else None
    for s, r in results.items():
        if len(r.losses) < 2:
            print(f"  {s:<12} (no loss: {r.error or 'not run'})")
            continue
        line = f"  {s:<12} step 1 {r.losses[0]:.6f}   step 2 {r.losses[1]:.6f}"
        if anchor_losses:
            d1 = abs(r.losses[0] - anchor_losses[0]) / abs(anchor_losses[0])
            d2 = abs(r.losses[1] - anchor_losses[1]) / abs(anchor_losses[1])
            line += f"   rel diff vs {anchor} {d1:.1e} / {d2:.1e}"
            if d1 > LOSS_RTOL:
                line += f"   WARNING: step-1 loss differs by more than {LOSS_RTOL:g}"
            elif d2 > LOSS2_RTOL:
                line += f"   WARNING: step-2 loss differs by more than {LOSS2_RTOL:g}"
        print(line)

    print(f"\n{world} ranks, global batch {args.micro_batch * world} x {args.seq} = {tokens:,} tokens/step, "
          f"{max((len(r.times) for r in results.values()), default=0)} timed steps per scenario; ratio = step time "
          f"ours / reference (median)")
    header = (f"{'scenario':<12} {'step ms (med)':>13} {'step ms (min)':>13} {'cpu ms (med)':>12} {'tokens/s':>9} "
              f"{'ratio':>16} {'peak MiB':>8} {'comm MiB/step':>13} {'theory MiB':>10}  ours: comm by kind (MiB)")
    print(header)
    print("-" * len(header))
    for s, r in results.items():
        if r.error or not r.times:
            print(f"{s:<12} FAILED: {r.error or 'no timed steps'}")
            continue
        ref = ref_of.get(s)
        ratio = f"{med[s] / med[ref]:.3f} vs {ref.replace('torch-', '')}" if ref in med else ""
        comm_total = f"{sum(r.comm.values()) / 2**20:.2f}" if r.comm else ""
        # the ZeRO grad-norm all-reduce is one fp32 scalar: show tiny kinds in bytes
        kinds = ", ".join(f"{k} {v / 2**20:.2f}" if v >= 2**20 / 100 else f"{k} {v} B" for k, v in r.comm.items())
        print(f"{s:<12} {med[s] * 1e3:>13.1f} {min(r.times) * 1e3:>13.1f} {statistics.median(r.cpu) * 1e3:>12.1f} "
              f"{tokens / med[s]:>9,.0f} {ratio:>16} {max(r.peak_bytes, default=0) / 2**20:>8.1f} "
              f"{comm_total:>13} {theory_bytes(s, n_params, world) / 2**20:>10.2f}  {kinds}")

    print("\ntargets (step time ours / reference, median; min-based in brackets):")
    summary = []
    for ours, ref, limit in TARGETS:
        if ours not in med or ref not in med:
            if ours in results or ref in results:
                print(f"  {ours} vs {ref}: not measured")
            continue
        ratio = med[ours] / med[ref]
        ratio_min = min(results[ours].times) / min(results[ref].times)
        met = ratio <= limit
        want = "no slower" if limit == 1.0 else f"within {round((limit - 1) * 100)}%"
        print(f"  {ours} vs {ref}: {ratio:.3f} [{ratio_min:.3f}]  target {want} (<= {limit:.2f}): "
              f"{'met' if met else 'NOT met'}")
        summary.append({"ours": ours, "reference": ref, "ratio_median": ratio, "ratio_min": ratio_min,
                        "limit": limit, "met": met})
    noisy = [s for s, r in results.items() if r.times and max(r.times) / min(r.times) > 1.15]
    if noisy:
        print(f"note: step times vary more than 15% (max/min) in {', '.join(noisy)}: the machine was busy or still "
              "warming up; compare the min column and 'cpu ms' (rank 0's process CPU time per step, all its threads, "
              "less sensitive to other load) too, or rerun with more --steps/--rounds")
    if args.json:
        args.json.write_text(json.dumps({
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "world": world, "n_params": n_params, "tokens_per_step": tokens, "targets": summary,
            "scenarios": {s: {"step_ms_median": med.get(s, math.nan) * 1e3,
                              "step_ms_all": [t * 1e3 for t in r.times], "cpu_ms_all": [t * 1e3 for t in r.cpu],
                              "losses": r.losses, "comm_bytes": r.comm, "peak_bytes_per_rank": r.peak_bytes,
                              "theory_bytes": theory_bytes(s, n_params, world), "error": r.error}
                          for s, r in results.items()}}, indent=2))
        print(f"wrote {args.json}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    return worker(args) if args.worker else launch(argv, args)


if __name__ == "__main__":
    raise SystemExit(main())
