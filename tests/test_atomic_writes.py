"""Every file dist_llm writes outside DCP's shards is whole or absent: a write that fails midway keeps the
previous file byte for byte and leaves no temporary behind; final files get the umask's mode.

Two ways to fail midway: the kernel's per-process file size limit (RLIMIT_FSIZE: a write past it fails with
EFBIG, as a full disk fails with ENOSPC), which reaches any writer; and, for safetensors files, a serializer
that writes part of its output in place and raises, as safetensors before 0.5 did (the installed one writes
through a temporary of its own, which must not be what keeps our files whole).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import signal
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_llm import convert as hf
from dist_llm.config import Config, load_config
from dist_llm.convert import save_full
from dist_llm.fileio import atomic_folder, atomic_path, atomic_write_text
from dist_llm.model import GPT
from dist_llm.peft import apply_peft, save_adapter
from dist_llm.train import checkpoint as ckpt
from dist_llm.train.metrics import plot_losses
from dist_llm.train.report import write_report
from tests.conftest import tiny_overrides


@contextlib.contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """Writes that would make any file larger than `nbytes` fail with EFBIG (SIGXFSZ ignored, so they return
    the error rather than kill the process)."""
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)


def failing_save_file(tensors: dict[str, torch.Tensor], filename: str, metadata: Any = None) -> None:
    """An in-place serializer that dies halfway: it truncates `filename`, writes some bytes, and raises."""
    with open(filename, "wb") as f:
        f.write(b"\x00" * 100)
    raise OSError(errno.ENOSPC, "No space left on device")


def failing_write_file(path: Path, *args: Any, **kwargs: Any) -> None:
    """dist_llm's streaming safetensors writer dying halfway, as failing_save_file does."""
    failing_save_file({}, str(path))


def fail_export_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dist_llm.safetensors_shards.write_file", failing_write_file)
    monkeypatch.setattr("dist_llm.convert.write_file", failing_write_file)


@pytest.fixture
def umask_027() -> Iterator[None]:
    old = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(old)


FILE_MODE, DIR_MODE = 0o640, 0o750  # 0o666 and 0o777 less umask 0o027, by hand


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every entry under `folder` (temporaries included: they are hidden names) with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"<dir>"
            for p in sorted(folder.rglob("*"))}


def tiny(tmp_path: Path, **extra: Any) -> tuple[GPT, Config]:
    cfg = load_config(None, tiny_overrides(tmp_path, **extra))
    torch.manual_seed(0)
    return GPT(cfg.model), cfg


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A complete dist_llm checkpoint of a tiny GPT-2 shaped model (through an HF export: no training)."""
    model, _ = tiny(tmp_path)
    hf.save_hf(model, tmp_path / "hf-src")
    return hf.convert_hf_to_checkpoint(tmp_path / "hf-src", tmp_path / "ckpt")


# -- failing midway -----------------------------------------------------------------------------------------
def test_hf_export_failing_midway_keeps_the_previous_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = tiny(tmp_path)
    out = tmp_path / "hf"
    hf.save_hf(model, out)
    before = snapshot(out)
    with torch.no_grad():
        model.wte.weight.add_(1.0)  # a different export, so a partial one would show
    fail_export_writes(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        hf.save_hf(model, out)
    assert snapshot(out) == before
    monkeypatch.undo()
    with file_size_limit(1000):  # a real write error: the weights are ~140 KB
        with pytest.raises(Exception, match="File too large"):
            hf.save_hf(model, out)
    assert snapshot(out) == before


def test_convert_to_hf_failing_midway_leaves_no_folder(tmp_path: Path, checkpoint: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    parent = tmp_path / "exports"
    parent.mkdir()
    fail_export_writes(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        hf.convert_checkpoint_to_hf(checkpoint, parent / "hf")
    assert snapshot(parent) == {}  # neither the target nor the folder it was built in
    (parent / "hf").mkdir()  # an empty target folder stays as it was
    with pytest.raises(OSError, match="No space left"):
        hf.convert_checkpoint_to_hf(checkpoint, parent / "hf")
    assert snapshot(parent) == {"hf": b"<dir>"}
    monkeypatch.undo()
    out = hf.convert_checkpoint_to_hf(checkpoint, parent / "hf")
    assert sorted(p.name for p in parent.iterdir()) == ["hf"]
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                               "tokenizer_config.json"}


def test_adapter_save_failing_midway_keeps_the_previous_adapter(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    model, cfg = tiny(tmp_path, peft__method="lora", peft__rank=4)
    apply_peft(model, cfg.peft, seed=0)
    base = {"init_from": "", "model_fingerprint": cfg.fingerprint()}
    save_adapter(model, tmp_path / "adapter", cfg.peft, base=base)
    before = snapshot(tmp_path / "adapter")
    monkeypatch.setattr("dist_llm.peft.save_file", failing_save_file)
    with pytest.raises(OSError, match="No space left"):
        save_adapter(model, tmp_path / "adapter", cfg.peft, base={**base, "init_from": "hf:elsewhere"})
    assert snapshot(tmp_path / "adapter") == before
    monkeypatch.undo()
    with file_size_limit(100), pytest.raises(Exception, match="File too large"):
        save_adapter(model, tmp_path / "adapter", cfg.peft, base={**base, "init_from": "hf:elsewhere"})
    assert snapshot(tmp_path / "adapter") == before


def test_consolidated_file_failing_midway_leaves_nothing(tmp_path: Path, checkpoint: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    parent = tmp_path / "full"
    parent.mkdir()
    fail_export_writes(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        save_full(checkpoint, parent / "model.safetensors")
    assert snapshot(parent) == {}


def run_dir_with_metrics(tmp_path: Path, steps: int) -> Path:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    _, cfg = tiny(tmp_path)
    (run / "config.yaml").write_text(cfg.to_yaml())
    records = [{"event": "start", "layout": {"world_size": 1, "dp": 1, "tp": 1, "pp": 1}}]
    records += [{"step": s, "loss": 5.0 - 0.1 * s, "tokens_per_s": 1000.0 + s} for s in range(1, steps + 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_report_and_loss_plot_failing_midway_keep_the_previous_ones(tmp_path: Path) -> None:
    run = run_dir_with_metrics(tmp_path, steps=3)
    write_report(run)
    plot_losses(run / "metrics.jsonl", run / "loss.png")
    before = snapshot(run)
    run_dir_with_metrics(tmp_path, steps=50)  # a longer run: a new report and plot
    before.update({"metrics.jsonl": (run / "metrics.jsonl").read_bytes()})
    with file_size_limit(200):
        with pytest.raises(OSError, match="File too large"):
            write_report(run)
        with pytest.raises(OSError, match="File too large"):
            plot_losses(run / "metrics.jsonl", run / "loss.png")
    assert snapshot(run) == before


def test_checkpoint_json_failing_midway_keeps_the_previous_file(tmp_path: Path) -> None:
    target = tmp_path / "train_state.json"
    ckpt._atomic_write(target, json.dumps({"step": 1}))
    with file_size_limit(10), pytest.raises(OSError, match="File too large"):
        ckpt._atomic_write(target, json.dumps({"step": 2, "tokens_seen": 123456789}))
    assert snapshot(tmp_path) == {"train_state.json": b'{"step": 1}'}


def test_atomic_helpers_on_failure_and_on_a_taken_folder(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("old")
    with pytest.raises(RuntimeError, match="writer died"):
        with atomic_path(tmp_path / "a.txt") as tmp:
            tmp.write_text("new, half")
            raise RuntimeError("writer died")
    with pytest.raises(RuntimeError, match="writer died"):
        with atomic_folder(tmp_path / "folder") as tmp:
            (tmp / "f").write_text("x")
            raise RuntimeError("writer died")
    assert snapshot(tmp_path) == {"a.txt": b"old"}
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep").write_text("mine")
    with pytest.raises(FileExistsError, match=f"^{tmp_path / 'taken'}: cannot put the new folder in place"):
        with atomic_folder(tmp_path / "taken") as tmp:
            (tmp / "f").write_text("x")
    assert snapshot(tmp_path) == {"a.txt": b"old", "taken": b"<dir>", "taken/keep": b"mine"}


# -- modes --------------------------------------------------------------------------------------------------
def modes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mode & 0o777 for p in sorted(folder.rglob("*"))}


def test_written_files_get_the_umask_mode(tmp_path: Path, checkpoint: Path, umask_027: None) -> None:
    out = tmp_path / "out"
    out.mkdir()
    model, cfg = tiny(tmp_path)
    hf.save_hf(model, out / "hf")
    hf.convert_checkpoint_to_hf(checkpoint, out / "converted")
    save_full(checkpoint, out / "model.safetensors")
    peft_model, peft_cfg = tiny(tmp_path, peft__method="lora", peft__rank=4)
    apply_peft(peft_model, peft_cfg.peft, seed=0)
    save_adapter(peft_model, out / "adapter", peft_cfg.peft, base={})
    run = run_dir_with_metrics(out, steps=3)
    write_report(run)
    plot_losses(run / "metrics.jsonl", run / "loss.png")
    ckpt._atomic_write(out / "state.json", "{}")
    written = modes(out)
    for folder in ("hf", "converted", "adapter", "run"):
        assert written.pop(folder) == DIR_MODE, folder
    for name in ("run/config.yaml", "run/metrics.jsonl"):  # written by this test
        written.pop(name)
    assert written == {name: FILE_MODE for name in [
        "adapter/adapter.json", "adapter/adapter.safetensors", "converted/config.json",
        "converted/model.safetensors", "converted/tokenizer.json", "converted/tokenizer_config.json", "hf/config.json", "hf/model.safetensors", "model.safetensors",
        "run/loss.png", "run/report.md", "state.json"]}


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENOTSUP])
def test_a_file_system_that_cannot_fsync_a_folder_still_writes(tmp_path: Path, code: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Some FUSE and CIFS mounts refuse fsync on a directory (EINVAL, ENOTSUP): the write has succeeded, so it
    must not be reported as failed; fsync of the file itself, or another error of the folder's, still fails."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(code, os.strerror(code))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    atomic_write_text(tmp_path / "a.txt", "new")
    with atomic_folder(tmp_path / "folder") as tmp:
        (tmp / "f").write_text("x")
    assert snapshot(tmp_path) == {"a.txt": b"new", "folder": b"<dir>", "folder/f": b"x"}

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", eio)
    with pytest.raises(OSError, match="Input/output error"):
        atomic_write_text(tmp_path / "b.txt", "lost")


def test_the_tokenizer_copied_into_a_checkpoint_is_synced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file a manifest lists must be on disk before the manifest says the checkpoint is complete: the
    tokenizer's copy was left in the page cache (shutil.copyfile, no fsync), so a power cut could leave a
    complete-looking checkpoint with an empty tokenizer.json (a review)."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    source = tmp_path / "tokenizer.src.json"
    source.write_text('{"model": {}}')
    cfg = load_config(None, tiny_overrides(tmp_path))
    from dist_llm.parallel.context import ParallelContext

    model = GPT(cfg.model)
    path = tmp_path / "ckpt"
    ckpt.save_checkpoint(path, state={"model": model.state_dict()}, train_state={"step": 0}, cfg=cfg,
                         ctx=ParallelContext.from_config(cfg), extra_files={"tokenizer.json": source})
    assert (path / "tokenizer.json").read_text() == '{"model": {}}'
    assert any(Path(p).parent == path and "tokenizer.json" in Path(p).name for p in synced), synced
