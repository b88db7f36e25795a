"""Checksums of a checkpoint's files, computed where the bytes are: each rank hashes what it wrote, and on
resume each rank verifies a share of the files; only small {file: size and sha256} dicts and verdicts travel.

Which rank wrote which file is read from the names: DCP's file writer names the shards of the rank at
position K of its process group `__K_<n>.distcp`, and each rank writes its own `rng/rank_KKKKK.json` (and,
with `parallel.backend=deepspeed`, its own `deepspeed/rank_KKKKK.safetensors`: its ZeRO partition). The
main rank hashes everything else (the small JSON and YAML files, DCP's `.metadata`, and any file no rank
claimed, so the manifest stays complete if the naming ever changes).

Every rank takes part in every collective here even when its own part failed: the failure travels as the
rank's result, so no rank waits on a peer that gave up (a wait that would otherwise end only at the group's
timeout), and every rank raises the same error.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

MANIFEST = "manifest.json"
_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")
# files each rank writes under its own global rank: its RNG states, and the DeepSpeed backend's engine state
_PER_RANK = re.compile(r"^(?:rng/rank_(\d+)\.json|deepspeed/rank_(\d+)\.safetensors)$")

FileEntries = dict[str, dict[str, Any]]  # relative name -> {"bytes": int, "sha256": str}


class UnreadableCheckpoint(Exception):
    """A file could not be read (an I/O error, not a mismatch): nothing can be said about the checkpoint."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def hash_files(root: Path, names: list[str]) -> FileEntries:
    """Size and sha256 of each file (raises the OSError of the first that cannot be read)."""
    return {name: {"bytes": (root / name).stat().st_size, "sha256": sha256_file(root / name)} for name in names}


def checkpoint_files(root: Path) -> list[str]:
    """Every file of a checkpoint directory but the manifest and hidden temporaries; DCP's `.metadata` included."""
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*")
                   if p.is_file() and p.name != MANIFEST and not p.name.startswith("."))
    return files + [".metadata"] if (root / ".metadata").is_file() else files


def written_by(names: list[str], *, rank: int, group_rank: int) -> list[str]:
    """The files among `names` that rank `rank` (position `group_rank` in the saving group) wrote itself."""
    return [n for n in names if ((m := _SHARD.match(n)) and int(m.group(1)) == group_rank)
            or ((m := _PER_RANK.match(n)) and int(m.group(1) or m.group(2)) == rank)]


def _group_rank_size(group: Any) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _reason(e: OSError, path: Path) -> str:
    """"<file>: <the OS's words>", e.g. "/ckpt/step_000008/__0_0.distcp: Input/output error"."""
    return f"{e.filename or path}: {e.strerror or e}"


def hash_and_write_manifest(root: Path, *, rank: int, group: Any, write: Callable[[FileEntries], None]) -> None:
    """Collective over `group` (None: the default group, or this process alone): each rank hashes the files it
    wrote, the dicts are gathered to the group's first rank, which hashes the rest and calls `write` with all
    entries. Raises the same OSError on every rank when any rank's part failed."""
    group_rank, size = _group_rank_size(group)
    names = checkpoint_files(root)
    mine = written_by(names, rank=rank, group_rank=group_rank)
    try:
        result: tuple[bool, Any] = (True, hash_files(root, mine))
    except OSError as e:
        result = (False, f"rank {rank}: {_reason(e, root)}")
    results = [result]
    if size > 1:
        results = [None] * size if group_rank == 0 else None  # type: ignore[assignment]
        dist.gather_object(result, results, group=group, group_dst=0)
    error: str | None = None
    if group_rank == 0:
        error = next((r[1] for r in results if not r[0]), None)
        if error is None:
            entries: FileEntries = {}
            for _, part in results:
                entries.update(part)
            try:
                entries.update(hash_files(root, [n for n in names if n not in entries]))
                write(entries)
            except OSError as e:
                error = f"rank {rank}: {_reason(e, root)}"
    if size > 1:
        box = [error]
        dist.broadcast_object_list(box, group=group, group_src=0)
        error = box[0]
    if error is not None:
        raise OSError(error)


def read_manifest(root: Path) -> FileEntries | str:
    """The manifest's file entries, or what is wrong with it (missing, not JSON); an I/O error raises."""
    path = root / MANIFEST
    try:
        files = json.loads(path.read_text())["files"]
        if not isinstance(files, dict):
            raise TypeError
        return files
    except FileNotFoundError:
        return f"{path}: missing"
    except OSError as e:
        raise UnreadableCheckpoint(_reason(e, path)) from None
    except (ValueError, KeyError, TypeError):
        return f"{path}: not a manifest (not JSON, or no files listed)"


def check_files(root: Path, files: FileEntries) -> str | None:
    """None when every listed file has its recorded size and sha256; else the first difference, naming the file
    (missing, truncated, changed). A file that exists but cannot be read raises UnreadableCheckpoint."""
    for name, want in files.items():
        f = root / name
        try:
            size = f.stat().st_size
            if size != want["bytes"]:
                return f"{f}: {size} bytes, the manifest says {want['bytes']}"
            if sha256_file(f) != want["sha256"]:
                return f"{f}: checksum differs from the manifest's"
        except FileNotFoundError:
            return f"{f}: missing"
        except OSError as e:
            raise UnreadableCheckpoint(_reason(e, f)) from None
    return None


def partition(files: FileEntries, parts: int) -> list[FileEntries]:
    """Split the files into `parts` shares of nearly equal bytes (largest first, each to the lightest share):
    deterministic, so every rank computes the same split from the same manifest."""
    shares: list[FileEntries] = [{} for _ in range(parts)]
    load = [0] * parts
    for name, entry in sorted(files.items(), key=lambda kv: (-kv[1]["bytes"], kv[0])):
        i = load.index(min(load))
        shares[i][name] = entry
        load[i] += entry["bytes"]
    return shares


def verify(root: Path, *, group: Any = None) -> str | None:
    """None when every file the manifest lists has its recorded size and sha256; else what is wrong, naming the
    file. Collective over `group` (None: the default group, or this process alone): each rank checks its share
    and the verdicts are gathered, so every rank returns the same answer. An I/O error on any rank raises
    UnreadableCheckpoint on every rank, naming that rank: a file that could not be read is not damaged."""
    group_rank, size = _group_rank_size(group)
    try:
        files = read_manifest(root)
        verdict: tuple[str, str | None] = (("damaged", files) if isinstance(files, str)
                                           else ("ok", check_files(root, partition(files, size)[group_rank])))
    except UnreadableCheckpoint as e:
        verdict = ("unreadable", f"rank {dist.get_rank() if dist.is_initialized() else 0}: {e}")
    verdicts = [verdict]
    if size > 1:
        verdicts = [None] * size  # type: ignore[list-item]
        dist.all_gather_object(verdicts, verdict, group=group)
    unreadable = [text for kind, text in verdicts if kind == "unreadable"]
    if unreadable:
        raise UnreadableCheckpoint(unreadable[0])
    return next((text for _, text in verdicts if text), None)
