"""MoE under ZeRO-3 (FSDP2), with and without expert parallelism (parallel/expert/fsdp.py).

At ep=1 an MoE block is a unit like the others (its router a unit of its own, gathered in fp32); at ep>1 each
layer's experts are a unit over the expert-dp ranks, each holding (E/ep)/(dp/ep) experts' rows. Every layout is
compared with one process in fp32 at 1e-5 relative (losses) and tests/test_data_parallel.py's PARAM_ATOL
(parameters): the same tokens meet the same experts with the same weights; only the order of the fp32 gradient
sums changes (the all-to-all's backward, then the reduce-scatter over expert-dp, then the division by dp), which
is float rounding of reordered sums alone. Micro-batches are the same size as the reference's, since the
balancing losses are per forward."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_llm import memory
from dist_llm.config import load_config
from dist_llm.parallel.context import ParallelContext
from dist_llm.train.trainer import Trainer
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed
from tests.test_data_parallel import PARAM_ATOL, STEPS, _full, assert_same_run, corpus  # noqa: F401 - corpus: fixture

MOE = {"model__n_experts": 4, "model__moe_top_k": 2, "model__moe_z_loss_coef": 0.001,
       "model__n_shared_experts": 1, "model__moe_bias_update_rate": 0.01, "model__bias": False}
ZERO3 = {"parallel__zero_stage": 3}
PLAIN = {"model__n_shared_experts": 0, "model__moe_bias_update_rate": 0.0}  # routed experts alone, no selection bias


def _expert_rows(module: torch.nn.Module) -> dict[str, Any]:
    """Per stacked expert parameter: the rows (experts) this rank holds, its local bytes, and its whole shape."""
    out = {}
    for name, p in module.named_parameters():
        if ".experts." in name:
            local = p.to_local() if hasattr(p, "to_local") else p
            out[name] = {"rows": local.shape[0], "bytes": local.untyped_storage().nbytes(), "shape": tuple(p.shape)}
    return out


def _train(rank: int, world_size: int, out_dir: Path, corpus: Path, extra: dict[str, Any]) -> dict[str, Any]:  # noqa: F811
    """Train (or resume) to step 8; report the losses, the full parameters, this rank's expert rows and the
    dtypes the routers' weights had in forward."""
    cfg = load_config(None, tiny_overrides(out_dir, **{"data__source": str(corpus), "train__max_steps": STEPS,
                                                       "train__eval_interval": 0, **MOE, **extra}))
    ctx = ParallelContext.from_config(cfg)
    try:
        trainer = Trainer(cfg, ctx)
        from dist_llm.model.moe import moe_layers

        router_dtypes: set[str] = set()
        for layer in moe_layers(trainer.module):
            layer.router.register_forward_hook(
                lambda m, args, out: router_dtypes.update({str(m.weight.dtype), str(out.dtype)}))
        trainer.fit()
        params = {n: _full(p) for n, p in trainer.module.named_parameters()}
        if trainer.tp_state is not None:  # expert slices -> the whole stacks
            params = trainer.tp_state.to_full({"model": params, "optim": {"state": {}}})["model"]
        out = {"params": params, "experts": _expert_rows(trainer.module), "state_bytes": trainer.state_bytes,
               "router_dtypes": sorted(router_dtypes), "dp": trainer.dp.name}
        if rank == 0:
            lines = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
            out["records"] = [r for r in lines if "loss" in r]
            out["losses"] = [r["loss"] for r in out["records"]]
        return out
    finally:
        ctx.destroy()


_REFERENCE: dict[str, dict[str, Any]] = {}


def _reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path, **extra: Any) -> dict[str, Any]:  # noqa: F811
    key = json.dumps(extra, sort_keys=True)
    if key not in _REFERENCE:
        _REFERENCE[key] = _train(0, 1, tmp_path_factory.mktemp("one"), corpus, extra)
    return _REFERENCE[key]


def _expected_rows(n_experts: int, dp: int, ep: int, expert_dp_rank: int) -> int:
    """FSDP2's dim-0 shard of a rank's (E/ep, ...) stack over the dp/ep expert-dp ranks: chunks of
    ceil((E/ep)/(dp/ep)) rows, the last ones shorter (or empty)."""
    local, parts = n_experts // ep, dp // ep
    chunk = math.ceil(local / parts)
    return max(0, min(chunk, local - expert_dp_rank * chunk))


def _assert_matches(ranks: list[dict[str, Any]], ref: dict[str, Any], *, world: int, ep: int, tmp_path: Path,
                    corpus: Path, extra: dict[str, Any]) -> None:  # noqa: F811
    """8 steps' losses, grad norms (each expert counted once) and final parameters equal one process; each rank
    holds exactly its (E/ep)/(dp/ep) experts' rows, and the model-state bytes `dist-llm memory` predicts."""
    assert ranks[0]["dp"] == "fsdp2"
    assert_same_run(ranks[0], ref, rtol=1e-5)
    for a, b in zip(ranks[0]["records"], ref["records"], strict=True):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert a["moe_imbalance"] == pytest.approx(b["moe_imbalance"], rel=1e-5)
    for r in ranks[1:]:  # every rank ends with the same whole model
        for name, p in ranks[0]["params"].items():
            torch.testing.assert_close(r["params"][name], p, rtol=0, atol=0)
    n_experts = MOE["model__n_experts"]
    for dp_rank, r in enumerate(ranks):
        assert r["experts"], "no expert parameters"
        for name, e in r["experts"].items():
            rows = _expected_rows(n_experts, world, ep, dp_rank // ep)
            assert e["rows"] == rows, (name, e)
            assert e["shape"][0] == n_experts // ep  # the DTensor's shape: this ep rank's slice of the stack
            whole = ref["experts"][name]
            assert e["bytes"] == whole["bytes"] // n_experts * rows  # (E/ep)/(dp/ep) of the stack, no more
    # model states: rank 0 holds what `dist-llm memory` predicts, to the byte, and that is the shape formula:
    # every tensor's dim 0 in ceil(rows / parts) chunks, parts = dp for the dense ones, dp/ep for an expert stack
    # of E/ep rows; fp32 parameters and gradients, Adam's two moments and its 4-byte step per tensor
    cfg = load_config(None, tiny_overrides(tmp_path, **{"data__source": str(corpus), **MOE, **extra, **ZERO3,
                                                        "parallel__ep": ep}))
    est = memory.predict(cfg, world, pp_rank=0)
    held = ranks[0]["state_bytes"]
    assert (held["params"], held["grads"], held["optimizer"]) == (est.params_bytes, est.grads_bytes,
                                                                  est.optimizer_bytes)
    shard = 0
    for name, p in ref["params"].items():
        rows, parts = (p.shape[0] // ep, world // ep) if ".experts." in name else (p.shape[0], world)
        shard += min(rows, math.ceil(rows / parts)) * math.prod(p.shape[1:])
    assert held["params"] == held["grads"] == 4 * shard
    assert held["optimizer"] == 8 * shard + 4 * len(ref["params"])


@pytest.mark.parametrize("world,ep,recompute,variant", [(2, 1, "none", {}), (2, 2, "none", PLAIN),
                                                        (4, 2, "full", {})], ids=["dp2", "dp2-ep2-plain",
                                                                                  "dp4-ep2-recompute"])
def test_matches_single_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,  # noqa: F811
                                world: int, ep: int, recompute: str, variant: dict[str, Any]) -> None:
    """ZeRO-3 with a shared expert and the aux-free bias (at dp=2 ep=2 without either: the routed experts alone)
    equals one process (_assert_matches). At dp=4 with full recompute too (backward runs each block's forward
    again: its all-to-alls and the experts' gather), against the same one-process run without it (recomputing
    changes no value). ep=4: test_an_ep4_run_matches_and_its_checkpoint_resumes_at_tp2_and_pp2."""
    extra = {"train__micro_batch_size": 8 // world, **variant}
    ranks = run_distributed(_train, world, tmp_path, corpus, {**extra, **ZERO3, "parallel__ep": ep,
                                                              "train__activation_checkpointing": recompute},
                            init_group=False)
    _assert_matches(ranks, _reference(tmp_path_factory, corpus, **extra), world=world, ep=ep, tmp_path=tmp_path,
                    corpus=corpus, extra=extra)


def test_an_ep4_run_matches_and_its_checkpoint_resumes_at_tp2_and_pp2(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> None:  # noqa: F811
    """dp=4 ZeRO-3 ep=4 (one expert a rank, whole: expert-dp is 1), shared expert and aux-free bias: the 8 steps
    equal one process (_assert_matches), and its step-4 checkpoint (each rank's expert at its global id, its
    quarter of the dense rows) resumes in one process, at tp=2 and at pp=2: steps 5-8 and the final parameters
    are the uninterrupted run's. The checkpoint holds the whole fp32 state of step 4 (weights, Adam's moments,
    the aux-free bias buffers, the data position), so what differs after the resume is only the order of the
    fp32 gradient sums in the new layout, the same rounding as the equalities above: 1e-5 on the losses,
    PARAM_ATOL on the parameters. Micro-batches of 2 everywhere, so every layout runs the same forwards."""
    import torch.distributed.checkpoint as dcp

    from tests.test_pipeline import merged

    extra = {"train__micro_batch_size": 2}
    first = tmp_path / "first"
    ranks = run_distributed(_train, 4, first, corpus, {**extra, **ZERO3, "parallel__ep": 4,
                                                       "train__ckpt_interval": 4}, init_group=False)
    ref = _reference(tmp_path_factory, corpus, **extra)
    _assert_matches(ranks, ref, world=4, ep=4, tmp_path=tmp_path, corpus=corpus, extra=extra)
    saved = first / "checkpoints" / "step_000004"
    meta = dcp.FileSystemReader(str(saved)).read_metadata().state_dict_metadata
    expert = next(k for k in meta if k.endswith("moe.experts.w_up") and not k.startswith("optim"))
    # one chunk per ep rank, each one expert at its global id: written shard by shard, never gathered
    assert sorted(c.offsets[0] for c in meta[expert].chunks) == [0, 1, 2, 3]
    assert {tuple(c.sizes)[0] for c in meta[expert].chunks} == {1}
    shutil.rmtree(first / "checkpoints" / "step_000008")
    for name, world, layout in (("one", 1, {}), ("tp2", 2, {"parallel__tp": 2}), ("pp2", 2, {"parallel__pp": 2})):
        out = tmp_path / name
        shutil.copytree(first, out)
        # named, so that a run that found no checkpoint fails instead of training steps 1-8 afresh (which would
        # pass); the metrics after step 4 are dropped by the resume and written again
        resume = {**extra, **layout, "train__resume": str(out / "checkpoints" / "step_000004")}
        got = (_train(0, 1, out, corpus, resume) if world == 1 else
               run_distributed(_train, world, out, corpus, resume, init_group=False))
        results = got if isinstance(got, list) else [got]
        assert len(results[0]["losses"]) == STEPS  # steps 1-4 from the ep=4 run, then 5-8 after the resume
        for a, b in zip(results[0]["losses"][4:], ref["losses"][4:], strict=True):
            assert a == pytest.approx(b, rel=1e-5), name
        params = merged(results)  # (each pp stage its own blocks; elsewhere every rank the whole model)
        assert params.keys() == ref["params"].keys()
        for n, p in ref["params"].items():
            torch.testing.assert_close(params[n], p, rtol=1e-5, atol=PARAM_ATOL, msg=lambda m, n=n: f"{name} {n}: {m}")


def test_bf16_routers_gather_in_fp32(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,  # noqa: F811
                                     corpus: Path) -> None:  # noqa: F811
    """bf16 at dp=2, ep=2: the blocks gather in bf16 (FSDP2's param_dtype), each router in fp32 (a unit of its
    own), so routing sees the fp32 master weights as one process's autocast does. The losses stay within 1e-3 of
    one bf16 process (measured 2.4e-4 at ep=2, 2.7e-4 at ep=1: under FSDP2 the norms and the embedding also run
    on bf16 weights, which autocast keeps in fp32; bf16's own resolution is 8e-3)."""
    extra = {"train__micro_batch_size": 4, "train__precision": "bf16"}
    ranks = run_distributed(_train, 2, tmp_path, corpus, {**extra, **ZERO3, "parallel__ep": 2}, init_group=False)
    ref = _reference(tmp_path_factory, corpus, **extra)
    assert all(r["router_dtypes"] == ["torch.float32"] for r in ranks)  # the weight in forward, and the logits
    for a, b in zip(ranks[0]["losses"], ref["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-3)


def test_a_zero3_ep2_checkpoint_resumes_at_other_layouts(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                         corpus: Path) -> None:  # noqa: F811
    """Saved at step 4 at dp=2 ZeRO-3 ep=2 (each rank's experts at their global ids, its FSDP2 rows of them),
    resumed at dp=2 ZeRO-3 ep=1, at dp=2 ZeRO-2 ep=2, in one process, and at dp=4 ZeRO-3 ep=2 (each rank reading
    only its rows of its experts): steps 5-8 and the final parameters are the uninterrupted run's. The checkpoint
    also starts a fresh ZeRO-3 ep=2 run (model.init_from=ckpt:) as it starts one process. Micro-batches of 2
    everywhere, so every layout runs the same forwards."""
    extra = {"train__micro_batch_size": 2}
    first = tmp_path / "first"
    run_distributed(_train, 2, first, corpus, {**extra, **ZERO3, "parallel__ep": 2, "train__stop_after_step": 4,
                                               "train__ckpt_interval": 4}, init_group=False)
    ref = _reference(tmp_path_factory, corpus, **extra)
    for world, layout in [(2, {**ZERO3, "parallel__ep": 1}), (2, {"parallel__zero_stage": 2, "parallel__ep": 2}),
                          (1, {}), (4, {**ZERO3, "parallel__ep": 2})]:
        out = tmp_path / f"resume{len(list(tmp_path.iterdir()))}"
        shutil.copytree(first, out)
        got = run_distributed(_train, world, out, corpus, {**extra, **layout}, init_group=False)[0]
        assert len(got["losses"]) == STEPS  # steps 1-4 from the first run, then 5-8 after the resume
        for a, b in zip(got["losses"][4:], ref["losses"][4:], strict=True):
            assert a == pytest.approx(b, rel=1e-5), layout
        for name, p in ref["params"].items():
            torch.testing.assert_close(got["params"][name], p, rtol=1e-5, atol=3e-5, msg=lambda m: f"{layout} {name}: {m}")
    # model.init_from=ckpt: the same checkpoint's weights into a fresh ZeRO-3 ep=2 run, each rank reading its rows of
    # its experts (before: refused, "weight blocks.0.moe.experts.w_up has shape (4, ...), this model wants (2, ...)":
    # the expert-slice marks were put back on FSDP2's parameters only after the load), as one process starts
    start = {**extra, "model__init_from": f"ckpt:{first / 'checkpoints' / 'step_000004'}", "train__max_steps": 2}
    got = run_distributed(_train, 2, tmp_path / "init_zero3", corpus, {**start, **ZERO3, "parallel__ep": 2},
                          init_group=False)[0]
    one = _train(0, 1, tmp_path / "init_one", corpus, start)
    assert got["losses"] == pytest.approx(one["losses"], rel=1e-5) and len(one["losses"]) == 2


def test_init_from_hf_mixtral_at_zero3_ep2(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """model.init_from=hf: of a tiny random Mixtral at dp=2 ZeRO-3 ep=2: each rank reads its rows of its own
    experts, and two steps' losses and the parameters after them equal one process (1e-5 and PARAM_ATOL, as
    above). Before, the expert-slice marks came back only after the load, so each ep rank read the first E/ep
    experts (rank 1 held experts 0-1's weights as its 2-3), with no error: the losses moved by 1e-5 only, the
    parameters of experts 2-3 by the whole weights."""
    from tests.test_hf_moe import hf_moe

    torch.manual_seed(3)
    hf_moe("mixtral").save_pretrained(tmp_path / "hf")
    start = {"model__init_from": f"hf:{tmp_path / 'hf'}", "model__n_shared_experts": 0, "train__max_steps": 2,
             "train__micro_batch_size": 4}
    got = run_distributed(_train, 2, tmp_path / "zero3", corpus, {**start, **ZERO3, "parallel__ep": 2},
                          init_group=False)[0]
    one = _train(0, 1, tmp_path / "one", corpus, start)
    assert len(one["losses"]) == 2 and got["losses"] == pytest.approx(one["losses"], rel=1e-5)
    for name, p in one["params"].items():
        torch.testing.assert_close(got["params"][name], p, rtol=1e-5, atol=PARAM_ATOL, msg=lambda m: f"{name}: {m}")
