"""Training throughput of dist_llm's GPT against Hugging Face GPT2LMHeadModel (SDPA) of the same shape.

    python scripts/bench_model.py [--models tiny,gpt2-124m] [--batch B] [--seq T] [--steps N] [--warmup W]
                                  [--threads K] [--json PATH] [--hf-act gelu_pytorch_tanh|gelu_new]

For each shape both models are built, our weights are copied into the HF model (HF's Conv1D stores the
transpose of nn.Linear's weight) and the two losses on one batch must agree to 1e-4 before anything is
timed, so the same computation is timed on both sides. A timed step is: zero grads, forward with loss,
backward; no optimizer step. Steps alternate between the models (ours/HF, then HF/ours, ...) so background
load falls on both alike; the median (and min) step time over the timed steps gives tokens/s.

Equal work in the loss: HF's `labels=` shifts inside the model (logits[:, :-1] against labels[:, 1:]), ours
takes inputs and targets already shifted. We pass HF our targets through its own loss path as
`shift_labels=y`, so both compute the mean cross-entropy of all B*T logits against the same targets.

HF's GPT-2 default activation `gelu_new` is a Python composite of the tanh GELU; by default we give HF
`gelu_pytorch_tanh`, the same fused kernel ours calls (F.gelu(approximate="tanh")), so the baseline is as
fast as HF can be; `--hf-act gelu_new` times the stock GPT-2 configuration instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dist_llm.config import ModelConfig, load_config  # noqa: E402
from dist_llm.model import GPT  # noqa: E402

LOSS_TOL = 1e-4
NOISY = 1.15  # max/min step time above which a result is flagged as noisy


@dataclasses.dataclass
class Shape:
    cfg: ModelConfig
    batch: int
    seq: int
    steps: int
    warmup: int
    note: str


def gpt2_compatible(cfg: ModelConfig) -> ModelConfig:
    """The GPT-2 architecture at cfg's sizes: learned positions, biased LayerNorm, GELU(tanh), tied head."""
    return dataclasses.replace(cfg, pos_emb="learned", bias=True, norm="layernorm", mlp="gelu", mlp_hidden=0,
                               n_kv_head=0, tie_embeddings=True, dropout=0.0)


def shapes() -> dict[str, Shape]:
    tiny_yaml = load_config(ROOT / "configs" / "tiny.yaml").model
    tiny = gpt2_compatible(tiny_yaml)
    changed = [f"{f.name}: {getattr(tiny_yaml, f.name)} -> {getattr(tiny, f.name)}"
               for f in dataclasses.fields(ModelConfig) if getattr(tiny_yaml, f.name) != getattr(tiny, f.name)]
    big = ModelConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=1024, pos_emb="learned",
                      norm="layernorm", mlp="gelu", dropout=0.0, bias=True, tie_embeddings=True)
    return {
        "tiny": Shape(tiny, 32, 128, 20, 3,
                      "configs/tiny.yaml sizes, made GPT-2-compatible for the comparison ("
                      + (", ".join(changed) or "no change") + ")"),
        "gpt2-124m": Shape(big, 1, 1024, 5, 2, "GPT-2 small: 12 layers, 12 heads, 768 wide, vocab 50304"),
    }


# -- the Hugging Face twin ---------------------------------------------------------------------------------
def build_hf(cfg: ModelConfig, *, act: str) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_cfg = GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
                        n_layer=cfg.n_layer, n_head=cfg.n_head, n_inner=cfg.ffn_hidden, activation_function=act,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=cfg.norm_eps,
                        initializer_range=cfg.init_std, use_cache=False, tie_word_embeddings=True,
                        bos_token_id=None, eos_token_id=None)
    hf_cfg._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(hf_cfg)
    model.loss_type = "ForCausalLM"  # what HF falls back to anyway for this class name, minus the warning
    impl = model.config._attn_implementation
    if impl != "sdpa":
        raise RuntimeError(f"HF model built with attn_implementation={impl!r}, expected 'sdpa'")
    return model


@torch.no_grad()
def copy_weights(ours: GPT, hf: nn.Module) -> None:
    """Our state into the HF model. nn.Linear holds (out, in); HF's Conv1D holds (in, out)."""
    t = hf.transformer
    t.wte.weight.copy_(ours.wte.weight)
    t.wpe.weight.copy_(ours.wpe.weight)
    for blk, h in zip(ours.blocks, t.h, strict=True):
        pairs = [(blk.ln_1, h.ln_1, False), (blk.ln_2, h.ln_2, False), (blk.attn.qkv, h.attn.c_attn, True),
                 (blk.attn.proj, h.attn.c_proj, True), (blk.mlp.up, h.mlp.c_fc, True),
                 (blk.mlp.down, h.mlp.c_proj, True)]
        for src, dst, transpose in pairs:
            dst.weight.copy_(src.weight.t() if transpose else src.weight)
            dst.bias.copy_(src.bias)
    t.ln_f.weight.copy_(ours.ln_f.weight)
    t.ln_f.bias.copy_(ours.ln_f.bias)
    if hf.lm_head.weight.data_ptr() != t.wte.weight.data_ptr():
        raise RuntimeError("HF lm_head is not tied to wte")


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a shared tensor once


# -- timing -------------------------------------------------------------------------------------------------
def make_steps(ours: GPT, hf: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Callable[[], float]]:
    def ours_step() -> float:
        ours.zero_grad(set_to_none=True)
        loss = ours(x, y)
        loss.backward()
        return loss.item()

    def hf_step() -> float:
        hf.zero_grad(set_to_none=True)
        loss = hf(input_ids=x, labels=y, shift_labels=y).loss
        loss.backward()
        return loss.item()

    return {"ours": ours_step, "HF": hf_step}


def run_interleaved(steps: dict[str, Callable[[], float]], *, warmup: int, timed: int) -> dict[str, list[float]]:
    """Step times in seconds per model; repetition r runs the models in order r%2==0 -> A,B else B,A."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(warmup + timed):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            t0 = time.perf_counter()
            steps[name]()
            dt = time.perf_counter() - t0
            if rep >= warmup:
                times[name].append(dt)
    return times


def bench_shape(name: str, shape: Shape, *, hf_act: str, seed: int = 0) -> dict:
    cfg = shape.cfg
    if shape.seq > cfg.block_size:
        raise SystemExit(f"--seq {shape.seq} is longer than {name}'s block_size {cfg.block_size}")
    torch.manual_seed(seed)
    ours = GPT(cfg).train()
    hf = build_hf(cfg, act=hf_act).train()
    copy_weights(ours, hf)

    n_ours, n_hf = num_params(ours), num_params(hf)
    if n_ours != n_hf:
        raise RuntimeError(f"{name}: parameter counts differ, ours {n_ours:,} vs HF {n_hf:,}")

    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, cfg.vocab_size, (shape.batch, shape.seq + 1), generator=g)
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    with torch.no_grad():
        loss_ours = ours(x, y).item()
        loss_hf = hf(input_ids=x, labels=y, shift_labels=y).loss.item()
    if abs(loss_ours - loss_hf) > LOSS_TOL:
        raise RuntimeError(f"{name}: losses differ, ours {loss_ours:.6f} vs HF {loss_hf:.6f}: not the same model")

    steps = make_steps(ours, hf, x, y)
    # One step each to compare gradients too (the token embedding's grad gathers every path through the model).
    steps["ours"]()
    steps["HF"]()
    g_ours, g_hf = ours.wte.weight.grad, hf.transformer.wte.weight.grad
    grad_diff = (g_ours - g_hf).abs().max().item() / max(g_ours.abs().max().item(), 1e-30)

    times = run_interleaved(steps, warmup=shape.warmup - 1, timed=shape.steps)
    tokens = shape.batch * shape.seq
    rows = {}
    for model_name, ts in times.items():
        median = statistics.median(ts)
        rows[model_name] = {"params": n_ours, "step_ms_median": median * 1e3, "step_ms_min": min(ts) * 1e3,
                            "tokens_per_s": tokens / median, "step_ms_all": [t * 1e3 for t in ts]}
    return {"note": shape.note, "batch": shape.batch, "seq": shape.seq, "steps": shape.steps, "warmup": shape.warmup,
            "loss_ours": loss_ours, "loss_hf": loss_hf, "wte_grad_rel_diff": grad_diff, "hf_activation": hf_act,
            "models": rows, "ratio": rows["ours"]["tokens_per_s"] / rows["HF"]["tokens_per_s"]}


def print_table(name: str, r: dict) -> None:
    print(f"\n== {name}: batch {r['batch']} x {r['seq']} tokens, {r['warmup']} warm-up + {r['steps']} timed steps "
          f"(fwd+bwd, no optimizer), interleaved")
    print(f"   {r['note']}")
    print(f"   loss on the same batch with the same weights: ours {r['loss_ours']:.6f}, HF {r['loss_hf']:.6f} "
          f"(|diff| {abs(r['loss_ours'] - r['loss_hf']):.1e} <= {LOSS_TOL:g}); "
          f"wte grad max rel diff {r['wte_grad_rel_diff']:.1e}")
    header = f"{'model':<24} {'params':>12} {'step ms (median)':>17} {'step ms (min)':>14} {'tokens/s':>11}"
    print(header)
    print("-" * len(header))
    labels = {"ours": "ours (dist_llm GPT)", "HF": "HF GPT2 (sdpa)"}
    for model_name, row in r["models"].items():
        print(f"{labels[model_name]:<24} {row['params']:>12,} {row['step_ms_median']:>17.1f} "
              f"{row['step_ms_min']:>14.1f} {row['tokens_per_s']:>11,.0f}")
    print(f"ours/HF tokens/s: {r['ratio']:.2f}")
    for model_name, row in r["models"].items():
        spread = max(row["step_ms_all"]) / row["step_ms_min"]
        if spread > NOISY:
            print(f"warning: {labels[model_name]} step times vary {spread:.2f}x (max/min); the machine was busy or "
                  f"still warming up: rerun with more --warmup/--steps")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,gpt2-124m", help="comma-separated: tiny, gpt2-124m")
    p.add_argument("--batch", type=int, help="sequences per step (default: tiny 32, gpt2-124m 1)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: tiny 128, gpt2-124m 1024)")
    p.add_argument("--steps", type=int, help="timed steps per model (default: tiny 20, gpt2-124m 5)")
    p.add_argument("--warmup", type=int, help="warm-up steps per model, at least 1 (default: tiny 3, gpt2-124m 2)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--hf-act", default="gelu_pytorch_tanh", choices=["gelu_pytorch_tanh", "gelu_new"],
                   help="HF activation: the fused kernel ours uses (default) or GPT-2's stock gelu_new")
    args = p.parse_args(argv)

    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    import transformers

    known = shapes()
    wanted = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in wanted:
        if m not in known:
            p.error(f"--models: unknown model {m!r}; choose from {', '.join(known)}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {threads} threads, fp32 on CPU; "
          f"HF loss through its own path with shift_labels=targets (same B*T tokens as ours); "
          f"HF activation {args.hf_act}")

    results = {}
    for m in wanted:
        shape = known[m]
        for key in ("batch", "seq", "steps", "warmup"):
            if getattr(args, key) is not None:
                setattr(shape, key, getattr(args, key))
        if shape.steps < 1 or shape.warmup < 1:
            p.error("--steps and --warmup must be at least 1 (the first warm-up step also compares gradients)")
        results[m] = bench_shape(m, shape, hf_act=args.hf_act)
        print_table(m, results[m])

    print("\nratio ours/HF tokens/s: " + ", ".join(f"{m} {r['ratio']:.2f}" for m, r in results.items()))
    if args.json:
        args.json.write_text(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                                         "threads": threads, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
