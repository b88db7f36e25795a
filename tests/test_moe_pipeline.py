"""MoE under pipeline parallelism (parallel.pp), alone and with expert parallelism (dp x pp x ep).

Each stage attaches its own MoE layers' aux and z-loss terms to its backward (parallel/pipeline/balancing.py),
and the metrics sum every stage's layers. Compared with one process at the same micro-batch size (the balancing
losses are per forward) in fp32: the same tokens meet the same experts with the same weights, only where the
rows are computed and the order of the gradient sums change (the tied embedding's two stage contributions, the
dp mean, the all-to-all's backward), so losses agree to float rounding of reordered sums, 1e-5 relative."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_llm.config import ConfigError, load_config
from tests.distributed import run_distributed
from tests.test_data_parallel import STEPS, corpus, reference, train  # noqa: F401 - corpus: fixture
from tests.test_pipeline import merged

# two MoE blocks, one per stage at pp=2: aux loss, z-loss, a shared expert and the aux-free bias on both (one cell
# below runs without the shared expert and the bias: PLAIN)
MOE = {"model__n_experts": 4, "model__moe_top_k": 2, "model__moe_z_loss_coef": 0.001,
       "model__n_shared_experts": 1, "model__moe_bias_update_rate": 0.01, "train__micro_batch_size": 2}
PLAIN = {"model__n_shared_experts": 0, "model__moe_bias_update_rate": 0.0}  # routed experts alone, no selection bias


def assert_same(results: list[dict[str, Any]], ref: dict[str, Any], *, atol: float) -> None:
    got = results[0]
    assert len(got["losses"]) == STEPS
    for a, b in zip(got["records"], ref["records"], strict=True):
        for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss", "moe_imbalance", "moe_dropped_fraction"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
        # every stage's layers gathered in block order, each counted over dp (and ep) as one process counts them
        assert a["moe_tokens_per_expert"] == b["moe_tokens_per_expert"], a["step"]
        assert a["moe_layer_imbalance"] == pytest.approx(b["moe_layer_imbalance"], rel=1e-5), a["step"]
    params = merged(results)
    assert params.keys() == ref["params"].keys()
    for name, p in ref["params"].items():
        torch.testing.assert_close(params[name], p, rtol=1e-5, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pp2_matches_one_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,
                                 schedule: str) -> None:
    """Stage 0's router is reached only through the term it attaches itself (without it grad_norm differed at
    the 4th digit); every parameter within 1e-6 absolute."""
    extra = {**MOE, "parallel__pp": 2, "parallel__pp_schedule": schedule}
    assert_same(run_distributed(train, 2, tmp_path, corpus, extra, init_group=False),
                reference(tmp_path_factory, corpus, **MOE), atol=1e-6)


@pytest.mark.parametrize("zero_stage,schedule,layers", [
    (0, "gpipe", {}),  # the flat all-reduce over dp leaves the experts to their expert-dp group (mixed them before)
    (1, "1f1b", {"model__moe_every": 2}),  # stage 0 holds a dense block alone: no experts, stand-in metric rows
    (2, "zb1", PLAIN),  # the attached term inside the split backward; expert reduce-scatters from the W passes
    (1, "interleaved", {"model__n_layer": 4, "parallel__pp_virtual": 2}),  # two chunks a rank, each its own term
    (3, "1f1b", {}),  # FSDP2 per stage: routers and experts units of their own, one reduce-scatter a step
], ids=["ddp-flat-gpipe", "zero1-1f1b-dense-stage0", "zero2-zb1-plain", "zero1-interleaved", "zero3-1f1b"])
def test_dp2_pp2_ep2_matches_one_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,
                                         zero_stage: int, schedule: str, layers: dict[str, Any]) -> None:
    """World 4: dp=2 x pp=2, ep=2 inside each stage's dp pair (experts 0-1 on dp rank 0, 2-3 on dp rank 1), with
    each data-parallel form a pipeline takes.
    atol 3e-6 on parameters as test_pipeline's dp x pp: the tied embedding's two stage contributions and the
    dp mean are summed in another order, which Adam scales up on near-zero gradients."""
    model = {k: v for k, v in layers.items() if k.startswith("model")}
    extra = {**MOE, "train__micro_batch_size": 1, **model}
    results = run_distributed(train, 4, tmp_path, corpus, {**extra, **layers, "parallel__pp": 2, "parallel__ep": 2,
                                                           "parallel__zero_stage": zero_stage,
                                                           "parallel__pp_schedule": schedule,
                                                           "parallel__bucket_mb": 0.01}, init_group=False)
    assert_same(results, reference(tmp_path_factory, corpus, **extra), atol=3e-6)
    assert {r["dp"] for r in results} == {{0: "ddp-flat", 3: "fsdp2"}.get(zero_stage, f"zero{zero_stage}+ep")}


def test_dp4_pp2_ep4_on_eight_ranks(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> None:
    """ep=4 with pp=2 needs 8 ranks (dp=4 x pp=2, ZeRO-1, two micro-batches a pipeline), so 4 steps only: each
    stage's ep group holds one expert a rank. Losses, balancing terms, grad norms and parameters equal one process
    as above."""
    extra = {**MOE, "train__micro_batch_size": 1, "train__max_steps": 4}
    results = run_distributed(train, 8, tmp_path, corpus, {**extra, "parallel__pp": 2, "parallel__ep": 4,
                                                           "parallel__zero_stage": 1}, init_group=False)
    ref = reference(tmp_path_factory, corpus, **extra)
    assert {r["dp"] for r in results} == {"zero1+ep"} and len(ref["losses"]) == 4
    for a, b in zip(results[0]["records"], ref["records"], strict=True):
        for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss", "moe_imbalance"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    params = merged(results)
    assert params.keys() == ref["params"].keys()
    for name, p in ref["params"].items():
        torch.testing.assert_close(params[name], p, rtol=1e-5, atol=3e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_pp2_checkpoint_resumes_at_pp1_and_ep2(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                               corpus: Path) -> None:
    """Saved at pp=2 (each stage its own blocks, experts at global ids, the aux-free bias buffers), resumed at
    one process and at dp=2 x ep=2: the next losses and the final parameters are the uninterrupted run's."""
    first = tmp_path / "first"
    run_distributed(train, 2, first, corpus, {**MOE, "parallel__pp": 2, "train__stop_after_step": 4,
                                              "train__ckpt_interval": 4}, init_group=False)
    ref = reference(tmp_path_factory, corpus, **MOE)
    for name, world, layout in (("pp1", 1, {}), ("ep2", 2, {"parallel__ep": 2})):
        out = tmp_path / name
        shutil.copytree(first, out)
        got = (train(0, 1, out, corpus, MOE) if world == 1 else
               run_distributed(train, world, out, corpus, {**MOE, **layout}, init_group=False)[0])
        assert len(got["losses"]) == STEPS  # steps 1-4 from the pp=2 run, then 5-8 after the resume
        for a, b in zip(got["losses"][4:], ref["losses"][4:], strict=True):
            assert a == pytest.approx(b, rel=1e-5)
        for name, p in ref["params"].items():
            torch.testing.assert_close(got["params"][name], p, rtol=1e-5, atol=3e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_pp_is_accepted_and_the_other_refusals_stay_one_line() -> None:
    """MoE and ep load with every pp schedule; what still refuses names its own key, not pp."""
    base = ["model.n_experts=4", "parallel.pp=2", "model.n_layer=4"]
    for extra in (["parallel.pp_schedule=1f1b"], ["parallel.pp_schedule=gpipe"], ["parallel.pp_schedule=zb1"],
                  ["parallel.pp_schedule=interleaved", "parallel.pp_virtual=2"], ["parallel.ep=2"],
                  ["parallel.ep=2", "train.compile=true"]):  # (the dispatch runs outside the compiled graphs)
        load_config(None, [*base, *extra])
    for extra, message in (
            (["parallel.ep=2", "parallel.backend=deepspeed"], "parallel.backend: deepspeed is not supported with "
                                                              "parallel.pp>1; use backend=native"),):
        with pytest.raises(ConfigError) as err:
            load_config(None, [*base, *extra])
        assert str(err.value) == message


def test_stage_split_under_ep_is_the_whole_models() -> None:
    """The FLOP balance counts an MoE block's experts at top_k/E of the WHOLE layer's (stage.py), also where ep
    left a rank E/ep of them: the cut reads the whole shapes back from the slices, so every ep (and
    `dist-llm memory`, which splits the whole model) gives the same stages. Before, an ep=4 rank counted its
    MoE block (the last of 3) at a quarter of its experts and split 1 | 2 blocks where the whole model gives 2 | 1."""
    from types import SimpleNamespace

    from dist_llm.model.gpt import GPT
    from dist_llm.parallel.expert import apply_expert_parallel
    from dist_llm.parallel.pipeline.stage import cut_to_stage, stage_ranges, whole_shapes

    cfg = load_config("configs/moe.yaml", ["model.n_layer=3", "model.moe_every=3", "parallel.pp=2"])
    with torch.device("meta"):
        whole, sliced = GPT(cfg.model), GPT(cfg.model)
    apply_expert_parallel(sliced, SimpleNamespace(ep=4, ep_rank=1, ep_group=None, comm=None))  # type: ignore[arg-type]
    shapes = [(n, tuple(p.shape)) for n, p in whole.named_parameters()]
    assert whole_shapes(sliced, tp=1) == shapes
    expected = stage_ranges(cfg.model, 2, shapes)
    assert [len(r) for r in expected] == [2, 1]
    assert cut_to_stage(sliced, cfg, 2, 0)[0] == expected[0]
    # a tensor-parallel slice reads back likewise (configs/3d.yaml, tp=8 x pp=2, split its 24 blocks 16 | 8 by
    # its slices where `dist-llm memory` splits the whole model 13 | 11)
    from torch import nn

    from dist_llm.parallel.marks import mark_partition

    layer = nn.Linear(8, 4, bias=False)  # weight (4, 8): a column slice of a (8, 8) at tp=2
    mark_partition(layer.weight, 0)
    assert whole_shapes(nn.ModuleDict({"fc": layer}), tp=2) == [("fc.weight", (8, 8))]
