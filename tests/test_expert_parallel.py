"""Expert parallelism (parallel.ep): experts split over ep of the dp ranks, tokens moved by all-to-all.

Every layout is compared with one process in fp32 at 1e-5: the same tokens meet the same experts with the same
weights, only the place where each row is computed and the order of the gradient sums change (the expert
gradients sum over the ep ranks in the all-to-all's backward, then over the expert-dp group), so the results
differ by float rounding of reordered sums alone. The reference runs at the same micro-batch size, since the
balancing losses are per forward."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_llm.config import ConfigError, load_config
from dist_llm.parallel.context import ParallelContext
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed
from tests.test_data_parallel import STEPS, assert_same_run, corpus, reference, train  # noqa: F401 - corpus: fixture

MOE = {"model__n_experts": 4, "model__moe_top_k": 2, "model__moe_z_loss_coef": 0.001}
VARIANTS = {"plain": {}, "shared+bias": {"model__n_shared_experts": 1, "model__moe_bias_update_rate": 0.01},
            "capacity": {"model__moe_capacity_factor": 1.0},  # rows dropped before the dispatch, per rank as at dp
            "recompute": {"train__activation_checkpointing": "full"}}  # the all-to-alls again in backward


@pytest.mark.parametrize("world,ep,zero_stage,variant", [
    (2, 2, 0, "shared+bias"), (2, 2, 1, "capacity"), (2, 2, 2, "shared+bias"),
    (4, 2, 0, "plain"), (4, 2, 1, "shared+bias"), (4, 2, 2, "plain"),
    (4, 4, 0, "shared+bias"), (4, 4, 1, "recompute"), (4, 4, 2, "shared+bias"),
])
def test_matches_single_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,
                                world: int, ep: int, zero_stage: int, variant: str) -> None:
    extra = {**MOE, **VARIANTS[variant], "train__micro_batch_size": 8 // world}
    results = run_distributed(train, world, tmp_path, corpus, {**extra, "parallel__ep": ep,
                                                               "parallel__zero_stage": zero_stage,
                                                               "parallel__bucket_mb": 0.01}, init_group=False)
    ref = reference(tmp_path_factory, corpus, **extra)
    assert_same_run(results[0], ref, rtol=1e-5)
    for r in results[1:]:  # every rank ends with the same whole model (its experts gathered over the ep group)
        for name, p in results[0]["params"].items():
            torch.testing.assert_close(r["params"][name], p, rtol=0, atol=0)
    for a, b in zip(results[0]["records"], ref["records"], strict=True):
        assert a["moe_imbalance"] == pytest.approx(b["moe_imbalance"], rel=1e-5)
        assert a["moe_tokens_per_expert"] == b["moe_tokens_per_expert"]  # summed over dp and ep: exact counts
        assert a["moe_aux_loss"] == pytest.approx(b["moe_aux_loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)  # each expert counted once


def _one_step_bytes(rank: int, world_size: int, ep: int) -> dict[str, Any]:
    """One forward and backward of a 2-layer MoE GPT at dp=world_size, ep: the all-to-all bytes this rank
    counted, and the tokens it routed to each expert, per layer."""
    from dist_llm.model.moe import moe_layers
    from dist_llm.parallel.parallelize import materialize, meta_model

    cfg = load_config(None, [*tiny_overrides(Path("unused"), **MOE, train__micro_batch_size=2), f"parallel.ep={ep}"])
    ctx = ParallelContext.from_config(cfg)
    model = meta_model(cfg, ctx)
    materialize(model, cfg, ctx)
    torch.manual_seed(rank)
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size))
    model.train()
    model(x, x, reduction="sum").backward()
    loads = [m.stats["load"].long().tolist() for m in moe_layers(model)]  # (E,) tokens per global expert
    return {"bytes": ctx.comm.snapshot().get("all_to_all", 0), "calls": ctx.comm.calls.get("all_to_all", 0),
            "loads": loads, "n_embd": cfg.model.n_embd}


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2), (4, 4)])
def test_all_to_all_bytes_are_what_routing_implies(world: int, ep: int) -> None:
    results = run_distributed(_one_step_bytes, world, ep)
    n_experts, row = MOE["model__n_experts"], results[0]["n_embd"] * 4  # fp32 rows of n_embd
    n_local = n_experts // ep
    for dp_rank, r in enumerate(results):
        group = range(dp_rank - dp_rank % ep, dp_rank - dp_rank % ep + ep)  # this rank's ep group (adjacent dp ranks)
        expected = 0
        for layer, load in enumerate(r["loads"]):
            mine = range((dp_rank % ep) * n_local, (dp_rank % ep + 1) * n_local)
            sent = sum(n for e, n in enumerate(load) if e not in mine)  # rows to experts on other ranks
            received = sum(results[q]["loads"][layer][e] for q in group if q != dp_rank for e in mine)
            # forward: the rows out (dispatch) and the results back (combine); backward: the same in reverse;
            # plus the counts exchange (int64, the other ranks' share of the E counts) once per layer
            expected += 2 * (sent + received) * row + (ep - 1) * n_local * 8
        assert r["bytes"] == expected
        assert r["calls"] == 5 * len(r["loads"])  # counts, dispatch, combine; combine and dispatch backward


@pytest.mark.parametrize("save_stage,resumes", [(0, [(1, 1, 0), (4, 4, 1)]), (1, [(4, 4, 0), (4, 2, 2)])])
def test_checkpoint_reshards_across_ep(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,
                                       save_stage: int, resumes: list[tuple[int, int, int]]) -> None:
    """Saved at ep=2 (dp=2; DDP or ZeRO-1), resumed at (world, ep, zero_stage) layouts down to one process: the
    next losses and the final parameters are the uninterrupted run's. Micro-batches of 2 everywhere, so every
    layout runs the same forwards."""
    extra = {**MOE, **VARIANTS["shared+bias"], "train__micro_batch_size": 2}
    first = tmp_path / "first"
    run_distributed(train, 2, first, corpus, {**extra, "parallel__ep": 2, "parallel__zero_stage": save_stage,
                                              "train__stop_after_step": 4, "train__ckpt_interval": 4},
                    init_group=False)
    ref = reference(tmp_path_factory, corpus, **extra)
    for world, ep, stage in resumes:
        out = tmp_path / f"ep{ep}_{world}"
        shutil.copytree(first, out)
        got = run_distributed(train, world, out, corpus, {**extra, "parallel__ep": ep, "parallel__zero_stage": stage},
                              init_group=False)[0]
        assert len(got["losses"]) == STEPS  # steps 1-4 from the first run, then 5-8 after the resume
        for a, b in zip(got["losses"][4:], ref["losses"][4:], strict=True):
            assert a == pytest.approx(b, rel=1e-5)
        for name, p in ref["params"].items():
            torch.testing.assert_close(got["params"][name], p, rtol=1e-5, atol=3e-5)


@pytest.mark.parametrize("override,message", [
    (["parallel.ep=2"], "parallel.ep=2 needs an MoE model (model.n_experts > 0); a dense model has no experts"),
    (["model.n_experts=6", "parallel.ep=4"], "parallel.ep: model.n_experts=6 is not divisible by parallel.ep=4"),
    (["model.n_experts=4", "parallel.ep=0"], "parallel.ep: must be >= 1, got 0"),
    (["model.n_experts=4", "parallel.ep=2", "parallel.dp=3", "train.global_batch_size=96"], "parallel.ep: 2 does not divide parallel.dp=3"),
    (["model.n_experts=4", "parallel.ep=2", "parallel.backend=deepspeed"],
     "parallel.ep: 2 with parallel.backend=deepspeed is not supported: DeepSpeed's engine would all-reduce the "
     "expert gradients over all of dp, mixing different experts; use parallel.ep=1 or parallel.backend=native"),
])
def test_config_refusals(override: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, override)
    assert str(err.value) == message


def _context_of(rank: int, world_size: int, ep: int) -> dict[str, Any]:
    import torch.distributed as dist

    cfg = load_config(None, ["model.n_experts=4", f"parallel.ep={ep}", "train.global_batch_size=8",
                             "train.micro_batch_size=1"])
    ctx = ParallelContext.from_config(cfg)
    return {"ep_rank": ctx.ep_rank, "ep_group": dist.get_process_group_ranks(ctx.ep_group),
            "expert_dp_group": dist.get_process_group_ranks(ctx.expert_dp_group), "placement": ctx.placement(),
            "layout": ctx.layout()}


def test_context_groups_and_layout() -> None:
    got = run_distributed(_context_of, 4, 2)
    assert [g["ep_group"] for g in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]  # adjacent ranks: one node
    assert [g["expert_dp_group"] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g["ep_rank"] for g in got] == [0, 1, 0, 1]
    assert got[0]["placement"][0].startswith("mesh (dp=4, pp=1, tp=1; ep=2 inside dp: expert groups (dp ranks) "
                                             "[0, 1], [2, 3]) over 1 host(s)")
    assert got[0]["layout"] == {"world_size": 4, "dp": 4, "tp": 1, "pp": 1, "ep": 2}


def _refused_at_start(rank: int, world_size: int) -> str:
    cfg = load_config(None, ["model.n_experts=4", "parallel.ep=4", "train.global_batch_size=8",
                             "train.micro_batch_size=1"])
    try:
        ParallelContext.from_config(cfg)
    except ConfigError as e:
        return str(e)
    return ""


def test_ep_must_divide_the_world_dp() -> None:
    got = run_distributed(_refused_at_start, 2, init_group=False)
    assert got == ["parallel.ep: 4 does not divide dp=2 (WORLD_SIZE=2 / (cp*tp*pp))"] * 2


def _biased_step(rank: int, world_size: int, ep: int) -> dict[str, Any]:
    """One forward and backward of a 4-expert model whose selection bias sends every token to experts 0 and 1, so
    at ep=2 rank 1's experts get no rows at all: its all-to-alls must still run, both ways."""
    from dist_llm.model.moe import moe_layers
    from dist_llm.parallel.parallelize import materialize, meta_model

    cfg = load_config(None, [*tiny_overrides(Path("unused"), **MOE, train__micro_batch_size=2), f"parallel.ep={ep}",
                             "model.bias=false"])
    ctx = ParallelContext.from_config(cfg)
    model = meta_model(cfg, ctx)
    materialize(model, cfg, ctx)
    for m in moe_layers(model):
        m.expert_bias.copy_(torch.tensor([9.0, 9.0, 0.0, 0.0]))
    losses = []
    for r in ([rank] if ep > 1 else range(2)):  # one process: both ranks' batches, gradients summed
        torch.manual_seed(r)
        x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size))
        loss = model(x, x, reduction="sum")
        loss.backward()
        losses.append(loss.item())
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()  # (None: no row reached them here)
             for n, p in model.named_parameters() if "experts" in n}
    return {"losses": losses, "grads": grads, "first": [m.experts.w_up.shape[0] * ctx.ep_rank for m in moe_layers(model)]}


def test_a_rank_whose_experts_get_no_rows() -> None:
    ref = run_distributed(_biased_step, 1, 1)[0]
    got = run_distributed(_biased_step, 2, 2)
    assert [g["losses"][0] for g in got] == pytest.approx(ref["losses"], rel=1e-6)
    for g in got:  # each rank's experts: the gradient of both ranks' tokens (zero for the experts no token chose)
        for name, grad in g["grads"].items():
            first = g["first"][0]
            torch.testing.assert_close(grad, ref["grads"][name][first : first + grad.shape[0]], rtol=1e-5, atol=1e-6)
    assert all(float(grad.abs().sum()) == 0.0 for grad in got[1]["grads"].values())


def _train_biased(rank: int, world_size: int, *args: Any) -> dict[str, Any]:
    """`train` with the tokens of dp ranks 0 and 1 routed to experts 0 and 1 only (a selection bias set before
    each training forward), those of dp ranks 2 and 3 as the router likes. At dp=4, ep=2 rank 1 (experts 2, 3)
    then gets no rows in any step while rank 3, its expert-dp peer, does. One process runs the four ranks'
    micro-batches in rank order (as every dp equality test relies on), so its k-th training forward of a step
    plays rank k's."""
    from dist_llm.model import moe

    forward, seen = moe.MoE.forward, {"forwards": 0}
    layers = 2  # (tiny_overrides' n_layer: every block MoE here)

    def biased(self: moe.MoE, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            dp_rank = rank if world_size > 1 else (seen["forwards"] // layers) % 4
            seen["forwards"] += 1
            self.expert_bias.copy_(torch.tensor([9.0, 9.0, 0.0, 0.0] if dp_rank < 2 else [0.0] * 4))
        return forward(self, x)

    moe.MoE.forward = biased  # type: ignore[method-assign]  # (in this spawned process only)
    return train(rank, world_size, *args)


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_ranks_whose_experts_get_no_rows_reduce_in_step(tmp_path: Path, corpus: Path, zero_stage: int) -> None:
    """ZeRO-2 at dp=4, ep=2 with small buckets: rank 1's experts get no rows, its expert-dp peer rank 3's do. Rank
    1 must reduce-scatter its expert buckets at the point, and in the order, rank 3 does (before: its buckets
    started only at the end of backward, so the two summed different buckets together, or hung). ZeRO-3 alike:
    FSDP2 reduce-scatters the experts' unit from a hook on its input's gradient, which rank 1's stand-in zero
    row must carry (detached, as it was, the reduce-scatter waited for the end of backward, out of order with
    rank 3's collectives)."""
    extra = {**MOE, "train__micro_batch_size": 2}
    got = run_distributed(_train_biased, 4, tmp_path / "ep", corpus,
                          {**extra, "parallel__ep": 2, "parallel__zero_stage": zero_stage, "parallel__bucket_mb": 0.01},
                          init_group=False, timeout=300)
    ref = run_distributed(_train_biased, 1, tmp_path / "ref", corpus, extra,
                          init_group=False, timeout=300)[0]
    assert_same_run(got[0], ref, rtol=1e-5)


def test_bf16_sends_half_the_bytes_and_matches_one_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                           corpus: Path) -> None:
    """Under bf16 autocast the rows travel in bf16 (the experts compute in it anyway): the all-to-all bytes are
    half of fp32's for the same routing, and the run stays within bf16's rounding of one process."""
    extra = {**MOE, "train__micro_batch_size": 4, "train__precision": "bf16"}
    got = run_distributed(train, 2, tmp_path / "bf16", corpus, {**extra, "parallel__ep": 2}, init_group=False)[0]
    ref = reference(tmp_path_factory, corpus, **extra)
    # the same bf16 matmuls on the same rows; only fp32 sums run in another order, and bf16 rounds their results
    # (measured 5e-5 apart over 8 steps; bf16's own step is 8e-3)
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-3)
    fp32 = run_distributed(train, 2, tmp_path / "fp32", corpus, {**extra, "train__precision": "fp32", "parallel__ep": 2},
                           init_group=False)[0]
    # rows in 2 bytes, not 4; the int64 counts exchange is the same, and the two precisions may route a few rows
    # differently (the router's input is rounded otherwise): 1% (before: the same bytes as fp32)
    assert got["comm"]["all_to_all"] == pytest.approx(fp32["comm"]["all_to_all"] / 2, rel=0.01)
