"""The single-process trainer: resume, accumulation, precision, skipping bad steps, outputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dist_llm.config import ConfigError, load_config
from dist_llm.parallel.context import ParallelContext
from dist_llm.train import checkpoint as ckpt
from dist_llm.optim import lr_at
from dist_llm.precision import LossScaler
from dist_llm.train.trainer import Trainer, TrainingError
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed
from tests.test_data_parallel import corpus, train  # noqa: F401 - corpus is a fixture


def make_trainer(out_dir: Path, corpus: Path, **extra: object) -> Trainer:
    cfg = load_config(None, tiny_overrides(out_dir, data__source=str(corpus), **extra))
    return Trainer(cfg, ParallelContext.from_config(cfg))


def losses(out_dir: Path) -> dict[int, float]:
    out = {}
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def test_outputs(tmp_path: Path, corpus_file: Path) -> None:
    out = tmp_path / "run"
    last = make_trainer(out, corpus_file, train__max_steps=10, train__eval_interval=5, train__plot=True).fit()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    header = records[0]
    assert header["n_params"] > 0 and header["layout"] == {"world_size": 1, "dp": 1, "tp": 1, "pp": 1}
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 11))
    for r in steps:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"} <= r.keys()
        assert r["tokens_per_s"] > 0 and math.isfinite(r["loss"])
    assert [r["step"] for r in records if "val_loss" in r] == [5, 10]
    assert last["step"] == 10 and "val_loss" in last
    assert (out / "loss.png").stat().st_size > 1000
    assert (out / "config.yaml").is_file()
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == ["step_000010"]
    # the loss went down from ln(256)
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5


def test_resume_gives_the_same_losses(tmp_path: Path, corpus_file: Path) -> None:
    kw = dict(train__max_steps=12, model__dropout=0.1, train__ckpt_interval=3)
    make_trainer(tmp_path / "a", corpus_file, **kw).fit()
    make_trainer(tmp_path / "b", corpus_file, train__stop_after_step=6, **kw).fit()
    assert max(losses(tmp_path / "b")) == 6
    resumed = make_trainer(tmp_path / "b", corpus_file, **kw)
    assert resumed.step == 6
    resumed.fit()
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(b) == list(range(1, 13))
    assert [b[s] for s in range(7, 13)] == [a[s] for s in range(7, 13)]  # bit-identical after the resume point
    # the model too
    for pa, pb in zip(resumed.model.parameters(), make_trainer(tmp_path / "a", corpus_file, **kw).model.parameters()):
        assert torch.equal(pa, pb)


def test_resume_ignores_partial_and_prunes(tmp_path: Path, corpus_file: Path) -> None:
    out = tmp_path / "run"
    make_trainer(out, corpus_file, train__max_steps=8, train__ckpt_interval=2, train__keep_checkpoints=2).fit()
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == ["step_000006", "step_000008"]
    partial = out / "checkpoints" / "step_000010"  # a save that crashed before its manifest
    partial.mkdir()
    (partial / "train_state.json").write_text("{}")
    t = make_trainer(out, corpus_file, train__max_steps=8)
    assert t.step == 8 and t.resumed_from == out / "checkpoints" / "step_000008"
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        make_trainer(out, corpus_file, train__resume=str(partial))
    with pytest.raises(ConfigError, match="different model"):
        make_trainer(out, corpus_file, model__n_layer=3)


def test_an_explicit_rollback_sets_the_later_checkpoints_aside(tmp_path: Path, corpus_file: Path) -> None:
    """Resuming step 4 of a run saved up to step 8 starts another history: a crash of the new run after its
    step-6 save must resume that save, not the old run's step 8 (found by a review: auto took step_000008)."""
    out = tmp_path / "run"
    kw = dict(train__max_steps=8, train__ckpt_interval=2, train__keep_checkpoints=10)
    make_trainer(out, corpus_file, **kw).fit()
    root = out / "checkpoints"
    old8 = (root / "step_000008" / ckpt.MANIFEST).read_bytes()
    make_trainer(out, corpus_file, train__resume=str(root / "step_000004"), train__stop_after_step=6,
                 optim__lr=1e-3, optim__min_lr=1e-4, **kw).fit()
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_000002", "step_000004", "step_000006"]
    aside = [p for p in root.iterdir() if p.name.startswith("superseded-")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == ["step_000006", "step_000008"]
    assert (aside[0] / "step_000008" / ckpt.MANIFEST).read_bytes() == old8  # moved, not rewritten
    t = make_trainer(out, corpus_file, optim__lr=1e-3, optim__min_lr=1e-4, **kw)
    assert t.resumed_from == root / "step_000006" and t.step == 6
    # back to the first history, from its set-aside step 6: none of checkpoints/ is of it, so all of it moves
    # (before, a crash ahead of the first save resumed the second history's step 6 without a word)
    t = make_trainer(out, corpus_file, train__resume=str(aside[0] / "step_000006"), **kw)
    assert t.step == 6 and ckpt.step_dirs(root) == []
    [again] = [p for p in root.iterdir() if p.name.startswith("superseded-") and p != aside[0]]
    assert sorted(p.name for p in again.iterdir()) == ["step_000002", "step_000004", "step_000006"]


def test_gradient_accumulation_matches_one_big_batch(tmp_path: Path, corpus_file: Path) -> None:
    runs = {}
    for micro in (8, 4, 2):
        out = tmp_path / f"mb{micro}"
        make_trainer(out, corpus_file, train__max_steps=6, train__micro_batch_size=micro, train__eval_interval=0).fit()
        runs[micro] = losses(out)
    for micro in (4, 2):
        for step, loss in runs[8].items():
            assert runs[micro][step] == pytest.approx(loss, rel=1e-5), (micro, step)


def test_eval_does_not_depend_on_micro_batch(tmp_path: Path, corpus_file: Path) -> None:
    a = make_trainer(tmp_path / "a", corpus_file, train__micro_batch_size=8).evaluate()
    b = make_trainer(tmp_path / "b", corpus_file, train__micro_batch_size=2).evaluate()
    assert a == pytest.approx(b, rel=1e-5)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_close_to_fp32(tmp_path: Path, corpus_file: Path, precision: str) -> None:
    make_trainer(tmp_path / "fp32", corpus_file, train__max_steps=8, train__eval_interval=0).fit()
    trainer = make_trainer(tmp_path / precision, corpus_file, train__max_steps=8, train__eval_interval=0,
                           train__precision=precision)
    trainer.fit()
    ref, got = losses(tmp_path / "fp32"), losses(tmp_path / precision)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=5e-2)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # fp32 master weights
    if precision == "fp16":
        assert trainer.scaler.scale > 1.0


def test_non_finite_gradients_skip_the_step_then_abort(tmp_path: Path, corpus_file: Path) -> None:
    trainer = make_trainer(tmp_path / "run", corpus_file, train__max_bad_steps=2)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.model.blocks[0].mlp.up.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    out = trainer.train_step()
    assert out.skipped.item() and trainer.scaler.skipped_steps == 1
    for p, b in zip(trainer.model.parameters(), before):
        assert torch.equal(p, b)
    # the fused optimizer skipped on the device: no moment moved, no step counted (bias correction stays right)
    for state in trainer.optimizer.state.values():
        assert state["step"].item() == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    trainer.train_step()
    with pytest.raises(TrainingError, match=r"^2 steps in a row had non-finite gradients \(train.max_bad_steps=2\); "
                                            r"stopping at step 2"):
        trainer.check_bad_steps()


@pytest.mark.parametrize("log_interval", [1, 3])
def test_bad_steps_stop_the_run_at_a_log_step(tmp_path: Path, corpus_file: Path, log_interval: int) -> None:
    """The run reads the skip counters at log steps only (no host sync in a step): it stops at the first log
    step at or after max_bad_steps bad steps in a row, and saves no checkpoint of the diverged run."""
    out = tmp_path / "run"
    trainer = make_trainer(out, corpus_file, train__max_bad_steps=2, train__log_interval=log_interval,
                           train__max_steps=8, train__eval_interval=0)
    trainer.model.blocks[0].mlp.up.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    with pytest.raises(TrainingError, match=f"^{max(2, log_interval)} steps in a row .* stopping at step "
                                            f"{max(2, log_interval)},"):
        trainer.fit()
    assert ckpt.list_checkpoints(out / "checkpoints") == []


@pytest.mark.parametrize("saved", [False, True])
def test_the_bad_steps_stop_names_a_checkpoint_only_where_one_was_saved(tmp_path: Path, corpus_file: Path,
                                                                        saved: bool) -> None:
    """Before, the stop said "the last complete checkpoint is kept" in a run that had saved none."""
    out = tmp_path / "run"
    if saved:  # two good steps, saved at the end; the run resumed from them then diverges
        make_trainer(out, corpus_file, train__max_steps=2, train__eval_interval=0).fit()
    trainer = make_trainer(out, corpus_file, train__max_bad_steps=1, train__log_interval=1, train__max_steps=8,
                           train__eval_interval=0)
    trainer.model.blocks[0].mlp.up.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    with pytest.raises(TrainingError) as info:
        trainer.fit()
    step = 3 if saved else 1
    where = (f"the last complete checkpoint ({out / 'checkpoints' / 'step_000002'}) is kept" if saved else
             "and no checkpoint has been saved")
    assert str(info.value) == ("1 step in a row had non-finite gradients (train.max_bad_steps=1); stopping at step "
                               f"{step}, {where}")


def test_loss_scaler() -> None:
    bad, good = torch.tensor(1.0), torch.tensor(0.0)
    s = LossScaler(enabled=True, scale=1024.0, growth_interval=3)
    s.update(bad)
    assert s.scale == 512.0 and s.skipped_steps == 1
    for _ in range(3):
        s.update(good)
    assert s.scale == 1024.0 and s.bad_steps_in_row == 0
    s.update(bad)
    s.update(bad)
    s.update(good)
    assert s.scale == 256.0 and s.skipped_steps == 3 and s.take_worst_run() == 2 and s.take_worst_run() == 0
    floor = LossScaler(enabled=True, scale=2.0, min_scale=1.0)
    for _ in range(3):
        floor.update(bad)
    assert floor.scale == 1.0
    grads = [torch.full((3,), 256.0)]
    s.unscale_(grads)
    assert grads[0].tolist() == [1.0, 1.0, 1.0]
    restored = LossScaler(enabled=True)
    restored.load_state_dict(s.state_dict())
    assert restored.scale == s.scale and restored.good_steps == s.good_steps
    assert restored.skipped_steps == s.skipped_steps == 3
    off = LossScaler(enabled=False, scale=1024.0)
    assert off.scale == 1.0 and off.scale_loss(torch.tensor(2.0)).item() == 2.0


def test_lr_schedule() -> None:
    cfg = load_config(None, ["optim.lr=1.0", "optim.min_lr=0.1", "optim.warmup_steps=10"]).optim
    assert lr_at(0, cfg, 110) == pytest.approx(0.1)
    assert lr_at(9, cfg, 110) == pytest.approx(1.0)
    assert lr_at(60, cfg, 110) == pytest.approx(0.55)  # half way through the cosine
    assert lr_at(110, cfg, 110) == pytest.approx(0.1)
    assert lr_at(500, cfg, 110) == pytest.approx(0.1)


def test_weight_decay_only_on_matrices(tmp_path: Path, corpus_file: Path) -> None:
    trainer = make_trainer(tmp_path / "run", corpus_file)
    decay, no_decay = trainer.optimizer.param_groups
    assert decay["weight_decay"] > 0 and no_decay["weight_decay"] == 0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(trainer.model.parameters()))


def test_bpe_run_keeps_its_tokenizer_with_the_checkpoint(tmp_path: Path, corpus_file: Path) -> None:
    from dist_llm.sample import sample_text

    out = tmp_path / "run"
    make_trainer(out, corpus_file, data__tokenizer="bpe", model__vocab_size=512, train__max_steps=4).fit()
    step = out / "checkpoints" / "step_000004"
    assert (step / "tokenizer.json").is_file()
    manifest = json.loads((step / "manifest.json").read_text())
    assert "tokenizer.json" in manifest["files"]
    text = sample_text(out, "import ", max_new_tokens=10, temperature=1.0, top_k=None, seed=0, device="cpu")
    assert text.startswith("import ") and len(text) > len("import ")


def test_compile_matches_eager(tmp_path: Path, corpus_file: Path) -> None:
    kw = dict(train__max_steps=3, train__eval_interval=0, model__n_layer=1)
    make_trainer(tmp_path / "eager", corpus_file, **kw).fit()
    compiled = make_trainer(tmp_path / "compiled", corpus_file, train__compile=True, **kw)
    compiled.fit()
    assert compiled.model.blocks[0]._compiled_call_impl is not None  # nn.Module.compile() took effect
    eager, comp = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    for step in eager:
        assert comp[step] == pytest.approx(eager[step], rel=1e-5)


def test_loss_scale_is_not_taken_from_an_unscaled_run() -> None:
    fp16 = LossScaler(enabled=True, scale=1024.0)
    fp16.load_state_dict(LossScaler(enabled=False).state_dict())
    assert fp16.scale == 1024.0
    other = LossScaler(enabled=True, scale=8.0)
    fp16.load_state_dict(other.state_dict())
    assert fp16.scale == 8.0


def test_profile_steps_write_a_chrome_trace_per_rank(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """train.profile_steps=2:3 at dp=2 ZeRO-2: each rank's trace holds steps 2 and 3 only, with the compute
    and communication ranges named."""
    run_distributed(train, 2, tmp_path, corpus, {"parallel__zero_stage": 2, "train__max_steps": 4,
                                                 "train__profile_steps": "2:3"}, init_group=False)
    for rank in (0, 1):
        events = json.loads((tmp_path / "profile" / f"rank_{rank}.json").read_text())["traceEvents"]
        names = {e.get("name") for e in events}
        assert {n for n in names if n and n.startswith("step ")} == {"step 2", "step 3"}
        assert {"forward", "backward", "grad_sync", "clip", "optimizer", "comm.reduce_scatter",
                "comm.all_gather", "comm.all_reduce"} <= names, sorted(n for n in names if n and "." not in n[:3])
    with pytest.raises(ConfigError, match=r"^train.profile_steps: expected a:b with 1 <= a <= b, got '3:2'$"):
        load_config(None, tiny_overrides(tmp_path, train__profile_steps="3:2"))
