"""The multi-process test harness itself: results, collectives, failures and hangs come back to the test."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed import RankFailed, distributed, run_distributed


def _all_reduce(rank: int, world_size: int, scale: float) -> list[float]:
    t = torch.tensor([float(rank + 1)]) * scale
    dist.all_reduce(t)
    return [t.item(), float(os.environ["RANK"]), float(dist.get_world_size())]


def _raise_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")


def _hang_on_rank_0(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(60)


def test_results_in_rank_order() -> None:
    results = run_distributed(_all_reduce, 3, 2.0)
    assert results == [[12.0, 0.0, 3.0], [12.0, 1.0, 3.0], [12.0, 2.0, 3.0]]


def test_a_rank_exception_fails_the_test_with_its_traceback() -> None:
    with pytest.raises(RankFailed, match=r"(?s)rank 1.*ValueError: boom on rank 1"):
        run_distributed(_raise_on_rank_1, 2)


def test_a_hang_times_out() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed, match="timed out after 2s"):
        run_distributed(_hang_on_rank_0, 2, timeout=2)
    # the hung rank is killed, not waited for (its sleep is 60 s)
    assert time.monotonic() - start < 30


@distributed(world_size=2)
def test_decorator_runs_body_on_every_rank(rank: int, world_size: int) -> None:
    t = torch.ones(4) * rank
    dist.all_reduce(t)
    assert t.tolist() == [1.0] * 4
    assert world_size == 2
