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


def _peak_above(fn: object) -> int:
    """MiB the resident set's peak rose above where it stood, while `fn` ran (Linux: VmHWM reset first)."""
    import re
    from pathlib import Path

    status = lambda key: int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))  # noqa: E731
    Path("/proc/self/clear_refs").write_text("5")
    base = status("VmRSS")
    fn()  # type: ignore[operator]
    return (status("VmHWM") - base) // 1024


def _large_gather(rank: int, world_size: int) -> dict[str, object]:
    n, shard = world_size, 4 << 20  # 16 MiB of fp32 per rank
    stats = comm.CommStats()
    mine = torch.full((shard,), float(rank + 1))
    out = torch.zeros(n * shard)  # resident before the gather: what it adds is the collective's own
    # a first small gather sets up gloo's pairs and threads, whose few MiB are not the gather's own
    comm.all_gather(torch.empty(n), torch.ones(1), dist.group.WORLD, comm.CommStats())
    rose = _peak_above(lambda: comm.all_gather(out, mine, dist.group.WORLD, stats))
    right = torch.equal(out.view(n, -1), torch.arange(1, n + 1, dtype=torch.float32)[:, None].expand(n, shard))
    out.zero_()
    work = comm.all_gather(out, out.view(n, -1)[rank].fill_(rank + 1), dist.group.WORLD, stats, async_op=True)
    is_work = isinstance(work, dist.Work)  # FSDP2 waits on it only if it is one
    work.wait()
    right_async = torch.equal(out.view(n, -1), torch.arange(1, n + 1, dtype=torch.float32)[:, None].expand(n, shard))
    return {"rose": rose, "right": right, "is_work": is_work, "right_async": right_async, "bytes": stats.reset()}


@pytest.mark.skipif(not __import__("os").access("/proc/self/clear_refs", __import__("os").W_OK),
                    reason="needs Linux's resettable peak resident set")
def test_a_large_gloo_all_gather_allocates_nothing_whole() -> None:
    """Gloo's all-gather receives into a buffer of the output's size and copies it out: a 48 MiB gather (3 ranks)
    took 48 MiB more at its peak; received straight into the output it takes next to nothing, gives the same
    result, synchronously and as a Work to wait on (with an input that is the rank's own chunk, as FSDP2 and
    ZeRO hand it), and counts the same bytes."""
    for r in run_distributed(_large_gather, 3):
        assert r["right"] and r["right_async"] and r["is_work"], r
        assert r["rose"] < 4, r  # MiB, of the 48 gathered
        assert r["bytes"] == {"all_gather": 2 * 2 * (4 << 20) * 4}, r  # 2 gathers, each 2 peers x 16 MiB
