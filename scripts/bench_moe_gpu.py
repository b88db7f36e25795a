"""One MoE layer (8 experts, top-2, SwiGLU) in bf16 on a GPU: our grouped path (torch._grouped_mm), its per-expert
loop and padded-bmm fallbacks, against the naive loop over the unsorted routing (Hugging Face Mixtral's way), at
sizes where the experts' matmuls fill the chip. Forward + backward, median of CUDA-event timings.

    python scripts/bench_moe_gpu.py [--sizes 8192x1024x2816,16384x2048x5632] [--device cuda] [--repeats 10]

(`--device cpu` runs the same code on the host with small sizes: a check that the script runs, not a benchmark.)
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from dist_llm.config import ModelConfig
from dist_llm.model.moe import MoE, route


def naive(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """A loop over experts on the unsorted routing: each expert's tokens found with torch.where, run, index_add-ed."""
    flat = x.reshape(-1, x.shape[-1])
    weights, experts, _ = route(F.linear(flat.float(), layer.router.weight.float()), layer.top_k, layer.order)
    ex, out = layer.experts, torch.zeros_like(flat)
    for e in range(layer.n_experts):
        token, slot = torch.where(experts == e)
        h = flat[token]
        hidden = F.silu(h @ ex.w_gate[e]) * (h @ ex.w_up[e])
        out = out.index_add(0, token, ((hidden @ ex.w_down[e]) * weights[token, slot, None]).to(out.dtype))
    return out.view_as(x)


def median_ms(step: Callable[[], None], repeats: int, device: str) -> float:
    for _ in range(3):  # warm-up: kernels chosen, allocator settled
        step()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            start = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8192x1024x2816,16384x2048x5632", help="tokens x width x expert hidden, ...")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, bf16")
    for size in args.sizes.split(","):
        tokens, embd, hidden = (int(v) for v in size.split("x"))
        torch.manual_seed(0)
        cfg = ModelConfig(n_embd=embd, n_experts=8, moe_top_k=2, moe_hidden=hidden, mlp="swiglu", bias=False)
        layer = MoE(cfg, None, torch.nn.Identity())
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.02)
        layer = layer.to(args.device, torch.bfloat16)
        x = torch.randn(1, tokens, embd, device=args.device, dtype=torch.bfloat16, requires_grad=True)
        res: dict[str, float] = {}
        for impl in ("grouped_mm", "loop", "bmm", "naive"):
            def step(impl: str = impl) -> None:
                if impl == "naive":
                    naive(layer, x).float().square().mean().backward()
                else:
                    layer.experts.impl = impl  # type: ignore[assignment]
                    layer(x).float().square().mean().backward()
            try:
                res[impl] = median_ms(step, args.repeats, args.device)
            except Exception as e:  # noqa: BLE001 - a path this torch/device lacks: say so, time the others
                print(f"  {impl}: {type(e).__name__}: {str(e).splitlines()[0]}")
        with torch.no_grad():
            layer.experts.impl = "grouped_mm"
            ours, ref = layer(x).float(), naive(layer, x).float()
        rel = ((ours - ref).norm() / ref.norm()).item()
        speed = (f"; grouped_mm {res['naive'] / res['grouped_mm']:.2f}x the naive loop"
                 if {"naive", "grouped_mm"} <= set(res) else "")
        print(f"tokens {tokens} width {embd} hidden {hidden}: median ms fwd+bwd "
              + ", ".join(f"{k} {v:.2f}" for k, v in res.items()) + speed + f"; output rel diff {rel:.1e}")


if __name__ == "__main__":
    main()
