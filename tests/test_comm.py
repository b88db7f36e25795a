"""comm.py: the collectives' results and the bytes they count, on gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_llm.parallel import comm
from tests.distributed import run_distributed


def _collectives(rank: int, world_size: int) -> dict[str, object]:
    stats = comm.CommStats()
    group = dist.group.WORLD
    n = world_size
    x = torch.arange(4 * n, dtype=torch.float32) * (rank + 1)  # rank r holds (r+1) * [0, 1, ..., 4n-1]
    ranks_sum = n * (n + 1) / 2

    out = torch.empty(4)
    comm.reduce_scatter(out, x, group, stats)
    expected = torch.arange(4 * n, dtype=torch.float32)[4 * rank : 4 * rank + 4] * ranks_sum
    assert torch.equal(out, expected)

    pending = comm.reduce_scatter(out, x, group, stats, op=dist.ReduceOp.AVG, async_op=True)
    pending.wait()
    torch.testing.assert_close(out, expected / n)

    gathered = torch.empty(4 * n)
    comm.all_gather(gathered, torch.full((4,), float(rank)), group, stats)
    assert torch.equal(gathered, torch.arange(n, dtype=torch.float32).repeat_interleave(4))

    y = torch.ones(10)
    comm.all_reduce(y, group, stats)
    assert torch.equal(y, torch.full((10,), float(n)))
    return stats.reset()


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_and_their_bytes(world_size: int) -> None:
    n = world_size
    for counted in run_distributed(_collectives, n):
        assert counted == {
            "reduce_scatter": 2 * round((n - 1) / n * 4 * n * 4),  # two reduce-scatters of 4n fp32
            "all_gather": (n - 1) * 4 * 4,  # each rank's 4 fp32 to n-1 others
            "all_reduce": round(2 * (n - 1) / n * 10 * 4),  # ring
        }


def test_single_rank_is_a_copy() -> None:
    stats = comm.CommStats()
    out = torch.empty(3)
    comm.reduce_scatter(out, torch.tensor([1.0, 2.0, 3.0]), None, stats)
    assert out.tolist() == [1.0, 2.0, 3.0] and stats.total == 0
    assert comm.all_reduce(torch.ones(2), None, stats) is None and stats.total == 0
