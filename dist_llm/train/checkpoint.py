"""Checkpoints: model and optimizer through torch.distributed.checkpoint, the rest as JSON, manifest last.

Layout of `checkpoints/step_NNNNNN/`:
  .metadata, __*.distcp      model and optimizer tensors, keyed by parameter name with their full shapes
                             (DCP: each rank writes only its own chunks, with their offsets in the full
                             tensors, see parallel/shards.py, and a load reshards into whatever layout asks
                             for them); tensors only
  train_state.json           step, tokens seen, sampler, loss scaler (identical on every rank)
  rng/rank_KKKKK.json        each rank's RNG states
  config.yaml                the resolved config, so `dist-llm sample` needs nothing else
  deepspeed/rank_KKKKK.safetensors  parallel.backend=deepspeed at ZeRO-1/2 only: each rank's optimizer
                             partition (fp32 master, Adam moments, loss scaler, step counts), tensors plus
                             JSON, written and read by that rank alone
  manifest.json              written last, atomically: the checkpoint is complete only once it exists; each
                             rank hashes the files it wrote (see checksums.py)

Nothing here deletes a complete checkpoint but pruning, and pruning only deletes checkpoints older than the
one just completed; a checkpoint in the way of a new one is moved aside into `damaged-<time>/` or
`previous-<time>/` next to the step directories.

Loading runs no code from the checkpoint: only tensors go through DCP (whose shards torch reads with
weights_only=True), everything else is JSON, and DCP's own `.metadata` index, a pickle, is read by
`safe_metadata.load_index` (exact globals, allowed opcodes and calls only; tensor entries only: DCP would
unpickle any other kind with weights_only=False).
"""

from __future__ import annotations

import base64
import contextlib
import errno
import io
import json
import logging
import math
import os
import re
import secrets
import shutil
import stat
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from dist_llm.config import Config, ConfigError, config_from_dict
from dist_llm.fileio import atomic_path, atomic_write_text, fsync_dir
from dist_llm.model.init import INIT_SCHEME
from dist_llm.parallel.comm import shared_error
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.shards import ChunkStager
from dist_llm.train.safe_metadata import load_failure, load_index
from dist_llm.train import checksums
# re-exported: callers know checkpoints, not how they are hashed
from dist_llm.train.checksums import MANIFEST, UnreadableCheckpoint  # noqa: F401
from dist_llm.train.errors import ReadError
from dist_llm.train.preemption import interrupted

log = logging.getLogger("dist_llm")
_STEP_DIR = re.compile(r"^step_(\d{6,})$")
CONFIG_FILE = "config.yaml"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


# The slowest rate at which a rank is assumed to write or hash its share of a checkpoint: a tenth of what the
# README's 2-core machine does (0.25 GB/s), for a shared network filesystem under load.
SLOWEST_BYTES_PER_S = 25e6


# What a checkpoint holds a parameter (fp32 weights; AdamW's two fp32 moments, and its fp32 master copy under
# 16-bit training), and the unevenness allowed between ranks' shares (pipeline stages differ by the
# embedding; DCP's dedup of replicated tensors balances by bytes, not exactly).
WEIGHT_BYTES, OPTIMIZER_BYTES, UNEVEN = 4, 12, 2
# However small a rank's share, its wait may cover this many bytes: small files, the index, a slow start.
FLOOR_BYTES = 1e9


def coordination_timeout_s(n_params: int, timeout_s: float, *, weight_shards: int = 1,
                           state_shards: int = 1) -> float:
    """How long a rank may wait for the others while a checkpoint of an `n_params` model is saved, loaded or
    checked: the training timeout plus the time for one rank to write, read or hash its own share at the
    slowest assumed rate. Each rank holds (and saves or loads) the weights split `weight_shards` ways (tp * pp,
    times dp under ZeRO-3) and the optimizer state `state_shards` ways (times dp from ZeRO-1 on); hashing and
    checking are split the same way. Not the whole checkpoint: at 70B and thousands of ranks that would be a
    wait of half a day for a rank that died silently."""
    share = n_params * (WEIGHT_BYTES / weight_shards + OPTIMIZER_BYTES / state_shards)
    return _wait_s(timeout_s, UNEVEN * share)


def _wait_s(timeout_s: float, share_bytes: float) -> float:
    """The training timeout plus the time to write, read or hash `share_bytes` (at least FLOOR_BYTES) at the
    slowest assumed rate."""
    return timeout_s + max(share_bytes, FLOOR_BYTES) / SLOWEST_BYTES_PER_S


# DCP warns that it "assumes a single process" when no process group exists, which is what we mean; the
# warning may come from the background save's thread, so it is filtered for the process.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _atomic_write(path: Path, text: str) -> None:
    atomic_write_text(path, text)


def rng_state(device: torch.device) -> dict[str, str]:
    state = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if device.type == "cuda":
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state(device).numpy().tobytes()).decode()
    return state


def set_rng_state(state: Any, device: torch.device, *, source: Path | None = None) -> None:
    """Restore `rng_state`'s generators; a state that is not one (`source`: the file it came from, named in the
    one-line ConfigError) leaves them as they were."""
    def tensor(key: str, like: torch.Tensor) -> torch.Tensor:
        text = state.get(key) if isinstance(state, dict) else None
        try:
            raw = base64.b64decode(text, validate=True) if isinstance(text, str) else None
        except ValueError:
            raw = None
        if raw is None or len(raw) != like.numel():  # (torch checks the size, in a multi-line RuntimeError)
            got = "missing" if raw is None else f"{len(raw)} bytes"
            raise ConfigError(f"{source or 'the RNG state'}: its {key} generator state is {got}, this torch's "
                              f"holds {like.numel()} bytes")
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    cpu = tensor("cpu", torch.get_rng_state())
    cuda = tensor("cuda", torch.cuda.get_rng_state(device)) if device.type == "cuda" and "cuda" in state else None
    try:  # (the right size, yet not a generator's state: "Invalid mt19937 state")
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
    except RuntimeError as e:
        raise ConfigError(f"{source or 'the RNG state'}: not a generator state ({str(e).splitlines()[0]})") from None


def _clear(path: Path, ctx: ParallelContext) -> str | None:
    """On the main rank: make `path` free for a new checkpoint; what went wrong, or None. A complete checkpoint
    there is moved aside, never deleted, and if the move fails it stays where it is, complete."""
    if not ctx.is_main or not path.exists():
        return None
    try:
        if is_complete(path):  # (resume moves later ones aside first: a guard, in case one appears since)
            log.warning("moved %s, an earlier run's checkpoint at this step, to %s", path,
                        move_aside(path.parent, [path], "previous"))
        else:
            shutil.rmtree(path)  # a partial leftover from a crashed save (no manifest) of this very step
    except OSError as e:
        return f"{e.filename or path}: {e.strerror or e} (while making room for the new checkpoint; {path} is kept)"
    return None




def _write_own_files(path: Path, *, train_state: dict[str, Any], cfg: Config, ctx: ParallelContext,
                     extra_files: dict[str, Path] | None, engine_files: Callable[[Path], None] | None) -> str | None:
    """This rank's files of a checkpoint (its RNG state; the main rank's small files and copies; an engine's
    files); what went wrong, naming the rank and file, or None."""
    try:
        (path / "rng").mkdir(parents=True, exist_ok=True)
        _atomic_write(path / "rng" / f"rank_{ctx.rank:05d}.json", json.dumps(rng_state(ctx.device)))
        if ctx.is_main:
            _atomic_write(path / "train_state.json", json.dumps(train_state, indent=1))
            _atomic_write(path / CONFIG_FILE, cfg.to_yaml())
            for name, source in (extra_files or {}).items():  # (synced, as every other file of a checkpoint)
                with atomic_path(path / name) as tmp:
                    shutil.copyfile(source, tmp)
        if engine_files is not None:  # before the manifest, which lists (and checksums) what it wrote
            engine_files(path)
    except Exception as e:  # noqa: BLE001 - an engine's save may fail otherwise; its peers must still hear of it
        if interrupted(e):  # a second Ctrl-C that stopped a write: the abort, not a failed save
            raise KeyboardInterrupt from None
        if isinstance(e, OSError):
            return f"rank {ctx.rank}: {e.filename or path}: {e.strerror or e}"
        first = str(e).splitlines()[0] if str(e) else ""
        return f"rank {ctx.rank}: {path}: {type(e).__name__}: {first}"
    return None


def _begin(path: Path, *, train_state: dict[str, Any], cfg: Config, ctx: ParallelContext, group: Any,
           extra_files: dict[str, Path] | None, engine_files: Callable[[Path], None] | None,
           on_cleared: Callable[[], None] | None) -> None:
    """Everything of a checkpoint but its DCP tensors and the manifest: the small files, and an engine's own
    files (`engine_files(path)`, on every rank), written at once. `on_cleared()` is called once `path` is
    free: from then on, a directory at `path` is this save's own (a failed save may remove it, not before).
    A failure to clear, or to write any rank's files, raises the same OSError on every rank (the errors are
    gathered over `group`: no peer waits in DCP's collectives on a rank that gave up)."""
    error = shared_error(_clear(path, ctx), group)
    if error is not None:
        raise OSError(error)
    if on_cleared is not None:
        on_cleared()
    error = shared_error(_write_own_files(path, train_state=train_state, cfg=cfg, ctx=ctx, extra_files=extra_files,
                                          engine_files=engine_files), group)
    if error is not None:
        raise OSError(error)


def _complete(path: Path, *, train_state: dict[str, Any], cfg: Config, ctx: ParallelContext, group: Any,
              manifest_extra: dict[str, Any] | None, keep: int) -> None:
    """Collective, once every rank's files are written: each rank hashes its own files, in parallel; the main
    rank writes the manifest, atomically and last, then prunes to the newest `keep`."""

    def write(files: checksums.FileEntries) -> None:
        manifest = {
            "step": train_state["step"],
            "tokens_seen": train_state.get("tokens_seen", 0),
            "layout": ctx.layout(),
            "model_fingerprint": cfg.fingerprint(),
            "init_scheme": INIT_SCHEME,  # (how train.seed's initial values were drawn: model/init.py)
            "files": dict(sorted(files.items())),
            **(manifest_extra or {}),
        }
        _atomic_write(path / MANIFEST, json.dumps(manifest, indent=1))
        # the manifest's rename is durable in step_N/ (atomic_write flushed it); step_N's own entry in checkpoints/
        # must be too, before older checkpoints are deleted: a power loss could otherwise keep the deletions and
        # lose the new one
        fsync_dir(path.parent)
        prune_checkpoints(path.parent, keep, newest=path)

    checksums.hash_and_write_manifest(path, rank=ctx.rank, group=group, write=write)


def save_checkpoint(path: Path, *, state: dict[str, Any], train_state: dict[str, Any], cfg: Config,
                    ctx: ParallelContext, group: Any = None, extra_files: dict[str, Path] | None = None,
                    manifest_extra: dict[str, Any] | None = None, keep: int = 0,
                    engine_files: Callable[[Path], None] | None = None,
                    on_cleared: Callable[[], None] | None = None, planner: Any = None,
                    storage_writer: Any = None) -> None:
    """Write a complete checkpoint to `path` (collective: every rank calls it). DCP and the checksums coordinate
    over `group` (None: the default group): waits there scale with the checkpoint's size, so a trainer passes a
    group whose timeout does too. `extra_files` (name -> source) are copied in by the main rank, e.g. the
    tokenizer, so the checkpoint stands on its own; `engine_files` writes an engine's own state into `path` on
    every rank (DeepSpeed's); `on_cleared()` is called once `path` is free (see `_begin`); `keep` > 0 then deletes all but the newest `keep` complete checkpoints up to this
    one (never a newer one). `planner` and `storage_writer` go to dcp.save (a conversion makes each tensor as
    it is written: dist_llm.convert_io)."""
    _begin(path, train_state=train_state, cfg=cfg, ctx=ctx, group=group, extra_files=extra_files,
           engine_files=engine_files, on_cleared=on_cleared)
    # returns once every rank's shards are down
    dcp.save(state, checkpoint_id=str(path), process_group=group, planner=planner, storage_writer=storage_writer)
    _complete(path, train_state=train_state, cfg=cfg, ctx=ctx, group=group, manifest_extra=manifest_extra, keep=keep)


class PendingSave:
    """A checkpoint being written in the background. `wait_staged()` returns once its tensors are copied off
    the training state (until then the optimizer must not change them); `wait()` once the checkpoint is
    complete (manifest written), raising what went wrong, e.g. an OSError of a full disk."""

    def __init__(self, path: Path, staged: Future | None, complete: Future) -> None:
        self.path, self._staged, self._complete = path, staged, complete
        self.staged_wait_s = 0.0  # how long training waited for the copy (part of the save's stall)

    def wait_staged(self) -> None:
        if self._staged is not None:
            start = time.perf_counter()
            self._staged.result()
            self.staged_wait_s = time.perf_counter() - start
            self._staged = None

    def done(self) -> bool:
        return self._complete.done()

    def wait(self) -> None:
        self._complete.result()


def host_stager(device: torch.device) -> ChunkStager:
    """Copies a state to host memory in a background thread, into buffers it keeps for the next save (a
    resident host copy of the checkpointed state, this rank's chunks only: the price of not allocating it at
    every save); pinned, and copied on a side stream, on a GPU. DCP's DefaultStager, taught the chunks."""
    gpu = device.type == "cuda"
    return ChunkStager(DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False,
                                                    use_async_staging=True, use_non_blocking_copy=gpu)))


_BACKGROUND = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dist_llm-checkpoint")


def save_checkpoint_async(path: Path, *, state: dict[str, Any], train_state: dict[str, Any], cfg: Config,
                          ctx: ParallelContext, stager: DefaultStager, group: Any = None,
                          extra_files: dict[str, Path] | None = None, manifest_extra: dict[str, Any] | None = None,
                          keep: int = 0, engine_files: Callable[[Path], None] | None = None,
                          on_cleared: Callable[[], None] | None = None) -> PendingSave:
    """`save_checkpoint` in the background: the small files now; the tensors staged by `stager` and written by
    DCP from a thread, which coordinates the ranks over `group` (a gloo group of its own, so its collectives
    never interleave with training's); then the main rank's manifest. One save at a time: wait for the last.
    `engine_files` writes now, in this thread: an engine's save is its own collective."""
    _begin(path, train_state=train_state, cfg=cfg, ctx=ctx, group=group, extra_files=extra_files,
           engine_files=engine_files, on_cleared=on_cleared)
    response = dcp.async_save(state, checkpoint_id=str(path), process_group=group, async_stager=stager)
    staged, upload = ((response.staging_completion, response.upload_completion)
                      if isinstance(response, AsyncSaveResponse) else (None, response))

    def finish() -> None:
        upload.result()  # every rank's shards and DCP's .metadata are written
        # (over `group` too, from this one thread after DCP's own collectives: the same order on every rank)
        _complete(path, train_state=train_state, cfg=cfg, ctx=ctx, group=group, manifest_extra=manifest_extra,
                  keep=keep)

    return PendingSave(path, staged, _BACKGROUND.submit(finish))


def verify(path: Path, *, group: Any = None) -> str | None:
    """None when every file the manifest lists has its recorded size and sha256; else what is wrong, naming
    the file (a truncated shard, a changed byte, a missing file). Collective over `group` when a process group
    exists (each rank checks a share); an I/O error raises UnreadableCheckpoint instead of calling it damaged."""
    return checksums.verify(path, group=group)


def _check_timeout_s(path: Path, timeout_s: float, ranks: int) -> float:
    """How long a rank may wait for the others while `ranks` ranks check the checkpoint at `path`: `timeout_s` plus
    the time to hash the largest share (`checksums.partition`: at most an even share and one file) at the slowest
    assumed rate. From the manifest's sizes; a manifest that cannot be read gives the floor (verify says why)."""
    try:
        files = checksums.read_manifest(path)
    except UnreadableCheckpoint:
        files = "unreadable"
    sizes = [entry["bytes"] for entry in files.values()] if isinstance(files, dict) else []
    return _wait_s(timeout_s, sum(sizes) / ranks + max(sizes, default=0))


def damage(path: Path, what: str, *, timeout_s: float = 600.0) -> str | None:
    """What is wrong with the checkpoint at `path` (a file that does not match its manifest, a missing manifest),
    naming the file, or None: `verify` for a reader other than resume (which does its own checking, in
    train/state.py). A file that cannot be read (an I/O error) raises ReadError "<what>: cannot check ...": nothing
    can be said of it. Collective over every rank when a process group exists (model.init_from=ckpt:), and reached
    by every rank whatever it finds: each checks a share of the files, over a gloo group made for the check whose
    timeout (`timeout_s` plus the time to hash the largest share) scales with the checkpoint as resume's does, so
    no rank reads every file. Alone (sample, convert) it checks them all."""
    group = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        group = dist.new_group(backend="gloo", timeout=timedelta(
            seconds=_check_timeout_s(path, timeout_s, dist.get_world_size())))
    try:
        return verify(path, group=group)
    except UnreadableCheckpoint as e:  # (raised on every rank alike)
        raise ReadError(f"{what}: cannot check {path}: {e}") from None
    finally:
        if group is not None:
            dist.destroy_process_group(group)


def refuse_damaged(path: Path, what: str, *, timeout_s: float = 600.0) -> None:
    """`damage`, refused as resume refuses a damaged checkpoint: a ConfigError "<what>: <the file>: <what is wrong>"."""
    problem = damage(path, what, timeout_s=timeout_s)
    if problem is not None:
        raise ConfigError(f"{what}: {problem}")


def saved_config(path: Path, what: str) -> Config:
    """The config checkpoint `path` was saved with (for rebuilding its model: not validated for training). Where
    its config.yaml is not YAML or not a config, a ConfigError in one line: "<what>: <the file>: <why>"."""
    file = path / CONFIG_FILE
    try:
        tree = yaml.safe_load(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{what}: {file}: missing") from None
    except RecursionError:
        raise ConfigError(f"{what}: {file} is nested too deeply to be a config") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:  # (a YAML error's text is a dozen lines with a caret)
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        why = getattr(e, "problem", None) or (str(e).splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"{what}: {file} is not valid YAML{at}: {why}") from None
    try:
        return config_from_dict(tree, check=False)
    except ConfigError as e:
        raise ConfigError(f"{what}: {file}: {e}") from None


def is_complete(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def step_dirs(root: Path) -> list[Path]:
    """Every step_NNNNNN directory under `root`, complete or not, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    return [p for p in step_dirs(root) if is_complete(p)]


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def step_of(path: Path) -> int:
    match = _STEP_DIR.match(path.name)
    if match is None:
        raise ValueError(f"{path}: not a checkpoint directory (step_NNNNNN)")
    return int(match.group(1))


def prune_checkpoints(root: Path, keep: int, *, newest: Path) -> None:
    """Keep `newest` (just completed, so intact) and the `keep` - 1 complete checkpoints before it; delete the
    older ones. A checkpoint newer than `newest` is not this run's to judge (another run's, or a damaged one
    resume passed over) and is never deleted here."""
    if keep <= 0:
        return
    older = [p for p in list_checkpoints(root) if step_of(p) < step_of(newest)]
    for old in older[:max(len(older) - (keep - 1), 0)]:
        _delete(old)
    for leftover in root.glob(f"{_DELETING}*"):  # what an earlier deletion could not finish
        shutil.rmtree(leftover, ignore_errors=True)


_DELETING = ".deleting-"


def _delete(path: Path) -> None:
    """Delete a checkpoint directory, first renamed to a hidden name: a deletion that stops halfway (an I/O
    error, a crash) must not leave a `step_*` directory whose manifest still calls it complete while files are
    gone. If even the rename fails, the checkpoint stays whole (logged): pruning is a convenience."""
    hidden = path.with_name(f"{_DELETING}{path.name}-{secrets.token_hex(4)}")
    try:
        os.rename(path, hidden)
    except OSError as e:
        log.warning("could not prune %s (%s); it stays", path, e.strerror or e)
        return
    shutil.rmtree(hidden, ignore_errors=True)


def move_aside(root: Path, paths: list[Path], label: str) -> Path:
    """Move checkpoint directories into `root/<label>-<UTC time>/` (a rename: instant, nothing copied or
    deleted), out of reach of resume and pruning, which look at `root/step_*` only. Returns the folder."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    folder = root / f"{label}-{stamp}"
    folder.mkdir(parents=True, exist_ok=True)
    for path in paths:
        target, n = folder / path.name, 1
        while target.exists():  # two moves within a second: never over an earlier one
            target, n = folder / f"{path.name}.{n}", n + 1
        os.replace(path, target)
    return folder


class _OwnFilesOnly(FileSystem):
    """DCP's file system, reading only regular files directly in the checkpoint's folder: a shard (or index)
    that is a symbolic link would load a file from elsewhere into the model, and a FIFO or device would hang
    the load. Checked on the open file (O_NOFOLLOW, fstat), so nothing can swap the file after the check."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "rb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        if path.parent != self.root:  # (load_index already refuses such names: a second line of defence)
            raise ConfigError(f"{path}: not a file of the checkpoint {self.root}")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            fd = -1
        if fd < 0 or not stat.S_ISREG(os.fstat(fd).st_mode):
            if fd >= 0:
                os.close(fd)
            raise ConfigError(f"{path}: a symbolic link or not a regular file; a checkpoint's files are its own")
        os.set_blocking(fd, True)
        with open(fd, "rb") as stream:
            yield cast(io.IOBase, stream)


class SafeReader(FileSystemReader):
    """DCP's file reader, with the index read by `safe_metadata.load_index` (no code runs; tensors only), and
    files opened only if they are the checkpoint's own regular files (`_OwnFilesOnly`)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.fs = _OwnFilesOnly(Path(path))
        self.path = self.fs.init_path(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        cached = getattr(self, "_index", None)
        if cached is None or cached[0] != path:  # `_load` reads it, then dcp.load: unpickle it once (in Python)
            with self.fs.create_stream(path, "rb") as f:
                self._index = (path, load_index(f, path))
        metadata = self._index[1]
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _load(state: dict[str, Any], path: Path, group: Any = None, reader: SafeReader | None = None) -> None:
    """dcp.load through `SafeReader` (`reader`, whose index may be read already, or a new one), coordinating over
    `group`. The index is read before, so that a refusal is raised as itself (inside dcp.load, DCP would log it
    at length and fall back to looking for per-rank indexes)."""
    reader = reader or SafeReader(str(path))
    reader.read_metadata()
    try:
        dcp.load(state, storage_reader=reader, process_group=group)
    except CheckpointException as e:  # one line, not every rank's traceback
        raise load_failure(path, e) from None


def holds_optimizer_state(path: Path) -> bool:
    """Whether the checkpoint at `path` holds optimizer state (a model converted from Hugging Face holds none)."""
    index = SafeReader(str(path)).read_metadata().state_dict_metadata
    return any(key.startswith("optim.") for key in index)


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def check_seeded_base(path: Path, cfg: Config, *, what: str) -> None:
    """Before a PEFT base is rebuilt from train.seed for checkpoint `path` (no model.init_from): refuse, in one line
    naming `what` asks for it, a checkpoint whose base was drawn by another init scheme (model/init.py's
    INIT_SCHEME; a manifest without `init_scheme` is scheme 1) where the schemes draw this model otherwise."""
    try:
        saved = read_json(path / MANIFEST).get("init_scheme", 1)
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"{what}: {path / MANIFEST}: unreadable ({e})") from None
    if saved == INIT_SCHEME:
        return
    from dist_llm.model import GPT
    from dist_llm.model.init import drawn_otherwise

    with torch.device("meta"):
        model = GPT(cfg.model)
    differ = drawn_otherwise(model, model._init_rule)
    if differ:
        raise ConfigError(f"{what}: {path} adapts a base drawn from train.seed by init scheme {saved}, which this "
                          f"version ({INIT_SCHEME}) draws otherwise ({differ[0]} and {len(differ) - 1} more): its "
                          "base cannot be rebuilt; use the dist_llm version that trained it")


def model_keys(path: Path) -> set[str]:
    """The names of the model tensors the checkpoint at `path` holds (as the model names them)."""
    index = SafeReader(str(path)).read_metadata().state_dict_metadata
    return {key.removeprefix("model.") for key in index if key.startswith("model.")}


def load_model_weights(path: Path, model: nn.Module, *, trainable_only: bool = False) -> None:
    """Load only the model's tensors from a checkpoint (resharding as DCP does); `trainable_only` for PEFT
    checkpoints, which hold nothing of the frozen base: its trainable parameters, and the buffers a run trains
    (model/buffers.py) where the checkpoint holds them (one written before they were saved leaves them as built)."""
    if trainable_only:
        from dist_llm.model.buffers import trained_buffers

        held = model_keys(path)
        tensors = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
        tensors |= {n: b for n, b in trained_buffers(model).items() if n in held}
        _load({"model": tensors}, path)  # in place, into the parameters and buffers
        return
    state = {"model": get_model_state_dict(model)}
    _load(state, path)
    set_model_state_dict(model, state["model"])


def load_model_state(path: Path, state: dict[str, Any], group: Any = None, *, reader: SafeReader | None = None) -> None:
    """Fill `state` ({"model": {name: tensor}}, plain tensors, DTensors or ChunkedTensors of this rank's part)
    from the checkpoint in place, resharding as needed; nothing else of it is read. `reader`: a SafeReader of
    `path` whose index was read already (it is read once per reader)."""
    _load(state, path, group, reader)


#: after a resume at another layout, the seed of stage k's stream is train.seed + 100 k (the start's, see
#: parallel/parallelize.py PP_SEED_STRIDE) + this x the step resumed from
RESHARD_SEED_STRIDE = 10_000


def load_checkpoint(path: Path, *, state: dict[str, Any], ctx: ParallelContext, group: Any = None,
                    stage_seed: int = 0) -> dict[str, Any]:
    """Fill `state` (tensors of this layout's shapes and shards) from the checkpoint, resharding as needed,
    restore the RNG, and return the train state saved with them. Collective over `group` (None: the default
    group), as `save_checkpoint`. A checkpoint without optimizer state (`holds_optimizer_state`: a model
    converted from Hugging Face) fills only the model's tensors of `state`.

    The RNG (dropout's masks): at the saving layout each rank takes back its own stream, so the run goes on as
    if never stopped. At another layout a rank's saved stream belongs to another role (rank 1 of a tp=2 run may
    have been stage 1 of a pp=2 one, or not have existed), and the ranks that must draw alike (a stage's tp
    ranks, which drop the same elements of activations they all hold whole) would draw apart and train their
    shared weights apart: every rank starts its stage's stream anew instead, from `stage_seed` (the stage's
    start seed) and the step."""
    if state.get("optim", {}).get("state") and not holds_optimizer_state(path):
        state = {k: v for k, v in state.items() if k != "optim"}
    # the small files are checked (their digests match the manifest, but a writer could have made both): the
    # train state before the tensors (minutes at 70B), the RNG after them; what fails on one rank (its own RNG
    # file) is every rank's one line, not a peer left waiting in a collective
    train_state = _agreed(ctx, lambda: checked_train_state(path / "train_state.json"))
    _load(state, path, group)
    rng_file = path / "rng" / f"rank_{ctx.rank:05d}.json"

    def restore_rng() -> None:
        if read_json(path / MANIFEST).get("layout") == ctx.layout() and rng_file.is_file():
            set_rng_state(checked_json(rng_file, "an RNG state"), ctx.device, source=rng_file)
        else:
            torch.manual_seed(stage_seed + RESHARD_SEED_STRIDE * train_state["step"])  # (CUDA's generators too)

    _agreed(ctx, restore_rng)
    return train_state


def _agreed(ctx: ParallelContext, fn: Callable[[], Any]) -> Any:
    """fn() on every rank, its ConfigError raised on every rank alike (`ParallelContext.first_failure`)."""
    failure: ConfigError | None = None
    result = None
    try:
        result = fn()
    except ConfigError as e:
        failure = e
    failure = ctx.first_failure(failure)
    if failure is not None:
        raise failure
    return result


def checked_json(file: Path, what: str) -> Any:
    """A small JSON file of a checkpoint, or a one-line ConfigError naming it (nested past Python's recursion
    limit, not UTF-8, not JSON)."""
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"{file}: not {what} ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None


def _is_count(value: Any) -> bool:
    """A non-negative integer that fits the int64 counters it is loaded into."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_scale(value: Any) -> bool:
    """A loss scale: positive, and finite in the float32 tensor that holds it."""
    return _is_number(value) and 0 < value <= torch.finfo(torch.float32).max


#: train_state.json's fields and what each must be; the loss scaler's may be absent (a run before they existed)
_TRAIN_STATE: dict[str, tuple[Callable[[Any], bool], str]] = {
    "step": (_is_count, "a count"), "tokens_seen": (_is_count, "a count"),
    **{f"sampler.{k}": (_is_count, "a count") for k in ("step", "seed", "global_batch_size", "stream")}}
_OPTIONAL = {"elapsed_s": (_is_number, "a number"),
             "scaler.scale": (_is_scale, "a positive float32 number"),
             **{f"scaler.{k}": (_is_count, "a count") for k in ("good_steps", "bad_steps_in_row", "skipped_steps")}}
_MISSING = object()


def _field(state: dict[str, Any], dotted: str) -> Any:
    outer, _, inner = dotted.partition(".")
    value = state.get(outer, _MISSING)
    if inner:
        value = value.get(inner, _MISSING) if isinstance(value, dict) else _MISSING
    return value


def checked_train_state(file: Path) -> dict[str, Any]:
    """train_state.json with every field of the type the resume uses, else one line naming the file and field
    (a list, a string step or a missing sampler were tracebacks deep inside the resume)."""
    state = checked_json(file, "a train state")
    problem = None
    if not isinstance(state, dict):
        problem = f"a JSON {type(state).__name__}, not an object"
    elif not isinstance(state.get("sampler"), dict) or not isinstance(state.get("scaler"), dict):
        problem = "sampler and scaler must be objects"
    else:
        for key, (ok, kind) in {**_TRAIN_STATE, **_OPTIONAL}.items():
            value = _field(state, key)
            if (value is not _MISSING or key in _TRAIN_STATE) and not ok(value):
                problem = f"{key} is {'missing' if value is _MISSING else repr(value)[:80]}, not {kind}"
                break
        else:
            if state["sampler"]["step"] != state["step"]:
                problem = f"sampler.step is {state['sampler']['step']}, step is {state['step']}: they are saved alike"
            elif state["scaler"].get("enabled") and "scale" not in state["scaler"]:
                problem = "scaler.scale is missing, and the scaler is enabled"
    if problem is not None:
        raise ConfigError(f"{file}: {problem}")
    return state
