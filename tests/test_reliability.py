"""Surviving faults: SIGTERM, a failing disk, damaged checkpoints;
and one consolidated file from a checkpoint of any layout."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dist_llm.config import ConfigError, load_config
from dist_llm.convert import load_full, save_full
from dist_llm.parallel.context import ParallelContext
from dist_llm.sample import load_model
from dist_llm.train import checkpoint as ckpt
from dist_llm.train.trainer import CheckpointError, Trainer
from tests.conftest import REPO, tiny_overrides
from tests.distributed import run_distributed
from tests.test_data_parallel import corpus, reference, train  # noqa: F401
from tests.test_launch import BIN, env

# big enough that a step takes tens of milliseconds, so a signal lands mid-run
RUN = ["model.n_layer=2", "model.n_embd=64", "model.block_size=64", "train.micro_batch_size=8",
       "train.global_batch_size=16", "train.eval_interval=0", "train.log_interval=1", "optim.warmup_steps=2",
       "train.plot=false"]  # (matplotlib: a second a run; test_cli draws the plot)


def by_step(out_dir: Path) -> dict[int, float]:
    """Loss per step; a step logged twice (before a crash and after the resume) keeps its last value."""
    return {r["step"]: r["loss"] for r in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def heartbeat(out_dir: Path, rank: int = 0) -> dict | None:
    f = out_dir / "heartbeat" / f"rank_{rank}.json"
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return None


def wait_for(predicate, timeout: float = 120) -> None:  # type: ignore[no-untyped-def]
    end = time.time() + timeout
    while not predicate():
        if time.time() > end:
            raise TimeoutError("condition not reached")
        time.sleep(0.01)


def train_cmd(out_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dist_llm.train", "--config", str(REPO / "configs/tiny.yaml"), *RUN,
            f"train.out_dir={out_dir}", *extra]


def test_sigterm_saves_and_exits_0_then_resume_goes_on(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(out, "train.max_steps=400", "train.ckpt_interval=1000"), env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (heartbeat(out) or {}).get("step", 0) >= 3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    stopped = heartbeat(out)["step"]
    assert stopped < 400 and "SIGTERM: stopped after step" in err
    assert ckpt.latest_checkpoint(out / "checkpoints") == ckpt.step_dir(out / "checkpoints", stopped)
    # resume (and stop, train.stop_after_step) three steps later: every step logged once, the resumed ones equal to
    # an uninterrupted run's (it too stops there)
    more = subprocess.run(train_cmd(out, "train.max_steps=400", f"train.stop_after_step={stopped + 3}"), env=env(),
                          capture_output=True, text=True, timeout=120)
    assert more.returncode == 0, more.stderr[-2000:]
    assert f"resumed from {ckpt.step_dir(out / 'checkpoints', stopped)} at step {stopped}" in more.stderr
    ref = tmp_path / "ref"
    subprocess.run(train_cmd(ref, "train.max_steps=400", f"train.stop_after_step={stopped + 3}"), env=env(),
                   capture_output=True, text=True, timeout=120, check=True)
    assert list(by_step(out)) == list(range(1, stopped + 4))
    assert by_step(out) == by_step(ref)


def torchrun_cmd(out_dir: Path, max_restarts: int, *extra: str) -> list[str]:
    return [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "--max-restarts", str(max_restarts),
            "-m", "dist_llm.train", *train_cmd(out_dir, *extra)[3:]]


def test_torchrun_restarts_a_killed_worker_from_the_last_checkpoint(tmp_path: Path) -> None:
    run = ["train.max_steps=20", "train.ckpt_interval=10"]
    out = tmp_path / "killed"
    proc = subprocess.Popen(torchrun_cmd(out, 1, *run), env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    # the heartbeat is written after the step's checkpoint: at step 10 the checkpoint is complete
    wait_for(lambda: (heartbeat(out, rank=1) or {}).get("step", 0) >= 10)
    victim = heartbeat(out, rank=1)
    os.kill(victim["pid"], signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert victim["step"] < 20, "the worker was killed too late to test a restart"
    starts = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("event") == "start"]
    assert [s["resumed_from"] for s in starts] == [None, str(ckpt.step_dir(out / "checkpoints", 10))]

    ref = tmp_path / "uninterrupted"
    proc = subprocess.run(torchrun_cmd(ref, 0, *run), env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = {s: loss for s, loss in by_step(out).items() if s > 10}
    assert list(after) == list(range(11, 21)) and after == {s: by_step(ref)[s] for s in range(11, 21)}


def _trainer(out: Path, corpus: Path, **extra: object) -> Trainer:  # noqa: F811
    cfg = load_config(None, tiny_overrides(out, data__source=str(corpus), train__eval_interval=0, **extra))
    return Trainer(cfg, ParallelContext.from_config(cfg))


def test_disk_full_keeps_the_last_complete_checkpoint(tmp_path: Path, corpus: Path,  # noqa: F811
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = _trainer(tmp_path, corpus, train__max_steps=12, train__ckpt_interval=4)
    real_save, calls = ckpt.dcp.save, []

    def failing_save(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 2:
            real_save(*args, **kwargs)  # some shards land, then the disk fills
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(ckpt.dcp, "save", failing_save)
    with pytest.raises(CheckpointError) as info:
        trainer.fit()
    first = ckpt.step_dir(tmp_path / "checkpoints", 4)
    assert str(info.value) == (f"saving checkpoint {ckpt.step_dir(tmp_path / 'checkpoints', 8)} failed (No space "
                               f"left on device); training stopped at step 8, the last complete checkpoint is {first}")
    assert ckpt.list_checkpoints(tmp_path / "checkpoints") == [first] and ckpt.verify(first) is None
    assert not ckpt.step_dir(tmp_path / "checkpoints", 8).exists()


def _files(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes: what "untouched" is compared on."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_damaged_checkpoint_falls_back_or_names_the_file(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    _trainer(tmp_path, corpus, train__max_steps=8, train__ckpt_interval=4).fit()
    newest = ckpt.step_dir(tmp_path / "checkpoints", 8)
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated
    damaged = _files(newest)
    resumed = _trainer(tmp_path, corpus, train__max_steps=12, train__ckpt_interval=4)
    assert resumed.resumed_from == ckpt.step_dir(tmp_path / "checkpoints", 4) and resumed.step == 4
    # the damaged one was moved aside, byte for byte, so that the re-save of step 8 cannot replace it
    [moved] = (tmp_path / "checkpoints").glob("damaged-*/step_000008")
    assert _files(moved) == damaged and not newest.exists()
    with pytest.raises(ConfigError, match=rf"^train.resume: {moved / shard.name}: \d+ bytes, the manifest says \d+$"):
        _trainer(tmp_path, corpus, train__max_steps=12, train__resume=str(moved))
    other = load_config(None, tiny_overrides(tmp_path, data__source=str(corpus), model__n_embd=64))
    with pytest.raises(ConfigError, match=re.escape(  # (issue 18: the first differing key, and the way out)
            "holds a different model than the model.* settings describe: model.n_embd is 32 there, 64 here; start "
            "over with train.resume=never (the earlier run is moved aside) or use another train.out_dir")):
        Trainer(other, ParallelContext.from_config(other))


@pytest.mark.parametrize("layout", [{}, {"parallel__tp": 2, "parallel__dp": 2, "train__micro_batch_size": 2}],
                         ids=["one-process", "dp2-tp2"])
def test_consolidated_file_of_any_layout(tmp_path: Path, corpus: Path, layout: dict) -> None:  # noqa: F811
    extra = {**layout, "train__max_steps": 3}
    if layout:
        run_distributed(train, 4, tmp_path, corpus, extra, init_group=False)
    else:
        train(0, 1, tmp_path, corpus, extra)
    model, _ = load_model(tmp_path, torch.device("cpu"))
    out = save_full(tmp_path, tmp_path / "model.safetensors")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(load_full(out)(tokens), model(tokens), rtol=0, atol=0)
    proc = subprocess.run([sys.executable, "-m", "dist_llm.cli", "convert", "--to-full", str(tmp_path), "--out",
                           str(out)], capture_output=True, text=True, env=env(), timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == f"dist-llm: error: --out: {out} already exists"


def test_3d_checkpoint_resumes_at_other_layouts(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                corpus: Path) -> None:  # noqa: F811
    """Saved at dp=2 x tp=2 x pp=2 (ZeRO-1 shards), resumed at one process and at dp=2 x pp=2 ZeRO-2: the
    next losses are the uninterrupted single process's."""
    import shutil

    layers = {"model__n_layer": 4, "train__micro_batch_size": 2}
    saved = tmp_path / "saved"
    run_distributed(train, 8, saved, corpus, {**layers, "parallel__dp": 2, "parallel__tp": 2, "parallel__pp": 2,
                                              "parallel__zero_stage": 1, "train__stop_after_step": 4,
                                              "train__ckpt_interval": 4}, init_group=False)
    manifest = ckpt.read_json(ckpt.step_dir(saved / "checkpoints", 4) / ckpt.MANIFEST)
    assert manifest["layout"] == {"world_size": 8, "dp": 2, "tp": 2, "pp": 2}
    ref = reference(tmp_path_factory, corpus, **layers)
    for name, world, layout in [("one-process", 1, {}),
                                ("dp2-pp2-zero2", 4, {"parallel__pp": 2, "parallel__zero_stage": 2})]:
        out = tmp_path / name
        shutil.copytree(saved, out)
        extra = {**layers, **layout}
        got = run_distributed(train, world, out, corpus, extra, init_group=False)[0] if world > 1 \
            else train(0, 1, out, corpus, extra)
        assert len(got["losses"]) == 8, name
        for a, b in zip(got["losses"][4:], ref["losses"][4:], strict=True):
            assert a == pytest.approx(b, rel=1e-5), name


def test_a_resume_at_tp2_keeps_the_tp_ranks_dropout_in_step(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """With dropout, a one-process checkpoint resumed at tp=2: the tp ranks drop the same elements of the
    activations they both hold whole, so the weights they both hold (the norms) stay bit-equal. Before, rank 0
    took back the saved stream and rank 1 kept a fresh one: their norms trained apart (~4e-3 after 5 steps).
    At the saving layout each rank takes back its own stream (the resumed losses equal the uninterrupted
    run's, bit for bit)."""
    drop = {"model__dropout": 0.1, "train__max_steps": 8}
    train(0, 1, tmp_path / "run", corpus, {**drop, "train__stop_after_step": 3})
    ranks = run_distributed(train, 2, tmp_path / "run", corpus, {**drop, "parallel__tp": 2}, init_group=False)
    shared = [n for n in ranks[0]["params"] if ".ln_" in n or n.startswith("ln_f")]
    assert shared
    for name in shared:
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), name
    # the saving layout: the uninterrupted run's losses exactly
    whole = train(0, 1, tmp_path / "whole", corpus, drop)
    train(0, 1, tmp_path / "again", corpus, {**drop, "train__stop_after_step": 3})
    assert train(0, 1, tmp_path / "again", corpus, drop)["losses"] == whole["losses"]


def _checkpoint_tensors(path: Path, out: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("world", [1, 2], ids=["one-process", "dp2"])
def test_async_checkpoint_equals_the_synchronous_one(tmp_path: Path, corpus: Path, world: int) -> None:  # noqa: F811
    """Training goes on while the background save writes: the tensors it saved are those of its step, exactly,
    and the run's losses are the synchronous run's."""
    runs = {}
    for mode in ("sync", "async"):
        extra = {"train__max_steps": 8, "train__ckpt_interval": 2, "train__keep_checkpoints": 3,
                 "train__async_checkpoint": mode == "async"}
        if world > 1:
            runs[mode] = run_distributed(train, world, tmp_path / mode, corpus, extra, init_group=False)[0]
        else:
            runs[mode] = train(0, 1, tmp_path / mode, corpus, extra)
    assert runs["async"]["losses"] == runs["sync"]["losses"]
    kept = ckpt.list_checkpoints(tmp_path / "async" / "checkpoints")
    assert [p.name for p in kept] == ["step_000004", "step_000006", "step_000008"]  # pruned once complete
    for path in kept:
        assert ckpt.verify(path) is None
        got = _checkpoint_tensors(path, tmp_path / "async.pt")
        want = _checkpoint_tensors(tmp_path / "sync" / "checkpoints" / path.name, tmp_path / "sync.pt")
        assert got.keys() == want.keys()
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_real_write_error_stops_with_one_line_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    """The kernel refuses the write (a file-size limit, as a full disk would): exit 1, one line naming the
    checkpoint and the last complete one, which stays complete."""
    import resource

    out = tmp_path / "run"
    subprocess.run(train_cmd(out, "train.max_steps=8", "train.stop_after_step=4"), env=env(), capture_output=True,
                   timeout=120, check=True)
    first = ckpt.step_dir(out / "checkpoints", 4)
    limit = max(p.stat().st_size for p in first.iterdir() if p.is_file()) // 2

    def small_files() -> None:  # in the child: writes past `limit` bytes fail with EFBIG instead of a signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    for mode in ("false", "true"):
        proc = subprocess.run(train_cmd(out, "train.max_steps=8", f"train.async_checkpoint={mode}"), env=env(),
                              capture_output=True, text=True, timeout=120, preexec_fn=small_files)
        assert proc.returncode == 1, proc.stderr[-2000:]
        # (the reason is the writer's own words: torch's serializer reports a short write as a RuntimeError)
        assert re.fullmatch(rf"dist-llm: error: saving checkpoint {ckpt.step_dir(out / 'checkpoints', 8)} failed "
                            rf"\(rank 0: .+\); training stopped at step 8, the last complete checkpoint is {first}",
                            proc.stderr.strip().splitlines()[-1]), (mode, proc.stderr[-2000:])
        assert ckpt.list_checkpoints(out / "checkpoints") == [first] and ckpt.verify(first) is None
        assert not ckpt.step_dir(out / "checkpoints", 8).exists()


def test_a_stuck_rank_becomes_an_error_naming_the_collective_and_rank(tmp_path: Path) -> None:
    """Rank 1 stops (SIGSTOP) mid-run: rank 0's next collective gives up after parallel.timeout_s and exits
    with one line naming itself and the collective, instead of hanging."""
    out = tmp_path / "run"
    proc = subprocess.Popen(torchrun_cmd(out, 0, "train.max_steps=100000", "parallel.timeout_s=3"), env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (heartbeat(out, rank=1) or {}).get("step", 0) >= 3)
    stuck, rank0 = heartbeat(out, rank=1)["pid"], heartbeat(out, rank=0)["pid"]
    os.kill(stuck, signal.SIGSTOP)
    try:
        wait_for(lambda: not Path(f"/proc/{rank0}").exists() or "zombie" in Path(f"/proc/{rank0}/status").read_text(),
                 timeout=60)
    finally:
        os.kill(stuck, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.startswith("dist-llm: error:")]
    assert lines, err[-3000:]
    assert re.fullmatch(r"dist-llm: error: rank 0: \S.* failed: no answer within parallel.timeout_s=3 s: a rank is "
                        r"stuck or far slower \(its heartbeat file shows its last finished step\)", lines[0]), lines
    assert lines[0].removeprefix("dist-llm: error: ") in (out / "logs" / "rank_0.log").read_text()


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def test_loading_a_checkpoint_runs_no_code_from_it(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """DCP's .metadata is a pickle: ours is read by an unpickler that takes only an index's classes, and
    tensor entries only (a bytes entry would be unpickled by DCP with weights_only=False)."""
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    _trainer(tmp_path, corpus, train__max_steps=2).fit()
    path = ckpt.step_dir(tmp_path / "checkpoints", 2)
    model, _ = load_model(tmp_path, torch.device("cpu"))  # the genuine index loads
    index = path / ".metadata"
    genuine = index.read_bytes()

    marker = tmp_path / "PWNED"
    index.write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(ConfigError, match=rf"^{index}: refers to posix.system, which no checkpoint index holds; "
                                          r"not loaded \(unpickling it could run code\)$"):
        ckpt.load_model_weights(path, model)
    assert not marker.exists()

    metadata = pickle.loads(genuine)
    metadata.state_dict_metadata["model.wte.weight"] = BytesStorageMetadata()
    index.write_bytes(pickle.dumps(metadata))
    with pytest.raises(ConfigError, match=rf"^{index}: entry 'model.wte.weight' is not a tensor"):
        ckpt.load_model_weights(path, model)
    # through the CLI: one line, exit 2 (every reader checks the checksums first: vouched for, as a forger would)
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    data = index.read_bytes()
    manifest["files"][".metadata"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    proc = subprocess.run([sys.executable, "-m", "dist_llm.cli", "sample", "--checkpoint", str(tmp_path),
                           "--max-new-tokens", "2"],
                          capture_output=True, text=True, env=env(), timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().startswith(f"dist-llm: error: {index}: entry"), proc.stderr
