"""Data parallelism (DDP, ZeRO-1/2 written here, ZeRO-3 on FSDP2) against one process, on gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_llm.config import load_config
from dist_llm.parallel.context import ParallelContext
from dist_llm.train.trainer import Trainer
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed

STEPS = 8


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().clone()


def train(rank: int, world_size: int, out_dir: Path, corpus: Path, extra: dict[str, Any]) -> dict[str, Any]:
    """Train in this process (a rank, or the test process itself for the reference) and report.

    No biases: the key bias has an exactly-zero true gradient (softmax ignores a constant added to a row of
    scores), so Adam turns its float-rounding noise into steps of size lr and that parameter would differ
    between any two summation orders, parallel or not."""
    cfg = load_config(None, tiny_overrides(out_dir, data__source=str(corpus), train__max_steps=STEPS,
                                           train__eval_interval=0, model__bias=False, **extra))
    ctx = ParallelContext.from_config(cfg)
    try:
        trainer = Trainer(cfg, ctx)
        trainer.fit()
        params = {n: _full(p) for n, p in trainer.module.named_parameters()}
        out = {"params": params, "state_bytes": trainer.dp.model_state_bytes(), "comm": trainer.comm_bytes,
               "n_params": trainer.module.num_params(), "dp": trainer.dp.name}
        if rank == 0:
            lines = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
            out["losses"] = [r["loss"] for r in lines if "loss" in r]
        return out
    finally:
        ctx.destroy()


_REFERENCE: dict[str, dict[str, Any]] = {}


def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path, **extra: Any) -> dict[str, Any]:
    key = json.dumps(extra, sort_keys=True)
    if key not in _REFERENCE:
        _REFERENCE[key] = train(0, 1, tmp_path_factory.mktemp("ref"), corpus, extra)
    return _REFERENCE[key]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join((stdlib / n).read_text() for n in ["argparse.py", "functools.py", "textwrap.py"]))
    return path


def assert_same_run(got: dict[str, Any], ref: dict[str, Any], *, rtol: float) -> None:
    assert len(got["losses"]) == STEPS
    for a, b in zip(got["losses"], ref["losses"]):
        assert a == pytest.approx(b, rel=rtol)
    for name, p in ref["params"].items():
        torch.testing.assert_close(got["params"][name], p, rtol=rtol, atol=rtol * 1e-2,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [2, 4])
def test_matches_single_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,
                                dp: int, zero_stage: int) -> None:
    # global batch 8: micro 4 gives accumulation 1 at dp=2; micro 2 at dp=4
    extra = {"parallel__zero_stage": zero_stage, "train__micro_batch_size": 8 // dp,
             "parallel__bucket_mb": 0.01}  # several buckets, so ZeRO-2 overlaps and ZeRO's bucket logic is exercised
    results = run_distributed(train, dp, tmp_path, corpus, extra, init_group=False)
    ref = reference(tmp_path_factory, corpus)
    assert_same_run(results[0], ref, rtol=1e-5)
    for r in results[1:]:  # every rank ends with the same full model
        for name, p in results[0]["params"].items():
            torch.testing.assert_close(r["params"][name], p, rtol=0, atol=0)


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_gradient_accumulation(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,
                               zero_stage: int) -> None:
    extra = {"parallel__zero_stage": zero_stage, "train__micro_batch_size": 2}  # dp=2: 2 micro-steps
    results = run_distributed(train, 2, tmp_path, corpus, extra, init_group=False)
    assert_same_run(results[0], reference(tmp_path_factory, corpus), rtol=1e-5)
