"""Checkpoints as chunks with global offsets: the layout arithmetic (no processes), that no rank gathers
anything to save and hands DCP exactly its own bytes, and a save at one layout resumed at another."""

from __future__ import annotations

import itertools
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_llm.parallel.shards import ChunkedTensor, chunk_bytes, narrow, range_rectangles, rewrap, unwrap_for_staging
from dist_llm.parallel.tensor.checkpoint import row_runs
from tests.distributed import run_distributed
from tests.test_data_parallel import corpus, reference, train  # noqa: F401


# -- range -> rectangles, against the elements one by one -------------------------------------------------------
def _covered(shape: tuple[int, ...], rects: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[int]:
    """Flat indices the rectangles cover, in the order they list them (each rectangle row-major)."""
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    out = []
    for offsets, sizes in rects:
        for idx in itertools.product(*(range(o, o + n) for o, n in zip(offsets, sizes))):
            out.append(sum(i * s for i, s in zip(idx, strides)))
    return out


@pytest.mark.parametrize("shape", [(7,), (3, 5), (4, 1), (1, 6), (2, 3, 4), (3, 2, 1, 2)])
def test_range_rectangles_cover_exactly_the_range_in_order(shape: tuple[int, ...]) -> None:
    n = math.prod(shape)
    for lo in range(n + 1):
        for hi in range(lo, n + 1):
            rects = range_rectangles(shape, lo, hi)
            assert _covered(shape, rects) == list(range(lo, hi)), (shape, lo, hi)
            assert len(rects) <= 2 * len(shape) - 1  # a partial first and last part per dimension, full rows between
            t = torch.arange(n).reshape(shape)
            flat = torch.cat([narrow(t, r).reshape(-1) for r in rects]) if rects else torch.empty(0, dtype=t.dtype)
            assert flat.tolist() == list(range(lo, hi))


def test_range_rectangles_of_a_scalar() -> None:
    assert range_rectangles((), 0, 1) == [((), ())]
    assert range_rectangles((), 0, 0) == []


def test_row_runs_follow_consecutive_rows_and_cut_at_shared_rows() -> None:
    # the fused QKV rows of rank 1 of 2 with 4 query heads of 2 rows and 1 KV head: q rows 4-7, then k 8-9, v 10-11
    rows = [4, 5, 6, 7, 8, 9, 10, 11]
    assert row_runs(rows) == [(0, 8, 4)]
    assert row_runs(rows, (4, 8)) == [(0, 4, 4), (4, 8, 8)]  # the shared KV rows a run of their own
    assert row_runs([0, 1, 8, 9, 12, 13]) == [(0, 2, 0), (2, 4, 8), (4, 6, 12)]


def test_chunked_tensor_reports_its_chunks_and_stages_as_plain_tensors() -> None:
    storage = torch.arange(10.0)
    t = ChunkedTensor((4, 5), [((1, 0), storage[:5].view(1, 5)), ((3, 2), storage[5:8].view(1, 3))],
                      dtype=torch.float32, device=torch.device("cpu"))
    assert [tuple(c.offsets) for c in t.__create_chunk_list__()] == [(1, 0), (3, 2)]
    assert chunk_bytes({"a": t}) == 8 * 4
    with pytest.raises(ValueError, match="does not fit"):
        ChunkedTensor((4, 5), [((3, 3), storage[:5].view(1, 5))], dtype=torch.float32, device=torch.device("cpu"))
    plain, layout = unwrap_for_staging({"m": {"a": t}})
    assert all(type(v) is torch.Tensor for v in plain["m"]["a"])
    back = rewrap({"m": {"a": [v.clone() for v in plain["m"]["a"]]}}, layout)["m"]["a"]
    assert isinstance(back, ChunkedTensor) and back.shape == t.shape
    assert [o for o, _ in back.chunks] == [(1, 0), (3, 2)]


# -- no gather: each rank hands DCP only its own bytes -----------------------------------------------------------
def handed_bytes(rank: int, world_size: int, out_dir: Path, corpus: Path,  # noqa: F811
                 extra: dict[str, Any]) -> dict[str, Any]:
    """Build a trainer, take one step, then save, counting the collectives of our own code during the save and
    the bytes this rank hands DCP; with the shares computed from the parameters' shapes."""
    from dist_llm.config import load_config
    from dist_llm.parallel import comm
    from dist_llm.parallel.context import ParallelContext
    from dist_llm.parallel.tensor import checkpoint as tp_checkpoint, mappings
    from dist_llm.train.trainer import Trainer
    from tests.conftest import tiny_overrides

    cfg = load_config(None, tiny_overrides(out_dir, **{"data__source": str(corpus), "train__max_steps": 1,
                                                       "train__eval_interval": 0, "model__bias": False, **extra}))
    ctx = ParallelContext.from_config(cfg)
    try:
        trainer = Trainer(cfg, ctx)
        trainer.fit()
        calls: list[str] = []
        originals = {(comm, "all_gather"): comm.all_gather, (comm, "all_reduce"): comm.all_reduce,
                     (mappings, "all_gather_dim"): mappings.all_gather_dim,
                     (tp_checkpoint, "all_gather_dim"): tp_checkpoint.all_gather_dim}
        for (module, name), fn in originals.items():
            setattr(module, name, lambda *a, _n=name, _f=fn, **k: (calls.append(_n), _f(*a, **k))[1])
        try:
            state = trainer._chunked(trainer._saved_part(trainer.dp.checkpoint_state()))
            handed = chunk_bytes(state)
            trainer.save_checkpoint()
        finally:
            for (module, name), fn in originals.items():
                setattr(module, name, fn)
        module = trainer.module
        params = dict(module.named_parameters(remove_duplicate=False))  # (the tied head is a key of its own)
        out: dict[str, Any] = {"calls": calls, "handed": handed, "names": len(params),
                               "optim_names": len(dict(module.named_parameters()))}
        if cfg.parallel.zero_stage in (1, 2):  # the elements of each parameter in this rank's ZeRO shard
            own = {id(p): 0 for p in params.values()}
            for seg in trainer.dp.segments:
                own[id(seg.entry.param)] += seg.hi - seg.lo
            out["own_model"] = sum(own[id(p)] for p in params.values())
            out["own_optim"] = sum(own[id(p)] for p in dict(module.named_parameters()).values())
        else:
            out["local_model"] = sum(p.numel() for p in params.values())
            out["local_optim"] = sum(p.numel() for p in dict(module.named_parameters()).values())
        out["n_params"] = trainer.n_params
        return out
    finally:
        ctx.destroy()


def test_tensor_parallel_save_hands_dcp_only_its_slices(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """tp=2 (one KV head, so its rows are held by both ranks): no collective of ours during the save; each rank
    hands DCP its slices' weights (4 bytes), both moments (8) and a 4-byte step per parameter, no more."""
    results = run_distributed(handed_bytes, 2, tmp_path, corpus, {"parallel__tp": 2, "model__n_kv_head": 1},
                              init_group=False)
    for r in results:
        assert r["calls"] == []
        assert r["handed"] == 4 * r["local_model"] + 8 * r["local_optim"] + 4 * r["optim_names"]
        assert r["local_optim"] < r["n_params"]  # a slice: the embedding, the blocks' matrices are halved


def test_zero2_save_hands_dcp_only_its_shard(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """ZeRO-2 at dp=2: no collective during the save; each rank hands DCP 12 bytes (fp32 master and both
    moments) for each element of its shard, and the shards of the two ranks are the whole model once."""
    results = run_distributed(handed_bytes, 2, tmp_path, corpus,
                              {"parallel__zero_stage": 2, "parallel__bucket_mb": 0.01}, init_group=False)
    for r in results:
        assert r["calls"] == []
        assert r["handed"] == 4 * r["own_model"] + 8 * r["own_optim"] + 4 * r["optim_names"]
    assert sum(r["own_optim"] for r in results) == results[0]["n_params"]


# -- a save at one layout resumed at another ------------------------------------------------------------------
LAYERS = {"model__n_layer": 4, "train__micro_batch_size": 2}


def test_zero1_at_dp4_resumes_at_tp2_pp2(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                         corpus: Path) -> None:  # noqa: F811
    """Saved by ZeRO-1 at dp=4 (each rank a quarter of the masters and moments, cut mid-row), resumed at
    tp=2 x pp=2: the next losses are the uninterrupted run's."""
    first = tmp_path / "first"
    run_distributed(train, 4, first, corpus, {**LAYERS, "parallel__zero_stage": 1, "train__stop_after_step": 4,
                                              "train__ckpt_interval": 4, "parallel__bucket_mb": 0.01},
                    init_group=False)
    ref = reference(tmp_path_factory, corpus, **LAYERS)
    out = tmp_path / "tp2pp2"
    shutil.copytree(first, out)
    got = run_distributed(train, 4, out, corpus, {**LAYERS, "parallel__tp": 2, "parallel__pp": 2},
                          init_group=False)[0]
    assert len(got["losses"]) == len(ref["losses"])
    for a, b in zip(got["losses"][4:], ref["losses"][4:], strict=True):
        assert a == pytest.approx(b, rel=1e-5)


RESUMED_ALONE = {
    # tp=2 x dp=2 ZeRO-1 with one KV head: its rows are held alike by both tp ranks and written once
    "gqa-tp2-zero1": ({"model__n_kv_head": 1, "train__micro_batch_size": 4},
                      {"parallel__tp": 2, "parallel__zero_stage": 1}),
    # ZeRO-3 (FSDP2) over dp=2 of tp=2 slices: each DTensor's rows of a tp slice become chunks of the full
    # tensor; an MLP of 90 splits into tp slices of 45 rows, which FSDP2 shards 23 + 22
    "fsdp2-tp2": ({"model__n_kv_head": 1, "model__mlp_hidden": 90, "train__micro_batch_size": 4},
                  {"parallel__tp": 2, "parallel__zero_stage": 3}),
}


@pytest.mark.parametrize("case", list(RESUMED_ALONE))
def test_a_four_rank_checkpoint_resumes_at_one_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                       corpus: Path, case: str) -> None:  # noqa: F811
    """Saved at step 4 by four ranks, resumed by one process: the next losses are the uninterrupted run's."""
    extra, layout = RESUMED_ALONE[case]
    run_distributed(train, 4, tmp_path, corpus, {**extra, **layout, "train__stop_after_step": 4,
                                                 "train__ckpt_interval": 4}, init_group=False)
    got = train(0, 1, tmp_path, corpus, extra)
    ref = reference(tmp_path_factory, corpus, **extra)
    for a, b in zip(got["losses"][4:], ref["losses"][4:], strict=True):
        assert a == pytest.approx(b, rel=1e-5)


def _checkpoint_tensors(path: Path, out: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("layout", [{"parallel__tp": 2}, {"parallel__zero_stage": 2}], ids=["tp2", "zero2-dp2"])
def test_async_save_of_chunks_equals_the_synchronous_one(tmp_path: Path, corpus: Path,  # noqa: F811
                                                         layout: dict[str, Any]) -> None:
    """The background save stages the chunks (as plain tensors) and writes them: the checkpoints hold the
    synchronous save's tensors exactly."""
    from dist_llm.train import checkpoint as ckpt

    for mode in ("sync", "async"):
        extra = {**layout, "train__max_steps": 4, "train__ckpt_interval": 2,
                 "train__async_checkpoint": mode == "async"}
        run_distributed(train, 2, tmp_path / mode, corpus, extra, init_group=False)
    for step in (2, 4):
        name = ckpt.step_dir(tmp_path / "async" / "checkpoints", step).name
        got = _checkpoint_tensors(tmp_path / "async" / "checkpoints" / name, tmp_path / "async.pt")
        want = _checkpoint_tensors(tmp_path / "sync" / "checkpoints" / name, tmp_path / "sync.pt")
        assert got.keys() == want.keys()
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def started_params(rank: int, world_size: int, out_dir: Path, corpus: Path,  # noqa: F811
                   extra: dict[str, Any]) -> dict[str, Any]:
    """The full parameters a trainer starts from (built and initialised, no step taken)."""
    from dist_llm.config import load_config
    from dist_llm.parallel.context import ParallelContext
    from dist_llm.train.trainer import Trainer
    from tests.conftest import tiny_overrides

    cfg = load_config(None, tiny_overrides(out_dir, **{"data__source": str(corpus), "model__bias": False, **extra}))
    ctx = ParallelContext.from_config(cfg)
    try:
        trainer = Trainer(cfg, ctx)
        params = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
        if trainer.tp_state is not None:
            params = trainer.tp_state.to_full({"model": params, "optim": {"state": {}}})["model"]
        return {"params": params, "step": trainer.step}
    finally:
        ctx.destroy()


def test_one_process_checkpoint_starts_and_resumes_tensor_parallel(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> None:  # noqa: F811
    """A checkpoint of one process (one chunk per tensor, as every checkpoint was before chunks) read into
    tp=2 slices: `model.init_from=ckpt:` starts from exactly its weights, and a resume at tp=2 x dp=2 ZeRO-2
    continues the uninterrupted run."""
    extra = {"model__n_kv_head": 2}
    saved = tmp_path / "saved"
    first = train(0, 1, saved, corpus, {**extra, "train__stop_after_step": 4, "train__ckpt_interval": 4})
    step4 = saved / "checkpoints" / "step_000004"
    got = run_distributed(started_params, 2, tmp_path / "init", corpus,
                          {**extra, "parallel__tp": 2, "model__init_from": f"ckpt:{step4}"}, init_group=False)[0]
    assert got["step"] == 0
    for name, p in first["params"].items():
        torch.testing.assert_close(got["params"][name], p, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    out = tmp_path / "resumed"
    shutil.copytree(saved, out)
    resumed = run_distributed(train, 4, out, corpus, {**extra, "parallel__tp": 2, "parallel__zero_stage": 2,
                                                      "train__micro_batch_size": 4}, init_group=False)[0]
    ref = reference(tmp_path_factory, corpus, **extra)
    for a, b in zip(resumed["losses"][4:], ref["losses"][4:], strict=True):
        assert a == pytest.approx(b, rel=1e-5)


def test_lora_at_tp2_zero1_resumes_its_own_run(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """LoRA over tp=2 x dp=2 ZeRO-1: the checkpoint holds the adapters' chunks only (the frozen base stays as
    built); stopped at step 4 and resumed, the run ends as the uninterrupted one."""
    lora = {"peft__method": "lora", "peft__targets": "[qkv, attn_out, mlp_up, mlp_down]", "peft__rank": 4,
            "parallel__tp": 2, "parallel__zero_stage": 1, "train__micro_batch_size": 4}
    whole = run_distributed(train, 4, tmp_path / "whole", corpus, lora, init_group=False)[0]
    run_distributed(train, 4, tmp_path / "cut", corpus, {**lora, "train__stop_after_step": 4,
                                                         "train__ckpt_interval": 4}, init_group=False)
    resumed = run_distributed(train, 4, tmp_path / "cut", corpus, lora, init_group=False)[0]
    assert resumed["losses"] == pytest.approx(whole["losses"], rel=1e-6)
    for name, p in whole["params"].items():
        torch.testing.assert_close(resumed["params"][name], p, rtol=1e-6, atol=1e-7)
