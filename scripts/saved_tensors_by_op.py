"""What one forward + backward of a config saves for backward, op by op, beside `dist-llm memory`'s prediction.

    python scripts/saved_tensors_by_op.py --config configs/tiny.yaml [--device cuda] [--precision bf16] [key=value ...]

One process, the whole model (built as the trainer builds it: PEFT, checkpointing as configured), one micro-batch
of random tokens under the run's autocast. After the forward, the autograd graph is walked from the loss: every
node's saved tensors (`_saved_*` attributes, a custom Function's `saved_tensors`) with the op that saved them (its
grad_fn name), shape, dtype and bytes (of the whole storage: a view keeps all of it), the storage counted once
however many ops save it or views of it ("again" marks one already counted; parameters and buffers are model
states, left out). The trainer's meter (SavedTensorMeter, saved_tensors_hooks) runs around the same step: its peak
is the "measured" figure of the trainer's log line, which the walk's total equals for a plain step (a Python
number an op multiplies by, LoRA's scale, is saved as a 0-dim float64 tensor without the hooks: 8 bytes the walk
counts and the meter does not).
Activation checkpointing saves placeholders that the walk cannot read (and reading them would recompute): refused.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_llm import memory, perf  # noqa: E402
from dist_llm.config import ConfigError, load_config  # noqa: E402
from dist_llm.model.gpt import Attention  # noqa: E402
from dist_llm.parallel.context import ParallelContext  # noqa: E402
from dist_llm.precision import DTYPES, autocast  # noqa: E402
from dist_llm.train.saved_tensors import SavedTensorMeter, _storage  # noqa: E402
from dist_llm.train.trainer import build_model  # noqa: E402

MiB = 2**20


def saved_of(node: object) -> list[tuple[str, torch.Tensor]]:
    """(attribute, tensor) for every tensor `node` saved for backward."""
    found: list[tuple[str, object]] = []
    for name in dir(node):
        if name.startswith("_saved_"):
            try:
                found.append((name[len("_saved_"):], getattr(node, name)))
            except (RuntimeError, TypeError, ValueError):  # (freed, or a value Python cannot be handed)
                pass
    if hasattr(node, "saved_tensors"):  # a custom autograd Function
        try:
            found += [(f"saved_tensors[{i}]", t) for i, t in enumerate(node.saved_tensors)]  # type: ignore[attr-defined]
        except RuntimeError:
            pass
    out = []
    for name, value in found:
        values = value if isinstance(value, (tuple, list)) else [value]
        out += [(name if len(values) == 1 else f"{name}[{i}]", t) for i, t in enumerate(values)
                if isinstance(t, torch.Tensor)]
    return out


def walk(loss: torch.Tensor, skip: set[int]) -> list[dict]:
    """One row per saved tensor of loss's graph, in the order the walk meets them (from the loss backwards)."""
    rows, counted, seen, todo = [], set(), set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo += [n for n, _ in node.next_functions]
        for attr, t in saved_of(node):
            storage = _storage(t)  # (as the meter finds it: a DTensor's local shard; None for a wrapper)
            if storage is None or storage.data_ptr() in skip or storage.nbytes() == 0:
                continue
            key = storage.data_ptr()
            rows.append({"op": type(node).__name__, "attr": attr, "shape": tuple(t.shape),
                         "dtype": str(t.dtype).removeprefix("torch."), "bytes": storage.nbytes(), "again": key in counted})
            counted.add(key)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--device", default="cpu", help="train.device (cpu, cuda)")
    ap.add_argument("--precision", default=None, help="train.precision (fp32, bf16, fp16); default the config's")
    ap.add_argument("--tensors", action="store_true", help="also print every saved tensor")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args()
    extra = [f"train.device={args.device}"] + ([f"train.precision={args.precision}"] if args.precision else [])
    try:
        cfg = load_config(args.config, [*args.overrides, *extra])
        if cfg.train.activation_checkpointing != "none":
            raise ConfigError("train.activation_checkpointing: the walk cannot read checkpointed placeholders; set none")
        ctx = ParallelContext.from_config(cfg)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    torch.manual_seed(0)
    model = build_model(cfg, ctx).train()
    attention = next(m for m in model.modules() if isinstance(m, Attention))
    m, t = cfg.model, cfg.train
    kernel = perf.sdpa_kernel(attention, seq=m.block_size, dtype=DTYPES[t.precision], device=ctx.device)
    tokens = torch.randint(0, m.vocab_size, (t.micro_batch_size, m.block_size + 1), device=ctx.device)
    skip = {s.data_ptr() for s in map(_storage, [*model.parameters(), *model.buffers()]) if s is not None}
    with SavedTensorMeter([*model.parameters(), *model.buffers()]) as meter:
        with autocast(t.precision, ctx.device):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        rows = walk(loss, skip)
        loss.backward()

    if args.tensors:
        for r in rows:
            print(f"{r['op']:<46}{r['attr']:<18}{str(r['shape']):<22}{r['dtype']:<10}{r['bytes']:>12}"
                  f"{'  again' if r['again'] else ''}")
    by_op: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0])  # -> [tensors, new bytes, again bytes]
    for r in rows:
        entry = by_op[(r["op"], r["attr"], r["shape"], r["dtype"])]
        entry[0] += 1
        entry[2 if r["again"] else 1] += r["bytes"]
    device = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    print(f"{args.config} on {device} ({t.precision}, SDPA {kernel}, torch {torch.__version__}): "
          f"{t.micro_batch_size} x {m.block_size} tokens, {m.n_layer} layers, width {m.n_embd}")
    print(f"{'op (grad_fn)':<46}{'saved':<14}{'shape':<20}{'dtype':<10}{'n':>4}{'new MiB':>10}{'again MiB':>11}")
    for (op, attr, shape, dtype), (n, new, again) in sorted(by_op.items(), key=lambda kv: -kv[1][1]):
        print(f"{op:<46}{attr[:13]:<14}{str(shape)[:19]:<20}{dtype:<10}{n:>4}{new / MiB:>10.3f}{again / MiB:>11.3f}")
    walked = sum(r["bytes"] for r in rows if not r["again"])
    predicted = memory.predict(cfg, 1).activation_bytes
    print(f"saved activations, MiB: walk {walked / MiB:.2f} | meter {meter.peak_bytes / MiB:.2f} | "
          f"predicted {predicted / MiB:.2f} ({(predicted - meter.peak_bytes) / MiB:+.2f}); bytes: walk {walked}, "
          f"meter {meter.peak_bytes}, predicted {predicted}")
    ctx.destroy()


if __name__ == "__main__":
    main()
