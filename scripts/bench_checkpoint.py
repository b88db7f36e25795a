"""Checkpoint save and load: dist_llm's synchronous and background (async) saves beside `torch.save`.

    python scripts/bench_checkpoint.py [--layers 14] [--width 768] [--rounds 2] [--dir DIR] [--json PATH]

One process builds the trainer for a GPT of about 100M parameters (14 x 768, byte vocabulary; `--layers` and
`--width` change it), takes one optimizer step so AdamW's moments exist, and then, `--rounds` times:
  sync         `Trainer.save_checkpoint` with train.async_checkpoint=false: DCP shards, rng and train state,
               sha256 of every file, manifest written last. The training loop waits for all of it.
  async        the same with train.async_checkpoint=true. "stall" is how long the training loop is blocked:
               the call (small files, the copy to host memory started in a thread) plus the wait of the next
               optimizer step for that copy to finish; "total" is until the manifest is written, while the
               loop trains on (the script runs training steps until the save is complete, as `fit` would).
               On a CPU the background write shares the cores with those steps, which run slower meanwhile.
  torch.save   `torch.save({"model": state_dict(), "optim": optimizer.state_dict()})` to one file, the
               plain reference (no checksums, no manifest, no resharding).
  dcp load     `ckpt.load_checkpoint` of the sync checkpoint into the trainer's state (what resume does).
  torch.load   `torch.load(..., weights_only=True)` of the torch.save file.
GB/s is the checkpoint's tensor bytes over the time. Medians over the rounds. The figure the reliability issue
asks for: async stall / sync save time, which must be under 0.20.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dist_llm.config import load_config  # noqa: E402
from dist_llm.parallel.context import ParallelContext  # noqa: E402
from dist_llm.train import checkpoint as ckpt  # noqa: E402
from dist_llm.train.trainer import Trainer  # noqa: E402

STALL_TARGET = 0.20


def build(out_dir: Path, layers: int, width: int) -> Trainer:
    overrides = [f"model.n_layer={layers}", f"model.n_embd={width}", f"model.n_head={max(1, width // 64)}",
                 "model.block_size=128", "train.micro_batch_size=1", "train.global_batch_size=1",
                 "train.max_steps=1000", "train.keep_checkpoints=0", "train.eval_interval=0",
                 f"train.out_dir={out_dir}", "train.resume=never"]
    cfg = load_config(ROOT / "configs/tiny.yaml", overrides)
    return Trainer(cfg, ParallelContext.from_config(cfg))


def tensor_bytes(state: object) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(v) for v in state)
    return 0


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir))
    try:
        trainer = build(root / "run", args.layers, args.width)
        trainer.train_step()
        state = trainer.dp.checkpoint_state()
        nbytes = tensor_bytes(state)
        print(f"model {trainer.n_params / 1e6:.1f}M parameters; checkpoint tensors {nbytes / 1e9:.3f} GB "
              f"(fp32 weights + AdamW moments); torch {torch.__version__}; writing under {root}", flush=True)
        times: dict[str, list[float]] = {k: [] for k in ("sync", "async stall", "async total", "torch.save",
                                                         "dcp load", "torch.load")}
        steps_during_async = []
        for r in range(args.rounds):
            trainer.cfg.train.async_checkpoint = False
            times["sync"].append(timed(trainer.save_checkpoint))
            synced = ckpt.step_dir(trainer.ckpt_root, trainer.step)
            trainer.train_step()

            trainer.cfg.train.async_checkpoint = True
            start = time.perf_counter()
            trainer.save_checkpoint()
            call = time.perf_counter() - start
            pending, steps = trainer.pending_save, 0
            while not pending.done():  # the loop trains on while the save is written
                trainer.train_step()
                steps += 1
            trainer.wait_for_save()
            times["async total"].append(time.perf_counter() - start)
            times["async stall"].append(call + pending.staged_wait_s)
            steps_during_async.append(steps)
            trainer.train_step()

            plain = root / f"torch_save_{r}.pt"
            everything = {"model": trainer.module.state_dict(), "optim": trainer.optimizer.state_dict()}
            times["torch.save"].append(timed(lambda: torch.save(everything, plain)))
            times["torch.load"].append(timed(lambda: torch.load(plain, weights_only=True)))
            target = trainer.dp.checkpoint_state()
            times["dcp load"].append(timed(lambda: ckpt.load_checkpoint(synced, state=target, ctx=trainer.ctx)))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()),
                  flush=True)

        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"\n{'':14}{'seconds':>9}{'GB/s':>8}")
        for k, v in med.items():
            rate = "" if k == "async stall" else f"{nbytes / 1e9 / v:8.2f}"
            print(f"{k:14}{v:9.3f}{rate}")
        stall = med["async stall"] / med["sync"]
        print(f"\nasync stall / sync save: {stall:.3f} (target < {STALL_TARGET}: "
              f"{'met' if stall < STALL_TARGET else 'NOT met'}); training steps taken during the async save: "
              f"{statistics.median(steps_during_async):.0f}")
        print(f"sync save / torch.save: {med['sync'] / med['torch.save']:.2f}; "
              f"dcp load / torch.load: {med['dcp load'] / med['torch.load']:.2f}")
        if args.json:
            args.json.write_text(json.dumps({"n_params": trainer.n_params, "bytes": nbytes, "median_s": med,
                                             "all_s": times, "stall_ratio": stall}, indent=1))
        trainer.ctx.destroy()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
