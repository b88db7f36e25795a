"""`dist-llm memory --suggest`: every layout counted analytically, ranked by the stated cost model, grouped by
layout, the cut said, --params honoured; the dp forms' predicted bytes equal comm.py's counters on real ranks.
(Its speed on configs/3d.yaml at 32 ranks is timed by scripts/bench_suggest.py, not here.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dist_llm import memory
from dist_llm.memory import suggest as memory_suggest
from dist_llm.cli import main
from dist_llm.config import load_config
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed
from tests.test_data_parallel import corpus, train  # noqa: F401


def memory_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["memory", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_every_candidate_has_predicts_own_peak(tmp_path: Path) -> None:
    """The suggester counts memory once per distinct shape, but each candidate's peak is memory.predict's."""
    cfg = load_config(None, tiny_overrides(tmp_path, model__tie_embeddings=False, train__global_batch_size=16))
    plan = memory_suggest.suggest(cfg, 4, 2**40)
    assert {s.layout for s in plan.fits} == {(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 4, 1), (1, 2, 2)}  # (n_layer=2: pp<=2)
    assert len(plan.fits) == plan.variants  # everything fits a TiB
    for s in plan.fits[::7]:
        assert s.est.peak_bytes == memory.predict(s.cfg, 4).peak_bytes, s.cfg.parallel


def test_context_parallelism_is_refused_not_miscounted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--suggest at cp=2 listed dp=4 at 4 ranks as the config's own layout (dp x cp x tp x pp = 8): it searches
    without context parallelism, so it says so."""
    code, out, err = memory_cli(capsys, "--config", str(Path(__file__).parent.parent / "configs" / "tiny.yaml"),
                                "--world-size", "4", "--suggest", "--gpu-memory", "80GiB", "parallel.cp=2")
    assert (code, out, err.strip().splitlines()) == (2, "", [
        "dist-llm: error: parallel.cp: --suggest searches dp x tp x pp without context parallelism (its ring's "
        "exchanges are not in the cost model), got cp=2; `dist-llm memory` without --suggest counts this layout"])


def test_a_layout_must_fit_its_build_too(tmp_path: Path) -> None:
    """Native ZeRO-1/2 in bf16 from model.init_from builds from the loaded fp32 model (4 bytes a parameter, cast one
    at a time into the 16-bit flat buffer): with a large model and small activations the build needs more than
    training. A budget that holds such a candidate's training peak but not its build leaves it out, and its reason
    says what building needs. (From a random start it draws each parameter into the buffer: no such excess.)"""
    cfg = load_config(None, tiny_overrides(tmp_path, model__n_embd=512, model__n_head=8, train__precision="bf16",
                                           train__device="cuda", train__micro_batch_size=1, train__global_batch_size=16,
                                           parallel__zero_stage=2, parallel__bucket_mb=1))  # (small buckets)
    hf_dir = tmp_path / "hf"  # (its config.json says the dtype the loader reads; no weights are read here)
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    cfg.model.init_from = f"hf:{hf_dir}"
    everything = memory_suggest.suggest(cfg, 16, 2**40)  # (at dp=16 training holds 2 + 16/16 bytes a parameter)
    z2 = next(s for s in everything.fits if s.layout == (16, 1, 1) and s.cfg.parallel.zero_stage == 2)
    est = memory.predict(z2.cfg, 16)  # (the counts themselves: test_memory's)
    assert z2.est.build_peak_bytes == est.params_bytes + est.master_bytes + est.init_transient_bytes
    assert z2.est.build_peak_bytes > z2.est.peak_bytes
    budget = z2.est.peak_bytes
    plan = memory_suggest.suggest(cfg, 16, budget)
    assert not any(s.layout == z2.layout and s.cfg.parallel == z2.cfg.parallel and s.cfg.train == z2.cfg.train
                   for s in plan.fits)
    assert all(max(s.est.peak_bytes, s.est.build_peak_bytes) <= budget for s in plan.fits)
    assert z2.reason(budget).startswith(f"does not fit: peak {z2.est.peak_bytes / 2**30:.3g} (building: "
                                        f"{z2.est.build_peak_bytes / 2**30:.3g}) of {budget / 2**30:.3g} GiB;")


def test_a_pipeline_setting_does_not_hide_the_layouts_without_a_pipeline(tmp_path: Path) -> None:
    """A config set for pp=2 with parallel.pp_overlap_p2p=true, which pp=1 refuses: the candidates without a pipeline
    are still counted (they drop the setting), not skipped as invalid."""
    cfg = load_config(None, tiny_overrides(tmp_path, model__tie_embeddings=False, train__global_batch_size=16,
                                           parallel__pp=2, parallel__pp_overlap_p2p=True))
    plan = memory_suggest.suggest(cfg, 4, 2**40)
    assert {s.layout for s in plan.fits} == {(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 4, 1), (1, 2, 2)}
    assert {s.cfg.parallel.pp_overlap_p2p for s in plan.fits if s.layout[2] == 2} == {True}


def test_zero3_under_a_pipeline_is_tried_with_both_gradient_reductions(tmp_path: Path) -> None:
    """ZeRO-3 x pp candidates are counted with parallel.pp_reduce_grads=step and =micro_batch (the other stages
    and pp=1 with step alone: they refuse micro_batch), whatever the config sets; micro_batch's peak is lower by
    the stage's gradients held whole (memory.pipelined_zero3_bytes), so with a budget between the two only it fits,
    shown as zero "3/mb"."""
    over = dict(model__tie_embeddings=False, train__global_batch_size=16, parallel__pp=2, parallel__zero_stage=3)
    for setting in ("step", "micro_batch"):
        cfg = load_config(None, tiny_overrides(tmp_path, **over, parallel__pp_reduce_grads=setting))
        plan = memory_suggest.suggest(cfg, 4, 2**40)
        tried = {(s.layout[2], s.cfg.parallel.zero_stage, s.cfg.parallel.pp_reduce_grads) for s in plan.fits}
        assert tried == {(1, 0, "step"), (1, 1, "step"), (1, 2, "step"), (1, 3, "step"), (2, 0, "step"),
                         (2, 1, "step"), (2, 2, "step"), (2, 3, "step"), (2, 3, "micro_batch")}, setting
        assert plan.this_config is not None and plan.this_config.cfg.parallel.pp_reduce_grads == setting
        every = [(s.layout, s.cfg.parallel.zero_stage, s.cfg.train.micro_batch_size, s.cfg.train.activation_checkpointing,
                  s.cfg.parallel.pp_reduce_grads) for s in plan.fits]
        assert len(set(every)) == len(every) == plan.variants  # each candidate counted once
        assert {row["pp_reduce_grads"] for row in memory_suggest.to_json(plan)} <= {"step", "micro_batch"}
        text = memory_suggest.format_plan(plan, top=20, memory_text="x")
        assert (f"as configured (zero {'3/mb' if setting == 'micro_batch' else '3'}," in text
                and ("zero 3/mb: parallel.pp_reduce_grads=micro_batch" in text) == (setting == "micro_batch"))
    # the same candidate both ways: dp2 x pp2, ZeRO-3, the config's micro batch and checkpointing
    pair = {s.cfg.parallel.pp_reduce_grads: s for s in plan.fits if s.layout == (2, 1, 2) and s.cfg.parallel.zero_stage
            == 3 and s.cfg.train.micro_batch_size == cfg.train.micro_batch_size
            and s.cfg.train.activation_checkpointing == cfg.train.activation_checkpointing}
    held = max(memory.pipelined_zero3_bytes(pair["step"].cfg, tp=1, pp=2, pp_rank=r) for r in (0, 1))
    assert held > 0 and pair["step"].est.peak_bytes > pair["micro_batch"].est.peak_bytes
    assert pair["step"].comm.bytes["reduce_scatter"] < pair["micro_batch"].comm.bytes["reduce_scatter"]
    budget = (pair["step"].needs_bytes + pair["micro_batch"].needs_bytes) // 2
    tight = memory_suggest.suggest(cfg, 4, budget)
    piped = {(s.cfg.parallel.zero_stage, s.cfg.parallel.pp_reduce_grads) for s in tight.fits if s.layout == (2, 1, 2)
             and s.cfg.train.micro_batch_size == cfg.train.micro_batch_size
             and s.cfg.train.activation_checkpointing == cfg.train.activation_checkpointing}
    assert (3, "micro_batch") in piped and (3, "step") not in piped
    assert memory_suggest._row(pair["micro_batch"], budget, 1).startswith("   2   1   2  3/mb")


def test_zero3_on_one_dp_rank_under_a_pipeline_is_this_config(tmp_path: Path) -> None:
    """dp=1 x pp=2 at ZeRO-3 runs FSDP2 over one rank (a mesh exists), holding the stage's part as under dp > 1:
    `--suggest` counts it and finds it as the config's own (it said the config could not run there)."""
    cfg = load_config(None, tiny_overrides(tmp_path, parallel__pp=2, parallel__zero_stage=3,
                                           parallel__pp_reduce_grads="micro_batch"))
    plan = memory_suggest.suggest(cfg, 2, 2**40)
    own = plan.this_config
    assert own is not None and own.layout == (1, 1, 2) and own.cfg.parallel.zero_stage == 3
    assert own.cfg.parallel.pp_reduce_grads == "micro_batch"


@pytest.mark.parametrize(("schedule", "per_micro_batch"), [("1f1b", 1), ("interleaved", 3), ("zb1", 3)])
def test_each_schedule_is_counted_at_its_own_bubble(tmp_path: Path, schedule: str, per_micro_batch: int) -> None:
    """A config set for pp=2 with each schedule: every layout is a candidate (interleaving's where the micro-batches
    per step are a multiple of pp; its chunks dropped without a pipeline), and a pp=2 candidate with m micro-batches
    idles 1/(k*m + 1) of its step, k the stage-time units one micro-batch keeps a stage busy in the steady state
    beyond the warm-up's: 1F1B 1 (the classic (p-1)/(m+p-1)), interleaved 3 (v=3 chunks: (p-1)/(vm+p-1)), ZB-H1
    with its exchanges overlapped 3 ((p-1)/(3m+p-1), the paper's, for m >= p); so its bubble time is the step's
    compute / (k*m). Before, an interleaved config had no candidate at all (each layout was checked at one
    micro-batch per step), and every schedule was priced at 1F1B's bubble."""
    extra = {"parallel__pp_virtual": 3} if schedule == "interleaved" else {}
    cfg = load_config(None, tiny_overrides(tmp_path, model__n_layer=6, train__global_batch_size=16, parallel__pp=2,
                                           parallel__pp_schedule=schedule, **extra))
    plan = memory_suggest.suggest(cfg, 4, 2**40)
    # (n_layer=6: pp=4 with 3 chunks a stage would need 12 blocks)
    assert {s.layout for s in plan.fits} == {(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 4, 1), (1, 2, 2)} | (
        set() if schedule == "interleaved" else {(1, 1, 4)})
    seen = set()
    for s in plan.fits:
        dp, pp, micro = s.layout[0], s.layout[2], s.cfg.train.micro_batch_size
        m = 16 // (micro * dp)
        if pp == 1:
            assert (s.bubble, s.bubble_s, s.cfg.parallel.pp_virtual) == (0, 0, 1)
        elif pp == 2 and (schedule != "zb1" or m >= pp):
            assert s.cfg.parallel.pp_virtual == (3 if schedule == "interleaved" else 1)
            assert s.bubble == pytest.approx(1 / (per_micro_batch * m + 1), rel=1e-12), (micro, dp)
            assert s.bubble_s == pytest.approx(s.compute_s / (per_micro_batch * m), rel=1e-12)
            seen.add((dp, m))
    # (dp, m) of the pp=2 candidates: micro-batch sizes dividing 16/dp; interleaving refuses m=1 (not a multiple
    # of pp), and ZB-H1's m < p is the simulator's figure, not checked here
    want = {(dp, 16 // dp // micro) for dp in (1, 2) for micro in (1, 2, 4, 8, 16) if micro <= 16 // dp}
    assert seen == (want if schedule == "1f1b" else {(dp, m) for dp, m in want if m >= 2})


@pytest.mark.parametrize("tie", [True, False])
def test_stage_params_are_the_cut_models(tmp_path: Path, tie: bool) -> None:
    cfg = load_config(None, tiny_overrides(tmp_path, model__n_layer=5, model__tie_embeddings=tie))
    for pp in (2, 3, 5):
        for rank in range(pp):
            want = [(n, tuple(p.shape), p.requires_grad) for n, p in memory._stage_model(cfg, pp, rank).named_parameters()]
            assert memory._stage_params(cfg, pp, rank) == want


def test_suggest_groups_layouts_says_the_cut_and_marks_the_config(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: Path) -> None:
    over = tiny_overrides(tmp_path, parallel__tp=2, parallel__pp=2, train__global_batch_size=16)
    code, out, _ = memory_cli(capsys, "--world-size", "8", "--gpu-memory", "80GiB", "--suggest", "--top", "3", *over)
    assert code == 0
    lines = out.splitlines()
    assert "distinct layouts (dp x tp x pp)" in lines[0] and lines[1].startswith("cost model: ranked by estimated step")
    n = int(lines[0].split(" distinct layouts")[0].rsplit(" ", 1)[1])
    assert f"top 3 layouts ({n - 3} cut; --top N to see more)" in lines[2]
    rows = [x.split() for x in lines[4:7]]
    assert len({tuple(r[:3]) for r in rows}) == 3  # distinct (dp, tp, pp), each its best variant
    assert all("fits: peak" in x and "bubble" in x and "comm" in x for x in lines[4:7])
    # the config's own layout (dp2 x tp2 x pp2) is shown: in the top rows, marked, or after them with its rank
    assert "this config's layout" in out
    if not any("<- this config's layout" in x for x in lines[4:7]):
        assert "this config's layout, dp2 x tp2 x pp2: ranked" in out
    assert "as configured (zero 0, micro batch 4, checkpointing none): est. step" in out


def test_ranking_follows_the_cost_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A tiny model where everything fits: dp-only (one DDP all-reduce, no bubble) ranks first, above any pipeline;
    the JSON rows are in estimated step time order, and each step time is its parts' sum as the header states."""
    over = tiny_overrides(tmp_path, train__global_batch_size=32)
    code, out, _ = memory_cli(capsys, "--world-size", "8", "--gpu-memory", "80GiB", "--suggest", "--json", *over)
    assert code == 0
    rows = json.loads(out)
    assert (rows[0]["dp"], rows[0]["tp"], rows[0]["pp"], rows[0]["zero_stage"]) == (8, 1, 1, 0)
    assert rows[0]["bubble"] == 0 and rows[0]["comm_bytes_by_kind"] == {"all_reduce": rows[0]["comm_bytes_per_step"]}
    assert [r["est_step_s"] for r in rows] == sorted(r["est_step_s"] for r in rows)
    assert len({(r["dp"], r["tp"], r["pp"]) for r in rows}) == len(rows)
    pp2 = next(r for r in rows if r["pp"] == 2)  # (n_layer=2)
    assert pp2["bubble"] == pytest.approx(1 / (32 // (pp2["dp"] * pp2["micro_batch_size"]) + 1))
    assert pp2["est_step_s"] > rows[0]["est_step_s"]
    # by hand: DDP over 8 ranks sends 2 * 7/8 of the fp32 gradients once per step
    n = memory._model_params(load_config(None, over))
    assert rows[0]["comm_bytes_per_step"] == round(2 * 7 / 8 * 4 * sum(math.prod(s) for _, s, _ in n))


def test_too_big_for_one_rank_lists_only_layouts_that_fit(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    over = tiny_overrides(tmp_path, train__global_batch_size=16)
    code, out, _ = memory_cli(capsys, "--world-size", "4", "--gpu-memory", "200MiB", "--suggest", "--json",
                              "--params", "30e6", *over)
    assert code == 0
    rows = json.loads(out)
    one_rank = memory_suggest.suggest(memory_suggest_cfg(over, 30e6), 4, 2**40)
    assert any(s.est.peak_bytes > 200 * 2**20 for s in one_rank.fits)  # some layouts do not fit ...
    assert rows and all(r["peak_bytes"] <= 200 * 2**20 for r in rows)  # ... and none of them is listed
    code, out, _ = memory_cli(capsys, "--world-size", "4", "--gpu-memory", "0.01MiB", "--suggest", *over)
    assert code == 0 and "none fits: more ranks" in out and "the smallest peak:" in out


def memory_suggest_cfg(over: list[str], params: float):  # type: ignore[no-untyped-def]
    cfg = load_config(None, over)
    cfg.model = memory_suggest.scale_model(cfg.model, params)
    return cfg


def test_params_scales_the_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    over = tiny_overrides(tmp_path, train__global_batch_size=16)
    args = ("--world-size", "4", "--gpu-memory", "80GiB", "--suggest", "--json", *over)
    small = json.loads(memory_cli(capsys, *args)[1])
    code, out, err = memory_cli(capsys, "--params", "50e6", *args)
    assert code == 0 and err.startswith("model: 0.05") and "n_layer=" in err
    big = json.loads(out)
    assert big[0]["model_states_bytes"] > 10 * small[0]["model_states_bytes"]
    # without a config: a Llama-shaped model at that size
    code, out, _ = memory_cli(capsys, "--params", "7e9", "--world-size", "16", "--gpu-memory", "80GiB", "--suggest")
    assert code == 0 and out.startswith("model: 6.") and "llama-shaped's architecture" in out
    assert "showing the best variant" in out
    code, _, err = memory_cli(capsys, "--params", "7e9", "--suggest", "--gpu-memory", "80GiB")
    assert code == 2 and err.strip() == "dist-llm: error: memory: --params with --suggest needs --world-size (or a --config)"
    # --params with a config and no --suggest: the table for the scaled model
    code, out, _ = memory_cli(capsys, "--params", "50e6", "--json", *over)
    assert code == 0 and json.loads(out)["model_states_bytes"] > 16 * 45e6


def test_scale_model_keeps_the_architecture() -> None:
    cfg = load_config("configs/3d.yaml")
    m = memory_suggest.scale_model(cfg.model, 7e9)
    assert (m.head_dim, m.norm, m.mlp, m.pos_emb, m.vocab_size) == (128, "rmsnorm", "swiglu", "rope", 50304)
    assert 6.5e9 < memory_suggest._approx_params(m) < 7.5e9 and m.n_head % 8 == 0
    assert memory_suggest._approx_params(cfg.model) == sum(math.prod(s) for _, s, _ in memory._model_params(cfg))


@pytest.mark.parametrize(("zero_stage", "precision", "extra"),
                         [(2, "bf16", {}), (3, "bf16", {}), (3, "fp32", {"model__tie_embeddings": False}),
                          (1, "bf16", {}), (0, "fp32", {})])
def test_predicted_bytes_equal_the_counted(tmp_path: Path, corpus: Path, zero_stage: int,  # noqa: F811
                                           precision: str, extra: dict[str, object]) -> None:
    """The independent check: 2 ranks, 2 micro-steps per step (ZeRO-2 reduce-scatters at each, FSDP2 gathers
    and reduce-scatters at each), several buckets; the suggester's bytes per step by kind equal what comm.py
    counted in the last step, to the byte."""
    over = {"parallel__zero_stage": zero_stage, "train__precision": precision, "train__micro_batch_size": 2,
            "train__global_batch_size": 8, "parallel__bucket_mb": 0.01, "train__max_steps": 2, **extra}
    got = run_distributed(train, 2, tmp_path, corpus, over, init_group=False)[0]["comm"]
    cfg = load_config(None, tiny_overrides(tmp_path, data__source=str(corpus), model__bias=False,
                                           **{k: v for k, v in over.items()}))
    want = memory_suggest.step_comm(cfg, dp=2, tp=1, pp=1)
    assert want.bytes == got


@pytest.mark.parametrize("extra", [{"parallel__tp": 2}, {"parallel__tp": 2, "parallel__sequence_parallel": True},
                                   {"parallel__pp": 2},
                                   {"parallel__tp": 2, "parallel__sequence_parallel": True, "train__precision": "bf16"},
                                   {"parallel__pp": 2, "train__precision": "bf16"},
                                   {"parallel__pp": 2, "parallel__pp_schedule": "interleaved", "parallel__pp_virtual": 3,
                                    "model__n_layer": 6}],
                         ids=["tp2", "tp2-sp", "pp2", "tp2-sp-bf16", "pp2-bf16", "pp2-interleaved"])
def test_tensor_and_pipeline_bytes_equal_the_counted(tmp_path: Path, corpus: Path,  # noqa: F811
                                                     extra: dict[str, object]) -> None:
    """tp (with and without sequence parallelism) and pp, 2 micro-steps: the suggester's bytes by kind are
    what comm.py counted in the last step (tp: rank 0's, whose counts it gives; pp: each stage's, which differ:
    the first and last chunks send one way only)."""
    over = {"train__micro_batch_size": 2, "train__global_batch_size": 4, "train__max_steps": 2, "parallel__dp": 1,
            **extra}
    results = run_distributed(train, 2, tmp_path, corpus, over, init_group=False)
    cfg = load_config(None, tiny_overrides(tmp_path, data__source=str(corpus), model__bias=False, **over))
    for r in results if cfg.parallel.pp > 1 else results[:1]:
        want = memory_suggest.step_comm(cfg, dp=1, tp=cfg.parallel.tp, pp=cfg.parallel.pp, pp_rank=r["pp_rank"])
        assert want.by_kind() == r["comm"], r["pp_rank"]


def test_a_group_within_a_node_is_priced_at_the_node_bandwidth() -> None:
    """Hand-computed: 600 GB of tp traffic, 50 GB of p2p, 100 GB of dp traffic, 10 calls. Ranks are numbered tp
    innermost, then pp, dp outermost, so a group is in one node when tp, tp x pp or the world fits one."""
    from dist_llm.memory.comm import BANDWIDTH, LATENCY, NODE_BANDWIDTH, Comm

    comm = Comm(bytes={"tp_all_reduce": 600 * 10**9, "p2p": 50 * 10**9, "all_reduce": 100 * 10**9}, calls=10)
    node, net, lat = NODE_BANDWIDTH, BANDWIDTH, 10 * LATENCY
    assert comm.seconds(world=32, tp=8, pp=2, gpus_per_node=8) == pytest.approx(600e9 / node + 50e9 / net + 100e9 / net + lat, rel=1e-12)
    assert comm.seconds(world=32, tp=16, pp=2, gpus_per_node=8) == pytest.approx((600e9 + 50e9 + 100e9) / net + lat, rel=1e-12)
    assert comm.seconds(world=8, tp=4, pp=2, gpus_per_node=8) == pytest.approx((600e9 + 50e9 + 100e9) / node + lat, rel=1e-12)


def test_gpus_per_node_is_checked_and_changes_the_ranking(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = memory_cli(capsys, "--world-size", "8", "--gpu-memory", "80GiB", "--suggest", "--gpus-per-node", "0")
    assert code == 2 and "--gpus-per-node must be at least 1, got 0" in err
    code, out, _ = memory_cli(capsys, "--world-size", "8", "--gpu-memory", "80GiB", "--suggest", "--gpus-per-node", "4")
    assert code == 0 and "within a node of 4 devices" in out
