"""train.max_time_s: a run ends at the first step past its time budget, as at its last step (evaluated, saved,
reported), and every rank ends at the same step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_llm.config import ConfigError, load_config
from dist_llm.parallel.context import ParallelContext
from dist_llm.train import checkpoint as ckpt
from dist_llm.train.trainer import Trainer
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed
from tests.test_data_parallel import corpus  # noqa: F401 - a fixture


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_budget_ends_the_run_evaluated_and_saved(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """A budget smaller than one step: step 1 is the last; it is logged, evaluated and checkpointed although
    neither interval falls on it, and the schedule is still max_steps'."""
    cfg = load_config(None, tiny_overrides(tmp_path, data__source=str(corpus), train__max_steps=8,
                                           train__max_time_s=1e-6, train__log_interval=4, train__eval_interval=4,
                                           optim__warmup_steps=4))
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    last = trainer.fit()
    assert trainer.step == 1 and last["step"] == 1 and "val_loss" in last
    records = _records(tmp_path)
    assert [r["step"] for r in records if "loss" in r] == [1]
    assert [r["step"] for r in records if "val_loss" in r and "loss" not in r] == [1]
    assert records[[i for i, r in enumerate(records) if "loss" in r][0]]["lr"] == pytest.approx(3e-3 / 4)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "checkpoints")] == ["step_000001"]
    # a budget no step reaches changes nothing: the run goes to max_steps
    cfg = load_config(None, tiny_overrides(tmp_path / "long", data__source=str(corpus), train__max_steps=3,
                                           train__max_time_s=1e6, train__eval_interval=0))
    assert Trainer(cfg, ParallelContext.from_config(cfg)).fit()["step"] == 3


def _one_rank_out_of_time(rank: int, world_size: int, out: Path, corpus: Path) -> tuple[int, int]:  # noqa: F811
    """Rank 0's budget is spent at once, rank 1's never: both must stop after step 1 (the one that stops alone
    would leave the other waiting in the next step's collectives). Also the host all-reduces a step: one (the
    stop signal and the budget's flag together; they were two)."""
    from dist_llm.parallel import comm

    budget = 1e-6 if rank == 0 else 1e6
    cfg = load_config(None, tiny_overrides(out, data__source=str(corpus), train__max_steps=8, train__eval_interval=0,
                                           train__max_time_s=budget))
    ctx = ParallelContext.from_config(cfg)
    host_reduces = 0
    reduce = comm.all_reduce

    def counted(t: torch.Tensor, group: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal host_reduces
        # (on gloo the host group is the world's, which the metrics' sums use too: the flags are its MAX ones)
        host_reduces += group is ctx.cpu_group and kwargs.get("op") == torch.distributed.ReduceOp.MAX
        return reduce(t, group, *args, **kwargs)

    comm.all_reduce = counted
    try:
        trainer = Trainer(cfg, ctx)
        trainer.fit()
        return trainer.step, host_reduces
    finally:
        comm.all_reduce = reduce
        ctx.destroy()


def test_every_rank_stops_at_the_same_step(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    assert run_distributed(_one_rank_out_of_time, 2, tmp_path, corpus, init_group=False) == [(1, 1), (1, 1)]


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_refused_in_one_line(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [*tiny_overrides(tmp_path), f"train.max_time_s={value}"])
    assert str(e.value).startswith("train.max_time_s: must be") and "\n" not in str(e.value)
