"""One pipeline stage in one process, timed by what load does not change: each action's thread CPU time and minor page
faults under 1F1B's order (F0 B0 F1 B1 ...) and ZB-H1's split order on the same stage (the last stage of p=2:
F0 B0 F1 B1 W0 F2 B2 W1 ...; --stage first: each W right after its B), the two orders' steps alternating.

    python scripts/bench_pp_split.py [--stage last|first] [--micro-batches 4] [--steps 4] [--trim-mib N]
                                     [--layers 8] [--width 256] [--seq 128] [--micro-batch 2]
                                     [--checkpointing none|full|selective]

The model is bench_pp's (GPT n_layer 8, n_embd 256, seq 128, micro-batch 2, fp32; the stage is half of its blocks,
with the head and loss on the last), one torch thread, glibc set as the trainer sets it (host_malloc:
--trim-mib overrides the trim threshold, 0.125 for glibc's 128 KiB). It prints per action the median wall and CPU
milliseconds and the mean faults, and per step the faults and the CPU milliseconds of the actions: what the split
costs beyond one backward (B + W against B), and whether the heap's memory is reused or faulted in again.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", choices=["last", "first"], default="last")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="timed steps of each order (after two warm-up steps)")
    p.add_argument("--trim-mib", type=float, help="glibc's trim threshold in MiB (default: host_malloc's)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--checkpointing", choices=["none", "full", "selective"], default="none",
                   help="train.activation_checkpointing of the stage's blocks (W recomputes them)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch

    from dist_llm.config import load_config
    from dist_llm.host_malloc import map_large_allocations
    from dist_llm.model import GPT
    from dist_llm.parallel.pipeline.executor import StageModel
    from dist_llm.parallel.pipeline.split_backward import backward_input, backward_weights

    torch.set_num_threads(1)
    trim = {} if args.trim_mib is None else {"trim": int(args.trim_mib * 2**20)}
    if not map_large_allocations(**trim):
        print("(no glibc: malloc left as it is)")
    torch.manual_seed(0)
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [
        f"model.n_layer={args.layers}", f"model.n_embd={args.width}", f"model.n_head={args.heads}",
        f"model.block_size={args.seq}"])
    model = GPT(cfg.model)
    model.set_activation_checkpointing(args.checkpointing)  # type: ignore[arg-type]
    first, half = args.stage == "first", args.layers // 2
    stage = StageModel(model, range(0, half) if first else range(half, args.layers), first=first, last=not first)
    params = [prm for name, prm in model.named_parameters()
              if not name.startswith("blocks.") or int(name.split(".")[1]) in stage.layers]
    opt = torch.optim.AdamW(params, lr=1e-4)
    m, shape = args.micro_batches, (args.micro_batch, args.seq, args.width)
    inputs = [torch.randint(0, cfg.model.vocab_size, shape[:2]) if first else torch.randn(shape) for _ in range(m)]
    targets = [torch.randint(0, cfg.model.vocab_size, shape[:2]) for _ in range(m)]
    out_grads = [torch.randn(shape) for _ in range(m)]

    def order(split: bool) -> list[tuple[str, int]]:
        if not split:
            return [a for j in range(m) for a in (("F", j), ("B", j))]
        if first:
            return [a for j in range(m) for a in (("F", j), ("B", j), ("W", j))]
        acts = [("F", 0), ("B", 0)]
        for j in range(1, m):
            acts += [("F", j), ("B", j), ("W", j - 1)]
        return acts + [("W", m - 1)]

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt

    def step(split: bool) -> dict[str, list[tuple[float, float, int]]]:
        outs: dict[int, torch.Tensor] = {}
        held: dict[int, torch.Tensor] = {}
        work: dict[int, object] = {}
        seen: dict[str, list[tuple[float, float, int]]] = {}
        for kind, j in order(split):
            f0, c0, w0 = faults(), time.thread_time(), time.perf_counter()
            grad = None if stage.last else out_grads[j]
            if kind == "F":
                inp = inputs[j] if first else inputs[j].clone().requires_grad_()
                out = stage.forward(inp)
                outs[j] = model.loss(out, targets[j], reduction="sum") / out.shape[0] / m if stage.last else out
                held[j] = inp
            elif kind == "B" and not split:
                torch.autograd.backward(outs.pop(j), grad)
                held.pop(j)
            elif kind == "B":
                inp = None if first else held[j]
                d_inp, work[j] = backward_input(outs.pop(j), grad, inp, params)
                if inp is not None:
                    inp.grad = d_inp
            else:
                backward_weights(work.pop(j))  # type: ignore[arg-type]
                held.pop(j)
            seen.setdefault(kind, []).append((time.perf_counter() - w0, time.thread_time() - c0, faults() - f0))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return seen

    results: dict[bool, dict[str, list[tuple[float, float, int]]]] = {False: {}, True: {}}
    for i in range(args.steps + 2):
        for split in (False, True):  # alternating: a load that comes and goes falls on both
            for kind, rows in step(split).items():
                if i >= 2:
                    results[split].setdefault(kind, []).extend(rows)
    print(f"{args.stage} stage of {args.layers} x {args.width}, seq {args.seq}, micro-batch {args.micro_batch}, "
          f"m={m}, checkpointing {args.checkpointing}, trim threshold {'host_malloc' if args.trim_mib is None else f'{args.trim_mib} MiB'}: "
          "per action median wall ms / CPU ms / mean faults")
    for split, name in ((False, "1F1B"), (True, "ZB-H1")):
        r = results[split]
        cells = [f"{k} {1e3 * statistics.median(x[0] for x in r[k]):6.1f} {1e3 * statistics.median(x[1] for x in r[k]):6.1f} "
                 f"{statistics.fmean(x[2] for x in r[k]):6.0f}" for k in ("F", "B", "W") if k in r]
        per_step = [sum(x[i] for k in r for x in r[k]) / args.steps for i in (1, 2)]
        print(f"  {name:6} " + " | ".join(cells) + f" | a step: {per_step[1]:.0f} faults, {1e3 * per_step[0]:.0f} CPU ms")


if __name__ == "__main__":
    main()
