"""Training throughput of dist_llm's GPT against Hugging Face GPT2LMHeadModel (SDPA) of the same shape.

    python scripts/bench_model.py [--models tiny,gpt2-124m,gpt-1.3b] [--batch B] [--seq T] [--steps N] [--warmup W]
                                  [--device cpu|cuda] [--dtype fp32|bf16] [--compile] [--no-optimizer] [--no-hf]
                                  [--peak-tflops F] [--threads K] [--json PATH] [--hf-act gelu_pytorch_tanh|gelu_new]

For each shape both models are built, our weights are copied into the HF model (HF's Conv1D stores the
transpose of nn.Linear's weight) and the two losses on one batch must agree to 1e-4 before anything is
timed, so the same computation is timed on both sides. A timed step is: zero grads, forward with loss,
backward, and (unless --no-optimizer) a fused AdamW step, each model its own. With --dtype bf16 both run
under the same bf16 autocast over fp32 weights, as `train.precision=bf16` does. Steps alternate between the
models (ours/HF, then HF/ours, ...) so background load falls on both alike; the median (and min) step time over
the timed steps gives tokens/s. --compile adds "ours+compile": our GPT with each block torch.compile'd, as
`train.compile=true` does (HF stays eager: the reference is HF as users run it).

MFU (model FLOPs utilisation) = tokens/s x `GPT.flops_per_token` (6N + 12*L*C*T) / the device's peak, which the
script measures once with a large matmul in --dtype (dist_llm.perf.measure_peak_flops) unless --peak-tflops
gives it. "step MiB" is the most memory one more untimed step of a model adds above where it starts
(activations, gradients, temporaries; CUDA: max_memory_allocated; CPU: the peak resident set).

Equal work in the loss: HF's `labels=` shifts inside the model (logits[:, :-1] against labels[:, 1:]), ours
takes inputs and targets already shifted. We pass HF our targets through its own loss path as
`shift_labels=y`, so both compute the mean cross-entropy of all B*T logits against the same targets.

HF's GPT-2 default activation `gelu_new` is a Python composite of the tanh GELU; by default we give HF
`gelu_pytorch_tanh`, the same fused kernel ours calls (F.gelu(approximate="tanh")), so the baseline is as
fast as HF can be; `--hf-act gelu_new` times the stock GPT-2 configuration instead.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
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

from dist_llm import perf  # noqa: E402
from dist_llm.config import ModelConfig, OptimConfig, load_config  # noqa: E402
from dist_llm.model import GPT  # noqa: E402
from dist_llm.optim import adamw, param_groups  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LOSS_TOL = {"fp32": 1e-4, "bf16": 3e-2}  # same weights, same batch: |loss difference| allowed
NOISY = 1.15  # max/min step time above which a result is flagged as noisy
LABELS = {"ours": "ours (dist_llm GPT)", "ours+compile": "ours, blocks compiled", "HF": "HF GPT2 (sdpa)"}


@dataclasses.dataclass
class Shape:
    cfg: ModelConfig
    batch: int
    seq: int
    steps: int
    warmup: int
    note: str
    gpu_batch: int = 0  # the batch on a GPU (0: as on the CPU)


def gpt2_compatible(cfg: ModelConfig) -> ModelConfig:
    """The GPT-2 architecture at cfg's sizes: learned positions, biased LayerNorm, GELU(tanh), tied head."""
    return dataclasses.replace(cfg, pos_emb="learned", bias=True, norm="layernorm", mlp="gelu", mlp_hidden=0,
                               n_kv_head=0, tie_embeddings=True, dropout=0.0)


def shapes() -> dict[str, Shape]:
    tiny_yaml = load_config(ROOT / "configs" / "tiny.yaml").model
    tiny = gpt2_compatible(tiny_yaml)
    changed = [f"{f.name}: {getattr(tiny_yaml, f.name)} -> {getattr(tiny, f.name)}"
               for f in dataclasses.fields(ModelConfig) if getattr(tiny_yaml, f.name) != getattr(tiny, f.name)]
    gpt2 = ModelConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=1024, pos_emb="learned",
                       norm="layernorm", mlp="gelu", dropout=0.0, bias=True, tie_embeddings=True)
    big = dataclasses.replace(gpt2, n_layer=24, n_head=16, n_embd=2048, block_size=2048)
    return {
        "tiny": Shape(tiny, 32, 128, 20, 3,
                      "configs/tiny.yaml sizes, made GPT-2-compatible for the comparison ("
                      + (", ".join(changed) or "no change") + ")"),
        "gpt2-124m": Shape(gpt2, 1, 1024, 5, 2, "GPT-2 small: 12 layers, 12 heads, 768 wide, vocab 50304",
                           gpu_batch=16),
        "gpt-1.3b": Shape(big, 1, 2048, 3, 1, "GPT-2 architecture at 1.3B: 24 layers, 16 heads, 2048 wide, seq 2048",
                          gpu_batch=8),
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
def make_step(model: nn.Module, loss_of: Callable[[], torch.Tensor], *, dtype: str, device: torch.device,
              optimizer: bool) -> Callable[[], torch.Tensor]:
    """One training step of `model`: zero grads, forward under the run's autocast, backward, fused AdamW."""
    opt = adamw(param_groups(model, 0.1), OptimConfig(lr=1e-4), device) if optimizer else None
    cast = torch.autocast(device.type, dtype=DTYPES[dtype]) if dtype != "fp32" else None

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        if cast is None:
            loss = loss_of()
        else:
            with cast:
                loss = loss_of()
        loss.backward()
        if opt is not None:
            opt.step()
        return loss.detach()

    return step


def run_interleaved(steps: dict[str, Callable[[], torch.Tensor]], *, warmup: int, timed: int,
                    device: torch.device) -> dict[str, list[float]]:
    """Step times in seconds per model; repetition r runs the models in order (A, B, C) when r is even, else
    reversed, so drift falls on all alike."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(warmup + timed):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            perf.synchronize(device)
            t0 = time.perf_counter()
            steps[name]()
            perf.synchronize(device)
            if rep >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def step_memory(steps: dict[str, Callable[[], torch.Tensor]], device: torch.device) -> dict[str, int]:
    """Per model, the most memory one more (untimed) step adds above where it starts: activations, gradients
    and temporaries (the models share the process, so an absolute peak would count the others' weights)."""
    peaks = {}
    for name, step in steps.items():
        gc.collect()
        perf.synchronize(device)
        perf.reset_peak_memory(device)
        start = perf.memory_bytes(device)
        step()
        perf.synchronize(device)
        peaks[name] = perf.peak_memory_bytes(device) - start
    return peaks


def bench_shape(name: str, shape: Shape, *, hf_act: str, device: torch.device, dtype: str, compile: bool,
                optimizer: bool, hf: bool, peak_flops: float, seed: int = 0) -> dict:
    cfg = shape.cfg
    if shape.seq > cfg.block_size:
        raise SystemExit(f"--seq {shape.seq} is longer than {name}'s block_size {cfg.block_size}")
    torch.manual_seed(seed)
    ours = GPT(cfg).to(device).train()
    n_ours = num_params(ours)
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, cfg.vocab_size, (shape.batch, shape.seq + 1), generator=g)
    x, y = seq[:, :-1].contiguous().to(device), seq[:, 1:].contiguous().to(device)

    models: dict[str, nn.Module] = {"ours": ours}
    losses: dict[str, Callable[[], torch.Tensor]] = {"ours": lambda: ours(x, y)}
    if compile:
        ours_c = copy.deepcopy(ours)
        for block in ours_c.blocks:
            block.compile()  # what train.compile=true does
        models["ours+compile"] = ours_c
        losses["ours+compile"] = lambda: ours_c(x, y)
    if hf:
        hf_model = build_hf(cfg, act=hf_act).to(device).train()
        copy_weights(ours, hf_model)
        if num_params(hf_model) != n_ours:
            raise RuntimeError(f"{name}: parameter counts differ, ours {n_ours:,} vs HF {num_params(hf_model):,}")
        models["HF"] = hf_model
        losses["HF"] = lambda: hf_model(input_ids=x, labels=y, shift_labels=y).loss

    # the same computation on every side: first-step losses (same weights, same batch) must agree
    cast = torch.autocast(device.type, dtype=DTYPES[dtype]) if dtype != "fp32" else None
    first = {}
    with torch.no_grad():
        for m, loss_of in losses.items():
            if cast is None:
                first[m] = loss_of().item()
            else:
                with cast:
                    first[m] = loss_of().item()
    for m, value in first.items():
        if abs(value - first["ours"]) > LOSS_TOL[dtype]:
            raise RuntimeError(f"{name}: losses differ, ours {first['ours']:.6f} vs {m} {value:.6f}: not the same model")

    grad_diff = compare_grads(models, losses) if dtype == "fp32" else None
    steps = {m: make_step(models[m], losses[m], dtype=dtype, device=device, optimizer=optimizer) for m in models}
    kernel = perf.sdpa_kernel(ours.blocks[0].attn, seq=shape.seq, dtype=DTYPES[dtype], device=device,
                              batch=shape.batch)
    times = run_interleaved(steps, warmup=shape.warmup, timed=shape.steps, device=device)
    peaks = step_memory(steps, device)
    tokens = shape.batch * shape.seq
    flops_per_token = flops_at(cfg, shape.seq)
    rows = {}
    for model_name, ts in times.items():
        median = statistics.median(ts)
        rows[model_name] = {"params": n_ours, "step_ms_median": median * 1e3, "step_ms_min": min(ts) * 1e3,
                            "tokens_per_s": tokens / median, "step_ms_all": [t * 1e3 for t in ts],
                            "peak_bytes": peaks[model_name],
                            "mfu": perf.mfu(tokens / median, flops_per_token, peak_flops) if peak_flops else None}
    result = {"note": shape.note, "batch": shape.batch, "seq": shape.seq, "steps": shape.steps,
              "warmup": shape.warmup, "first_losses": first, "hf_activation": hf_act if hf else None,
              "wte_grad_rel_diff": grad_diff, "flops_per_token": flops_per_token, "sdpa_kernel": kernel,
              "models": rows}
    if "HF" in rows:
        result["ratio"] = rows["ours"]["tokens_per_s"] / rows["HF"]["tokens_per_s"]
    return result


def compare_grads(models: dict[str, nn.Module], losses: dict[str, Callable[[], torch.Tensor]]) -> dict[str, float]:
    """One backward each (no step): the token embedding's gradient, which gathers every path through the model,
    relative to ours, as max |difference| / max |ours|."""
    grads = {}
    for m, loss_of in losses.items():
        loss_of().backward()
        wte = models[m].transformer.wte if m == "HF" else models[m].wte
        grads[m] = wte.weight.grad.detach().clone()
        models[m].zero_grad(set_to_none=True)
    scale = max(grads["ours"].abs().max().item(), 1e-30)
    return {m: (g - grads["ours"]).abs().max().item() / scale for m, g in grads.items() if m != "ours"}


def flops_at(cfg: ModelConfig, seq: int) -> float:
    """GPT.flops_per_token for sequences of `seq` tokens (the attention term grows with the context)."""
    with torch.device("meta"):
        return GPT(dataclasses.replace(cfg, block_size=seq)).flops_per_token()


def print_table(name: str, r: dict, *, dtype: str, optimizer: bool) -> None:
    what = "fwd+bwd+AdamW" if optimizer else "fwd+bwd, no optimizer"
    print(f"\n== {name}: batch {r['batch']} x {r['seq']} tokens, {r['warmup']} warm-up + {r['steps']} timed steps "
          f"({what}, {dtype}), interleaved; attention runs SDPA's {r['sdpa_kernel']} kernel")
    print(f"   {r['note']}")
    print("   first-step loss, same weights and batch: " + ", ".join(f"{m} {v:.6f}" for m, v in r["first_losses"].items())
          + "".join(f"; wte grad max rel diff {m} {d:.1e}" for m, d in (r["wte_grad_rel_diff"] or {}).items()))
    header = (f"{'model':<24} {'params':>14} {'step ms (median)':>17} {'step ms (min)':>14} {'tokens/s':>11} "
              f"{'MFU':>6} {'step MiB':>9}")
    print(header)
    print("-" * len(header))
    for model_name, row in r["models"].items():
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
        print(f"{LABELS[model_name]:<24} {row['params']:>14,} {row['step_ms_median']:>17.1f} "
              f"{row['step_ms_min']:>14.1f} {row['tokens_per_s']:>11,.0f} {mfu:>6} {row['peak_bytes'] / 2**20:>9.0f}")
    if "ratio" in r:
        print(f"ours/HF tokens/s: {r['ratio']:.2f}")
    for model_name, row in r["models"].items():
        spread = max(row["step_ms_all"]) / row["step_ms_min"]
        if spread > NOISY:
            print(f"warning: {LABELS[model_name]} step times vary {spread:.2f}x (max/min); the machine was busy or "
                  f"still warming up: rerun with more --warmup/--steps")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,gpt2-124m", help="comma-separated: tiny, gpt2-124m, gpt-1.3b")
    p.add_argument("--batch", type=int, help="sequences per step (default per model, larger on a GPU)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: the model's block size)")
    p.add_argument("--steps", type=int, help="timed steps per model (default per model)")
    p.add_argument("--warmup", type=int, help="warm-up steps per model, at least 1 (default per model)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="fp32, or bf16 autocast over fp32 weights")
    p.add_argument("--compile", action="store_true", help="also time our GPT with each block torch.compile'd")
    p.add_argument("--optimizer", action=argparse.BooleanOptionalAction, default=True,
                   help="include a fused AdamW step in the timed step (default: yes)")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True, help="time the HF twin too")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="the device's peak for MFU (default: measured)")
    p.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (default: all cores)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--hf-act", default="gelu_pytorch_tanh", choices=["gelu_pytorch_tanh", "gelu_new"],
                   help="HF activation: the fused kernel ours uses (default) or GPT-2's stock gelu_new")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False")
    device = torch.device(args.device)
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on tensor cores, as training on a GPU would
        torch.backends.cudnn.allow_tf32 = True

    known = shapes()
    wanted = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in wanted:
        if m not in known:
            p.error(f"--models: unknown model {m!r}; choose from {', '.join(known)}")
    import transformers

    peak = args.peak_tflops * 1e12 or perf.measure_peak_flops(device, DTYPES[args.dtype])
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {threads} threads"
    print(f"torch {torch.__version__}, transformers {transformers.__version__} | {where} | {args.dtype} | peak "
          f"{peak / 1e12:.2f} TFLOP/s ({'given' if args.peak_tflops else 'measured: a large ' + args.dtype + ' matmul'})"
          f" | HF loss through its own path with shift_labels=targets (same B*T tokens as ours); HF activation "
          f"{args.hf_act}")

    results = {}
    for m in wanted:
        shape = known[m]
        if device.type == "cuda" and shape.gpu_batch:
            shape.batch = shape.gpu_batch
        for key in ("batch", "seq", "steps", "warmup"):
            if getattr(args, key) is not None:
                setattr(shape, key, getattr(args, key))
        if shape.steps < 1 or shape.warmup < 1:
            p.error("--steps and --warmup must be at least 1")
        results[m] = bench_shape(m, shape, hf_act=args.hf_act, device=device, dtype=args.dtype, compile=args.compile,
                                 optimizer=args.optimizer, hf=args.hf, peak_flops=peak)
        print_table(m, results[m], dtype=args.dtype, optimizer=args.optimizer)

    if args.hf:
        print("\nratio ours/HF tokens/s: " + ", ".join(f"{m} {r['ratio']:.2f}" for m, r in results.items()))
    if args.json:
        args.json.write_text(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                                         "device": where, "dtype": args.dtype, "peak_flops": peak,
                                         "optimizer": args.optimizer, "threads": threads, "results": results},
                                        indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
