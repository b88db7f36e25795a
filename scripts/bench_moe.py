"""Grouped expert computation on this machine: torch._grouped_mm vs a per-expert loop over contiguous slices vs a
padded bmm (forward + backward of one MoE expert layer, fp32), and a naive token-by-token loop for scale.

    python scripts/bench_moe.py [--tokens 4096] [--experts 8] [--top-k 2] [--embd 128] [--hidden 512]
"""

from __future__ import annotations

import argparse
import time

import torch

from dist_llm.model.moe import Experts


def timed(fn, repeats: int) -> float:
    """The fastest of `repeats` runs after a warm-up (the least disturbed by other work on a shared machine)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--swiglu", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    experts = Experts(args.experts, args.embd, args.hidden, swiglu=args.swiglu, bias=True)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    rows = args.tokens * args.top_k
    expert_of_row = torch.randint(0, args.experts, (rows,)).sort().values  # (a random, roughly balanced load)
    counts = torch.bincount(expert_of_row, minlength=args.experts)
    x = torch.randn(rows, args.embd, requires_grad=True)

    def step(impl: str) -> None:
        experts.impl = impl
        experts(x, counts, expert_of_row).square().mean().backward()

    def naive() -> None:  # one row at a time: what "not a Python loop over tokens" rules out
        out = [x[i] @ experts.w_up[e] for i, e in enumerate(expert_of_row[:512].tolist())]
        torch.stack(out).square().mean().backward()

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.tokens} tokens x top-{args.top_k} "
          f"over {args.experts} experts, {args.embd} -> {args.hidden} -> {args.embd}, fp32, forward+backward")
    best = {impl: float("inf") for impl in ("grouped_mm", "loop", "bmm")}
    for _ in range(args.repeats):  # interleaved, so a burst of other work hits every variant alike
        for impl in best:
            best[impl] = min(best[impl], timed(lambda: step(impl), 1))
    for impl, s in best.items():
        print(f"  {impl:10s} {s * 1e3:8.2f} ms  {rows / s / 1e3:8.1f} k rows/s")
    s = timed(naive, 3) * rows / 512
    print(f"  {'per-token':10s} {s * 1e3:8.2f} ms  (one projection only, extrapolated from 512 rows)")


if __name__ == "__main__":
    main()
