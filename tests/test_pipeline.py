"""Pipeline parallelism (GPipe and 1F1B over gloo ranks) against one process."""

from __future__ import annotations

import functools
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


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb1"])
@pytest.mark.parametrize("pp", [2, 4])
def test_matches_one_stage(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,  # noqa: F811
                           pp: int, schedule: str) -> None:
    extra = {**LAYERS, "parallel__pp": pp, "parallel__pp_schedule": schedule}
    assert_matches(run_distributed(train, pp, tmp_path, corpus, extra, init_group=False),
                   reference(tmp_path_factory, corpus, **LAYERS))


@pytest.mark.parametrize("layout", [{}, {"parallel__zero_stage": 1}, {"parallel__tp": 2},
                                    {"parallel__pp": 4, "model__n_layer": 8}], ids=["pp2", "dp2-zero1", "tp2", "pp4"])
def test_interleaved_matches_one_stage(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,  # noqa: F811
                                       corpus: Path, layout: dict[str, Any]) -> None:
    """Interleaved 1F1B, p stages x 2 chunks of one block each (at p=2 rank 0 holds blocks 0 and 2, rank 1 blocks 1
    and 3, activations going round the ring), alone on 2 processes, with dp=2 or tp=2 on 4, or p=4 on 4."""
    extra = {**LAYERS, "parallel__pp": 2, "parallel__pp_schedule": "interleaved", "parallel__pp_virtual": 2, **layout}
    pp = extra["parallel__pp"]
    world = 4 if layout else 2
    if "parallel__zero_stage" in layout:
        extra["train__micro_batch_size"] = 1  # 4 micro-batches a step on each dp rank
    results = run_distributed(train, world, tmp_path, corpus, extra, init_group=False)
    for r in results:  # the chunks: virtual stages r and r + p
        held = {int(n.split(".")[1]) for n in r["params"] if n.startswith("blocks.")}
        assert held == {r["pp_rank"], r["pp_rank"] + pp}
    model = {**LAYERS, **{k: v for k, v in layout.items() if k.startswith("model__")}}
    # tp and dp sum in other orders: the tolerances of test_3d_layout
    atol = 3e-5 if "parallel__tp" in layout or "parallel__zero_stage" in layout else 1e-7
    assert_matches(results, reference(tmp_path_factory, corpus, **model), atol=atol)


@pytest.mark.parametrize("variant", [
    {"model__tie_embeddings": False},
    {"model__n_layer": 3},  # uneven: 2 + 1 blocks
    {"parallel__pp_layers": [1, 3]},
    {"train__activation_checkpointing": "full"},
    {"train__activation_checkpointing": "full", "parallel__pp_schedule": "zb1"},  # W's branches in one recompute group
], ids=["untied", "uneven", "explicit-layers", "checkpointing", "checkpointing-zb1"])
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
    # atol 3e-6 (0.1% of one Adam step at lr 3e-3): the tied embedding's two contributions and the dp mean are
    # summed in another order than at pp=1, and Adam turns that rounding into differences of that size on
    # near-zero gradients (one element of 4096 reaches 1.5e-6 with the per-parameter-seeded initialisation)
    assert_matches(results, reference(tmp_path_factory, corpus, **LAYERS), atol=3e-6)
    assert {r["dp"] for r in results} == {["ddp-flat", "zero1", "zero2"][zero_stage]}


@pytest.mark.parametrize("layout", [{"parallel__zero_stage": 0}, {"parallel__zero_stage": 1},
                                    {"parallel__zero_stage": 2}, {"parallel__tp": 2}],
                         ids=["dp2-ddp-flat", "dp2-zero1", "dp2-zero2", "tp2"])
def test_zb1_with_data_or_tensor_parallel(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,  # noqa: F811
                                          corpus: Path, layout: dict[str, Any]) -> None:
    """ZB-H1 at pp=2 on 4 processes: W accumulates the weight gradients through AccumulateGrad, so the flat
    all-reduce buffer, ZeRO-1's fp32 accumulation and ZeRO-2's per-bucket reduce-scatter (hooks that fire as
    gradients land; its micro-step wraps W, where they land) take them as from one backward."""
    extra = {**LAYERS, "parallel__pp": 2, "parallel__pp_schedule": "zb1", "train__micro_batch_size": 1,
             "parallel__bucket_mb": 0.01, **layout}
    results = run_distributed(train, 4, tmp_path, corpus, extra, init_group=False)
    # atol 3e-6 as in test_with_data_parallel (the tied embedding's and the dp mean's sums in another order); tp's
    # sums reorder more, 3e-5 as test_3d_layout (1F1B at tp=2 x pp=2 misses 3e-6 by the same 4.1e-6 element)
    atol = 3e-5 if "parallel__tp" in layout else 3e-6
    assert_matches(results, reference(tmp_path_factory, corpus, **LAYERS), atol=atol)


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


def test_stages_hold_the_schedules_micro_batches(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """Saved-for-backward bytes on each of 2 stages over the (metered) first step, in micro-batches of that stage:
    GPipe holds all m, 1F1B p - s, ZB-H1 p = 2 on both: schedule.peak_in_flight's counts, which `dist-llm memory`
    uses. On ZB-H1's last stage the micro-batch held back for its W keeps its graph below the weight ops only: its
    B dropped the loss's part above the LM head. At m=8 the last stage held all 8 micro-batches before the meter
    stopped keeping split graphs alive (saved_tensors.py), and the loss's part of the held-back one before the
    executor dropped the root at B."""
    from dist_llm.parallel.pipeline.schedule import SCHEDULES, peak_in_flight

    held: dict[tuple[str, int], list[int]] = {}
    for schedule, m in [("gpipe", 1), ("gpipe", 4), ("1f1b", 4), ("zb1", 8)]:
        extra = {**LAYERS, "parallel__pp": 2, "parallel__pp_schedule": schedule, "train__global_batch_size": 2 * m,
                 "train__max_steps": 1}
        results = run_distributed(train, 2, tmp_path / f"{schedule}{m}", corpus, extra, init_group=False)
        held[schedule, m] = [r["activation_bytes"] for r in sorted(results, key=lambda r: r["pp_rank"])]
    one = held["gpipe", 1]  # one micro-batch of each stage (the last stage's includes the head and loss)
    assert all(b > 0 for b in one)
    # the loss above the head: log-softmax over 256 values in fp32 and an int64 target per token (micro-batch 2 x 32
    # tokens), and nll's total weight (one fp32)
    loss_part = 2 * 32 * (256 * 4 + 8) + 4
    for (schedule, m), stages in held.items():
        counts = [peak_in_flight(plan) for plan in SCHEDULES[schedule](2, m)]
        expected = [c * b for c, b in zip(counts, one, strict=True)]
        if schedule == "zb1":
            expected[1] -= (counts[1] - 1) * loss_part
        assert stages == expected, (schedule, m, stages, one)
    assert held["gpipe", 4] == [4 * b for b in one]
    assert held["1f1b", 4] == [2 * one[0], one[1]]
    assert held["zb1", 8] == [2 * one[0], 2 * one[1] - loss_part]


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


class _LateWork:
    """A recorded work handle: a receive's buffer gets its message only when the work is waited on (it arrives in a
    shadow buffer first), so a computation that read its input before waiting would read NaN."""

    def __init__(self, work: Any, into: torch.Tensor | None, shadow: torch.Tensor | None) -> None:
        self.work, self.into, self.shadow, self.waited = work, into, shadow, False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self.work.wait(*args, **kwargs)
        if self.into is not None and not self.waited:
            with torch.no_grad():  # (a buffer the executor already marked as needing its gradient)
                self.into.copy_(self.shadow)
        self.waited = True
        return out


def train_recording_p2p(rank: int, world_size: int, out_dir: Path, corpus: Path,  # noqa: F811
                        extra: dict[str, Any]) -> dict[str, Any]:
    """train() with every `batch_isend_irecv` recorded, in order: [(is_send, peer, shape, dtype), ...] per call, how
    many works of earlier calls were not yet waited on when each call was made, and at the end how many never
    were. Every received buffer holds NaN until its work is waited on (gloo: one work per operation)."""
    import torch.distributed as dist

    real = dist.batch_isend_irecv
    calls: list[list[tuple[bool, int, tuple[int, ...], torch.dtype]]] = []
    works: list[_LateWork] = []
    unwaited: list[int] = []

    def late(ops: list[dist.P2POp]) -> list[_LateWork]:
        unwaited.append(sum(not w.waited for w in works))
        calls.append([(op.op is dist.isend, op.peer, tuple(op.tensor.shape), op.tensor.dtype) for op in ops])
        shadows = [None if op.op is dist.isend else torch.empty_like(op.tensor) for op in ops]
        for op in ops:
            if op.op is dist.irecv:
                op.tensor.fill_(float("nan"))
        got = real([op if sh is None else dist.P2POp(dist.irecv, sh, op.peer, op.group)  # (the same group)
                    for op, sh in zip(ops, shadows)])
        assert len(got) == len(ops), "gloo: one work per operation"
        new = [_LateWork(w, None if sh is None else op.tensor, sh) for w, op, sh in zip(got, ops, shadows)]
        works.extend(new)
        return new

    dist.batch_isend_irecv = late
    try:
        out = train(rank, world_size, out_dir, corpus, extra)
    finally:
        dist.batch_isend_irecv = real
    return {**out, "calls": calls, "unwaited": unwaited, "never_waited": sum(not w.waited for w in works),
            "rank": rank}


def train_recording_p2p_groups(rank: int, world_size: int, out_dir: Path, corpus: Path,  # noqa: F811
                               extra: dict[str, Any]) -> dict[str, Any]:
    """train() with the global ranks of the group each posted point-to-point operation goes over, its peer, and
    the ranks of this rank's pipeline group."""
    import torch.distributed as dist

    from dist_llm.parallel.context import ParallelContext

    real_post, real_from = dist.batch_isend_irecv, ParallelContext.from_config
    ops_seen: list[tuple[tuple[int, ...], int]] = []
    pp_ranks: list[int] = []

    def post(ops: list[dist.P2POp]) -> list[Any]:
        ops_seen.extend((tuple(dist.get_process_group_ranks(op.group)), op.peer) for op in ops)
        return real_post(ops)

    def from_config(*args: Any, **kwargs: Any) -> ParallelContext:
        ctx = real_from(*args, **kwargs)
        pp_ranks.extend(dist.get_process_group_ranks(ctx.pp_group))
        return ctx

    dist.batch_isend_irecv, ParallelContext.from_config = post, from_config  # type: ignore[method-assign]
    try:
        out = train(rank, world_size, out_dir, corpus, extra)
    finally:
        dist.batch_isend_irecv, ParallelContext.from_config = real_post, real_from  # type: ignore[method-assign]
    return {**out, "ops": ops_seen, "pp_ranks": pp_ranks, "rank": rank}


def test_exchanges_go_over_the_pipeline_group(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,  # noqa: F811
                                              corpus: Path) -> None:
    """dp=2 x pp=2 on 4 processes: every send and receive of the executor is posted on the rank's pipeline group
    (its own communicator, not the world's), its peer a global rank of that group: on the second pipeline group,
    ranks 2 and 3, group and global ranks differ. The run equals one process."""
    extra = {**LAYERS, "parallel__pp": 2, "train__micro_batch_size": 1}
    results = run_distributed(train_recording_p2p_groups, 4, tmp_path, corpus, extra, init_group=False)
    assert sorted(tuple(r["pp_ranks"]) for r in results) == [(0, 1), (0, 1), (2, 3), (2, 3)]
    for r in results:
        pair = tuple(r["pp_ranks"])
        peer = next(x for x in pair if x != r["rank"])
        # each step: 4 micro-batches' activations and their gradients, each sent by one stage, received by the other
        assert r["ops"] == [(pair, peer)] * (STEPS * 8), r["ops"][:2]
    assert_matches(results, reference(tmp_path_factory, corpus, **LAYERS), atol=3e-6)  # (as test_with_data_parallel)


def crossed_waits(a: list[list[tuple]], b: list[list[tuple]], rank_a: int, rank_b: int) -> list[tuple[int, int]]:
    """Message pairs that deadlock two ranks whose p2p behaves as NCCL's (a send completes only once its receive is
    posted; a rank's batches run one after another; messages between two ranks pair in the order posted): a message
    X from a to b and Y from b to a where a posts X's send before Y's receive and b posts Y's send before X's
    receive. Returns (batch of X's send on a, batch of Y's send on b) for each."""
    def batches(calls: list[list[tuple]], send: bool, peer: int) -> list[int]:
        return [i for i, c in enumerate(calls) for op in c if op[0] == send and op[1] == peer]

    a_sends, b_recvs = batches(a, True, rank_b), batches(b, False, rank_a)  # message k: a's k-th send, b's k-th receive
    b_sends, a_recvs = batches(b, True, rank_a), batches(a, False, rank_b)
    assert len(a_sends) == len(b_recvs) and len(b_sends) == len(a_recvs), "unmatched sends and receives"
    return [(ia, jb) for ia, ib in zip(a_sends, b_recvs) for jb, ja in zip(b_sends, a_recvs) if ia < ja and jb < ib]


@pytest.mark.parametrize(("schedule", "precision"), [("1f1b", "bf16"), ("gpipe", "fp32")])
def test_each_exchange_is_one_batch_that_nccl_completes(tmp_path: Path, corpus: Path,  # noqa: F811
                                                        schedule: str, precision: str) -> None:
    """The executor's calls without overlap, two steps and an evaluation on 2 stages with 4 micro-batches: the two ranks' batches
    never wait on each other in a circle, every batch is waited on before the next, and what travels is the
    compute dtype in the shape the receiver posted (micro batch 2 x block 32 x width 32)."""
    extra = {**LAYERS, "parallel__pp": 2, "parallel__pp_schedule": schedule, "train__precision": precision,
             "train__max_steps": 2, "train__eval_interval": 2, "parallel__pp_overlap_p2p": False}
    first, last = run_distributed(train_recording_p2p, 2, tmp_path, corpus, extra, init_group=False)
    assert crossed_waits(first["calls"], last["calls"], 0, 1) == []
    for r in (first, last):
        assert r["unwaited"] == [0] * len(r["calls"])
        ops = [op for c in r["calls"] for op in c]
        # each rank, each step: 4 activations and 4 gradients (sent by one rank, received by the other); the
        # evaluation's 2 batches of 4 micro-batches: activations only
        assert len(ops) == 2 * 8 + 2 * 4
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
        assert {(op[2], op[3]) for op in ops} == {((2, 32, 32), dtype)}
    if schedule == "1f1b":  # the steady state's send-forward-receive-backward is one call: 3 of them a step
        assert sum(len(c) == 2 for c in first["calls"]) == 2 * 3


def test_interleaved_exchanges_round_the_ring_without_a_circular_wait(tmp_path: Path,
                                                                      corpus: Path) -> None:  # noqa: F811
    """Interleaved without overlap on 2 ranks x 2 chunks, a step and an evaluation: rank 0 and rank 1 are each other's previous and
    next stage, so activations and gradients of both directions share one pair of ranks, and every batch is
    waited on. 4 micro-batches through 4 virtual stages: 3 hops each way a step, 3 forward hops in evaluation."""
    extra = {**LAYERS, "parallel__pp": 2, "parallel__pp_schedule": "interleaved", "parallel__pp_virtual": 2,
             "train__max_steps": 2, "train__eval_interval": 2, "parallel__pp_overlap_p2p": False}
    first, last = run_distributed(train_recording_p2p, 2, tmp_path, corpus, extra, init_group=False)
    assert crossed_waits(first["calls"], last["calls"], 0, 1) == []
    for r, eval_sends in ((first, 8), (last, 4)):
        assert r["unwaited"] == [0] * len(r["calls"])
        sends = [op for c in r["calls"] for op in c if op[0]]
        # a step: 4 micro-batches x 3 hops x 2 directions, 12 sent by each rank (rank 0 forwards from virtual
        # stages 0 and 2, rank 1 from 1; the backwards the reverse); each of evaluation's 2 batches: forwards only
        assert len(sends) == 2 * 12 + 2 * eval_sends


@pytest.mark.parametrize(("schedule", "layout"), [
    ("interleaved", {}), ("interleaved", {"parallel__tp": 2}), ("interleaved", {"parallel__pp": 4, "model__n_layer": 8}),
    ("zb1", {"parallel__zero_stage": 1, "train__micro_batch_size": 1}), ("1f1b", {"parallel__pp_overlap_p2p": True}),
    ("zb1", {"parallel__pp": 4, "train__micro_batch_size": 1}),
    ("interleaved", {"parallel__pp_overlap_p2p": False}), ("zb1", {"parallel__pp_overlap_p2p": False}),
], ids=["interleaved-pp2", "interleaved-tp2", "interleaved-pp4", "zb1-dp2-zero1", "1f1b-overlap", "zb1-pp4-m8",
        "interleaved-waited", "zb1-waited"])
def test_exchanges_match_one_stage_with_and_without_overlap(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                            corpus: Path, schedule: str,  # noqa: F811
                                                            layout: dict[str, Any]) -> None:
    """parallel.pp_overlap_p2p (the default for interleaved and zb1): exchanges posted and waited for only where a
    computation needs what they receive, or with it false each as it is posted. Every received buffer holds NaN
    until its work is waited on, so a computation that used its input before the wait would spoil the losses;
    they, the validation losses (evaluation's forward-only plans) and the parameters equal one process's
    (tolerances of the layouts without overlap). ZB-H1 at pp=4 with 8 micro-batches runs its middle stages' steady
    state (W between the exchange and the next forward). With overlap interleaved's steady state posts calls while
    earlier ones are out, but never more than two exchanges' worth (a wait completes the earlier calls too, as NCCL's stream does, and a
    call that only sends is waited for before the next is posted, so no send's tensors are held to the step's end:
    evaluation's first stage at pp=4 with 8 micro-batches would hold 7); without it none; every work is waited on
    by the step's end."""
    overlap = layout.get("parallel__pp_overlap_p2p", schedule != "1f1b")
    extra = {**LAYERS, "parallel__pp": 2, "parallel__pp_schedule": schedule, "train__eval_interval": 4,
             **({"parallel__pp_virtual": 2} if schedule == "interleaved" else {}), **layout}
    world = 4 if layout.get("parallel__tp") or layout.get("parallel__zero_stage") else extra["parallel__pp"]
    results = run_distributed(train_recording_p2p, world, tmp_path, corpus, extra, init_group=False)
    assert [r["never_waited"] for r in results] == [0] * world
    model = {**LAYERS, **{k: v for k, v in layout.items() if k.startswith(("model__", "train__"))},
             "train__eval_interval": 4}
    ref = reference(tmp_path_factory, corpus, **model)
    atol = 3e-5 if "parallel__tp" in layout or "parallel__zero_stage" in layout else 1e-7
    assert_matches(results, ref, atol=atol)
    assert len(ref["val_losses"]) == 2
    assert results[0]["val_losses"] == pytest.approx(ref["val_losses"], rel=1e-5)
    most = max(max(r["unwaited"]) for r in results)
    if not overlap:
        assert most == 0
    elif schedule == "interleaved" and extra["parallel__pp"] == 2:  # (m=4 > p: a steady state, where it overlaps)
        assert 0 < most <= 4
    else:  # the others' computations each need the call just posted, or it only sent: nothing left out
        assert most == 0


def test_overlapped_exchanges_never_wait_in_a_circle(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """Interleaved with pp_overlap_p2p on 2 ranks x 2 chunks: calls are posted while earlier ones are still
    outstanding, which NCCL runs one after another in the communicator's stream, so the two ranks' calls, in the
    order posted, must not wait on each other in a circle (crossed_waits, the check of the schedules without
    overlap); each rank sends 12 messages in the step, every work is waited on by its end."""
    extra = {**LAYERS, "parallel__pp": 2, "parallel__pp_schedule": "interleaved", "parallel__pp_virtual": 2,
             "parallel__pp_overlap_p2p": True, "train__max_steps": 1}
    first, last = run_distributed(train_recording_p2p, 2, tmp_path, corpus, extra, init_group=False)
    assert crossed_waits(first["calls"], last["calls"], 0, 1) == []
    for r in (first, last):
        assert sum(op[0] for c in r["calls"] for op in c) == 12
        assert max(r["unwaited"]) > 0 and r["never_waited"] == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["waited", "overlap"])
def test_a_middle_stage_exchanges_with_both_neighbours_without_a_circular_wait(tmp_path: Path, corpus: Path,  # noqa: F811
                                                                               overlap: bool) -> None:
    """3 stages of 1F1B: the middle one exchanges with the stage before and the one after. In a chain of stages a
    circular wait must include two neighbours waiting on each other, so the check is pairwise, per neighbour pair.
    With overlap the executor takes its other path (waits where a receive is used), which the same checks cover."""
    extra = {**LAYERS, "model__n_layer": 3, "parallel__pp": 3, "parallel__pp_schedule": "1f1b", "train__max_steps": 1,
             "parallel__pp_overlap_p2p": overlap}
    results = run_distributed(train_recording_p2p, 3, tmp_path, corpus, extra, init_group=False)
    calls = {r["rank"]: r["calls"] for r in results}
    assert crossed_waits(calls[0], calls[1], 0, 1) == [] and crossed_waits(calls[1], calls[2], 1, 2) == []
    # with overlap too no call is out when the next is posted: each of 1F1B's computations needs the call just
    # posted, and a call that only sends is waited for before the next
    assert all(r["unwaited"] == [0] * len(r["calls"]) and r["never_waited"] == 0 for r in results)
    # the middle stage's 4 activations and 4 gradients each way: 16 ops, each batch with one neighbour only
    middle = calls[1]
    assert sum(len(c) for c in middle) == 16 and all(len({op[1] for op in c}) == 1 for c in middle)


class _Embed(torch.nn.Module):
    """A first stage's stand-in: the 'embedding' turns (B, T) ids into (B, T, 4) floats."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return ids.float()[..., None] * self.w  # (B, T, 4)


class _FakeP2P:
    """The p2p layer's interface, recording what would be posted instead of posting it."""

    prev, next = None, 1

    def __init__(self) -> None:
        self.posted: list[list[tuple[bool, torch.Tensor, int]]] = []

    def post(self, ops: list[tuple[bool, torch.Tensor, int]]) -> list[Any]:
        self.posted.append(ops)
        return []  # (no works to wait for)


@pytest.mark.parametrize("act_shape", [(2, 3, 4), (2, 6, 4)])
def test_a_send_is_posted_in_the_compute_dtype_and_checked_against_the_receivers_shape(act_shape: tuple) -> None:
    """A first stage's forward and send, with a fake p2p layer: the output goes out as bf16; one of another shape
    than the receiver posts (which on NCCL would hang or corrupt) is refused with one line before anything is posted."""
    import contextlib

    from dist_llm.parallel.pipeline.executor import StageModel, run_schedule
    from dist_llm.parallel.pipeline.schedule import Action, Exchange

    p2p, ids = _FakeP2P(), torch.arange(6).reshape(2, 3)
    run = functools.partial(
        run_schedule, [Action("F", 0), Exchange((Action("SEND_F", 0),))], StageModel(_Embed(), range(0), True, False),
        p2p, batches=[(ids, ids)], act_shape=act_shape, act_dtype=torch.bfloat16, loss_fn=lambda loss: loss,
        backward=lambda t: None, micro_step=lambda last: contextlib.nullcontext(),
        autocast=contextlib.nullcontext, device=torch.device("cpu"), train=False)
    if act_shape != (2, 3, 4):
        with pytest.raises(RuntimeError, match=r"^pipeline SEND_F 0: the tensor to send is \(2, 3, 4\), the neighbour "
                                               r"stage expects \(2, 6, 4\) \(train.micro_batch_size x "):
            run()
        assert p2p.posted == []
        return
    run()
    [[(is_send, t, peer)]] = p2p.posted
    assert is_send and peer == 1 and t.dtype == torch.bfloat16
    assert torch.equal(t, ids.to(torch.bfloat16)[..., None].expand(2, 3, 4))  # small integers: exact in bf16
