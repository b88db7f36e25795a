"""Leaner tensor parallelism (issue 20): SwiGLU's gate and up share one input collective, and under sequence
parallelism the column-parallel layers keep only their input's local slice for backward (Megatron-Core's way),
on gloo ranks against counts worked out here by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dist_llm import memory
from dist_llm.config import load_config
from dist_llm.parallel.context import ParallelContext
from dist_llm.train.saved_tensors import SavedTensorMeter
from dist_llm.train.trainer import build_model
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed
from tests.test_data_parallel import assert_same_run, corpus, reference, train  # noqa: F401

LLAMA = {"model__mlp": "swiglu", "model__norm": "rmsnorm", "model__pos_emb": "rope", "model__bias": False}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_swiglu_tp_bytes_equal_megatrons_count(tmp_path: Path, corpus: Path,  # noqa: F811
                                               sequence_parallel: bool) -> None:
    """Per micro-batch Megatron moves (4L + 2) b*s*h activations: per layer the all-reduces of attention-out's
    and MLP-down's outputs (forward) and of qkv's and the MLP's input gradients (backward; ONE for gate and up),
    the embedding's output and the head's input gradient. With sequence parallelism each becomes an all-gather
    plus a reduce-scatter, and each column input (qkv, the MLP's, the head's: 2L + 1) is all-gathered once more
    in backward, since only its local slice was kept. Besides: the vocab-parallel cross-entropy's 3 floats a
    token, the gradient norm's float, and under SP the norms' gradients (2L + 1 RMSNorm weights)."""
    tp = 2
    over = {"parallel__tp": tp, "parallel__sequence_parallel": sequence_parallel, "train__max_steps": 2, **LLAMA}
    got = run_distributed(train, tp, tmp_path, corpus, over, init_group=False)[0]["comm"]
    cfg = load_config(None, tiny_overrides(tmp_path, **over))
    m, t = cfg.model, cfg.train
    L, micro = m.n_layer, t.global_batch_size // t.micro_batch_size
    tokens = t.micro_batch_size * m.block_size
    bsh = tokens * m.n_embd * 4  # bytes of one fp32 (b, s, h) activation
    part = (tp - 1) / tp  # what a rank sends of an all-gather's output or a reduce-scatter's input
    extra = micro * 3 * tokens * 4 * 2 * part + 4 * 2 * part  # cross-entropy, gradient norm
    if sequence_parallel:
        norms = (2 * L + 1) * m.n_embd * 4 * 2 * part
        want = {"all_gather": micro * ((4 * L + 2) + (2 * L + 1)) * bsh * part,
                "reduce_scatter": micro * (4 * L + 2) * bsh * part,
                "all_reduce": extra + norms}
    else:
        want = {"all_reduce": micro * (4 * L + 2) * bsh * 2 * part + extra}
    assert got == {k: round(v) for k, v in want.items()}


def _saved(rank: int, world_size: int, out_dir: Path, extra: dict[str, Any]) -> dict[str, float]:
    """Bytes saved for backward by the column-parallel layers and by a whole block, and the memory model's
    prediction for the block."""
    cfg = load_config(None, tiny_overrides(out_dir, parallel__tp=world_size, parallel__sequence_parallel=True,
                                           model__bias=False, **extra))
    ctx = ParallelContext.from_config(cfg)
    model = build_model(cfg, ctx).train()
    block, b, T, C = model.blocks[0], 4, cfg.model.block_size, cfg.model.n_embd
    x = torch.randn(b, T // world_size, C, requires_grad=True)  # a slice of the sequence
    out: dict[str, float] = {}
    for name, run in {"qkv": lambda: block.attn.qkv(x),
                      "mlp_in": lambda: model.layers.linears(x, *[m for m in (block.mlp.gate, block.mlp.up) if m]),
                      "block": lambda: block(x)}.items():
        with SavedTensorMeter(model.parameters()) as meter:
            run()
        out[name] = meter.peak_bytes
    with SavedTensorMeter(model.parameters()) as meter, torch.autocast("cpu", dtype=torch.bfloat16):
        block.attn.qkv(x)
    out["qkv_bf16"] = meter.peak_bytes
    out["predicted_block"] = memory._layer_bytes(cfg, tp=world_size, dp=1, sequence_parallel=True) * b * T
    ctx.destroy()
    return out


@pytest.mark.parametrize("extra", [{}, {"model__mlp": "swiglu", "model__norm": "rmsnorm"}], ids=["gpt2", "swiglu"])
def test_sequence_parallel_keeps_the_local_slice(tmp_path: Path, extra: dict[str, Any]) -> None:
    """A column-parallel layer under SP keeps its input's (b, s/tp, h) slice, not the all-gathered (b, s, h)
    input (in the compute dtype under autocast); SwiGLU's gate and up keep one slice between them. So a
    block keeps 2 (b, s, h) (1 - 1/tp) fewer values than before (3 - 2/tp for SwiGLU, whose gate and up
    each kept a gathered copy), which is what the memory model predicts for the block, to the byte."""
    tp = 2
    got = run_distributed(_saved, tp, tmp_path, extra, init_group=False)[0]
    cfg = load_config(None, tiny_overrides(tmp_path))
    local = 4 * cfg.model.block_size // tp * cfg.model.n_embd  # values of one (b, s/tp, h) slice
    assert (got["qkv"], got["mlp_in"], got["qkv_bf16"]) == (4 * local, 4 * local, 2 * local)
    assert got["block"] == got["predicted_block"]


def test_swiglu_sequence_parallel_training_matches_tp1(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                       corpus: Path) -> None:  # noqa: F811
    """The shared gather and the re-gather in backward change no number beyond summation order: the losses
    and parameters of 8 steps equal one process's (fp32, 1e-5)."""
    model_keys = {"model__mlp": "swiglu", "model__norm": "rmsnorm", "model__pos_emb": "rope"}
    got = run_distributed(train, 2, tmp_path, corpus, {"parallel__tp": 2, "parallel__sequence_parallel": True,
                                                       **model_keys}, init_group=False)[0]
    assert_same_run(got, reference(tmp_path_factory, corpus, **model_keys), rtol=1e-5)


def test_swiglu_sequence_parallel_bf16(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                       corpus: Path) -> None:  # noqa: F811
    """Under autocast the gathered input and the kept slice are bf16 (what the matmuls read): the losses stay
    those of one bf16 process within bf16's rounding."""
    keys = {"model__mlp": "swiglu", "train__precision": "bf16"}
    got = run_distributed(train, 2, tmp_path, corpus, {"parallel__tp": 2, "parallel__sequence_parallel": True,
                                                       **keys}, init_group=False)[0]
    ref = reference(tmp_path_factory, corpus, **keys)
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert a == pytest.approx(b, abs=1e-2)
