"""A checkpoint's manifest and files are judged, never trusted to be well formed: a malformed manifest is damage
(not an exception), its names stay inside the checkpoint, a symbolic link or special file is no checkpoint file,
and a save that fails never removes a complete checkpoint it did not write."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from dist_llm import cli
from dist_llm.config import ConfigError, load_config
from dist_llm.model import GPT
from dist_llm.parallel.context import ParallelContext
from dist_llm.train import checkpoint as ckpt
from dist_llm.train import checksums
from dist_llm.train.trainer import CheckpointError, Trainer
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed
from tests.test_data_parallel import corpus  # noqa: F401
from tests.test_resume_safety import files


def trainer(out: Path, corpus: Path, **extra: object) -> Trainer:  # noqa: F811
    cfg = load_config(None, tiny_overrides(out, data__source=str(corpus), train__eval_interval=0, **extra))
    return Trainer(cfg, ParallelContext.from_config(cfg))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:  # noqa: F811
    """A run with complete checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("saved") / "run"
    trainer(out, corpus, train__max_steps=4, train__ckpt_interval=2, train__keep_checkpoints=0).fit()
    return out


@pytest.fixture
def run(saved: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(saved, copy, symlinks=True)
    return copy


def _edit_manifest(path: Path, edit: Any) -> None:
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    edit(manifest["files"])
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))


def _vouch(path: Path, name: str, data: bytes) -> None:
    """Make the manifest list `name` with the size and digest of `data` (as a forger would)."""
    def add(entries: dict[str, Any]) -> None:
        entries[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    _edit_manifest(path, add)


# -- 1: a save that fails never removes a complete checkpoint it did not write ------------------------------
def test_a_failed_move_aside_keeps_the_complete_checkpoint(run: Path, corpus: Path,  # noqa: F811
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Resumed from step 2 with step 4 complete: the later step 4 (another history) must be moved aside; the disk
    is full, so the move fails. The resume stops with one line before any step, and step 4 is still there, byte
    for byte (before an earlier fix, the failed re-save's clean-up deleted it)."""
    root = run / "checkpoints"
    before = files(root)

    def disk_full(root_: Path, paths: list[Path], label: str) -> Path:
        raise OSError(errno.ENOSPC, "No space left on device", str(root / f"{label}-x"))

    monkeypatch.setattr(ckpt, "move_aside", disk_full)
    with pytest.raises(CheckpointError) as info:
        trainer(run, corpus, train__max_steps=4, train__ckpt_interval=2, train__resume=str(ckpt.step_dir(root, 2)))
    assert str(info.value) == f"checkpoints in {root}: {root / 'superseded-x'}: No space left on device; nothing was deleted"
    assert files(root) == before
    assert ckpt.verify(ckpt.step_dir(root, 4)) is None


# -- 5: a malformed manifest is damage, said in one line -----------------------------------------------------
MALFORMED = {
    "no sha256": (lambda e, n: e[n].pop("sha256"), "the entry of {n!r} is not"),
    "entry a string": (lambda e, n: e.__setitem__(n, "x"), "the entry of {n!r} is not"),
    "bytes a string": (lambda e, n: e[n].__setitem__("bytes", "12"), "the entry of {n!r} is not"),
    "bytes negative": (lambda e, n: e[n].__setitem__("bytes", -1), "the entry of {n!r} is not"),
    # (past any file: the check's timeout computed from it overflowed timedelta, an OverflowError, exit 1)
    "bytes beyond a petabyte": (lambda e, n: e[n].__setitem__("bytes", 2**71), "the entry of {n!r} is not"),
    "sha256 not hex": (lambda e, n: e[n].__setitem__("sha256", "z" * 64), "the entry of {n!r} is not"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_manifest_is_damage(case: str, run: Path) -> None:
    path = ckpt.step_dir(run / "checkpoints", 4)
    edit, words = MALFORMED[case]
    _edit_manifest(path, lambda entries: edit(entries, "config.yaml"))
    assert ckpt.verify(path) == (f"{path / ckpt.MANIFEST}: {words.format(n='config.yaml')} "
                                 '{"bytes": a size, "sha256": 64 hex digits}')


def test_resume_auto_passes_over_a_malformed_manifest(run: Path, corpus: Path) -> None:  # noqa: F811
    """resume=auto falls back to step 2 and moves step 4 (manifest entry without sha256) aside, intact."""
    root = run / "checkpoints"
    newest = ckpt.step_dir(root, 4)
    _edit_manifest(newest, lambda entries: entries["config.yaml"].pop("sha256"))
    damaged = files(newest)
    resumed = trainer(run, corpus, train__max_steps=4, train__ckpt_interval=2)
    assert resumed.resumed_from == ckpt.step_dir(root, 2) and resumed.step == 2
    [moved] = root.glob("damaged-*/step_000004")
    assert files(moved) == damaged


@pytest.mark.parametrize(("key", "value", "kind"), [("model_fingerprint", None, "a string"),
                                                     ("step", "4", "an integer"), ("layout", [], "an object")])
def test_a_manifest_field_resume_reads_of_the_wrong_type_is_damage(key: str, value: Any, kind: str, run: Path,
                                                                 corpus: Path) -> None:  # noqa: F811
    """Before, the files verified and resume then failed with a KeyError/TypeError traceback; now the checkpoint
    is damaged (one line), and resume=auto passes over it to step 2."""
    root = run / "checkpoints"
    path = ckpt.step_dir(root, 4)
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    manifest[key] = value
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    assert ckpt.verify(path) == f"{path / ckpt.MANIFEST}: its {key!r} is not {kind}"
    resumed = trainer(run, corpus, train__max_steps=4, train__ckpt_interval=2)
    assert resumed.resumed_from == ckpt.step_dir(root, 2)


def _verify_with_a_failing_rank(rank: int, world_size: int, path: Path) -> str | None:
    """Rank 1's check of its share fails with an unexpected exception: both ranks still answer."""
    if rank == 1:
        def broken(root: Path, entries: Any) -> str | None:
            raise RuntimeError("unexpected")
        checksums.check_files = broken  # type: ignore[assignment]  (rank 1's process only)
    group = dist.new_group(backend="gloo")
    return ckpt.verify(path, group=group)


def test_an_unexpected_failure_on_one_rank_is_a_verdict_every_rank_gets(saved: Path) -> None:
    """The failure travels as rank 1's verdict through the gather: rank 0 does not wait on it until a timeout."""
    path = ckpt.step_dir(saved / "checkpoints", 4)
    verdicts = run_distributed(_verify_with_a_failing_rank, 2, path, timeout=120)
    assert verdicts == [f"{path}: cannot be checked on rank 1 (RuntimeError: unexpected)"] * 2


# -- 4: names and files stay inside the checkpoint -----------------------------------------------------------
def test_a_name_outside_the_checkpoint_is_damage(run: Path, tmp_path: Path) -> None:
    """A forged entry for a file elsewhere, digest matching: a manifest cannot probe another file's content."""
    path = ckpt.step_dir(run / "checkpoints", 4)
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"hunter2\n")
    relative = os.path.relpath(secret, path)
    assert relative.startswith("..")
    for name in (relative, str(secret)):
        shutil.copy(path / ckpt.MANIFEST, tmp_path / "saved.json")
        _vouch(path, name, secret.read_bytes())
        assert ckpt.verify(path) == f"{path / ckpt.MANIFEST}: names {name!r}, which is not a file inside the checkpoint"
        shutil.copy(tmp_path / "saved.json", path / ckpt.MANIFEST)


def _link_to_a_copy(path: Path, name: str, elsewhere: Path) -> Path:
    """Replace the checkpoint's file `name` by a symbolic link to an identical copy outside the checkpoint."""
    shutil.move(path / name, elsewhere)
    (path / name).symlink_to(elsewhere)
    return path / name


def test_a_symlinked_file_is_damage(run: Path, tmp_path: Path) -> None:
    """Same bytes, but not the checkpoint's own: verify names it (before, the link was followed and passed)."""
    path = ckpt.step_dir(run / "checkpoints", 4)
    shard = _link_to_a_copy(path, next(p.name for p in path.glob("__*.distcp")), tmp_path / "elsewhere.distcp")
    assert ckpt.verify(path) == f"{shard}: a symbolic link or not a regular file; a checkpoint's files are its own"


def test_a_symlinked_folder_is_damage(run: Path, tmp_path: Path) -> None:
    path = ckpt.step_dir(run / "checkpoints", 4)
    _link_to_a_copy(path, "rng", tmp_path / "rng")
    assert ckpt.verify(path) == f"{path / 'rng'}: a symbolic link or not a regular file; a checkpoint's files are its own"


def test_a_fifo_is_damage_not_a_hang(run: Path) -> None:
    """A FIFO under a shard's name, the manifest vouching for 0 bytes: refused without being opened for a read
    that would wait for a writer forever."""
    path = ckpt.step_dir(run / "checkpoints", 4)
    os.mkfifo(path / "pipe")
    _vouch(path, "pipe", b"")
    assert ckpt.verify(path) == f"{path / 'pipe'}: a symbolic link or not a regular file; a checkpoint's files are its own"


def test_loading_refuses_a_symlinked_shard(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A shard that is a link to a file outside the checkpoint: `sample` refuses it in one line, exit 2 (before:
    it loaded the linked file and exited 0), at its manifest check; and DCP's own reads refuse it too."""
    path = ckpt.step_dir(run / "checkpoints", 4)
    shard = _link_to_a_copy(path, next(p.name for p in path.glob("__*.distcp")), tmp_path / "elsewhere.distcp")
    code = cli.main(["sample", "--checkpoint", str(path), "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"dist-llm: error: --checkpoint: {shard}: a symbolic link or not a regular file; "
                                 "a checkpoint's files are its own"], err
    cfg = load_config(path / "config.yaml")
    with pytest.raises(ConfigError) as info:  # (the load alone, without the manifest check)
        ckpt.load_model_weights(path, GPT(cfg.model))
    assert str(info.value) == (f"{path}: its tensors cannot be read (rank 0: {shard}: a symbolic link or not a "
                               "regular file; a checkpoint's files are its own)")


def test_loading_refuses_a_symlinked_index(run: Path, tmp_path: Path) -> None:
    path = ckpt.step_dir(run / "checkpoints", 4)
    index = _link_to_a_copy(path, ".metadata", tmp_path / "elsewhere.metadata")
    cfg = load_config(path / "config.yaml")
    with pytest.raises(ConfigError) as info:
        ckpt.load_model_weights(path, GPT(cfg.model))
    assert str(info.value) == f"{index}: a symbolic link or not a regular file; a checkpoint's files are its own"


# -- 10: pruning that stops halfway, and a fresh start that cannot read an old checkpoint ---------------------
def test_a_prune_that_stops_halfway_leaves_no_complete_looking_checkpoint(run: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The deletion of step 2 removes one shard, then fails (its errors ignored): no `step_000002` with a
    manifest may stay behind, for resume to take as complete and then find damaged."""
    root = run / "checkpoints"

    def stops_halfway(path: Path, ignore_errors: bool = False) -> None:
        for shard in list(Path(path).glob("__*.distcp"))[:1]:
            shard.unlink()

    monkeypatch.setattr(shutil, "rmtree", stops_halfway)
    ckpt.prune_checkpoints(root, 1, newest=ckpt.step_dir(root, 4))
    assert [p.name for p in ckpt.step_dirs(root)] == ["step_000004"]


def test_the_new_step_is_durable_in_checkpoints_before_older_ones_are_pruned(tmp_path: Path, corpus: Path,  # noqa: F811
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """After step 4's manifest is written (its rename flushed in step_000004/), checkpoints/ itself is flushed, so
    that step_000004's entry is on disk before step 2 is deleted: a power loss between them could otherwise keep
    the deletion and lose the new checkpoint."""
    from dist_llm import fileio

    root = tmp_path / "run" / "checkpoints"
    events: list[tuple[str, str, bool]] = []  # (what, which folder, whether step 4's manifest exists by then)
    real_fsync, real_delete = fileio.fsync_dir, ckpt._delete

    def fsync_dir(folder: Path) -> None:
        events.append(("fsync", Path(folder).name, (ckpt.step_dir(root, 4) / ckpt.MANIFEST).is_file()))
        real_fsync(folder)

    def delete(path: Path) -> None:
        events.append(("delete", path.name, (ckpt.step_dir(root, 4) / ckpt.MANIFEST).is_file()))
        real_delete(path)

    monkeypatch.setattr(fileio, "fsync_dir", fsync_dir)  # (the atomic writes')
    monkeypatch.setattr(ckpt, "fsync_dir", fsync_dir)
    monkeypatch.setattr(ckpt, "_delete", delete)
    trainer(tmp_path / "run", corpus, train__max_steps=4, train__ckpt_interval=2, train__keep_checkpoints=1).fit()
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_000004"]
    deleted = events.index(("delete", "step_000002", True))
    assert events[deleted - 2 : deleted] == [("fsync", "step_000004", True), ("fsync", "checkpoints", True)]


def test_a_fresh_start_moves_an_unreadable_checkpoint_aside(run: Path, corpus: Path,  # noqa: F811
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """resume=never with step 4's manifest unreadable (EIO): the fresh start goes on, step 4 is moved into
    damaged-<time>/ byte for byte (not deleted), step 2 into previous-<time>/."""
    root = run / "checkpoints"
    earlier = {step: files(ckpt.step_dir(root, step)) for step in (2, 4)}
    manifest = ckpt.step_dir(root, 4) / ckpt.MANIFEST
    read_text = Path.read_text

    def manifest_fails(self: Path, *args: Any, **kwargs: Any) -> str:
        if self == manifest:
            raise OSError(errno.EIO, "Input/output error", str(self))
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", manifest_fails)
    fresh = trainer(run, corpus, train__max_steps=4, train__resume="never")
    monkeypatch.setattr(Path, "read_text", read_text)
    assert fresh.step == 0 and ckpt.step_dirs(root) == []
    [damaged] = root.glob("damaged-*/step_000004")
    [previous] = root.glob("previous-*/step_000002")
    assert files(damaged) == earlier[4] and files(previous) == earlier[2]


# -- 9: a failure of the main rank's file work reaches every rank ---------------------------------------------
def _on_main_failing(rank: int, world_size: int, root: Path) -> str:
    """Trainer._on_main on a stand-in trainer: the main rank's move fails (disk full)."""
    def move() -> str:
        raise OSError(errno.ENOSPC, "No space left on device", str(root / "previous-x"))
    stand_in = SimpleNamespace(ctx=SimpleNamespace(is_main=rank == 0), ckpt_root=root)
    try:
        Trainer._on_main(stand_in, move)  # type: ignore[arg-type]
    except CheckpointError as e:
        return str(e)
    return "no error"


def test_a_failure_on_the_main_rank_reaches_every_rank(tmp_path: Path) -> None:
    """Before, rank 0 raised and rank 1 waited in the broadcast until parallel.timeout_s (here: the test's
    timeout); now both raise the same one line."""
    said = run_distributed(_on_main_failing, 2, tmp_path, timeout=60)
    assert said == [f"checkpoints in {tmp_path}: {tmp_path / 'previous-x'}: No space left on device; nothing was "
                    "deleted"] * 2


def _run_lock_failing(rank: int, world_size: int, out_dir: Path) -> str:
    """Trainer._take_run_lock on a stand-in trainer: the main rank cannot create the lock (disk full)."""
    from dist_llm.train import run_lock

    def full(path: Path) -> str | None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    run_lock.take = full
    stand_in = SimpleNamespace(ctx=SimpleNamespace(is_main=rank == 0), out_dir=out_dir)
    try:
        Trainer._take_run_lock(stand_in)  # type: ignore[arg-type]
    except ConfigError as e:
        return str(e)
    return "no error"


def test_a_failure_to_take_the_run_lock_reaches_every_rank(tmp_path: Path) -> None:
    """Before, rank 0 raised a traceback and rank 1 waited in the broadcast until parallel.timeout_s (here: the
    test's timeout); now both raise the same one line."""
    said = run_distributed(_run_lock_failing, 2, tmp_path, timeout=60)
    assert said == [f"train.out_dir: {tmp_path / 'run.lock'}: cannot take the run lock: No space left on device"] * 2


# -- 8: the checkpoint group's timeout scales with one rank's share ------------------------------------------
def test_the_checkpoint_timeout_scales_with_one_ranks_share() -> None:
    """70B at tp=8, pp=8, dp=64 under ZeRO-1: each rank holds 1/64 of the fp32 weights (4 B) and 1/4096 of the
    optimizer state (12 B); twice that share at 25 MB/s on top of the 1800 s training timeout, computed by hand:
    70e9 * (4/64 + 12/4096) = 4,580,078,125 B; * 2 / 25e6 = 366.40625 s. (Before: the whole 16 B/param, 12.4 h.)
    A tiny model waits for at least 1 GB's worth (40 s)."""
    assert ckpt.coordination_timeout_s(70_000_000_000, 1800, weight_shards=64, state_shards=4096) == 2166.40625
    assert ckpt.coordination_timeout_s(1000, 1800) == 1840.0


# -- 7: a rank other than the first looks up only its own files ---------------------------------------------
def test_a_rank_looks_up_its_own_files_without_listing_the_folder(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 3 of a checkpoint written by 4 ranks: it finds its two shards, its RNG and engine files with no listing of
    the checkpoint folder (listing raises here), so a save costs it a few lookups, not one per file."""
    for k in range(4):
        for n in range(2):
            (tmp_path / f"__{k}_{n}.distcp").write_bytes(b"x")
    (tmp_path / "rng").mkdir()
    for k in range(4):
        (tmp_path / "rng" / f"rank_{k:05d}.json").write_text("{}")
    (tmp_path / ".metadata").write_bytes(b"x")
    (tmp_path / "deepspeed").mkdir()  # parallel.backend=deepspeed: each rank's engine state file
    for k in range(4):
        (tmp_path / "deepspeed" / f"rank_{k:05d}.safetensors").write_bytes(b"x")

    def no_listing(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("listed the checkpoint folder")

    monkeypatch.setattr(Path, "rglob", no_listing)
    monkeypatch.setattr(Path, "iterdir", no_listing)
    monkeypatch.setattr(Path, "glob", no_listing)
    monkeypatch.setattr(os, "scandir", no_listing)
    monkeypatch.setattr(os, "listdir", no_listing)
    assert checksums.checkpoint_files(tmp_path, rank=3, group_rank=3) == [
        "__3_0.distcp", "__3_1.distcp", "rng/rank_00003.json", "deepspeed/rank_00003.safetensors"]


# -- 11: one run per out_dir; a fresh start keeps the earlier run's metrics ----------------------------------
def test_a_second_run_in_the_same_out_dir_is_refused(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """The lock names a live process on this host (a `sleep`), then a process of another host: refused in one
    line naming the file and the holder; a lock whose process is gone is taken over."""
    out = tmp_path / "run"
    out.mkdir()
    lock = out / "run.lock"
    holder = subprocess.Popen(["sleep", "60"])
    try:
        lock.write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname()}))
        with pytest.raises(ConfigError) as info:
            trainer(out, corpus, train__max_steps=2)
        assert str(info.value) == (f"train.out_dir: {lock}: in use by process {holder.pid} on this host; wait for "
                                   "it, or use another train.out_dir")
        lock.write_text(json.dumps({"pid": holder.pid, "host": "elsewhere"}))
        with pytest.raises(ConfigError) as info:
            trainer(out, corpus, train__max_steps=2)
        assert str(info.value) == (f"train.out_dir: {lock}: in use by process {holder.pid} on host elsewhere, which "
                                   "cannot be checked from here; if that run has ended, remove the file")
    finally:
        holder.kill()
        holder.wait()
    lock.write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname()}))  # gone: stale
    trainer(out, corpus, train__max_steps=2).fit()
    assert not lock.exists()  # released at the end of the run
    with pytest.raises(ConfigError):
        trainer(out, corpus, train__max_steps=2, train__resume=str(out / "nowhere"))
    assert not lock.exists()  # and by a run that stopped before training


def test_the_same_job_restarted_elsewhere_takes_its_lock_over(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun restarting a failed group (or SLURM requeueing a job) may start rank 0 on another host: the lock
    of an earlier attempt of the same job is taken over; another job's lock, or torchrun's default id 'none'
    (which every job without --rdzv-id shares), is not."""
    from dist_llm.train import run_lock

    lock = tmp_path / "run.lock"
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    for ours, theirs, taken in (("job-7", "job-7", True), ("job-7", "job-8", False), ("none", "none", False)):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", ours)
        lock.write_text(json.dumps({"pid": 1, "host": "elsewhere", "job": theirs}))
        assert (run_lock.take(lock) is None) == taken, (ours, theirs)
        if taken:
            assert json.loads(lock.read_text())["job"] == "job-7"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # a requeued SLURM job keeps its id
    lock.write_text(json.dumps({"pid": 1, "host": "elsewhere", "job": "4242"}))
    assert run_lock.take(lock) is None
    # on this host the pid decides, whatever the job: two live runs of one job id (two sruns of one allocation,
    # or the launch script's fixed rendezvous id) must not share an out_dir
    holder = subprocess.Popen(["sleep", "60"])
    try:
        lock.write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname(), "job": "4242"}))
        assert run_lock.take(lock) == (f"{lock}: in use by process {holder.pid} on this host; wait for it, or use "
                                       "another train.out_dir")
    finally:
        holder.kill()
        holder.wait()


def test_a_fresh_start_keeps_the_earlier_runs_metrics(run: Path, corpus: Path) -> None:  # noqa: F811
    earlier = (run / "metrics.jsonl").read_bytes()
    assert b'"loss"' in earlier
    trainer(run, corpus, train__max_steps=2, train__resume="never").fit()
    [kept] = run.glob("metrics.previous-*.jsonl")
    assert kept.read_bytes() == earlier
    assert (run / "metrics.jsonl").read_bytes() != earlier


# -- 10: a rank whose own files fail to write takes its peers with it, before DCP's collectives ---------------
def _save_with_rank_1_disk_full(rank: int, world_size: int, root: Path) -> str:
    """save_checkpoint on stand-ins for the config and context; rank 1's RNG file hits a full disk."""
    import torch

    real_write = ckpt._atomic_write

    def full_for_rng(path: Path, text: str) -> None:
        if path.parent.name == "rng":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, text)

    if rank == 1:
        ckpt._atomic_write = full_for_rng  # type: ignore[assignment]  (rank 1's process only)
    ctx = SimpleNamespace(rank=rank, is_main=rank == 0, device=torch.device("cpu"))
    cfg = SimpleNamespace(to_yaml=lambda: "model: {}\n")
    group = dist.new_group(backend="gloo")
    try:
        ckpt.save_checkpoint(ckpt.step_dir(root, 8), state={"w": torch.ones(4) * rank}, train_state={"step": 8},
                             cfg=cfg, ctx=ctx, group=group)  # type: ignore[arg-type]
    except OSError as e:
        return str(e)
    return "no error"


def test_a_failed_write_on_one_rank_reaches_every_rank_before_dcp(tmp_path: Path) -> None:
    """Before, rank 1 raised and rank 0 went on into dcp.save, where it waited on rank 1 until that process exited
    and then died of a gloo error; now both raise the same one line, naming the rank and the file, and the
    complete checkpoint already there stays as it was."""
    earlier = ckpt.step_dir(tmp_path, 4)
    earlier.mkdir()
    (earlier / ckpt.MANIFEST).write_text("{}")
    said = run_distributed(_save_with_rank_1_disk_full, 2, tmp_path, timeout=60)
    rng = ckpt.step_dir(tmp_path, 8) / "rng" / "rank_00001.json"
    assert said == [f"rank 1: {rng}: No space left on device"] * 2
    assert (earlier / ckpt.MANIFEST).read_text() == "{}"
