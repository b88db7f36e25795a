"""Checkpoints: model and optimizer through torch.distributed.checkpoint, the rest as JSON, manifest last.

Layout of `checkpoints/step_NNNNNN/`:
  .metadata, __*.distcp      model and optimizer tensors, keyed by parameter name with their full shapes
                             (DCP: each rank writes its own shards, and a load reshards into whatever
                             layout asks for them); tensors only
  train_state.json           step, tokens seen, sampler, loss scaler (identical on every rank)
  rng/rank_KKKKK.json        each rank's RNG states
  config.yaml                the resolved config, so `dist-llm sample` needs nothing else
  deepspeed/                 parallel.backend=deepspeed only: the engine's own save_checkpoint (optimizer
                             partitions, fp32 master, loss scaler, step counts), read back only by that
                             backend's resume, with torch.load(weights_only=False): trusted input
  manifest.json              written last, atomically: the checkpoint is complete only once it exists

Loading runs no code from the checkpoint: only tensors go through DCP (whose shards torch reads with
weights_only=True), everything else is JSON, and DCP's own `.metadata` index, a pickle, is read by
`safe_metadata.load_index` (exact globals, allowed opcodes and calls only; tensor entries only: DCP would
unpickle any other kind with weights_only=False).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from dist_llm.config import Config
from dist_llm.fileio import atomic_write_text
from dist_llm.parallel.context import ParallelContext
from dist_llm.train.safe_metadata import load_failure, load_index

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


# DCP warns that it "assumes a single process" when no process group exists, which is what we mean; the
# warning may come from the background save's thread, so it is filtered for the process.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _atomic_write(path: Path, text: str) -> None:
    atomic_write_text(path, text)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def rng_state(device: torch.device) -> dict[str, str]:
    state = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if device.type == "cuda":
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state(device).numpy().tobytes()).decode()
    return state


def set_rng_state(state: dict[str, str], device: torch.device) -> None:
    def tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["cpu"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(tensor(state["cuda"]), device)


def _begin(path: Path, *, train_state: dict[str, Any], cfg: Config, ctx: ParallelContext,
           extra_files: dict[str, Path] | None, engine_files: Callable[[Path], None] | None) -> None:
    """Everything of a checkpoint but its DCP tensors and the manifest: the small files, and an engine's own
    files (`engine_files(path)`, on every rank), written at once."""
    if ctx.is_main and path.exists():
        shutil.rmtree(path)  # a partial leftover from a crashed save (no manifest) of this very step
    ctx.barrier()
    (path / "rng").mkdir(parents=True, exist_ok=True)
    _atomic_write(path / "rng" / f"rank_{ctx.rank:05d}.json", json.dumps(rng_state(ctx.device)))
    if ctx.is_main:
        _atomic_write(path / "train_state.json", json.dumps(train_state, indent=1))
        _atomic_write(path / "config.yaml", cfg.to_yaml())
        for name, source in (extra_files or {}).items():
            shutil.copyfile(source, path / name)
    if engine_files is not None:  # before the manifest, which lists (and checksums) what it wrote
        engine_files(path)


def _complete(path: Path, *, train_state: dict[str, Any], cfg: Config, ctx: ParallelContext,
              manifest_extra: dict[str, Any] | None, keep: int) -> None:
    """On the main rank, once every rank's files are written: the manifest, atomically and last; then the
    checkpoints beyond the newest `keep` go."""
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name != MANIFEST and not p.name.startswith("."))
    files.append(path / ".metadata")
    manifest = {
        "step": train_state["step"],
        "tokens_seen": train_state.get("tokens_seen", 0),
        "layout": ctx.layout(),
        "model_fingerprint": cfg.fingerprint(),
        "files": {str(p.relative_to(path)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files},
        **(manifest_extra or {}),
    }
    _atomic_write(path / MANIFEST, json.dumps(manifest, indent=1))
    prune_checkpoints(path.parent, keep)


def save_checkpoint(path: Path, *, state: dict[str, Any], train_state: dict[str, Any], cfg: Config,
                    ctx: ParallelContext, extra_files: dict[str, Path] | None = None,
                    manifest_extra: dict[str, Any] | None = None, keep: int = 0,
                    engine_files: Callable[[Path], None] | None = None) -> None:
    """Write a complete checkpoint to `path` (collective: every rank calls it). `extra_files` (name -> source)
    are copied in by the main rank, e.g. the tokenizer, so the checkpoint stands on its own; `engine_files`
    writes an engine's own state into `path` on every rank (DeepSpeed's); `keep` > 0 then deletes all but
    the newest `keep` complete checkpoints."""
    _begin(path, train_state=train_state, cfg=cfg, ctx=ctx, extra_files=extra_files, engine_files=engine_files)
    dcp.save(state, checkpoint_id=str(path))
    ctx.barrier()
    if ctx.is_main:
        _complete(path, train_state=train_state, cfg=cfg, ctx=ctx, manifest_extra=manifest_extra, keep=keep)
    ctx.barrier()


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


def host_stager(device: torch.device) -> DefaultStager:
    """Copies a state to host memory in a background thread, into buffers it keeps for the next save (a
    resident host copy of the checkpointed state: the price of not allocating it at every save); pinned, and
    copied on a side stream, on a GPU."""
    gpu = device.type == "cuda"
    return DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False, use_async_staging=True,
                                        use_non_blocking_copy=gpu))


_BACKGROUND = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dist_llm-checkpoint")


def save_checkpoint_async(path: Path, *, state: dict[str, Any], train_state: dict[str, Any], cfg: Config,
                          ctx: ParallelContext, stager: DefaultStager, group: Any = None,
                          extra_files: dict[str, Path] | None = None, manifest_extra: dict[str, Any] | None = None,
                          keep: int = 0, engine_files: Callable[[Path], None] | None = None) -> PendingSave:
    """`save_checkpoint` in the background: the small files now; the tensors staged by `stager` and written by
    DCP from a thread, which coordinates the ranks over `group` (a gloo group of its own, so its collectives
    never interleave with training's); then the main rank's manifest. One save at a time: wait for the last.
    `engine_files` writes now, in this thread: an engine's save is its own collective."""
    _begin(path, train_state=train_state, cfg=cfg, ctx=ctx, extra_files=extra_files, engine_files=engine_files)
    response = dcp.async_save(state, checkpoint_id=str(path), process_group=group, async_stager=stager)
    staged, upload = ((response.staging_completion, response.upload_completion)
                      if isinstance(response, AsyncSaveResponse) else (None, response))

    def finish() -> None:
        upload.result()  # on the main rank: every rank's shards and DCP's .metadata are written
        if ctx.is_main:
            _complete(path, train_state=train_state, cfg=cfg, ctx=ctx, manifest_extra=manifest_extra, keep=keep)

    return PendingSave(path, staged, _BACKGROUND.submit(finish))


def verify(path: Path) -> str | None:
    """None when every file the manifest lists has its recorded size and sha256; else what is wrong, naming
    the file (a truncated shard, a changed byte, a missing file)."""
    try:
        files = read_json(path / MANIFEST)["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"{path / MANIFEST}: unreadable ({e})"
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            return f"{f}: missing"
        if f.stat().st_size != want["bytes"]:
            return f"{f}: {f.stat().st_size} bytes, the manifest says {want['bytes']}"
        if _sha256(f) != want["sha256"]:
            return f"{f}: checksum differs from the manifest's"
    return None


def is_complete(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and is_complete(p)]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def prune_checkpoints(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints (called only after a newer one is complete)."""
    if keep <= 0:
        return
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


class SafeReader(FileSystemReader):
    """DCP's file reader, with the index read by `safe_metadata.load_index` (no code runs; tensors only)."""

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


def _load(state: dict[str, Any], path: Path) -> None:
    """dcp.load through `SafeReader`. The index is read once before, so that a refusal is raised as itself
    (inside dcp.load, DCP would log it at length and fall back to looking for per-rank indexes)."""
    reader = SafeReader(str(path))
    reader.read_metadata()
    try:
        dcp.load(state, storage_reader=reader)
    except CheckpointException as e:  # one line, not every rank's traceback
        raise load_failure(path, e) from None


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def load_model_weights(path: Path, model: nn.Module, *, trainable_only: bool = False) -> None:
    """Load only the model's tensors from a checkpoint (resharding as DCP does); `trainable_only` for PEFT
    checkpoints, which hold nothing of the frozen base."""
    if trainable_only:
        params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
        _load({"model": params}, path)  # in place, into the parameters
        return
    state = {"model": get_model_state_dict(model)}
    _load(state, path)
    set_model_state_dict(model, state["model"])


def load_checkpoint(path: Path, *, state: dict[str, Any], ctx: ParallelContext) -> dict[str, Any]:
    """Fill `state` (tensors of this layout's shapes and shards) from the checkpoint, resharding as needed,
    restore this rank's RNG, and return the train state saved with them."""
    _load(state, path)
    rng_file = path / "rng" / f"rank_{ctx.rank:05d}.json"
    if rng_file.is_file():  # absent when the saving layout had fewer ranks: then fresh streams are fine
        set_rng_state(read_json(rng_file), ctx.device)
    return read_json(path / "train_state.json")
