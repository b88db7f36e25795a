"""model/casting.py: gate and up read one autocast copy of their fp32 input, with the values and gradients of a
cast per matmul (each matmul kept its own 16-bit copy before)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dist_llm.model.factory as factory
from dist_llm.config import ModelConfig
from dist_llm.model import GPT
from dist_llm.model.casting import cast_once
from tests.distributed import run_distributed


def _saved_bytes(fn) -> tuple[object, int]:  # type: ignore[no-untyped-def]
    """fn's result and the bytes of the distinct storages autograd saved while it ran."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(saved.values())


def test_swiglu_under_autocast_keeps_one_copy_with_the_same_values_and_gradients(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A SwiGLU GPT in bf16 autocast over fp32 weights, against the same model whose gate and up each cast their
    input (autocast's own way): bitwise the same loss and gradients (the cast is the same rounding; the two input
    gradients are cast up and summed in fp32 as autograd summed them), and exactly one (tokens x n_embd) bf16
    copy a block less saved."""
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=64, block_size=16, mlp="swiglu", norm="rmsnorm",
                      pos_emb="rope", bias=False)
    idx = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))

    def run() -> tuple[float, list[torch.Tensor], int]:
        torch.manual_seed(0)
        model = GPT(cfg)

        def step() -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(idx, idx)

        loss, nbytes = _saved_bytes(step)
        loss.backward()  # type: ignore[union-attr]
        return loss.item(), [p.grad for p in model.parameters()], nbytes  # type: ignore[union-attr]

    loss, grads, nbytes = run()
    monkeypatch.setattr(factory, "cast_once", lambda x, n: (x,) * n)  # each matmul casts for itself
    ref_loss, ref_grads, ref_bytes = run()
    assert loss == ref_loss
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.equal(a, b)
    assert ref_bytes - nbytes == cfg.n_layer * 3 * 16 * 32 * 2


def test_cast_once_leaves_what_autocast_would_not_cast() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    assert cast_once(x, 2) == (x, x)  # no autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert all(t is x for t in cast_once(x, 1))
        low = x.detach().bfloat16()
        assert all(t is low for t in cast_once(low, 2))  # already 16-bit
        double = x.detach().double()
        assert all(t is double for t in cast_once(double, 2))  # autocast leaves fp64 alone
        a, b = cast_once(x, 2)
        assert a.dtype == b.dtype == torch.bfloat16 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        with torch.no_grad():
            c, d = cast_once(x, 2)
        assert c is d and not c.requires_grad


def test_a_reader_left_unused_adds_nothing() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, _ = cast_once(x, 2)
    (a.float() * 3).sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


def _tp_runs(rank: int, world_size: int, out_dir: Path) -> list[tuple[float, list[torch.Tensor], int]]:
    """A tp=2 SwiGLU model's loss, gradients and saved bytes in bf16 autocast, with the column-parallel gate and
    up reading one cast of their input and, second, each casting its own."""
    import dist_llm.parallel.tensor.layers as tp_layers
    from dist_llm.config import load_config
    from dist_llm.parallel.context import ParallelContext
    from dist_llm.train.trainer import build_model
    from tests.conftest import tiny_overrides

    cfg = load_config(None, tiny_overrides(out_dir, parallel__tp=world_size, model__mlp="swiglu",
                                           model__norm="rmsnorm", model__pos_emb="rope", model__bias=False))
    ctx = ParallelContext.from_config(cfg)
    idx = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.block_size), generator=torch.Generator().manual_seed(0))
    runs = []
    for each_casts in (False, True):
        if each_casts:
            tp_layers.cast_once = lambda x, n: (x,) * n  # (this rank process only)
        torch.manual_seed(0)
        model = build_model(cfg, ctx).train()

        def step() -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(idx, idx)

        loss, nbytes = _saved_bytes(step)
        loss.backward()  # type: ignore[union-attr]
        runs.append((loss.item(), [p.grad for p in model.parameters()], nbytes))  # type: ignore[union-attr]
    return runs


def test_column_parallel_gate_and_up_read_one_cast(tmp_path: Path) -> None:
    """The same under tp=2 without sequence parallelism, where the summed input gradient is then all-reduced:
    bitwise the same loss and gradients on each rank, one (tokens x n_embd) bf16 copy a block less."""
    for (loss, grads, nbytes), (ref_loss, ref_grads, ref_bytes) in run_distributed(_tp_runs, 2, tmp_path):
        assert loss == ref_loss
        for a, b in zip(grads, ref_grads, strict=True):
            assert torch.equal(a, b)
        assert ref_bytes - nbytes == 2 * 4 * 32 * 32 * 2  # 2 blocks, 4 x 32 tokens, n_embd 32, bf16
