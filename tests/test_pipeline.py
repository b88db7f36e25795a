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


def assert_matches(results: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    losses = results[0]["losses"]  # rank 0 writes the metrics; the losses come from the last stage
    assert len(losses) == STEPS
    for a, b in zip(losses, ref["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    params = merged(results)
    assert params.keys() == ref["params"].keys()
    for name, p in ref["params"].items():
        torch.testing.assert_close(params[name], p, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


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
