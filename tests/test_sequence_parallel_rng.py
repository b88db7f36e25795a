"""Dropout under sequence parallelism: each tp rank's slice of the sequence gets its own mask, and
activation checkpointing replays those masks exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dist_llm.config import load_config
from dist_llm.parallel.context import ParallelContext
from dist_llm.train.trainer import build_model
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed

P = 0.5  # half the positions dropped: two independent masks of thousands of positions cannot agree by chance
SP = {"parallel__sequence_parallel": True, "model__dropout": P, "model__bias": False, "model__n_layer": 1}
# where each dropout of a one-block model draws its seed from the shared stream, in forward order (the
# attention core's SDPA dropout draws the second)
SEED_DRAW = {"drop": 0, "blocks.0.attn.resid_dropout": 2, "blocks.0.mlp.dropout": 3}
SEED_DRAWS = 4


def _batch(cfg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (2, cfg.model.block_size)
    return (torch.randint(0, cfg.model.vocab_size, shape, generator=torch.Generator().manual_seed(0)),
            torch.randint(0, cfg.model.vocab_size, shape, generator=torch.Generator().manual_seed(1)))


def _record_masks(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """Every dropout's kept positions, one entry per call (a recomputation calls it again), laid out in memory
    as its input was (dropout draws in memory order). Where the input is exactly 0 (a first token whose one
    attention weight attention dropout dropped) the mask cannot be read: those positions hold -1."""
    masks: dict[str, list[torch.Tensor]] = {}

    def keep(name: str, inp: torch.Tensor, out: torch.Tensor) -> None:
        mask = torch.empty_strided(out.shape, inp.stride(), dtype=torch.int8)
        mask.copy_((out != 0).to(torch.int8).masked_fill(inp == 0, -1))
        masks.setdefault(name, []).append(mask)

    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout):
            module.register_forward_hook(lambda m, inp, out, name=name: keep(name, inp[0], out))
    return masks


def _dropout_masks(rank: int, world_size: int, out_dir: Path) -> dict[str, Any]:
    cfg = load_config(None, tiny_overrides(out_dir, parallel__tp=world_size, **SP))
    ctx = ParallelContext.from_config(cfg)
    try:
        model = build_model(cfg, ctx).train()
        masks = _record_masks(model)
        idx, tgt = _batch(cfg)
        torch.manual_seed(1234)
        shared_state = torch.get_rng_state()
        model(idx, tgt)
        return {"masks": {k: v[0] for k, v in masks.items()}, "shared_state": shared_state}
    finally:
        ctx.destroy()


def test_sequence_slices_get_their_own_masks(tmp_path: Path) -> None:
    """tp=2 with sequence parallelism: the embedding, attention-output and MLP-output dropouts act on each
    rank's half of the sequence. Their masks differ between the two halves, and each is the mask a one-process
    dropout draws from the per-slice generator: seeded with s + tp rank, s drawn from the shared stream."""
    ranks = run_distributed(_dropout_masks, 2, tmp_path, init_group=False)
    assert ranks[0]["shared_state"].equal(ranks[1]["shared_state"])
    shared = torch.Generator().set_state(ranks[0]["shared_state"])
    seeds = [int(torch.randint(0, 2**62, (1,), generator=shared)) for _ in range(SEED_DRAWS)]
    for name, draw in SEED_DRAW.items():
        got = [r["masks"][name] for r in ranks]
        assert got[0].shape == (2, 16, 32)  # (B, T/tp, C): a slice of the sequence
        assert not got[0].equal(got[1]), f"{name}: the same mask on both sequence slices"
        for rank, mask in enumerate(got):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seeds[draw] + rank)
                ones = torch.empty_strided(mask.shape, mask.stride()).fill_(1.0)
                want = (F.dropout(ones, P, training=True) != 0).to(torch.int8)
            known = mask >= 0
            assert known.float().mean() > 0.95
            assert mask[known].equal(want[known]), f"{name} on tp rank {rank}: not the per-slice generator's mask"
            assert 0.4 < mask[known].float().mean() < 0.6  # (a dropout that drew nothing would fail here too)


def _gradients_by_checkpointing(rank: int, world_size: int, out_dir: Path) -> dict[str, Any]:
    cfg = load_config(None, tiny_overrides(out_dir, parallel__tp=world_size, **{**SP, "model__n_layer": 2}))
    ctx = ParallelContext.from_config(cfg)
    try:
        model = build_model(cfg, ctx).train()
        masks = _record_masks(model)
        idx, tgt = _batch(cfg)
        grads, calls = {}, {}
        for mode in ("none", "full", "selective"):
            model.set_activation_checkpointing(mode)
            model.zero_grad(set_to_none=True)
            masks.clear()
            torch.manual_seed(99)
            model(idx, tgt).backward()
            grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
            calls[mode] = {n: len(v) for n, v in masks.items()}
            for name, seen in masks.items():  # a recomputed mask is the forward's
                assert all(m.equal(seen[0]) for m in seen), f"{mode}: {name} recomputed with another mask"
        return {"grads": grads, "calls": calls}
    finally:
        ctx.destroy()


def test_recomputation_replays_sequence_parallel_masks(tmp_path: Path) -> None:
    """The same step with full, selective and no activation checkpointing: bit-identical gradients on every
    rank, the recomputed blocks' dropouts drawing the forward's masks again."""
    for rank in run_distributed(_gradients_by_checkpointing, 2, tmp_path, init_group=False):
        # really recomputed in backward (the MLP's dropout too, but the recomputation stops as soon as its
        # mask is saved again, before the module's hook would run)
        assert rank["calls"]["full"]["blocks.0.attn.resid_dropout"] == 2
        assert rank["calls"]["none"]["blocks.0.attn.resid_dropout"] == 1
        for mode in ("full", "selective"):
            for name, g in rank["grads"]["none"].items():
                assert g.equal(rank["grads"][mode][name]), f"{mode}: gradient of {name} differs"


def _lora_masks(rank: int, world_size: int, out_dir: Path) -> dict[bool, dict[str, torch.Tensor]]:
    masks = {}
    ctx = None
    try:
        for sp in (True, False):
            extra = {**SP, "parallel__sequence_parallel": sp, "model__dropout": 0.0, "peft__method": "lora",
                     "peft__targets": "[qkv,attn_out]", "peft__rank": 4, "peft__dropout": P}
            cfg = load_config(None, tiny_overrides(out_dir, parallel__tp=world_size, **extra))
            ctx = ParallelContext.from_config(cfg)  # the second call finds the group: no re-init on one port
            model = build_model(cfg, ctx).train()
            seen = _record_masks(model)
            idx, tgt = _batch(cfg)
            torch.manual_seed(5)
            model(idx, tgt)
            masks[sp] = {k: v[0] for k, v in seen.items()}
    finally:
        if ctx is not None:
            ctx.destroy()
    return masks


def test_lora_dropout_masks_follow_what_each_rank_holds(tmp_path: Path) -> None:
    """LoRA's input dropout at tp=2: a row-parallel layer's input (each rank its columns), and a
    column-parallel one's under sequence parallelism (each rank its slice), get a mask per rank; the
    column-parallel input without sequence parallelism is the same on both ranks, and so is its mask."""
    ranks = run_distributed(_lora_masks, 2, tmp_path, init_group=False)
    column, row = "blocks.0.attn.qkv.lora.dropout", "blocks.0.attn.proj.lora.dropout"
    for sp in (True, False):
        assert not ranks[0][sp][row].equal(ranks[1][sp][row]), f"sequence_parallel={sp}: {row}"
    assert not ranks[0][True][column].equal(ranks[1][True][column])
    assert ranks[0][False][column].equal(ranks[1][False][column])


def _stream_after_build(rank: int, world_size: int, out_dir: Path) -> dict[str, Any]:
    cfg = load_config(None, tiny_overrides(out_dir, parallel__pp=world_size, model__n_layer=2, model__dropout=0.1))
    ctx = ParallelContext.from_config(cfg)
    try:
        build_model(cfg, ctx)
        return {"draw": torch.rand(4096), "pp_rank": ctx.pp_rank}
    finally:
        ctx.destroy()


def test_pipeline_stages_draw_dropout_from_their_own_streams(tmp_path: Path) -> None:
    """After the model is built, stage k > 0 seeds its stream with train.seed + 100 k: stage 0 draws what one process
    draws, and stage 1 draws something else (two sets of 4096 uniform draws cannot agree by chance)."""
    first, second = run_distributed(_stream_after_build, 2, tmp_path, init_group=False)
    one = _stream_after_build(0, 1, tmp_path / "one")
    assert (first["pp_rank"], second["pp_rank"]) == (0, 1)
    assert torch.equal(first["draw"], one["draw"])
    assert not torch.equal(second["draw"], first["draw"])
    cfg = load_config(None, tiny_overrides(tmp_path))
    assert torch.equal(second["draw"], torch.rand(4096, generator=torch.Generator().manual_seed(cfg.train.seed + 100)))
