"""`parallel.backend=deepspeed` on 2 gloo ranks: against our own ZeRO-2 (fp32: the same losses to 1e-5), resumed
from its own engine state, and its skipped steps reported."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_data_parallel import STEPS, corpus, train  # noqa: F401 - corpus is a fixture

DS_ZERO2 = {"parallel__zero_stage": 2, "train__micro_batch_size": 2}  # 2 micro-steps per rank
_UNINTERRUPTED: dict[str, dict[str, Any]] = {}


def train_recording(rank: int, world_size: int, out_dir: Path, corpus: Path,  # noqa: F811
                    extra: dict[str, Any]) -> dict[str, Any]:
    """`train`, noting which checkpoint files this rank hashed and which engine-state files it wrote."""
    from dist_llm.parallel.data import deepspeed as ds_backend
    from dist_llm.train import checksums

    hashed: list[str] = []
    written: list[str] = []
    hash_files, write_engine_state = checksums.hash_files, getattr(ds_backend, "write_engine_state", None)

    def hashing(root: Path, names: list[str]) -> Any:
        hashed.extend(names)
        return hash_files(root, names)

    def writing(path: Path, *args: Any, **kwargs: Any) -> None:
        written.append(path.relative_to(path.parents[1]).as_posix())
        write_engine_state(path, *args, **kwargs)

    checksums.hash_files = hashing
    if write_engine_state is not None:  # (a backend that left its files to DeepSpeed's save_checkpoint has none)
        ds_backend.write_engine_state = writing
    return {**train(rank, world_size, out_dir, corpus, extra), "hashed": hashed, "written": written}


def uninterrupted(out_dir: Path, corpus: Path) -> dict[str, Any]:  # noqa: F811
    """DeepSpeed ZeRO-2 for STEPS steps in one go (run once per test worker: a DeepSpeed run takes ~15 s)."""
    if "run" not in _UNINTERRUPTED:
        _UNINTERRUPTED["run"] = run_distributed(train, 2, out_dir, corpus, {**DS_ZERO2, "parallel__backend": "deepspeed"},
                                                init_group=False, timeout=600)[0]
    return _UNINTERRUPTED["run"]


def test_deepspeed_zero2_matches_ours(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    ours = run_distributed(train, 2, tmp_path / "ours", corpus, DS_ZERO2, init_group=False)[0]
    theirs = uninterrupted(tmp_path / "ds", corpus)
    assert theirs["dp"] == "deepspeed"
    assert len(theirs["losses"]) == STEPS
    for a, b in zip(theirs["losses"], ours["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)


def _train_reporting_the_shm_op(rank: int, world_size: int, out_dir: Path, corpus: Path,  # noqa: F811
                                extra: dict[str, Any]) -> dict[str, Any]:
    """`train`, and afterwards whether DeepSpeed's comm backend holds its shared-memory op and what its list of
    compatible ops says of it."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    from dist_llm.parallel.data.deepspeed import built_inference_all_reduce

    got = train(rank, world_size, out_dir, corpus, extra)
    return {**got, "shm_built": built_inference_all_reduce(),
            "shm_compatible": deepspeed.ops.__compatible_ops__.get(ShareMemCommBuilder.NAME)}


def test_deepspeed_on_cpu_compiles_no_op(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """DeepSpeed's comm backend JIT-compiled its shared-memory all-reduce (only its inference tensor parallelism
    calls it) at the first init_distributed on a CPU machine: a minute of g++ into TORCH_EXTENSIONS_DIR. With an
    empty one, a ZeRO-2 run trains, the op is marked incompatible and not held, and the folder stays empty (before:
    deepspeed_shm_comm built there). On a machine without a compiler the folder would stay empty anyway; the mark
    and the backend's state say it was the skip."""
    ext = tmp_path / "torch_extensions"
    ext.mkdir()
    got = run_distributed(_train_reporting_the_shm_op, 2, tmp_path / "run", corpus,
                          {**DS_ZERO2, "parallel__backend": "deepspeed", "train__max_steps": 1},
                          init_group=False, env={"TORCH_EXTENSIONS_DIR": str(ext)})[0]
    assert got["dp"] == "deepspeed" and len(got["losses"]) == 1
    assert got["shm_compatible"] is False and got["shm_built"] is False
    assert [p.relative_to(ext).as_posix() for p in ext.rglob("*")] == []


def test_deepspeed_zero2_resume_gives_uninterrupted_losses(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """Stopped after step 4 and resumed: steps 5-8 are the uninterrupted run's, because DeepSpeed's state comes
    back: the fp32 master partitions and Adam moments from the DCP chunks each rank wrote of them, the loss
    scaler and the engine's step counters from step_000004/deepspeed/, which the manifest covers. Restarting the moments instead changes step 5's update by about lr (Adam's first
    step is lr * sign(g)) and the losses from step 6 on by far more than the tolerance."""
    extra = {**DS_ZERO2, "parallel__backend": "deepspeed"}
    out = tmp_path / "resumed"
    first = run_distributed(train_recording, 2, out, corpus,
                            {**extra, "train__stop_after_step": 4, "train__ckpt_interval": 4}, init_group=False,
                            timeout=600)
    got = run_distributed(train, 2, out, corpus, extra, init_group=False, timeout=600)[0]
    whole = uninterrupted(tmp_path / "whole", corpus)
    assert len(got["losses"]) == STEPS  # the metrics file holds steps 1-4, then 5-8 after the resume
    # Same ranks, same reduction order, the same fp32 state restored bit for bit: only the order in which a
    # checkpoint's load touches memory could differ, so 1e-6 (a few fp32 ulps of a loss near 5) is ample.
    for a, b in zip(got["losses"], whole["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-6)
    for name, p in whole["params"].items():
        torch.testing.assert_close(got["params"][name], p, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    # Each rank wrote and hashed its own engine file and no other (DeepSpeed's save_checkpoint had rank 0 hash
    # every rank's optim_states.pt); no 16-bit module file (mp_rank_00_model_states.pt): DCP holds the weights.
    step = out / "checkpoints" / "step_000004"
    mine = [f"deepspeed/rank_{r:05d}.safetensors" for r in range(2)]
    assert sorted(p.relative_to(step).as_posix() for p in (step / "deepspeed").iterdir()) == mine
    files = json.loads((step / "manifest.json").read_text())["files"]
    assert [f for f in files if f.startswith("deepspeed/")] == mine  # checksummed by our manifest
    for rank, got_rank in enumerate(first):
        assert got_rank["written"] == [mine[rank]], (rank, got_rank["written"])
        hashed = [f for f in got_rank["hashed"] if f.startswith("deepspeed/")]
        assert hashed == [mine[rank]], (rank, got_rank["hashed"])


def test_deepspeed_skipped_steps_come_from_the_engine(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """An absurd learning rate makes the first update blow the weights up, so every later forward is
    non-finite and DeepSpeed skips those steps inside its own step (fp32: it checks the gradient norm).
    `skipped_steps` in metrics.jsonl must count them: the steps whose logged loss is not finite."""
    extra = {**DS_ZERO2, "parallel__backend": "deepspeed", "optim__lr": 1e30, "optim__warmup_steps": 0,
             "train__max_steps": 4, "train__max_bad_steps": 100}
    got = run_distributed(train, 2, tmp_path, corpus, extra, init_group=False, timeout=600)[0]
    records = got["records"]
    bad = [r["step"] for r in records if not math.isfinite(r["loss"])]
    assert bad, [r["loss"] for r in records]  # the premise: some steps did overflow
    for r in records:  # the running count, step by step
        want = sum(1 for s in bad if s <= r["step"])
        assert r.get("skipped_steps", 0) == want, (r["step"], r.get("skipped_steps"), bad)


def test_deepspeed_zero1_bf16_resume_gives_uninterrupted_losses(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """ZeRO-1 in bf16: the checkpoint carries the fp32 master (the bf16 weights alone would round it) and the
    engine file the loss scaler object's state, put back into the live engine's."""
    extra = {"parallel__zero_stage": 1, "train__micro_batch_size": 2, "train__precision": "bf16",
             "parallel__backend": "deepspeed"}
    out = tmp_path / "resumed"
    run_distributed(train, 2, out, corpus, {**extra, "train__stop_after_step": 4, "train__ckpt_interval": 4},
                    init_group=False, timeout=600)
    got = run_distributed(train, 2, out, corpus, extra, init_group=False, timeout=600)[0]
    whole = run_distributed(train, 2, tmp_path / "whole", corpus, extra, init_group=False, timeout=600)[0]
    assert len(got["losses"]) == STEPS
    # as in the ZeRO-2 test: the same state restored bit for bit, the same reduction order
    for a, b in zip(got["losses"], whole["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-6)
    for name, p in whole["params"].items():
        torch.testing.assert_close(got["params"][name], p, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def _train_or_refusal(rank: int, world_size: int, out_dir: Path, corpus: Path,  # noqa: F811
                      extra: dict[str, Any]) -> str:
    """`train`, or the ConfigError it stopped with on this rank."""
    from dist_llm.config import ConfigError

    try:
        train(rank, world_size, out_dir, corpus, extra)
    except ConfigError as e:
        return f"ConfigError: {e}"
    return "trained"


def test_deepspeed_hostile_engine_state_is_one_line_naming_the_file(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """Rank 1's partition file replaced by one whose JSON sets the loss scaler's `loss_scale` (a property of
    DeepSpeed's: setattr raised a bare AttributeError), the manifest rewritten to match (an attacker can): the
    resume refuses it with one ConfigError naming the file, on both ranks (before, rank 0 went on training
    while rank 1 died), before anything in it is applied."""
    import hashlib

    from safetensors import safe_open
    from safetensors.torch import save_file

    extra = {**DS_ZERO2, "parallel__backend": "deepspeed", "train__max_steps": 2}
    out = tmp_path / "run"
    run_distributed(train, 2, out, corpus, {**extra, "train__stop_after_step": 2, "train__ckpt_interval": 2},
                    init_group=False, timeout=600)
    step = out / "checkpoints" / "step_000002"
    victim = step / "deepspeed" / "rank_00001.safetensors"
    hostile = {"object": "LossScaler", "attrs": {"dict": [["loss_scale", 5]]}}
    with safe_open(str(victim), framework="pt") as f:  # the partition layout stays: this engine's own
        layout = f.metadata()["dist_llm.engine_layout"]
    save_file({}, str(victim), metadata={"dist_llm.engine_state": json.dumps({"dict": [["optimizer", hostile]]}),
                                         "dist_llm.engine_layout": layout})
    manifest = json.loads((step / "manifest.json").read_text())
    data = victim.read_bytes()
    manifest["files"]["deepspeed/rank_00001.safetensors"] = {"bytes": len(data),
                                                              "sha256": hashlib.sha256(data).hexdigest()}
    (step / "manifest.json").write_text(json.dumps(manifest))
    said = run_distributed(_train_or_refusal, 2, out, corpus, {**extra, "train__resume": str(step)},
                           init_group=False, timeout=600)
    refusal = (f"ConfigError: train.resume: {victim}: cannot load DeepSpeed's state ({victim}: attribute "
               "'loss_scale' of LossScaler: this engine's LossScaler has no such data attribute)")
    assert said == [refusal] * 2


def _train_logging_warnings(rank: int, world_size: int, out_dir: Path, corpus: Path,  # noqa: F811
                            extra: dict[str, Any]) -> list[str]:
    """`train`; the dist_llm warnings this rank logged."""
    import logging

    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logging.getLogger("dist_llm").addHandler(handler)
    try:
        train(rank, world_size, out_dir, corpus, extra)
    finally:
        logging.getLogger("dist_llm").removeHandler(handler)
    return said


def test_deepspeed_resume_with_other_zero_settings_keeps_the_moments(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """Saved with round_robin_gradients off, resumed with it on: the flat partitions hold the parameters in
    another order. Before, the partitions were saved as they lay, so such a resume had to drop the moments (it
    warned and started them afresh); now each moment is saved and read by parameter name, as chunks of the full
    tensor, so the resumed run is the uninterrupted one (1e-5: the gradients are summed in another order)."""
    extra = {**DS_ZERO2, "parallel__backend": "deepspeed"}
    out = tmp_path / "run"
    run_distributed(train, 2, out, corpus, {**extra, "train__stop_after_step": 4, "train__ckpt_interval": 4},
                    init_group=False, timeout=600)
    toggled = tmp_path / "ds.json"
    toggled.write_text(json.dumps({"zero_optimization": {"round_robin_gradients": True}}))
    step = out / "checkpoints" / "step_000004"
    said = run_distributed(_train_logging_warnings, 2, out, corpus,
                           {**extra, "train__resume": str(step), "parallel__deepspeed_config": str(toggled)},
                           init_group=False, timeout=600)
    for rank_said in said:
        assert not [s for s in rank_said if "afresh" in s], rank_said
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in lines if "loss" in r]
    whole = uninterrupted(tmp_path / "whole", corpus)
    assert len(losses) == STEPS
    for a, b in zip(losses, whole["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)


def _resumed_hyperparameters(rank: int, world_size: int, out_dir: Path, corpus: Path,  # noqa: F811
                             extra: dict[str, Any]) -> list[dict[str, Any]]:
    """Build the trainer (which resumes), and report its optimizer groups' hyperparameters."""
    from dist_llm.config import load_config
    from dist_llm.parallel.context import ParallelContext
    from dist_llm.train.trainer import Trainer
    from tests.conftest import tiny_overrides

    cfg = load_config(None, tiny_overrides(out_dir, **{"data__source": str(corpus), "train__eval_interval": 0,
                                                       "model__bias": False, **extra}))
    ctx = ParallelContext.from_config(cfg)
    try:
        trainer = Trainer(cfg, ctx)
        assert trainer.resumed_from is not None
        inner = trainer.dp.optimizer.optimizer  # the torch AdamW DeepSpeed wraps
        return [{"betas": tuple(g["betas"]), "eps": g["eps"], "weight_decay": g["weight_decay"]}
                for g in inner.param_groups]
    finally:
        ctx.destroy()


def test_deepspeed_resume_keeps_the_configs_optimizer_hyperparameters(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """Saved at betas (0.9, 0.95), eps 1e-8, weight decay 0.1, resumed with other values: the new config's hold
    (as under the native backends), not the ones in the saved param groups. The decay group takes the new
    weight decay, the no-decay group stays at 0."""
    extra = {**DS_ZERO2, "parallel__backend": "deepspeed", "train__max_steps": 2}
    out = tmp_path / "run"
    run_distributed(train, 2, out, corpus, {**extra, "train__stop_after_step": 2, "train__ckpt_interval": 2},
                    init_group=False, timeout=600)
    new = {"optim__beta1": 0.8, "optim__beta2": 0.99, "optim__eps": 1e-6, "optim__weight_decay": 0.05}
    got = run_distributed(_resumed_hyperparameters, 2, out, corpus,
                          {**extra, **new, "train__resume": str(out / "checkpoints" / "step_000002")},
                          init_group=False, timeout=600)
    want = [{"betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.05},
            {"betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0}]
    assert got == [want, want]


@pytest.mark.parametrize(("ds", "key"), [
    ({"data_types": {"grad_accum_dtype": "fp32"}},
     "data_types.grad_accum_dtype='fp32', which makes DeepSpeed use its BF16_Optimizer"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, "zero_optimization.offload_optimizer.device"),
    ({"zero_optimization": {"offload_param": {"device": "nvme"}}}, "zero_optimization.offload_param.device"),
    ({"zero_optimization": {"mics_shard_size": 2}}, "zero_optimization.mics_shard_size"),
    ({"zero_optimization": {"zero_quantized_weights": True}}, "zero_optimization.zero_quantized_weights"),
    ({"zero_optimization": {"zero_quantized_gradients": True}}, "zero_optimization.zero_quantized_gradients"),
], ids=["bf16-fp32-accum", "nvme-optimizer", "nvme-param", "mics", "quantized-weights", "quantized-grads"])
def test_ds_config_keys_whose_partitions_cannot_be_checkpointed_are_refused(tmp_path: Path, ds: dict,
                                                                            key: str) -> None:
    """bf16 ZeRO-1 with fp32 accumulation (DeepSpeed's usual bf16 setup) silently became a run whose checkpoints
    held bf16-rounded weights and no moments; NVMe offload, MiCS and quantised partitions move or re-lay-out the
    partitions the chunks are cut from. Each: one line naming the key, before DeepSpeed starts."""
    from dist_llm.config import ConfigError, load_config
    from dist_llm.parallel.data.deepspeed_config import merged_deepspeed_config
    from tests.conftest import tiny_overrides

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    cfg = load_config(None, tiny_overrides(tmp_path, parallel__backend="deepspeed", parallel__zero_stage=1,
                                           train__precision="bf16", parallel__deepspeed_config=str(path)))
    with pytest.raises(ConfigError) as e:
        merged_deepspeed_config(cfg, dp=2)
    assert str(e.value).startswith(f"parallel.deepspeed_config: {path} sets {key}")
    assert "\n" not in str(e.value)
    # fp32 accumulation is DeepSpeed's own at ZeRO-2/3 (DeepSpeedZeroOptimizer keeps its fp32 partitions): accepted
    if "data_types" in ds:
        cfg.parallel.zero_stage = 2
        assert merged_deepspeed_config(cfg, dp=2)["data_types"]["grad_accum_dtype"] == "fp32"


def test_older_deepspeed_checkpoint_resumes_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A ZeRO-1/2 checkpoint from before the moments moved into the DCP tensors (deepspeed/ files, no optim.*):
    the resume's one warning says it is the older format whose moments are not read; DeepSpeed's backend then
    reads none of its files and claims no moments (it said "resumed the weights and optimizer moments")."""
    import logging
    from types import SimpleNamespace

    from dist_llm.parallel.data.deepspeed import ENGINE_DIR, DeepSpeedDataParallel

    old = tmp_path / "step_00000004"
    (old / ENGINE_DIR).mkdir(parents=True)
    (old / ENGINE_DIR / "rank_00000.safetensors").write_bytes(b"not read")
    # a ZeRO-3 optimizer as the resume leaves it for a checkpoint without optimizer state: its moments cleared
    dp = DeepSpeedDataParallel.__new__(DeepSpeedDataParallel)
    dp.ctx = SimpleNamespace(rank=0)
    dp.optimizer = SimpleNamespace(fp32_partitioned_groups_flat=[], optimizer=SimpleNamespace(state={}))
    assert dp.no_optimizer_state_note(old) == (" (an older DeepSpeed format: the moments it kept in "
                                               "deepspeed/rank_*.safetensors are not read)")
    assert dp.no_optimizer_state_note(tmp_path) == ""  # (a converted Hugging Face model: no words needed)
    with caplog.at_level(logging.INFO, logger="dist_llm"):
        dp.load_engine_state(old)  # (the file is not a safetensors file: reading it would raise)
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "resumed the weights only; optimizer moments, loss scaler and step counters start afresh" in caplog.text
