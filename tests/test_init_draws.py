"""model/init.py draws only what a rank holds: one expert at a time for stacked experts, fixed row chunks for
large parameters; the values are one process's at every layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dist_llm.config import load_config
from dist_llm.model import init as model_init
from dist_llm.model.moe import Experts
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.expert.layers import LocalExperts
from dist_llm.parallel.parallelize import meta_model, parallelize
from dist_llm.parallel.tensor.checkpoint import TensorParallelState
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed

DRAWS = {torch.ops.aten.normal_.default, torch.ops.aten.uniform_.default}
ALLOCS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default}


class Draws(TorchDispatchMode):
    """The shapes every random fill writes into (`draws`) and every tensor allocated (`allocs`, in elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.draws: list[tuple[int, ...]] = []
        self.allocs: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in DRAWS:
            self.draws.append(tuple(args[0].shape))
        elif func in ALLOCS and out.device.type != "meta":
            self.allocs.append(out.numel())
        return out


class Part(nn.Module):
    """A layer holding rows [first, first + n) of a whole (rows, 3) weight: a vocab-parallel embedding's slice."""

    def __init__(self, rows: int, first: int, n: int) -> None:
        super().__init__()
        self.rows, self.first = rows, first
        self.weight = nn.Parameter(torch.empty(n, 3))

    def full_shape(self, pname: str) -> tuple[int, ...]:
        return (self.rows, 3)

    def local_part(self, pname: str, full: torch.Tensor) -> torch.Tensor:
        return full[self.first : self.first + self.weight.shape[0]]


class Picked(Part):
    """Rows picked by an index (not one box of the whole): drawn whole, then picked."""

    def local_part(self, pname: str, full: torch.Tensor) -> torch.Tensor:
        return full[torch.tensor([self.first, self.first + 2], device=full.device)]


def test_a_slice_draws_only_its_chunks_and_equals_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_init, "CHUNK_NUMEL", 12)  # 4 rows of 3 per chunk
    whole = nn.Linear(3, 10, bias=False)  # weight (10, 3): chunks rows 0-3, 4-7, 8-9
    model_init.fill_parameter(whole, "weight", "w", model_init.normal(1.0), seed=5)
    assert not torch.equal(whole.weight[:4], whole.weight[4:8])  # each chunk its own generator
    for layer in (Part(10, 3, 6), Part(10, 4, 4), Part(10, 9, 1), Picked(10, 5, 2)):
        with Draws() as meter:
            model_init.fill_parameter(layer, "weight", "w", model_init.normal(1.0), seed=5)
        assert torch.equal(layer.weight, layer.local_part("weight", whole.weight.detach())), type(layer)
        if isinstance(layer, Picked):  # drawn whole, chunk by chunk
            assert meter.draws == [(4, 3), (4, 3), (2, 3)] and max(meter.allocs) == 30
            continue
        rows = range(layer.first, layer.first + layer.weight.shape[0])
        chunks = sorted({r // 4 for r in rows})
        assert len(meter.draws) == len(chunks)  # the chunks it overlaps, nothing else
        assert all(numel <= 12 for numel in meter.allocs)  # one chunk at a time at most
    # a parameter of one chunk draws what one generator over the whole tensor draws (as before chunks)
    small = nn.Linear(3, 4, bias=False)
    model_init.fill_parameter(small, "weight", "w", model_init.normal(1.0), seed=5)
    expect = torch.empty(4, 3).normal_(0.0, 1.0, generator=torch.Generator().manual_seed(model_init.param_seed(5, "w")))
    assert torch.equal(small.weight.detach(), expect)


def test_local_experts_draw_their_experts_one_at_a_time() -> None:
    """Experts 2-3 of 4 (an ep=2 rank) equal rows 2-3 of the whole layer's, each expert drawn alone."""
    whole = Experts(4, 8, 16, swiglu=True, bias=True)
    local = LocalExperts(4, 2, 2, 8, 16, swiglu=True, bias=True)
    rule = lambda *_: model_init.normal(0.02)  # noqa: E731
    model_init.init_parameters(whole, 3, rule)
    with Draws() as meter:
        model_init.init_parameters(local, 3, rule)
    for name, p in local.named_parameters():
        assert torch.equal(p, getattr(whole, name)[2:4]), name
    assert sorted(meter.draws) == sorted([(1, 8, 16)] * 4 + [(1, 16, 8)] * 2 + [(1, 16)] * 4 + [(1, 8)] * 2)
    assert meter.allocs == []  # straight into the rank's own rows


LORA_EXPERTS = {"peft__method": "lora", "peft__rank": 4, "peft__targets": "[experts_up,experts_down,qkv]"}
MOE = {"model__n_experts": 4, "model__moe_top_k": 2, "model__mlp": "swiglu", "model__bias": False}
# ep=2, ZeRO-3 at dp=2 (FSDP2 rows of whole experts), ZeRO-3 with ep=2, expert LoRA at ep=2: rank r holds
# experts 2r, 2r+1 of 4
EXPERT_LAYOUTS = {"ep2": {**MOE, "parallel__dp": 2, "parallel__ep": 2},
                  "ep2-lora": {**MOE, **LORA_EXPERTS, "parallel__dp": 2, "parallel__ep": 2},
                  "zero3-dp2": {**MOE, "parallel__dp": 2, "parallel__zero_stage": 3},
                  "zero3-ep2": {**MOE, "parallel__dp": 2, "parallel__zero_stage": 3, "parallel__ep": 2}}
# tp=2 with chunks of 256 elements (8 rows of the 32-wide embedding and head): a vocab-parallel rank draws its half
TP = {"parallel__tp": 2, "model__tie_embeddings": False}
TP_CHUNK = 256
# ZeRO-3 at dp=2 with chunks of 160 elements (5 rows of 32): every parameter, FSDP2's dim-0 shards starting inside
# a chunk (rank 1's half of the 256-row embedding at row 128, of QKV's 96 rows at 48) and uneven (an MLP 99 wide:
# rows 0-49 and 50-98 of mlp.up, whose bias of 99 is one chunk)
ZERO3 = {"parallel__dp": 2, "parallel__zero_stage": 3, "model__mlp": "gelu", "model__mlp_hidden": 99}
ZERO3_CHUNK = 160


def _build(out_dir: Path, extra: dict[str, Any], drawn: dict[str, Draws] | None = None) -> dict[str, Any]:
    """This rank's build of the tiny model with `extra`: its parameters (the local tensors; at tp the full ones)
    and, if `drawn` is given, what each parameter's fill drew and allocated (by name)."""
    fill = model_init.fill_parameter

    def recording(module: nn.Module, pname: str, name: str, *args: Any, **kwargs: Any) -> None:
        with Draws() as meter:
            fill(module, pname, name, *args, **kwargs)
        drawn[name] = meter  # type: ignore[index]

    if drawn is not None:
        model_init.fill_parameter = recording
    cfg = load_config(None, tiny_overrides(out_dir, **extra))
    ctx = ParallelContext.from_config(cfg)
    try:
        model = parallelize(meta_model(cfg, ctx), cfg, ctx).model
        params = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
                  for n, p in model.named_parameters()}
        if ctx.tp > 1:
            params = TensorParallelState(model, ctx).to_full({"model": params, "optim": {"state": {}}})["model"]
        assert ctx.ep == extra.get("parallel__ep", 1)
        return params
    finally:
        model_init.fill_parameter = fill
        ctx.destroy()


def _draws_on_ranks(rank: int, world_size: int, out_dir: Path) -> dict[str, Any]:
    """Every layout above on these 2 ranks: each parameter's values on this rank and what its fill drew."""
    out = {}
    for layout, extra in EXPERT_LAYOUTS.items():
        drawn: dict[str, Draws] = {}
        params = _build(out_dir / layout, extra, drawn)
        out[layout] = {n: {"local": p, "draws": drawn[n].draws, "allocs": drawn[n].allocs}
                       for n, p in params.items() if ".experts." in n}
    model_init.CHUNK_NUMEL = TP_CHUNK
    drawn = {}
    params = _build(out_dir / "tp2", TP, drawn)
    out["tp2"] = {n: {"local": p, "draws": drawn[n].draws, "allocs": drawn[n].allocs} for n, p in params.items()}
    model_init.CHUNK_NUMEL = ZERO3_CHUNK
    out["zero3-chunks"] = _build(out_dir / "zero3-chunks", ZERO3)
    return out


def test_each_rank_draws_only_what_it_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On 2 ranks: at every expert layout rank r draws experts 2r, 2r+1 alone, one (in, out) matrix at a time,
    never a whole expert stack; at tp=2 a vocab-parallel rank draws the row chunks of its half of the embedding
    and of the untied head. Values equal one process's everywhere: every parameter too at ZeRO-3 with small chunks,
    its FSDP2 shards starting inside a chunk and uneven."""
    ranks = run_distributed(_draws_on_ranks, 2, tmp_path / "many")
    one = {"plain": _build(tmp_path / "plain", MOE), "lora": _build(tmp_path / "lora", {**MOE, **LORA_EXPERTS})}
    for rank, layouts in enumerate(ranks):
        for layout in EXPERT_LAYOUTS:
            ref = {n: p for n, p in one["lora" if "lora" in layout else "plain"].items() if ".experts." in n}
            assert layouts[layout].keys() == ref.keys()
            for name, got in layouts[layout].items():
                whole, where = ref[name], f"{layout} rank {rank} {name}"
                assert torch.equal(got["local"], whole[2 * rank : 2 * rank + 2]), where
                assert got["draws"] in ([], [(1, *whole.shape[1:])] * 2), where  # (LoRA's B: zeros, no draw)
                assert all(n <= whole[0].numel() for n in got["allocs"]), where
    monkeypatch.setattr(model_init, "CHUNK_NUMEL", TP_CHUNK)
    ref = _build(tmp_path / "one-tp", {k: v for k, v in TP.items() if not k.startswith("parallel__")})
    for rank, layouts in enumerate(ranks):
        got = layouts["tp2"]
        assert got.keys() == ref.keys()
        for name, p in ref.items():
            assert torch.equal(got[name]["local"], p), f"tp2 rank {rank} {name}"
        for name in ("wte.weight", "lm_head.weight"):
            rows = sum(shape[0] for shape in got[name]["draws"])
            assert rows == ref[name].shape[0] // 2 and got[name]["allocs"] == [], (name, got[name])


    monkeypatch.setattr(model_init, "CHUNK_NUMEL", ZERO3_CHUNK)
    ref = _build(tmp_path / "one-zero3", {k: v for k, v in ZERO3.items() if not k.startswith("parallel__")})
    assert [r["zero3-chunks"]["blocks.0.mlp.up.weight"].shape[0] for r in ranks] == [50, 49]  # (uneven)
    for rank, layouts in enumerate(ranks):
        got = layouts["zero3-chunks"]
        assert got.keys() == ref.keys()
        for name, whole in ref.items():  # FSDP2's shard: rank 0 the first ceil(rows / 2) rows, rank 1 the rest
            first = rank * -(-whole.shape[0] // 2)
            assert torch.equal(got[name], whole[first : first + got[name].shape[0]]), f"zero3 rank {rank} {name}"
