"""Ring attention (context parallelism's core) on gloo ranks against SDPA on the whole sequence, its ring bytes,
and the zigzag layout's arithmetic and load balance (process-free)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_llm.model.positions import alibi_bias, alibi_slopes
from dist_llm.parallel import comm
from dist_llm.parallel.context_parallel import ring as ring_module
from dist_llm.parallel.context_parallel import (block_plan, local_positions, merge_sequence, ring_attention,
                                                split_sequence, unmasked_entries)
from tests.distributed import run_distributed

B, H, D, T = 2, 4, 8, 64  # T = 64 tokens: 16 per rank at cp 4, zigzag chunks of 8
# (causal, layout, kv heads, alibi, dtype): MHA, GQA, MQA under both layouts, with and without ALiBi; non-causal; bf16
F32, BF16 = torch.float32, torch.bfloat16
CASES = [(True, layout, kv, alibi, F32) for layout, kv, alibi in itertools.product(("contiguous", "zigzag"), (4, 2, 1),
                                                                                     (False, True))]
CASES += [(False, "zigzag", 2, False, F32), (False, "contiguous", 4, False, F32), (True, "zigzag", 2, True, BF16)]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
               slopes: torch.Tensor | None) -> torch.Tensor:
    """The model's own attention call (gpt.Attention.core) on the whole sequence."""
    gqa = k.shape[1] != q.shape[1]
    if slopes is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=alibi_bias(slopes, q.shape[2], q.dtype),
                                              enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


def _compare(group: dist.ProcessGroup | None, cp: int, rank: int, causal: bool, layout: str, kv_heads: int,
             alibi: bool, dtype: torch.dtype = F32, query_rows: int = ring_module.QUERY_ROWS) -> dict[str, int]:
    """Ring attention on this rank's part vs the whole-sequence reference's part (fp32, on the same values);
    returns the ring bytes of the forward and of the backward."""
    case = f"rank {rank} cp {cp} causal={causal} {layout} kv_heads={kv_heads} alibi={alibi} {dtype} rows={query_rows}"
    gen = torch.Generator().manual_seed(1234 + kv_heads)  # every rank draws the same whole sequence
    # (rounded to `dtype` and back, so that the fp32 reference sees the values the ring sees)
    q, dout = (torch.randn(B, H, T, D, generator=gen).to(dtype).float() for _ in range(2))
    k, v = (torch.randn(B, kv_heads, T, D, generator=gen).to(dtype).float() for _ in range(2))
    slopes = alibi_slopes(H) if alibi else None
    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = _reference(*whole, causal, slopes)
    ref_grads = torch.autograd.grad(ref, whole, dout)

    part = lambda x: split_sequence(x, rank, cp, layout, dim=2)  # noqa: E731
    local = [part(x).to(dtype).requires_grad_() for x in (q, k, v)]
    stats = comm.CommStats()
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        out = ring_attention(*local, group=group, stats=stats, causal=causal, layout=layout, alibi_slopes=slopes,
                             query_rows=query_rows)
    forward_bytes = stats.reset().get("ring", 0)
    grads = torch.autograd.grad(out, local, part(dout).to(dtype))
    backward_bytes = stats.reset().get("ring", 0)

    # what backward keeps is this rank's slice only: q, k, v, the output and the fp32 lse (B, nh, T_local)
    assert sum(saved) == sum(x.numel() * x.element_size() for x in (*local, out)) + B * H * (T // cp) * 4, case
    # fp32: the ring sums the softmax in blocks merged by log-sum-exp, SDPA in one pass; the orders of summation
    # differ by a few ulps of values O(1), so 1e-5 is tight and still far below any real error (a missed or doubled
    # block moves outputs by ~1e-1). bf16: the ring computes in fp32 and rounds its results once (2^-8 relative).
    tol = 1e-5 if dtype == F32 else 1e-2
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads), case
    torch.testing.assert_close(out.float(), part(ref), rtol=tol, atol=tol, msg=lambda m: f"{case}: output: {m}")
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g.float(), part(r), rtol=tol, atol=tol, msg=lambda m: f"{case}: d{name}: {m}")
    return {"forward": forward_bytes, "backward": backward_bytes}


def _events(cp: int, rank: int) -> list[str]:
    """The order in which one forward and backward post ring transfers, compute blocks and wait."""
    events: list[str] = []
    real_shift, real_scores = comm.ring_shift, ring_module._Ring.scores

    class Logged:
        def __init__(self, work: dist.Work) -> None:
            self.work = work

        def wait(self) -> None:
            self.work.wait()
            events.append("wait")

    def shift(*args: object, **kwargs: object) -> Logged:
        events.append("post")
        return Logged(real_shift(*args, **kwargs))

    def scores(*args: object) -> torch.Tensor:
        events.append("compute")
        return real_scores(*args)

    comm.ring_shift, ring_module._Ring.scores = shift, scores
    try:
        q = split_sequence(torch.randn(1, 2, T, D), rank, cp, "zigzag", dim=2).requires_grad_()
        ring_attention(q, q, q, group=dist.group.WORLD, stats=None).sum().backward()
    finally:
        comm.ring_shift, ring_module._Ring.scores = real_shift, real_scores
    return events


def _ring_cases(rank: int, world_size: int) -> tuple[list[dict[str, int]], list[str]]:
    return [_compare(dist.group.WORLD, world_size, rank, *case) for case in CASES], _events(world_size, rank)


def _kv_block_bytes(cp: int, kv_heads: int, dtype: torch.dtype = F32) -> int:
    return B * kv_heads * (T // cp) * D * dtype.itemsize  # one rank's k (or v) block


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_equals_sdpa_and_counts_its_bytes(cp: int) -> None:
    # each transfer is posted before the block it overlaps is computed, and waited for after; the last step of
    # forward has nothing left to receive; backward's last hop takes the gradient accumulators home
    overlapped = ["post", "compute", "wait"]
    forward_events = overlapped * (cp - 1) + ["compute"]
    backward_events = overlapped * (cp - 1) + (overlapped if cp > 2 else ["compute"]) + ["post", "wait"]
    for rank_bytes, events in run_distributed(_ring_cases, cp):
        assert events == forward_events + backward_events
        for (causal, layout, kv_heads, alibi, dtype), got in zip(CASES, rank_bytes):
            # every block passes every rank, masked or not: 2 (k and v) x (cp - 1) sends forward; backward sends
            # the blocks again and their gradient accumulators (fp32) as many times
            forward = 2 * (cp - 1) * _kv_block_bytes(cp, kv_heads, dtype)
            accumulators = 2 * (cp - 1) * _kv_block_bytes(cp, kv_heads, F32)
            assert got == {"forward": forward, "backward": forward + accumulators}, (causal, layout, kv_heads, dtype)


def _strided_groups(rank: int, world_size: int) -> dict[str, int]:
    """cp = 2 rings over ranks {0, 2} and {1, 3}: group ranks differ from global ranks, as under dp x cp."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]
    return _compare(group, 2, dist.get_rank(group), True, "zigzag", 2, True)


def test_ring_over_a_subgroup_addresses_its_global_peers() -> None:
    forward = 2 * _kv_block_bytes(2, 2)
    assert run_distributed(_strided_groups, 4) == [{"forward": forward, "backward": 2 * forward}] * 4


def _tiled(rank: int, world_size: int) -> list[dict[str, int]]:
    return [_compare(dist.group.WORLD, world_size, rank, causal, "zigzag", 2, alibi, query_rows=rows)
            for rows in (1, 5) for causal, alibi in ((True, True), (True, False), (False, False))]


def test_query_tiles_leave_outputs_and_grads_unchanged() -> None:
    """Blocks computed a few queries at a time (tiles of 1 and 5 rows over 32 per rank: the last tile short, the
    masked diagonal cut across tiles) equal SDPA too, with the same ring bytes."""
    forward = 2 * _kv_block_bytes(2, 2)
    for rank_bytes in run_distributed(_tiled, 2):
        assert rank_bytes == [{"forward": forward, "backward": 2 * forward}] * 6


def test_one_rank_is_plain_attention_and_sends_nothing() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 32, 8, generator=gen, requires_grad=True) for _ in range(3))
    stats = comm.CommStats()
    out = ring_attention(q, k, v, group=None, stats=stats, layout="zigzag")
    torch.testing.assert_close(out, _reference(q, k, v, True, None), rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert stats.total == 0


def test_autocast_around_the_core_keeps_it_fp32() -> None:
    """A trainer runs attention inside bf16 autocast; the core's scores, softmax and sums stay fp32 there (its
    backward recomputes the scores in fp32 against the forward's log-sum-exp: both must be the same arithmetic).
    fp32 inputs under autocast therefore give the fp32 result (1e-5: summation order against SDPA); before, the
    scores were rounded to bf16 (errors ~1e-1 at these magnitudes, dq off by more)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (3 * torch.randn(1, 4, 128, 16, generator=gen) for _ in range(3))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _reference(*ref, True, None)
    want.backward(torch.ones_like(want))
    got_in = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ring_attention(*got_in, group=None, stats=None, layout="zigzag")
        got.backward(torch.ones_like(got))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_in, ref):  # gradients reach ~30 here; the fp32 ring differs from SDPA by up to 6e-5 (2e-6
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-4)  # relative) without autocast too


# -- layout arithmetic (no processes) ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_split_and_merge_are_inverse_and_match_positions(layout: str, cp: int) -> None:
    x = torch.arange(2 * 24).view(2, 24)  # (B, T)
    parts = [split_sequence(x, r, cp, layout) for r in range(cp)]
    assert torch.equal(merge_sequence(parts, layout), x)
    for r, p in enumerate(parts):
        assert p[0].tolist() == local_positions(r, cp, 24 // cp, layout)


def test_zigzag_places_chunks_r_and_2cp_minus_1_minus_r() -> None:
    assert local_positions(1, 4, 4, "zigzag") == [2, 3, 12, 13]  # chunks 1 and 6 of 8 chunks of 2
    assert [b.src for b in block_plan(1, 4, 4, "zigzag", causal=True)] == [1, 0, 3, 2]  # nothing skipped
    assert [b.src for b in block_plan(1, 4, 4, "contiguous", causal=True)] == [1, 0]  # later ranks' keys skipped


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_balances_causal_attention_work(cp: int) -> None:
    t_local = 4096 // cp
    work = {layout: [unmasked_entries(r, cp, t_local, layout, causal=True) for r in range(cp)]
            for layout in ("zigzag", "contiguous")}
    computed = [sum(b.entries(t_local) for b in block_plan(r, cp, t_local, "zigzag", True)) for r in range(cp)]
    # every query-key pair of the causal triangle is attended exactly once, by the rank holding the query
    assert sum(work["zigzag"]) == sum(work["contiguous"]) == 4096 * 4097 // 2
    ratio = {layout: max(w) / min(w) for layout, w in work.items()}
    print(f"cp={cp}: attended pairs max/min over ranks: zigzag {ratio['zigzag']:.4f}, contiguous "
          f"{ratio['contiguous']:.2f}; zigzag score entries computed max/min {max(computed) / min(computed):.4f}")
    assert ratio["zigzag"] <= 1.05 and max(computed) / min(computed) <= 1.05
    assert ratio["contiguous"] > 2  # what zigzag is for: ~2cp-1 on a contiguous split


# -- bad input ---------------------------------------------------------------------------------------------------
def test_bad_inputs_are_one_clear_line() -> None:
    q = torch.zeros(1, 4, 6, 8)
    with pytest.raises(ValueError, match="layout 'stripes' is not one of contiguous, zigzag"):
        ring_attention(q, q, q, group=None, stats=None, layout="stripes")
    with pytest.raises(ValueError, match=r"k/v \(1, 3, 6, 8\) do not fit q \(1, 4, 6, 8\)"):
        ring_attention(q, q[:, :3], q[:, :3], group=None, stats=None)
    with pytest.raises(ValueError, match=r"alibi_slopes of shape \(2,\), expected \(4,\)"):
        ring_attention(q, q, q, group=None, stats=None, alibi_slopes=torch.ones(2))
    with pytest.raises(ValueError, match="ALiBi is defined here for causal attention only"):
        ring_attention(q, q, q, group=None, stats=None, causal=False, alibi_slopes=torch.ones(4))
    with pytest.raises(ValueError, match="zigzag layout needs an even number of tokens per rank, got 3"):
        split_sequence(torch.zeros(1, 6), 0, 2, "zigzag")
    with pytest.raises(ValueError, match="sequence length 7 is not a multiple of the context parallel degree 2"):
        split_sequence(torch.zeros(1, 7), 0, 2, "contiguous")
