"""ZeRO-3 (FSDP2) under a pipeline (dp x pp) and under context parallelism (dp x cp), against one process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_llm.memory import suggest as memory_suggest
from dist_llm.config import load_config
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed
from tests.test_context_parallel import BLOCK
from tests.test_data_parallel import STEPS, assert_same_run, corpus, expected_state_bytes, reference, train  # noqa: F401
from tests.test_pipeline import LAYERS, assert_matches, merged

# dp=2 x pp=2: micro-batch 1 gives 4 micro-batches per stage and step (global batch 8 over 2 dp ranks)
DP_PP = {**LAYERS, "parallel__pp": 2, "parallel__zero_stage": 3, "train__micro_batch_size": 1}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb1", "interleaved", "1f1b-reshard",
                                      "interleaved-per-micro-batch", "1f1b-reshard-per-micro-batch"])
def test_zero3_with_pipeline_matches_one_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                 corpus: Path, schedule: str) -> None:  # noqa: F811
    """dp=2 x pp=2 on 4 processes, tied embedding (the first stage's embedding and the last stage's head are one
    weight, each stage's copy a DTensor sharded over its dp pair): 8 steps equal one process. Under 1F1B also
    evaluation (the forward-only schedule through the same root calls) every 4 steps, its losses equal too;
    '-reshard': parallel.reshard_after_forward=true (each unit gathered twice per micro-batch); '-per-micro-batch':
    parallel.pp_reduce_grads=micro_batch (every backward reduce-scatters, each chunk's under interleaved)."""
    name, reshard, per_micro_batch = schedule.split("-")[0], "-reshard" in schedule, "-per-micro-batch" in schedule
    extra = {**DP_PP, "parallel__pp_schedule": name}
    if name == "interleaved":
        extra["parallel__pp_virtual"] = 2
    if reshard:
        extra["parallel__reshard_after_forward"] = True
    if per_micro_batch:
        extra["parallel__pp_reduce_grads"] = "micro_batch"
    evaluate = {"train__eval_interval": 4} if schedule == "1f1b" else {}
    results = run_distributed(train, 4, tmp_path / "pp", corpus, {**extra, **evaluate}, init_group=False)
    assert {r["dp"] for r in results} == {"fsdp2"}
    # atol 3e-6 as test_pipeline.test_with_data_parallel: the tied embedding's two contributions and the dp mean
    # are summed in another order than at one process, and Adam scales that rounding on near-zero gradients
    ref = train(0, 1, tmp_path / "one", corpus, {**LAYERS, **evaluate}) if evaluate else reference(
        tmp_path_factory, corpus, **LAYERS)
    assert_matches(results, ref, atol=3e-6)
    if evaluate:
        val = {run: [r["val_loss"] for r in map(json.loads, (tmp_path / run / "metrics.jsonl").open())
                     if "val_loss" in r] for run in ("pp", "one")}
        assert len(val["pp"]) == 2 and val["pp"] == pytest.approx(val["one"], rel=1e-5)
    # each unit gathered once (twice per micro-batch when resharding) and reduce-scattered once per step, not per
    # micro-batch (GPipe and 1F1B in the last backward, zb1 after its last W, interleaved's chunks at the end of
    # chunk 0's last backward; per micro-batch: 4 times): the last step's counted data-parallel bytes (and the
    # tied embedding's all-reduce) are the planner's (memory/comm.py), to the byte; by hand, below
    cfg = load_config(None, tiny_overrides(tmp_path, data__source=str(corpus), model__bias=False,
                                           train__max_steps=STEPS, **extra))
    for r in results[:2]:  # a rank of each stage
        want = memory_suggest.step_comm(cfg, dp=2, tp=1, pp=2, pp_rank=r["pp_rank"]).by_kind()
        kinds = ("all_gather", "reduce_scatter", "all_reduce")
        assert {k: want[k] for k in kinds} == {k: r["comm"][k] for k in kinds}
        # by hand: each reduce-scatter sends (dp-1)/dp of a unit's padded fp32 gradient, which is dp - 1 = 1 times
        # this rank's shard of it (dp rank 0 holds the full-size first chunk): once a step, or for each of the
        # 4 micro-batches (global batch 8 over 2 dp ranks, micro-batch 1)
        assert r["comm"]["reduce_scatter"] == (4 if per_micro_batch else 1) * r["state_bytes"]["grads"] > 0


def test_zero3_pipeline_checkpoint_resumes_at_pp1_and_at_zero2(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                               corpus: Path) -> None:  # noqa: F811
    """Saved at dp=2 x pp=2 ZeRO-3 after 4 steps (DTensor shards of each stage's part), resumed at one process and
    at dp=2 ZeRO-2 (flat buffers): the next 4 losses are those of the uninterrupted one-process run."""
    first = tmp_path / "zero3-pp2"
    run_distributed(train, 4, first, corpus, {**DP_PP, "train__stop_after_step": 4, "train__ckpt_interval": 4},
                    init_group=False)
    ref = reference(tmp_path_factory, corpus, **LAYERS)
    for name, world, layout in (("one", 1, {}), ("zero2", 2, {"parallel__zero_stage": 2})):
        out = tmp_path / name
        shutil.copytree(first, out)
        got = run_distributed(train, world, out, corpus, {**LAYERS, **layout}, init_group=False)[0]
        assert len(got["losses"]) == STEPS  # 4 steps at ZeRO-3 x pp=2, then 4 resumed
        for a, b in zip(got["losses"][4:], ref["losses"][4:], strict=True):
            assert a == pytest.approx(b, rel=1e-5)


@pytest.mark.parametrize("dp", [1, 2])
def test_zero3_with_context_parallel_matches_one_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                         corpus: Path, dp: int) -> None:  # noqa: F811
    """cp=2 ZeRO-3 on 2 processes, dp2 x cp2 on 4: FSDP2 shards over the dp x cp ranks (cp ranks hold the same
    parameters), so at dp=1 the 2 cp ranks each hold half the model, and the gradients of their different tokens
    are averaged over all dp x cp ranks."""
    model = {"model__block_size": BLOCK, "model__pos_emb": "rope"}
    results = run_distributed(train, 2 * dp, tmp_path, corpus, {**model, "parallel__cp": 2, "parallel__zero_stage": 3},
                              init_group=False)
    got = results[0]
    assert got["dp"] == "fsdp2" and got["comm"]["ring"] > 0
    for kind, want in expected_state_bytes(got["n_params"], 2 * dp, 3, "fp32").items():  # sharded over dp x cp
        assert want <= got["state_bytes"][kind] <= want * 1.01 + 512, (kind, got["state_bytes"][kind], want)
    assert_same_run(got, reference(tmp_path_factory, corpus, **model), rtol=1e-5)


def _held_at_last_backward(rank: int, world_size: int, out_dir: Path, corpus: Path,  # noqa: F811
                           extra: dict[str, Any]) -> dict[str, Any]:
    """Two steps; at the start of the stage's last backward of each, the bytes of every gathered parameter and
    every unsharded gradient (accumulated over the earlier micro-batches, or a reduce-scatter's input FSDP2 still
    keeps) this rank holds; after them, whether
    FSDP2's every unit is back to sharded and idle with nothing unsharded left."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    from dist_llm.parallel.context import ParallelContext
    from dist_llm.train.trainer import Trainer

    cfg = load_config(None, tiny_overrides(out_dir, **{"data__source": str(corpus), "train__max_steps": 2,
                                                       "train__eval_interval": 0, "model__bias": False, **extra}))
    ctx = ParallelContext.from_config(cfg)
    try:
        trainer = Trainer(cfg, ctx)
        dp, seen = trainer.dp, []
        states = [unit._get_fsdp_state() for unit in dp.fsdp_units]
        params = [fp for state in states for g in state._fsdp_param_groups for fp in g.fsdp_params]
        micro_step = dp.micro_step

        def unsharded_grads() -> list[torch.Tensor]:
            return [g for fp in params for g in (fp.unsharded_param.grad, fp.unsharded_accumulated_grad)
                    if g is not None]

        def recording(*, last: bool) -> Any:
            if last:
                seen.append((sum(fp.unsharded_param.untyped_storage().nbytes() for fp in params),
                             sum(g.untyped_storage().nbytes() for g in unsharded_grads())
                             + sum(r.reduce_scatter_input.untyped_storage().nbytes()  # (the root's: every unit's)
                                   for r in states[-1]._comm_ctx.reduce_scatter_states)))
            return micro_step(last=last)

        dp.micro_step = recording
        trainer.fit()
        groups = [g for state in states for g in state._fsdp_param_groups]
        clean = (all(g.is_sharded and g._training_state == TrainingState.IDLE for g in groups)
                 and all(state._training_state == TrainingState.IDLE for state in states) and not unsharded_grads())
        return {"seen": seen, "clean": clean, "pp_rank": ctx.pp_rank}
    finally:
        ctx.destroy()


@pytest.mark.parametrize("reduce", ["step", "micro_batch"])
def test_memory_counts_what_a_stage_holds_through_the_step(tmp_path: Path, corpus: Path, reduce: str) -> None:  # noqa: F811
    """`dist-llm memory`'s ZeRO-3-with-pp term (memory.pipelined_zero3_bytes) is what each stage holds at the start
    of its last backward: its part gathered whole and its gradients accumulated whole, to the byte; with
    parallel.pp_reduce_grads=micro_batch its part gathered and no gradient but the fp32 shards (not even the last
    unit's reduce-scatter input, which FSDP2 keeps until a backward marked last). FSDP2's state after the step's
    partial backwards (root hooks through the stage's own call) is back where a step starts."""
    from dist_llm import memory

    extra = {**DP_PP, "model__tie_embeddings": False, "parallel__pp_reduce_grads": reduce}
    got = run_distributed(_held_at_last_backward, 4, tmp_path, corpus, extra, init_group=False)
    cfg = load_config(None, tiny_overrides(tmp_path, data__source=str(corpus), model__bias=False, **extra))
    for r in got[:2]:
        want = memory.pipelined_zero3_bytes(cfg, tp=1, pp=2, pp_rank=r["pp_rank"])
        (params, grads), again = r["seen"]
        # fp32: a gathered parameter and its whole gradient take the same bytes
        assert params > 0 and grads == (params if reduce == "step" else 0) and params + grads == want, (r, want)
        assert again == (params, grads)  # the second step the same: nothing left over from the first
    assert all(r["clean"] for r in got)  # after the step: every unit resharded and idle, no unsharded gradient


def test_reduce_inputs_are_released_after_the_compute_stream_waits_for_them() -> None:
    """`release_reduce_inputs` on FSDP2's comm context: the compute stream waits for each reduce-scatter's event
    (under NCCL the input's memory is read by the reduce-scatter's stream until then), and only then are the inputs
    dropped. On the CPU the events are None, so the training tests never take the wait: fake events stand in for
    CUDA's here. A context without the list (another torch's FSDP2) is refused, not passed over."""
    import weakref
    from types import SimpleNamespace

    from dist_llm.parallel.data.fsdp import release_reduce_inputs

    class Stream:
        def __init__(self) -> None:
            self.waited: list[Any] = []

        def wait_event(self, event: Any) -> None:
            self.waited.append((event, alive()))  # (how many inputs were still held when the wait was issued)

    inputs = [torch.empty(8), torch.empty(4)]
    refs = [weakref.ref(t) for t in inputs]

    def alive() -> int:
        return sum(r() is not None for r in refs)

    ctx = SimpleNamespace(reduce_scatter_states=[SimpleNamespace(reduce_scatter_input=t, event=f"event{i}")
                                                 for i, t in enumerate(inputs)])
    del inputs
    stream = Stream()
    release_reduce_inputs(ctx, stream)
    assert stream.waited == [("event0", 2), ("event1", 2)]  # every wait while both were held
    assert alive() == 0 and ctx.reduce_scatter_states == []  # then dropped
    with pytest.raises(RuntimeError, match="keeps no reduce_scatter_states; use torch>=2.13"):
        release_reduce_inputs(SimpleNamespace(reduce_scatter_state=None), stream)


def test_zb1_bf16_sums_each_weight_pass_in_fp32_as_1f1b(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """ZeRO-3 with bf16 mixed precision under ZB-H1: 8 steps equal 1F1B's. FSDP2 folds a backward's bf16 weight
    gradient into its fp32 accumulator in the unit's post-backward hook, which under zb1 fires in B (the input
    gradient); W writes the weight gradient later. Each micro-batch's gradient must still be rounded to bf16 once
    and summed in fp32, as 1F1B does: the last stage's trailing W2 W3 (W1 W2 W3 at pp=3) run with no B between
    them, and summed their bf16 gradients in bf16. The gradient of each micro-batch is the same computation in
    either schedule (W runs the weight matmuls B left), so only that summation may differ: the tolerance is
    fp32 rounding (another order of the same fp32 sums; on the CPU the runs are equal to the bit), far below one
    bf16 rounding of a gradient (2^-9 relative), which moved the second step's loss by 6e-6 relative."""
    extra = {**DP_PP, "train__precision": "bf16"}
    got, ref = (run_distributed(train, 4, tmp_path / name, corpus, {**extra, "parallel__pp_schedule": name},
                                init_group=False) for name in ("zb1", "1f1b"))
    assert {r["dp"] for r in got} == {"fsdp2"}
    for a, b in zip(got[0]["losses"], ref[0]["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-6)
    want = merged(ref)
    for name, p in merged(got).items():
        torch.testing.assert_close(p, want[name], rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def _stream_dtypes(rank: int, world_size: int, out_dir: Path, corpus: Path,  # noqa: F811
                   extra: dict[str, Any]) -> dict[str, Any]:
    """Two steps; the dtype of the residual stream each forward of this stage hands its first block, read before
    FSDP2's own pre-forward hook casts the block's input to its param_dtype."""
    from dist_llm.parallel.context import ParallelContext
    from dist_llm.train.trainer import Trainer

    cfg = load_config(None, tiny_overrides(out_dir, **{"data__source": str(corpus), "train__max_steps": 2,
                                                       "train__eval_interval": 0, "model__bias": False, **extra}))
    ctx = ParallelContext.from_config(cfg)
    try:
        trainer = Trainer(cfg, ctx)
        first = trainer.runtime.stage.layers[0] if trainer.runtime.stage is not None else 0
        seen: list[str] = []
        trainer.module.blocks[first].register_forward_pre_hook(lambda _, args: seen.append(str(args[0].dtype)),
                                                               prepend=True)
        trainer.fit()
        return {"seen": seen, "pp_rank": ctx.pp_rank, "dp": trainer.dp.name}
    finally:
        ctx.destroy()


def test_a_stage_runs_every_micro_batch_in_the_dtype_of_one_process(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """ZeRO-3 with bf16 mixed precision at pp=3 (a middle stage, 8 micro-batches a step): every stage hands its
    blocks the residual stream in one dtype, every micro-batch, that of one stage (dp=2, no pipeline): bf16, the
    gathered parameters'. The stage took it from its first parameter, which FSDP2 swaps between the sharded fp32
    one and the gathered bf16 one: the middle stage's first micro-batch of each step, before its blocks were
    gathered, ran in fp32. (Each FSDP2 block casts its input to bf16 anyway, so the values did not change; the
    stream's dtype at the stage's boundary and the casts in its graph did.)"""
    model = {"model__n_layer": 3, "train__micro_batch_size": 1, "parallel__zero_stage": 3, "train__precision": "bf16"}
    staged = run_distributed(_stream_dtypes, 3, tmp_path / "pp3", corpus, {**model, "parallel__pp": 3},
                             init_group=False)
    one = run_distributed(_stream_dtypes, 2, tmp_path / "one", corpus, model, init_group=False)
    assert {r["dp"] for r in staged + one} == {"fsdp2"}
    assert [len(r["seen"]) for r in staged] == [16] * 3  # 2 steps x 8 micro-batches on each stage
    assert {d for r in one for d in r["seen"]} == {"torch.bfloat16"}
    for r in staged:
        assert set(r["seen"]) == {"torch.bfloat16"}, (r["pp_rank"], r["seen"])
