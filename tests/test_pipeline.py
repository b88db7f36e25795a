"""Pipeline parallelism (GPipe and 1F1B over gloo ranks) against one process."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_data_parallel import STEPS, corpus, reference, train  # noqa: F401

LAYERS = {"model__n_layer": 4, "train__micro_batch_size": 2}  # 4 micro-batches a step


def merged(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Every stage's parameters in one dict; the tied embedding, held by the first and last stage, must agree."""
    out: dict[str, torch.Tensor] = {}
    for r in results:
        for name, p in r["params"].items():
            if name in out:
                torch.testing.assert_close(p, out[name], rtol=0, atol=0, msg=name)
            out[name] = p
    return out


def assert_matches(results: list[dict[str, Any]], ref: dict[str, Any], *, atol: float = 1e-7) -> None:
    losses = results[0]["losses"]  # rank 0 writes the metrics; the losses come from the last stage
    assert len(losses) == STEPS
    for a, b in zip(losses, ref["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    params = merged(results)
    assert params.keys() == ref["params"].keys()
    for name, p in ref["params"].items():
        torch.testing.assert_close(params[name], p, rtol=1e-5, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp", [2, 4])
def test_matches_one_stage(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,  # noqa: F811
                           pp: int, schedule: str) -> None:
    extra = {**LAYERS, "parallel__pp": pp, "parallel__pp_schedule": schedule}
    assert_matches(run_distributed(train, pp, tmp_path, corpus, extra, init_group=False),
                   reference(tmp_path_factory, corpus, **LAYERS))


@pytest.mark.parametrize("variant", [
    {"model__tie_embeddings": False},
    {"model__n_layer": 3},  # uneven: 2 + 1 blocks
    {"parallel__pp_layers": [1, 3]},
    {"train__activation_checkpointing": "full"},
], ids=["untied", "uneven", "explicit-layers", "checkpointing"])
def test_variants(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,  # noqa: F811
                  variant: dict[str, Any]) -> None:
    model = {**LAYERS, **{k: v for k, v in variant.items() if k.startswith("model__")}}
    extra = {**LAYERS, "parallel__pp": 2, **variant}
    assert_matches(run_distributed(train, 2, tmp_path, corpus, extra, init_group=False),
                   reference(tmp_path_factory, corpus, **model))


def test_with_tensor_parallel(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> None:  # noqa: F811
    """tp=2 x pp=2 on 4 processes, sequence parallel: activations travel as 1/tp slices."""
    extra = {**LAYERS, "parallel__pp": 2, "parallel__tp": 2, "parallel__sequence_parallel": True}
    results = run_distributed(train, 4, tmp_path, corpus, extra, init_group=False)
    ref = reference(tmp_path_factory, corpus, **LAYERS)
    for a, b in zip(results[0]["losses"], ref["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)


def test_checkpoint_moves_between_pp(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                     corpus: Path) -> None:  # noqa: F811
    first = tmp_path / "first"
    run_distributed(train, 2, first, corpus, {**LAYERS, "parallel__pp": 2, "train__stop_after_step": 4,
                                              "train__ckpt_interval": 4}, init_group=False)
    ref = reference(tmp_path_factory, corpus, **LAYERS)
    for pp in (1, 4):
        out = tmp_path / f"pp{pp}"
        shutil.copytree(first, out)
        got = run_distributed(train, pp, out, corpus, {**LAYERS, "parallel__pp": pp}, init_group=False)[0]
        for a, b in zip(got["losses"][4:], ref["losses"][4:], strict=True):
            assert a == pytest.approx(b, rel=1e-5)


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_with_data_parallel(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,  # noqa: F811
                            zero_stage: int) -> None:
    """dp=2 x pp=2 on 4 processes, tied embedding: its gradient summed between the first and last stage
    before (all-reduce) or on the shards after (ZeRO) the dp reduction."""
    extra = {**LAYERS, "parallel__pp": 2, "parallel__zero_stage": zero_stage, "train__micro_batch_size": 1,
             "parallel__bucket_mb": 0.01}
    results = run_distributed(train, 4, tmp_path, corpus, extra, init_group=False)
    # atol 1e-6: the tied embedding's two contributions and the dp mean are summed in another order than at
    # pp=1, and Adam turns that rounding into differences of that size on near-zero gradients
    assert_matches(results, reference(tmp_path_factory, corpus, **LAYERS), atol=1e-6)
    assert {r["dp"] for r in results} == {["ddp-flat", "zero1", "zero2"][zero_stage]}


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_3d_layout(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,  # noqa: F811
                   zero_stage: int) -> None:
    """The full 3D layout, dp=2 x tp=2 x pp=2 on 8 processes, against one process."""
    extra = {**LAYERS, "parallel__pp": 2, "parallel__tp": 2, "parallel__zero_stage": zero_stage,
             "train__micro_batch_size": 1, "parallel__pp_schedule": "1f1b"}
    results = run_distributed(train, 8, tmp_path, corpus, extra, init_group=False)
    ref = reference(tmp_path_factory, corpus, **LAYERS)
    assert len(results[0]["losses"]) == len(ref["losses"])
    for a, b in zip(results[0]["losses"], ref["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    params = merged(results)
    for name, p in ref["params"].items():  # tensor-parallel sums reorder float additions: see test_tensor_parallel
        torch.testing.assert_close(params[name], p, rtol=1e-5, atol=3e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_first_stage_holds_m_or_p_micro_batches(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """Saved-for-backward bytes on the first of 2 stages with m=4 micro-batches: GPipe holds all 4, 1F1B 2."""
    held = {}
    for schedule, batch in [("gpipe", 2), ("gpipe", 8), ("1f1b", 8)]:
        extra = {**LAYERS, "parallel__pp": 2, "parallel__pp_schedule": schedule, "train__global_batch_size": batch,
                 "train__max_steps": 1}
        results = run_distributed(train, 2, tmp_path / f"{schedule}{batch}", corpus, extra, init_group=False)
        held[schedule, batch // 2] = next(r["activation_bytes"] for r in results if r["pp_rank"] == 0)
    one = held["gpipe", 1]
    assert one > 0
    assert held["gpipe", 4] == 4 * one
    assert held["1f1b", 4] == 2 * one


def test_records_busy_and_idle_time_per_stage(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    extra = {**LAYERS, "parallel__pp": 2, "train__max_steps": 2}
    records = run_distributed(train, 2, tmp_path, corpus, extra, init_group=False)[0]["records"]
    for r in records:
        assert len(r["pp_busy_s"]) == len(r["pp_idle_s"]) == len(r["pp_idle_fraction"]) == 2
        assert all(b > 0 for b in r["pp_busy_s"]) and all(i >= 0 for i in r["pp_idle_s"])
        for b, i, f in zip(r["pp_busy_s"], r["pp_idle_s"], r["pp_idle_fraction"]):
            assert f == pytest.approx(i / (b + i), abs=1e-4)


def test_bf16_activations_travel_in_bf16(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                         corpus: Path) -> None:  # noqa: F811
    """Mixed precision: the p2p bytes are those of bf16 activations, and the losses stay near the pp=1 run."""
    extra = {**LAYERS, "train__precision": "bf16", "train__max_steps": 4}
    got = run_distributed(train, 2, tmp_path, corpus, {**extra, "parallel__pp": 2}, init_group=False)[0]
    ref = reference(tmp_path_factory, corpus, **extra)
    # 4 micro-batches of 2 x 32 x 32 activations forward, and their gradients back: 2 bytes each
    assert got["comm"]["p2p"] == 4 * 2 * 32 * 32 * 2
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert a == pytest.approx(b, rel=2e-2)


def test_zero_pipeline_checkpoint_resumes_on_one_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                         corpus: Path) -> None:  # noqa: F811
    """Saved at dp=2 x pp=2 with ZeRO-1 (each stage's shards gathered to full tensors), resumed at one process."""
    run_distributed(train, 4, tmp_path, corpus, {**LAYERS, "parallel__pp": 2, "parallel__zero_stage": 1,
                                                 "train__micro_batch_size": 1, "train__stop_after_step": 4,
                                                 "train__ckpt_interval": 4}, init_group=False)
    got = train(0, 1, tmp_path, corpus, LAYERS)
    ref = reference(tmp_path_factory, corpus, **LAYERS)
    for a, b in zip(got["losses"][4:], ref["losses"][4:], strict=True):
        assert a == pytest.approx(b, rel=1e-5)
