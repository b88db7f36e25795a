"""Expert parallelism on this machine: tokens/s of one MoE layer's forward + backward (fp32, gloo) on N ranks at
ep=1 (every rank runs all experts on its own tokens: data parallelism) and at ep=N (each rank runs E/N experts on
the tokens the all-to-all brings it), at the same tokens per rank; and the all-to-all bytes per step.

    python scripts/bench_ep.py [--ranks 2] [--tokens 4096] [--experts 8] [--top-k 2] [--embd 128] [--hidden 512]
                               [--json out.json]

On 2 shared CPU cores the two layouts do the same FLOPs and ep adds the exchange, so expect no speed-up here;
what ep buys is 1/ep of the expert weights, gradients and optimizer states per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dist_llm.config import ModelConfig
from dist_llm.model.moe import MoE
from dist_llm.parallel.comm import CommStats
from dist_llm.parallel.expert import AllToAllDispatch, LocalExperts
from pathlib import Path


def build(args: argparse.Namespace, rank: int, ep: int, group: object, stats: CommStats) -> MoE:
    cfg = ModelConfig(n_embd=args.embd, n_experts=args.experts, moe_top_k=args.top_k, moe_hidden=args.hidden,
                      mlp="swiglu", bias=False)
    layer = MoE(cfg, None, torch.nn.Identity())
    if ep > 1:
        n_local = args.experts // ep
        layer.experts = LocalExperts(args.experts, rank * n_local, n_local, args.embd, args.hidden, swiglu=True,
                                     bias=False)
        layer.dispatch = AllToAllDispatch(group, ep, args.experts, stats)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return layer


def worker(rank: int, args: argparse.Namespace, port: int, queue: object) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks))
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    results = {}
    for ep in (1, args.ranks):
        stats = CommStats()
        layer = build(args, rank, ep, dist.group.WORLD, stats)
        torch.manual_seed(rank)
        x = torch.randn(1, args.tokens, args.embd, requires_grad=True)  # (as in a model: both reverse all-to-alls run)

        def step() -> None:
            layer(x).square().mean().backward()

        step()
        stats.reset()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.repeats):
            step()
        dist.barrier()
        seconds = (time.perf_counter() - start) / args.repeats
        results[ep] = (args.ranks * args.tokens / seconds, stats.bytes.get("all_to_all", 0) / args.repeats)
    if rank == 0:
        queue.put(results)  # type: ignore[attr-defined]
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, port, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    results = queue.get()
    for p in procs:
        p.join()
    for ep, (tokens_s, nbytes) in results.items():
        print(f"ep={ep}: {tokens_s:,.0f} tokens/s over {args.ranks} ranks, all-to-all {nbytes / 2**20:.2f} MiB/step "
              f"on rank 0")
    if args.json:
        args.json.write_text(json.dumps({"ranks": args.ranks, "tokens_per_rank": args.tokens, "results": {
            str(ep): {"tokens_per_s": t, "all_to_all_bytes": b} for ep, (t, b) in results.items()}}, indent=1))


if __name__ == "__main__":
    main()
