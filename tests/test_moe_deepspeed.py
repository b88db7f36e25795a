"""MoE with `parallel.backend=deepspeed` (ep=1): DeepSpeed's engine backpropagates the loss the model returns, whose
gradient carries the routers' aux and z terms (model/gpt.py `_balancing_gradient`); the trainer nudges the
aux-free bias after DeepSpeed's step and reports the MoE metrics as under the native engines. Checkpoints move
between DeepSpeed at ep=1 and the native engine at ep=2 both ways, resharding the expert stacks by global id.

fp32 at 1e-5 against one process (or the native ep=2 run, itself equal to one process in
test_expert_parallel.py): the same tokens meet the same experts with the same weights, only the order of the
gradient sums differs. Micro-batches of 2 everywhere: the balancing losses are per forward."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_data_parallel import STEPS, assert_same_run, corpus, reference, train  # noqa: F401 - corpus: fixture

MOE = {"model__n_experts": 4, "model__moe_top_k": 2, "model__moe_z_loss_coef": 0.001,  # (aux: its default 0.01)
       "model__n_shared_experts": 1, "model__moe_bias_update_rate": 0.01, "train__micro_batch_size": 2}
DS = {"parallel__backend": "deepspeed"}
METRICS = ("moe_aux_loss", "moe_z_loss", "moe_imbalance", "moe_dropped_fraction")


def expert_biases(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every MoE layer's expert_bias as a checkpoint holds it."""
    from dist_llm.train import checkpoint as ckpt

    keys = [k for k in ckpt.SafeReader(str(step_dir)).read_metadata().state_dict_metadata if k.endswith("expert_bias")]
    state = {"model": {k.removeprefix("model."): torch.zeros(MOE["model__n_experts"]) for k in keys}}
    ckpt.load_model_state(step_dir, state)
    return state["model"]


def resume_at(first: Path, out: Path, corpus: Path, extra: dict[str, Any]) -> dict[str, Any]:  # noqa: F811
    """A copy of run `first` resumed from its step-4 checkpoint on 2 ranks with `extra` (steps 5-8)."""
    shutil.copytree(first, out)
    shutil.rmtree(out / "checkpoints" / "step_000008")
    resume = {"train__resume": str(out / "checkpoints" / "step_000004")}
    return run_distributed(train, 2, out, corpus, {**MOE, **extra, **resume}, init_group=False, timeout=600)[0]


def test_zero2_matches_one_process_and_resumes_at_ep2(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                      corpus: Path) -> None:  # noqa: F811
    """dp=2 DeepSpeed ZeRO-2 with a shared expert, aux + z losses and the aux-free bias: 8 steps equal one process
    (losses, parameters, the MoE metrics); its step-4 checkpoint resumes under the native engine at ep=2 (each rank
    reading its half of the experts) with the uninterrupted losses, and both runs end with the same expert bias."""
    first = tmp_path / "ds"
    got = run_distributed(train, 2, first, corpus, {**MOE, **DS, "parallel__zero_stage": 2,
                                                    "train__ckpt_interval": 4}, init_group=False, timeout=600)[0]
    ref = reference(tmp_path_factory, corpus, **MOE)
    assert got["dp"] == "deepspeed"
    assert_same_run(got, ref, rtol=1e-5)
    for a, b in zip(got["records"], ref["records"], strict=True):
        for key in METRICS:  # (logged rounded to 6 decimals)
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)
    resumed = resume_at(first, tmp_path / "ep2", corpus, {"parallel__ep": 2, "parallel__zero_stage": 1})
    assert resumed["dp"] != "deepspeed"
    assert_same_run(resumed, ref, rtol=1e-5)
    biases = expert_biases(first / "checkpoints" / "step_000008")
    assert biases and all(b.abs().sum() > 0 for b in biases.values())  # the premise: the bias moved
    # sign steps of equal counts: the same bias to the bit, whichever engine took steps 5-8
    for name, b in expert_biases(tmp_path / "ep2" / "checkpoints" / "step_000008").items():
        torch.testing.assert_close(b, biases[name], rtol=0, atol=0)


def test_ep2_checkpoint_resumes_at_deepspeed_zero0_1_and_3(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """The native engine's ep=2 checkpoint (experts saved by global id from two ranks' halves) resumes under
    DeepSpeed at ZeRO-1 and ZeRO-3 (experts whole, or partitioned by DeepSpeed) with the uninterrupted run's
    losses and parameters. ZeRO-3 saves the expert bias too (a buffer beside its partitions: it saved none), and
    ZeRO-0, which resumes the weights alone, resumes the bias with them. ZeRO-3 started from that checkpoint by
    model.init_from=ckpt: builds with its bias, as the native one-process start loads it, and trains to its losses."""
    first = tmp_path / "ep2"
    whole = run_distributed(train, 2, first, corpus, {**MOE, "parallel__ep": 2, "train__ckpt_interval": 4},
                            init_group=False)[0]
    for stage in (1, 3):
        out = tmp_path / f"ds{stage}"
        got = resume_at(first, out, corpus, {**DS, "parallel__zero_stage": stage})
        assert got["dp"] == "deepspeed"
        assert_same_run(got, whole, rtol=1e-5)
        want = expert_biases(first / "checkpoints" / "step_000008")
        for name, b in expert_biases(out / "checkpoints" / "step_000008").items():
            torch.testing.assert_close(b, want[name], rtol=0, atol=0, msg=lambda m, n=name, s=stage: f"{s} {n}: {m}")
    # stage 0 resumes the weights only (its moments start afresh), but the bias with them: it was loaded into a copy.
    # The same world then starts ZeRO-3 from that checkpoint by model.init_from: the bias read with the weights
    # (before: the build filled the parameters only, and the bias stayed zero), the native one-process losses
    step = first / "checkpoints" / "step_000004"
    want = expert_biases(step)
    assert want and all(b.abs().sum() > 0 for b in want.values())  # the premise: a bias to read
    start = {"model__init_from": f"ckpt:{step}", "train__max_steps": INIT_STEPS}
    ranks = run_distributed(_zero0_resumed_then_zero3_from, 2, tmp_path / "world", corpus, step, start, timeout=600)
    native = train(0, 1, tmp_path / "native", corpus, {**MOE, **start})
    for got in ranks:
        for built in ("zero0", "zero3"):
            assert sorted(got[built]) == sorted(want), built
            for name, b in got[built].items():
                torch.testing.assert_close(b, want[name], rtol=0, atol=0, msg=lambda m, n=name, s=built: f"{s} {n}: {m}")
    assert len(ranks[0]["losses"]) == len(native["losses"]) == INIT_STEPS
    for a, b in zip(ranks[0]["losses"], native["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)


INIT_STEPS = 4  # (the bias decides the routing from the first forward on: a few steps show it)


def _zero0_resumed_then_zero3_from(rank: int, world_size: int, out_dir: Path, corpus: Path,  # noqa: F811
                                   step: Path, start: dict[str, Any]) -> dict[str, Any]:
    """Two trainers in one world (the process group is the harness's, kept between them): DeepSpeed ZeRO-0 resumed
    from `step`, then ZeRO-3 from a fresh start `start` (model.init_from=ckpt:`step`) trained to its end. Each one's
    MoE layers' expert bias as built, and the second's losses."""
    from dist_llm.config import load_config
    from dist_llm.parallel.context import ParallelContext
    from dist_llm.train.trainer import Trainer
    from tests.conftest import tiny_overrides

    out: dict[str, Any] = {}
    for built, extra in (("zero0", {"parallel__zero_stage": 0, "train__resume": str(step)}),
                         ("zero3", {"parallel__zero_stage": 3, **start})):
        where = out_dir / built
        cfg = load_config(None, tiny_overrides(where, **{"data__source": str(corpus), "train__max_steps": STEPS,
                                                         "train__eval_interval": 0, "model__bias": False, **MOE,
                                                         **DS, **extra}))
        trainer = Trainer(cfg, ParallelContext.from_config(cfg))
        assert (trainer.resumed_from is not None) == (built == "zero0")
        out[built] = {n: b.clone() for n, b in trainer.module.named_buffers() if n.endswith("expert_bias")}
        if built == "zero3":
            trainer.fit()
            lines = (where / "metrics.jsonl").read_text().splitlines() if rank == 0 else []
            out["losses"] = [r["loss"] for r in map(json.loads, lines) if "loss" in r]
        del trainer
    return out


def test_ep_above_1_is_refused_with_one_line(tmp_path: Path) -> None:
    """DeepSpeed's engine reduces every gradient over all of dp: the experts of ep>1, which differ between the ep
    ranks, would be mixed. The CLI refuses before launching anything: exit 2, one line naming the keys."""
    from tests.test_cli import run

    proc = run("-m", "dist_llm.cli", "train", "--nproc-per-node", "2", "model.n_experts=4", "parallel.ep=2",
               "parallel.backend=deepspeed", f"train.out_dir={tmp_path}", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "dist-llm: error: parallel.ep: 2 with parallel.backend=deepspeed is not supported: DeepSpeed's engine would "
        "all-reduce the expert gradients over all of dp, mixing different experts; use parallel.ep=1 or "
        "parallel.backend=native"]
