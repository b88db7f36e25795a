"""Resume never loses work (a damaged checkpoint is kept, byte for byte; an I/O error is not damage; pruning
never reaches past the newest checkpoint), and checksums are computed by the rank that holds the bytes."""

from __future__ import annotations

import errno
import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from dist_llm.config import load_config
from dist_llm.parallel.context import ParallelContext
from dist_llm.train import checkpoint as ckpt
from dist_llm.train import checksums
from dist_llm.train.trainer import CheckpointError, Trainer
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed
from tests.test_data_parallel import corpus  # noqa: F401
from tests.test_launch import env
from tests.test_reliability import train_cmd


def files(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes: what "untouched" and "moved, not deleted" are compared on."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def trainer(out: Path, corpus: Path, **extra: object) -> Trainer:  # noqa: F811
    cfg = load_config(None, tiny_overrides(out, data__source=str(corpus), train__eval_interval=0, **extra))
    return Trainer(cfg, ParallelContext.from_config(cfg))


def test_the_only_checkpoint_damaged_stops_resume_and_never_deletes_it(tmp_path: Path) -> None:
    """Through the CLI: one truncated shard in the only checkpoint. resume=auto exits 2 with one line naming
    it and the ways on, and changes nothing; resume=never moves it into damaged-<time>/ intact and starts over."""
    out = tmp_path / "run"
    subprocess.run(train_cmd(out, "train.max_steps=2"), env=env(), capture_output=True, timeout=300, check=True)
    root, only = out / "checkpoints", ckpt.step_dir(out / "checkpoints", 2)
    shard = next(only.glob("__*.distcp"))
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-10])
    before = files(root)

    proc = subprocess.run(train_cmd(out, "train.max_steps=4"), env=env(), capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dist-llm: error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert errors == [
        f"dist-llm: error: train.resume=auto: no checkpoint in {root} matches its manifest: step_000002 ({shard}: "
        f"{size - 10} bytes, the manifest says {size}). Nothing was changed: repair them, resume from another copy "
        f"with train.resume=PATH, or start over with train.resume=never (which moves them into {root}/"
        "damaged-<time>/)"], proc.stderr[-2000:]
    assert files(root) == before  # every byte of every file, nothing added

    proc = subprocess.run(train_cmd(out, "train.max_steps=2", "train.resume=never"), env=env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [moved] = root.glob("damaged-*/step_000002")
    assert files(moved) == {name.removeprefix("step_000002/"): data for name, data in before.items()}
    assert ckpt.verify(only) is None  # the new run's own checkpoint


def test_a_fresh_start_moves_intact_checkpoints_aside(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    trainer(tmp_path, corpus, train__max_steps=4, train__ckpt_interval=2, train__keep_checkpoints=0).fit()
    earlier = files(tmp_path / "checkpoints")
    partial = tmp_path / "checkpoints" / "step_000006"  # a save that crashed before its manifest
    partial.mkdir()
    (partial / "train_state.json").write_text("{}")
    fresh = trainer(tmp_path, corpus, train__max_steps=4, train__resume="never")
    assert fresh.step == 0 and ckpt.list_checkpoints(tmp_path / "checkpoints") == []
    [previous] = (tmp_path / "checkpoints").glob("previous-*")
    assert files(previous) == earlier
    [damaged] = (tmp_path / "checkpoints").glob("damaged-*")
    assert files(damaged) == {"step_000006/train_state.json": b"{}"}


def _eio(path: Path) -> OSError:
    return OSError(errno.EIO, "Input/output error", str(path))


def test_an_io_error_while_checking_is_not_damage(tmp_path: Path, corpus: Path,  # noqa: F811
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest or a shard that cannot be read (EIO) stops the run with one line naming the file; the
    checkpoint is neither skipped as damaged nor moved, and a fresh start does not follow."""
    trainer(tmp_path, corpus, train__max_steps=2).fit()
    path = ckpt.step_dir(tmp_path / "checkpoints", 2)
    before = files(tmp_path / "checkpoints")
    manifest, shard = path / ckpt.MANIFEST, next(path.glob("__*.distcp"))

    read_text = Path.read_text

    def manifest_fails(self: Path, *args: Any, **kwargs: Any) -> str:
        if self == manifest:
            raise _eio(self)
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", manifest_fails)
    with pytest.raises(CheckpointError) as info:
        trainer(tmp_path, corpus, train__max_steps=4)
    assert str(info.value) == (f"train.resume: cannot check {path}: rank 0: {manifest}: Input/output error; nothing "
                               "was moved or deleted: run again once the storage answers")
    monkeypatch.setattr(Path, "read_text", read_text)

    open_regular = checksums._open_regular

    def shard_fails(root: Path, name: str) -> tuple[int, int]:
        if root / name == shard:
            raise _eio(root / name)
        return open_regular(root, name)

    monkeypatch.setattr(checksums, "_open_regular", shard_fails)
    with pytest.raises(CheckpointError, match=rf"^train.resume: cannot check {path}: rank 0: {shard}: Input/output "
                                              "error; nothing was moved or deleted"):
        trainer(tmp_path, corpus, train__max_steps=4)
    assert files(tmp_path / "checkpoints") == before


def test_pruning_keeps_the_newest_and_anything_newer(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """Resumed from an older checkpoint while newer ones exist (one of them damaged): the newer ones are another
    history, moved aside intact (damaged as it is) before the first save, and pruning deletes only checkpoints
    older than the one just written."""
    root = tmp_path / "checkpoints"
    trainer(tmp_path, corpus, train__max_steps=8, train__ckpt_interval=2, train__keep_checkpoints=0).fit()
    newest = ckpt.step_dir(root, 8)
    shard = next(newest.glob("__*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    earlier = {step: files(ckpt.step_dir(root, step)) for step in (4, 6, 8)}

    trainer(tmp_path, corpus, train__max_steps=8, train__ckpt_interval=2, train__keep_checkpoints=1,
            train__stop_after_step=4, train__resume=str(ckpt.step_dir(root, 2))).fit()
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_000004"]  # (step 2 pruned: older, keep=1)
    assert ckpt.verify(ckpt.step_dir(root, 4)) is None
    [aside] = root.glob("superseded-*")
    assert {step: files(aside / f"step_{step:06d}") for step in (4, 6, 8)} == earlier  # moved, byte for byte


def test_prune_counts_back_from_the_checkpoint_just_written(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8, 10):
        ckpt.step_dir(tmp_path, step).mkdir()
        (ckpt.step_dir(tmp_path, step) / ckpt.MANIFEST).write_text("{}")
    ckpt.prune_checkpoints(tmp_path, 2, newest=ckpt.step_dir(tmp_path, 6))
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000004", "step_000006", "step_000008",
                                                                 "step_000010"]


# -- each rank hashes its own files -------------------------------------------------------------------------
def _save_and_check(rank: int, world_size: int, out: Path, corpus: Path) -> dict[str, Any]:  # noqa: F811
    """On each of 2 ranks (ZeRO-2, so both write shards): save, then resume; record the files this rank hashed
    at each, then damage and fail-to-read a file of rank 1's share and check both ranks' verdicts."""
    hashed: list[Path] = []
    real = checksums.sha256_file

    def recording(path: Path) -> str:
        hashed.append(path)
        if failing and path == failing[0]:
            raise _eio(path)
        return real(path)

    opened = checksums._open_regular

    def recording_open(root: Path, name: str) -> tuple[int, int]:  # what verifying reads
        hashed.append(root / name)
        if failing and root / name == failing[0]:
            raise _eio(root / name)
        return opened(root, name)

    failing: list[Path] = []
    checksums.sha256_file = recording  # type: ignore[assignment]  (this rank's process only)
    checksums._open_regular = recording_open  # type: ignore[assignment]
    cfg = load_config(None, tiny_overrides(out, data__source=str(corpus), train__eval_interval=0, train__max_steps=2,
                                           parallel__zero_stage=2))
    ctx = ParallelContext.from_config(cfg)
    try:
        Trainer(cfg, ctx).fit()
        path = ckpt.step_dir(out / "checkpoints", 2)
        saved = [str(p.relative_to(path)) for p in hashed]
        hashed.clear()
        resumed = Trainer(cfg, ctx)  # resume=auto: checks step 2
        assert resumed.resumed_from == path
        verified = [str(p.relative_to(path)) for p in hashed]

        group = resumed.ckpt_group
        victim = [path / verified[0] if rank == 1 else None]  # a file only rank 1 checks
        dist.broadcast_object_list(victim, src=1, group=group)
        original = victim[0].read_bytes()
        if rank == 1:  # one byte changed, the size kept: only its checksum can tell
            victim[0].write_bytes(bytes([original[0] ^ 1]) + original[1:])
        dist.barrier(group=group)
        damaged = ckpt.verify(path, group=group)
        dist.barrier(group=group)
        if rank == 1:
            victim[0].write_bytes(original)
            failing.append(victim[0])
        try:
            ckpt.verify(path, group=group)
            unreadable = None
        except ckpt.UnreadableCheckpoint as e:
            unreadable = str(e)
        return {"saved": saved, "verified": verified, "damaged": damaged, "unreadable": unreadable,
                "victim": str(victim[0])}
    finally:
        ctx.destroy()


def test_each_rank_hashes_the_files_it_wrote_and_checks_a_share(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    ranks = run_distributed(_save_and_check, 2, tmp_path, corpus, init_group=False)
    path = ckpt.step_dir(tmp_path / "checkpoints", 2)
    on_disk = {name: data for name, data in files(path).items() if name != ckpt.MANIFEST}
    shards = {r: {n for n in on_disk if n.startswith(f"__{r}_") and n.endswith(".distcp")} for r in (0, 1)}
    assert shards[0] and shards[1] and len(on_disk) == len(shards[0]) + len(shards[1]) + 5

    # saving: rank 1 hashed its own shards and RNG file only; rank 0 its own and the files only it writes
    assert sorted(ranks[1]["saved"]) == sorted(shards[1] | {"rng/rank_00001.json"})
    assert sorted(ranks[0]["saved"]) == sorted(shards[0] | {"rng/rank_00000.json", ".metadata", "config.yaml",
                                                            "train_state.json"})
    # the manifest lists every file, with sizes and digests computed here from the bytes
    manifest = json.loads((path / ckpt.MANIFEST).read_text())["files"]
    assert manifest == {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                        for name, data in on_disk.items()}

    # resuming: the two ranks checked disjoint shares that together cover the manifest
    shares = [set(r["verified"]) for r in ranks]
    assert shares[0] and shares[1] and not shares[0] & shares[1] and shares[0] | shares[1] == set(manifest)
    # a changed byte in rank 1's share, or an I/O error there: both ranks say the same
    victim = ranks[1]["victim"]
    assert ranks[0]["damaged"] == ranks[1]["damaged"] == f"{victim}: checksum differs from the manifest's"
    assert ranks[0]["unreadable"] == ranks[1]["unreadable"] == f"rank 1: {victim}: Input/output error"
