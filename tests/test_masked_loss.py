"""The masked fine-tuning loss is the mean over the global batch's unmasked targets, at every layout.

Records with prompts of varied length give windows whose share of masked (prompt) targets varies, so a mean
taken per micro-batch (or per dp rank) and then averaged differs from the global mean: each layout is
compared with that mean computed directly, on one process, from the global batch's windows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dist_llm.config import Config, load_config
from dist_llm.data import get_batch, prepare_data
from dist_llm.data.sampler import GlobalBatchSampler, val_sampler
from dist_llm.model import GPT
from dist_llm.parallel.context import ParallelContext
from dist_llm.train.trainer import Trainer
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed

GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Prompts of 5 to 60 bytes before completions of 2 to 9: a 32-token window holds anywhere from none
    to most of its targets masked."""
    lines = [json.dumps({"prompt": f"Q{i}: " + "why " * (i % 15), "completion": f" {i * i}" + "!" * (i % 4)})
             for i in range(400)]
    path = tmp_path_factory.mktemp("sft") / "records.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _config(out_dir: Path, records: Path, extra: dict[str, Any]) -> Config:
    # no gradient clipping: the gradients are compared as the backward left them
    return load_config(None, tiny_overrides(out_dir, **{"data__source": str(records), "model__bias": False,
                                                        "train__global_batch_size": GLOBAL_BATCH,
                                                        "optim__grad_clip": 0.0, "train__eval_steps": 2, **extra}))


def _step(rank: int, world_size: int, out_dir: Path, records: Path, extra: dict[str, Any]) -> dict[str, Any]:
    """One training step and one evaluation before it: the logged loss, val loss and the full gradients."""
    cfg = _config(out_dir, records, extra)
    ctx = ParallelContext.from_config(cfg)
    try:
        trainer = Trainer(cfg, ctx)
        val = trainer.evaluate()
        pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
        zero_grad = trainer.dp.zero_grad

        def keep_then_zero() -> None:  # the step's gradients, read before the trainer clears them
            names = {id(p): n for n, p in trainer.module.named_parameters()}
            held = [(names[id(p)], start, g.detach().clone()) for p, g, start in trainer.dp.grad_shards()]
            if trainer.tp_state is not None:  # (whole local gradients at dp=1) tensor-parallel slices -> full
                full = trainer.tp_state.to_full({"model": {n: g for n, _, g in held}, "optim": {"state": {}}})
                held = [(n, 0, g) for n, g in full["model"].items()]
            for name, start, g in held:
                pieces.setdefault(name, []).append((start, g.flatten()))
            zero_grad()

        trainer.dp.zero_grad = keep_then_zero
        out = trainer.train_step()
        loss = trainer._from_last_stage(trainer._dp_mean(out.loss)).item()
        return {"loss": loss, "val": val, "grads": pieces}
    finally:
        ctx.destroy()


def _masked_mean(model: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Sum of the unmasked targets' cross-entropies / their count, written out."""
    logits = model(x)  # (B, T, V)
    losses = F.cross_entropy(logits.flatten(0, 1), y.flatten().clamp(min=0), reduction="none")
    keep = y.flatten() != -100
    return (losses * keep).sum() / keep.sum()


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory, records: Path) -> dict[str, Any]:
    """Loss, gradients and val loss from the global batch's windows in one batch on one process."""
    out_dir = tmp_path_factory.mktemp("ref")
    cfg = _config(out_dir, records, {})
    m, t = cfg.model, cfg.train
    data = prepare_data(cfg.data, m.vocab_size)
    model = GPT(m)
    model.reset_parameters(t.seed)  # the initialisation every layout builds
    val_tokens, val_mask = data.val_tokens(), data.val_mask()
    windows = val_sampler(len(val_tokens), m.block_size, GLOBAL_BATCH)
    with torch.no_grad():
        batches = [get_batch(val_tokens, windows.starts(i), m.block_size, mask=val_mask) for i in range(t.eval_steps)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        val = _masked_mean(model.eval(), x, y).item()
    tokens, mask = data.train_tokens(), data.train_mask()
    starts = GlobalBatchSampler(len(tokens), m.block_size, GLOBAL_BATCH, t.seed).starts(0)
    x, y = get_batch(tokens, starts, m.block_size, mask=mask)
    per_window = (y != -100).sum(dim=1)
    assert per_window.min() < per_window.max() / 2  # micro-batches really differ in their unmasked counts
    loss = _masked_mean(model.train(), x, y)
    loss.backward()
    return {"loss": loss.item(), "val": val, "grads": {n: p.grad for n, p in model.named_parameters()}}


LAYOUTS = {
    "micro8": (1, {"train__micro_batch_size": 8}),
    "micro4": (1, {"train__micro_batch_size": 4}),
    "micro2": (1, {"train__micro_batch_size": 2}),
    "micro1": (1, {"train__micro_batch_size": 1}),
    "dp2-micro2": (2, {"train__micro_batch_size": 2}),
    "dp2-zero2": (2, {"train__micro_batch_size": 1, "parallel__zero_stage": 2}),
    "tp2-micro2": (2, {"train__micro_batch_size": 2, "parallel__tp": 2}),
    "pp2-micro1": (2, {"train__micro_batch_size": 1, "parallel__pp": 2}),
    # context parallelism: each cp rank holds half of every window's targets, unevenly masked between the halves
    "cp2-micro2": (2, {"train__micro_batch_size": 2, "parallel__cp": 2}),
    "dp2-cp2-zero2": (4, {"train__micro_batch_size": 1, "parallel__cp": 2, "parallel__zero_stage": 2}),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_masked_loss_is_the_global_token_mean(tmp_path: Path, records: Path, expected: dict[str, Any],
                                              layout: str) -> None:
    world, extra = LAYOUTS[layout]
    if world == 1:
        got = [_step(0, 1, tmp_path, records, extra)]
    else:
        got = run_distributed(_step, world, tmp_path, records, extra, init_group=False)
    # fp32 sums of a few hundred token losses, in another order and split: rounding at ~1e-7 relative
    assert got[0]["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert got[0]["val"] == pytest.approx(expected["val"], rel=1e-6)
    for name, want in expected["grads"].items():
        # every parameter's gradient from the ranks that hold its pieces (a ZeRO-2 shard, a pipeline stage's blocks)
        got_flat, held = torch.zeros(want.numel()), torch.zeros(want.numel(), dtype=torch.bool)
        for rank in got:
            for start, piece in rank["grads"].get(name, []):
                got_flat[start : start + piece.numel()] = piece
                held[start : start + piece.numel()] = True
        assert held.all(), f"{name}: no rank holds all of its gradient"
        # gradients of ~1e-3 summed over windows in another order: float32 rounding, well under 1e-6
        torch.testing.assert_close(got_flat.view_as(want), want, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")
