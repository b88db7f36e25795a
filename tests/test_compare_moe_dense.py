"""scripts/compare_moe_dense.py's plan, without training: each run's steps come from the seconds a step of the run's
resolved config takes at its probe's tokens/s, so a --moe-override of the batch or block size (which changes the
tokens a step holds) changes the plan; before, the plan read them from the config file alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(REPO / "scripts"))  # (it imports bench_runs as the scripts folder's module)
    from scripts import compare_moe_dense

    return compare_moe_dense


def test_plan_counts_the_tokens_of_the_resolved_step(script: Any) -> None:
    cfg = script.resolved("configs/moe.yaml", [])
    assert (cfg.train.global_batch_size, cfg.model.block_size, cfg.optim.warmup_steps) == (32, 128, 50)
    plan = script.plan(cfg, 600.0, 4096.0)  # 32 x 128 tokens a step at 4096 tokens/s: 1 s a step
    assert (plan.seconds_per_step, plan.steps) == (1.0, 600)
    assert plan.overrides == ["train.max_steps=600", "train.max_time_s=600.0", "train.eval_interval=600",
                              "optim.warmup_steps=50", "train.log_interval=10"]
    # 4x the tokens a step: 4 s a step, 150 steps (the file's sizes gave 600), the warm-up cut to a tenth of them
    bigger = script.resolved("configs/moe.yaml", ["train.global_batch_size=64", "model.block_size=256"])
    plan = script.plan(bigger, 600.0, 4096.0)
    assert (plan.seconds_per_step, plan.steps) == (4.0, 150)
    assert "optim.warmup_steps=15" in plan.overrides
    # an overridden warm-up is the one cut; a step slower than the budget still gets 10 steps
    short = script.plan(script.resolved("configs/moe.yaml", ["optim.warmup_steps=5"]), 600.0, 4096.0)
    assert "optim.warmup_steps=5" in short.overrides
    assert script.plan(cfg, 10.0, 4096.0).steps == 10


def test_main_plans_each_run_from_its_own_probe_and_overrides(script: Any, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The whole script with train_run stood in (no training): the MoE probe runs with the overrides, its plan
    counts the overridden step's tokens, and the real run gets the overrides with the plan's keys after them."""
    calls: list[tuple[str, list[str]]] = []

    def train_run(config: str, overrides: list[str], nproc: int, out_dir: Path, *, threads: int = 1) -> dict:
        calls.append((config, overrides))
        return {"tokens_per_s": 4096.0, "steps": 1, "elapsed_s": 1.0, "val_loss": 1.0}

    monkeypatch.setattr(script, "train_run", train_run)
    monkeypatch.setattr("sys.argv", ["compare_moe_dense.py", "--seconds", "600", "--probe-steps", "3",
                                     "--moe-override", "train.global_batch_size=64",
                                     "--moe-override", "model.block_size=256"])
    script.main()
    runs = dict(calls[2:])  # (the two probes first)
    assert calls[1] == ("configs/moe.yaml", ["train.global_batch_size=64", "model.block_size=256",
                                             "train.max_steps=3", "optim.warmup_steps=1"])
    assert runs["configs/tiny.yaml"][0] == "train.max_steps=600"  # 32 x 128 tokens a step: 1 s
    assert runs["configs/moe.yaml"][:3] == ["train.global_batch_size=64", "model.block_size=256",
                                            "train.max_steps=150"]  # 64 x 256: 4 s
    assert "moe: 4.000 s a step in the probe" in capsys.readouterr().out
