"""MoE under tensor parallelism (parallel/tensor/moe.py): whole experts on every tp rank, 1/tp of the tokens each.

Every layout is compared with one process in fp32 at 1e-5: each token meets the same experts with the same
weights; what changes is where its rows are computed and the order of sums (the router and expert gradients are
summed over tp, the balancing statistics over tp before the losses are formed), so the results differ by the
rounding of reordered sums alone. The reference runs at the same micro-batch size, since the balancing losses
and the capacity are per micro-batch."""

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
from tests.test_data_parallel import (  # noqa: F401 - corpus: fixture
    PARAM_ATOL,
    STEPS,
    assert_same_run,
    corpus,
    reference,
    train,
)

# SwiGLU experts and shared expert, aux loss + z-loss + the aux-free bias: every balancing term at once (one cell
# below runs without the shared expert and the bias: PLAIN)
MOE = {"model__n_experts": 4, "model__moe_top_k": 2, "model__mlp": "swiglu", "model__n_shared_experts": 1,
       "model__moe_aux_loss_coef": 0.01, "model__moe_z_loss_coef": 0.001, "model__moe_bias_update_rate": 0.01}
CAPACITY = {"model__moe_capacity_factor": 1.0}  # tight: rows dropped every step, placed as one process orders them
PLAIN = {"model__n_shared_experts": 0, "model__moe_bias_update_rate": 0.0}  # routed experts alone, no selection bias


@pytest.mark.parametrize("world,layout,variant", [
    (2, {"parallel__tp": 2, "train__activation_checkpointing": "full"}, {}),  # the tp collectives again in backward
    (2, {"parallel__tp": 2, "parallel__sequence_parallel": True}, CAPACITY),
    (4, {"parallel__tp": 2, "parallel__ep": 2}, CAPACITY),  # DDP; experts reduced over their expert-dp group
    (4, {"parallel__tp": 2, "parallel__ep": 2, "parallel__zero_stage": 2, "parallel__sequence_parallel": True,
         "parallel__bucket_mb": 0.01}, PLAIN),
    (4, {"parallel__tp": 2, "parallel__ep": 2, "parallel__zero_stage": 3, "parallel__sequence_parallel": True}, {}),
], ids=["tp2-recompute", "tp2-sp-capacity", "dp2-tp2-ep2-capacity", "dp2-tp2-ep2-sp-zero2-plain",
        "dp2-tp2-ep2-sp-zero3"])
def test_matches_single_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,
                                world: int, layout: dict[str, Any], variant: dict[str, Any]) -> None:
    extra = {**MOE, **variant, "train__micro_batch_size": 2}  # (one reference for the layouts of each variant)
    results = run_distributed(train, world, tmp_path, corpus, {**extra, **layout}, init_group=False)
    ref = reference(tmp_path_factory, corpus, **extra)
    assert_same_run(results[0], ref, rtol=1e-5)
    for r in results[1:]:  # every rank ends with the same whole model (router and experts summed over tp alike)
        for name, p in results[0]["params"].items():
            torch.testing.assert_close(r["params"][name], p, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    for a, b in zip(results[0]["records"], ref["records"], strict=True):
        for key in ("moe_imbalance", "moe_aux_loss", "moe_z_loss", "moe_dropped_fraction", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
        assert a["moe_tokens_per_expert"] == b["moe_tokens_per_expert"]  # every token once, not once per tp rank
    if variant == CAPACITY:
        assert all(r["moe_dropped_fraction"] > 0 for r in ref["records"])  # the capacity did drop rows


def test_dp4_tp2_ep4_on_eight_ranks(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> None:
    """ep=4 with tp=2 needs 8 ranks (dp=4 x tp=2, ZeRO-1: the tp row's ZeRO-1 cell), so 4 steps only: each ep group
    holds one expert a rank at each tp position. Losses, grad norms and parameters equal one process as above.
    Its end-of-run checkpoint (step 4: each rank's expert at its global id, its ZeRO-1 shard of Adam's moments,
    the aux-free bias buffers) resumes in one process to step 8: steps 5-8 are the uninterrupted 8-step run's.
    The saved state is step 4's whole fp32 state, so the resumed steps differ only by the rounding the 8 ranks'
    reordered sums left in it: 1e-5 on the losses, PARAM_ATOL on the parameters, as every resume test."""
    extra = {**MOE, "train__micro_batch_size": 2, "train__max_steps": 4}
    results = run_distributed(train, 8, tmp_path, corpus, {**extra, "parallel__tp": 2, "parallel__ep": 4,
                                                           "parallel__zero_stage": 1}, init_group=False)
    ref = reference(tmp_path_factory, corpus, **extra)
    assert results[0]["dp"] == "zero1+ep" and len(ref["losses"]) == 4
    for a, b in zip(results[0]["records"], ref["records"], strict=True):
        for key in ("loss", "grad_norm", "moe_imbalance", "moe_aux_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key
    for name, p in ref["params"].items():
        torch.testing.assert_close(results[0]["params"][name], p, rtol=1e-5, atol=PARAM_ATOL,
                                   msg=lambda m, n=name: f"{n}: {m}")
    for r in results[1:]:
        for name, p in results[0]["params"].items():
            torch.testing.assert_close(r["params"][name], p, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    whole = {**MOE, "train__micro_batch_size": 2}
    uninterrupted = reference(tmp_path_factory, corpus, **whole)
    # steps 1-4 are warmup (optim.warmup_steps=5), whose learning rates do not depend on train.max_steps: the 4-step
    # run is the 8-step run's first half, bit for bit
    assert uninterrupted["losses"][:4] == ref["losses"]
    got = train(0, 1, tmp_path, corpus, {**whole, "train__resume": str(tmp_path / "checkpoints" / "step_000004")})
    assert len(got["losses"]) == STEPS  # steps 1-4 from the 8 ranks, then 5-8 after the resume
    for a, b in zip(got["losses"][4:], uninterrupted["losses"][4:], strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    for name, p in uninterrupted["params"].items():
        torch.testing.assert_close(got["params"][name], p, rtol=1e-5, atol=PARAM_ATOL, msg=lambda m, n=name: f"{n}: {m}")


def _one_step(rank: int, world_size: int, tp: int, ep: int) -> dict[str, Any]:
    """One forward and backward of a 2-layer MoE GPT at (dp, tp, ep): the all-to-all bytes and calls this rank
    counted, and the rows per global expert it sent into the dispatch, per layer."""
    from dist_llm.model.moe import moe_layers
    from dist_llm.parallel.parallelize import materialize, meta_model

    cfg = load_config(None, [*tiny_overrides(Path("unused"), **MOE, train__micro_batch_size=2),
                             f"parallel.tp={tp}", f"parallel.ep={ep}"])
    ctx = ParallelContext.from_config(cfg)
    model = meta_model(cfg, ctx)
    materialize(model, cfg, ctx)
    sent: list[list[int]] = []
    for m in moe_layers(model):
        def record(experts, x, counts, expert_of_row, inner=m.dispatch):  # type: ignore[no-untyped-def]
            sent.append(counts.tolist())
            return inner(experts, x, counts, expert_of_row)
        m.dispatch = record
    torch.manual_seed(ctx.dp_rank)  # the tp ranks of a dp row see the same batch
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size))
    model.train()
    model(x, x, reduction="sum").backward()
    return {"bytes": ctx.comm.snapshot().get("all_to_all", 0), "calls": ctx.comm.calls.get("all_to_all", 0),
            "all_gather": ctx.comm.snapshot().get("all_gather", 0),
            "sent": sent, "n_embd": cfg.model.n_embd, "ep_rank": ctx.ep_rank, "tp_rank": ctx.tp_rank}


def test_all_to_all_bytes_are_what_routing_implies() -> None:
    """dp2 x tp2 x ep2: each rank dispatches only its tp slice of the tokens, through the ep group of its tp
    position (global ranks {0, 2} and {1, 3}); the bytes are those rows' exactly."""
    got = run_distributed(_one_step, 4, 2, 2)
    n_experts, row, n_local = MOE["model__n_experts"], got[0]["n_embd"] * 4, MOE["model__n_experts"] // 2
    for rank, r in enumerate(got):
        peer = got[rank ^ 2]  # the other member of this rank's ep group (same tp position, other dp rank)
        assert (peer["tp_rank"], peer["ep_rank"]) == (r["tp_rank"], 1 - r["ep_rank"])
        mine = range(r["ep_rank"] * n_local, (r["ep_rank"] + 1) * n_local)
        expected = 0
        for layer, counts in enumerate(r["sent"]):
            out = sum(n for e, n in enumerate(counts) if e not in mine)
            back = sum(peer["sent"][layer][e] for e in mine)
            # rows out and results back, forward and backward; the counts exchange (int64, the peer's E/ep) once
            expected += 2 * (out + back) * row + n_local * 8
        assert sum(sum(c) for c in r["sent"]) == 2 * 2 * 32 // 2 * 2  # (layers x B x T/tp x top-k) rows routed
        assert r["bytes"] == expected
        assert r["calls"] == 5 * len(r["sent"])
        # tp's own part of an MoE layer (no SP): the (B, E) int64 counts from the other tp rank, its half of the
        # output (B, T/2, C) in forward and of the input's gradient in backward: nothing else is all-gathered
        assert r["all_gather"] == len(r["sent"]) * (2 * n_experts * 8 + 2 * (2 * 16 * r["n_embd"] * 4))


def test_checkpoint_at_tp2_resumes_at_tp1_and_ep2(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                  corpus: Path) -> None:
    """Saved at tp=2 (every tp rank holds the whole experts: each is written once), resumed at one process and at
    dp2 x ep2: the next losses and the final parameters are the uninterrupted run's."""
    import torch.distributed.checkpoint as dcp

    extra = {**MOE, "train__micro_batch_size": 2}
    first = tmp_path / "first"
    run_distributed(train, 2, first, corpus, {**extra, "parallel__tp": 2, "train__stop_after_step": 4,
                                              "train__ckpt_interval": 4}, init_group=False)
    saved = next(p for p in first.rglob(".metadata")).parent
    meta = dcp.FileSystemReader(str(saved)).read_metadata().state_dict_metadata
    expert = next(k for k in meta if k.endswith("moe.experts.w_up"))
    assert len(meta[expert].chunks) == 1  # one chunk, not one per tp rank
    ref = reference(tmp_path_factory, corpus, **extra)
    for world, layout in ((1, {}), (2, {"parallel__ep": 2})):
        out = tmp_path / f"resume{world}"
        shutil.copytree(first, out)
        got = run_distributed(train, world, out, corpus, {**extra, **layout}, init_group=False)[0]
        assert len(got["losses"]) == STEPS  # steps 1-4 from the first run, then 5-8 after the resume
        for a, b in zip(got["losses"][4:], ref["losses"][4:], strict=True):
            assert a == pytest.approx(b, rel=1e-5)
        for name, p in ref["params"].items():
            torch.testing.assert_close(got["params"][name], p, rtol=1e-5, atol=3e-5)


def _context_of(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    cfg = load_config(None, ["model.n_experts=4", "parallel.tp=2", "parallel.ep=2", "train.global_batch_size=8",
                             "train.micro_batch_size=1"])
    ctx = ParallelContext.from_config(cfg)
    return {"ep_group": dist.get_process_group_ranks(ctx.ep_group),
            "expert_dp_group": dist.get_process_group_ranks(ctx.expert_dp_group), "placement": ctx.placement(),
            "layout": ctx.layout()}


def test_context_groups_and_layout() -> None:
    got = run_distributed(_context_of, 4)
    assert [g["ep_group"] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]  # dp ranks 0, 1 at each tp position
    assert [g["expert_dp_group"] for g in got] == [[0], [1], [2], [3]]  # dp/ep = 1 replica of each expert
    assert got[0]["placement"][0].startswith("mesh (dp=2, pp=1, tp=2; ep=2 inside dp: expert groups (dp ranks) "
                                             "[0, 1], at each (pp, tp) position) over 1 host(s)")
    assert got[0]["layout"] == {"world_size": 4, "dp": 2, "tp": 2, "pp": 1, "ep": 2}


def _sync_in_buckets(rank: int, world_size: int) -> list[tuple[int, list[float]]]:
    """Three marked 4 KiB gradients (and one unmarked) summed over tp=2 at three bucket sizes: the all-reduce
    count and the values after."""
    from dist_llm.parallel.marks import mark_sequence_parallel
    from dist_llm.parallel.tensor import sync_sequence_parallel_grads

    ctx = ParallelContext.from_config(load_config(None, ["parallel.tp=2", "train.global_batch_size=8",
                                                         "train.micro_batch_size=1"]))
    params = [torch.nn.Parameter(torch.zeros(1024)) for _ in range(4)]
    for p in params[:3]:
        mark_sequence_parallel(p)
    out = []
    for bucket_mb in (None, 8192 / 2**20, 4096 / 2**20):  # (one bucket; two tensors a bucket; one each)
        shards = [(p, torch.full((1024,), 10.0 * i + rank), 0) for i, p in enumerate(params)]
        ctx.comm.calls.clear()
        sync_sequence_parallel_grads(shards, ctx, bucket_mb=bucket_mb)
        out.append((ctx.comm.calls["all_reduce"], [g.unique().item() for _, g, _ in shards]))
    return out


def test_sequence_parallel_grads_summed_in_buckets() -> None:
    """parallel.bucket_mb bounds the flat copy of the tp-summed gradients (with MoE, every local expert's)."""
    for rank, got in enumerate(run_distributed(_sync_in_buckets, 2)):
        assert [calls for calls, _ in got] == [1, 2, 3]
        # the marked ones: 10 i + 0 plus 10 i + 1; the unmarked one as this rank left it
        assert all(values == [1.0, 21.0, 41.0, 30.0 + rank] for _, values in got)


def test_offloaded_sequence_parallel_grads_are_reduced_on_the_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """parallel.offload=cpu with tp (sequence parallelism, or MoE): FSDP2 leaves the gradients on the host, and an
    NCCL group reduces accelerator tensors only. Each bucket (the in-place single tensor too) goes to the
    collectives' device and its sum comes back into the host gradients. The meta device stands in for the
    accelerator (tests/standin_device.py); the all-reduce, as NCCL would, refuses a host tensor, and sums with a
    peer that holds the same values (x2)."""
    from types import SimpleNamespace

    from dist_llm.parallel import comm
    from dist_llm.parallel.marks import mark_sequence_parallel
    from dist_llm.parallel.tensor import sync_sequence_parallel_grads
    from tests.standin_device import STANDIN, standin

    reduced = []

    def nccl_all_reduce(t: torch.Tensor, group: object, stats: object) -> None:
        assert t.device == STANDIN, f"a {t.device} tensor given to an accelerator-only group"
        reduced.append(t.numel())
        t.mul_(2)

    monkeypatch.setattr(comm, "all_reduce", nccl_all_reduce)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (1024, 1024, 3, 7)]
    for p in params[:3]:
        mark_sequence_parallel(p)
    ctx = SimpleNamespace(device=STANDIN, tp=2, tp_group=object(), comm=None)
    for bucket_mb, sizes in ((None, [2051]), (4096 / 2**20, [1024, 1024, 3])):  # (one flat bucket; one tensor each)
        grads = [torch.arange(p.numel(), dtype=torch.float32) + i for i, p in enumerate(params)]
        want = [g * 2 for g in grads[:3]] + [grads[3].clone()]
        reduced.clear()
        with standin():
            sync_sequence_parallel_grads([(p, g, 0) for p, g in zip(params, grads)], ctx, bucket_mb=bucket_mb)
        assert reduced == sizes
        for g, w in zip(grads, want):
            assert g.device.type == "cpu" and torch.equal(g, w)


def test_config_refusal() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.n_experts=4", "parallel.tp=4", "model.block_size=66", "model.n_head=4"])
    assert str(err.value) == ("model.block_size: 66 is not divisible by parallel.tp=4; an MoE layer splits the "
                              "sequence over the tp ranks")


def _hf_logits_at_tp(rank: int, world_size: int, hf_dir: Path, out: Path, tokens: torch.Tensor) -> list[torch.Tensor]:
    """The logits at tp=2 without and with SP (one process group for both builds)."""
    from dist_llm.config import validate
    from dist_llm.train.init_from import resolve_architecture
    from dist_llm.train.trainer import build_model

    logits = []
    for sp in (False, True):
        cfg = resolve_architecture(load_config(None, tiny_overrides(
            out, model__init_from=f"hf:{hf_dir}", train__device="cpu", parallel__tp=2,
            parallel__sequence_parallel=sp)))
        validate(cfg)
        model = build_model(cfg, ParallelContext.from_config(cfg))
        with torch.no_grad():
            logits.append(model.eval()(tokens).float())
    return logits


def test_init_from_hf_qwen2_moe_at_tp2(tmp_path: Path) -> None:
    """A Qwen2-MoE (shared expert and its gate, q/k/v biases) exported by `save_hf` and read by
    `model.init_from=hf:` into tp=2, without and with SP: every rank's logits equal the one-process model's (the
    experts and the shared expert read whole; tests/test_hf_moe.py checks the one process against transformers)."""
    from dist_llm.config import ModelConfig
    from dist_llm.convert import save_hf
    from dist_llm.model import GPT

    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, vocab_size=256, block_size=32, pos_emb="rope",
                      norm="rmsnorm", mlp="swiglu", tie_embeddings=False, n_experts=4, moe_top_k=2, moe_hidden=24,
                      bias=False, qkv_bias=True, n_shared_experts=1, moe_shared_hidden=40, moe_shared_gate=True,
                      moe_router_order="softmax_topk")
    torch.manual_seed(4)
    model = GPT(cfg).eval()
    with torch.no_grad():  # (biases start at zero: made random, so that their slicing shows)
        for block in model.blocks:
            block.attn.qkv.bias.normal_(0, 0.1)
    save_hf(model, tmp_path / "hf")
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(tokens)
    for per_rank in run_distributed(_hf_logits_at_tp, 2, tmp_path / "hf", tmp_path / "run", tokens):
        for got in per_rank:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def _biased_capacity_step(rank: int, world_size: int, tp: int) -> dict[str, Any]:
    """One forward and backward with a selection bias that sends every token to experts 0 and 1 and a capacity of
    16 rows each: one process keeps the first 16 tokens of batch row 0 (all on tp rank 0) and drops the rest, so
    at tp=2 rank 1 keeps no row at all. The MoE gradients summed over tp, as the trainer sums them."""
    from dist_llm.model.moe import moe_layers
    from dist_llm.parallel import comm
    from dist_llm.parallel.marks import is_sequence_parallel
    from dist_llm.parallel.parallelize import materialize, meta_model

    cfg = load_config(None, [*tiny_overrides(Path("unused"), **MOE, train__micro_batch_size=2), f"parallel.tp={tp}",
                             "model.moe_capacity_factor=0.5", "model.bias=false"])
    ctx = ParallelContext.from_config(cfg)
    model = meta_model(cfg, ctx)
    materialize(model, cfg, ctx)
    for m in moe_layers(model):
        m.expert_bias.copy_(torch.tensor([9.0, 9.0, 0.0, 0.0]))
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size), generator=torch.Generator().manual_seed(0))
    model.train()
    loss = model(x, x, reduction="sum")
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if ".moe." in name:
            assert is_sequence_parallel(p) == (tp > 1) and p.grad is not None, name
            comm.all_reduce(p.grad, ctx.tp_group, None)
            grads[name] = p.grad
    return {"loss": loss.item(), "grads": grads, "dropped": [m.stats["dropped"].item() for m in moe_layers(model)]}


def test_a_tp_rank_whose_rows_are_all_dropped() -> None:
    ref = run_distributed(_biased_capacity_step, 1, 1)[0]
    assert ref["dropped"] == [0.75] * 2  # 16 tokens x 2 slots kept of the 64 tokens x 2
    for got in run_distributed(_biased_capacity_step, 2, 2):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert got["dropped"] == ref["dropped"]
        for name, g in ref["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
