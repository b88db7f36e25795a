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

import errno
import hashlib
import json
import os
import re
import stat
import threading
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


def checkpoint_files(root: Path, *, rank: int = 0, group_rank: int = 0) -> list[str]:
    """The files of a checkpoint directory a rank may have to hash: for the group's first rank (the default),
    every file but the manifest and hidden temporaries, DCP's `.metadata` included. Any other rank looks up
    only the names it can have written, without listing or stat-ing the folder's other files (at thousands of
    ranks, every rank listing the whole folder is millions of metadata operations on a shared file system):
    its DCP shards `__K_0.distcp`, `__K_1.distcp`... up to the first absent one, its RNG file, and its engine
    state file (`deepspeed/rank_KKKKK.safetensors`). A name missed here is hashed by the first rank, which
    lists everything."""
    if group_rank == 0:
        files = sorted(str(p.relative_to(root)) for p in root.rglob("*")
                       if p.is_file() and p.name != MANIFEST and not p.name.startswith("."))
        return files + [".metadata"] if (root / ".metadata").is_file() else files
    own, n = [], 0
    while (root / (name := f"__{group_rank}_{n}.distcp")).is_file():
        own.append(name)
        n += 1
    if (root / (name := f"rng/rank_{rank:05d}.json")).is_file():
        own.append(name)
    if (root / (name := f"deepspeed/rank_{rank:05d}.safetensors")).is_file():
        own.append(name)
    return own


def written_by(names: list[str], *, rank: int, group_rank: int) -> list[str]:
    """The files among `names` that rank `rank` (position `group_rank` in the saving group) wrote itself."""
    return [n for n in names if ((m := _SHARD.match(n)) and int(m.group(1)) == group_rank)
            or ((m := _PER_RANK.match(n)) and int(m.group(1) or m.group(2)) == rank)]


def _group_rank_size(group: Any) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _reason(e: OSError, path: Path) -> str:
    """"<file>: <the OS's words>", e.g. "/ckpt/step_000008/__0_0.distcp: Input/output error"."""
    return f"{e.filename or path}: {e.strerror or e}"


def hash_and_write_manifest(root: Path, *, rank: int, group: Any, write: Callable[[FileEntries], None]) -> None:
    """Collective over `group` (None: the default group, or this process alone): each rank hashes the files it
    wrote, the dicts are gathered to the group's first rank, which hashes the rest and calls `write` with all
    entries. Raises the same OSError on every rank when any rank's part failed."""
    group_rank, size = _group_rank_size(group)
    names: list[str] = []
    try:  # (the listing too: a rank whose listing fails must still take part in the gather)
        names = checkpoint_files(root, rank=rank, group_rank=group_rank)
        result: tuple[bool, Any] = (True, hash_files(root, written_by(names, rank=rank, group_rank=group_rank)))
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


_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _bad_name(name: Any) -> bool:
    """A manifest name that is not a plain relative path inside the checkpoint (absolute, `..`, `.`, empty parts,
    a trailing slash): joined onto the root, it could name any file of the machine."""
    if type(name) is not str or not name or "\0" in name:
        return True
    parts = name.split("/")
    return name.startswith("/") or any(part in ("", ".", "..") for part in parts)


#: no file of a checkpoint is larger (a petabyte): a larger size is damage, not a figure to compute a timeout from
MAX_FILE_BYTES = 2**50


def _bad_entry(entry: Any) -> bool:
    return (not isinstance(entry, dict) or type(entry.get("bytes")) is not int
            or not 0 <= entry["bytes"] <= MAX_FILE_BYTES
            or type(entry.get("sha256")) is not str or not _SHA256.match(entry["sha256"]))


_FIELDS: dict[str, type] = {"step": int, "tokens_seen": int, "model_fingerprint": str, "layout": dict}
_FIELD_NAMES = {int: "an integer", str: "a string", dict: "an object"}


def read_manifest(root: Path) -> FileEntries | str:
    """The manifest's file entries, or what is wrong with it (missing, not JSON, not of the shape
    {relative name: {"bytes": int >= 0, "sha256": 64 hex digits}}, or a name outside the checkpoint): any of
    these is damage, said in one line, never an exception. An I/O error raises UnreadableCheckpoint."""
    path = root / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError
    except FileNotFoundError:
        return f"{path}: missing"
    except OSError as e:
        raise UnreadableCheckpoint(_reason(e, path)) from None
    except (ValueError, KeyError, TypeError):
        return f"{path}: not a manifest (not JSON, or no files listed)"
    for key, kind in _FIELDS.items():  # what resume reads besides the files: a wrong type is damage too
        if key in manifest and (not isinstance(manifest[key], kind) or isinstance(manifest[key], bool)):
            return f"{path}: its {key!r} is not {_FIELD_NAMES[kind]}"
    for name, entry in files.items():
        if _bad_name(name):
            return f"{path}: names {name!r}, which is not a file inside the checkpoint"
        if _bad_entry(entry):
            return f"{path}: the entry of {name!r} is not {{\"bytes\": a size, \"sha256\": 64 hex digits}}"
    return files


def _open_regular(root: Path, name: str) -> tuple[int, int]:
    """(fd, size) of the checkpoint's own regular file `name`: no component may be a symbolic link (a link would
    make the manifest vouch for a file elsewhere), and a FIFO or device is refused before it is read (opened
    non-blocking: a FIFO would wait for a writer). Raises _NotAFile, or the OSError (FileNotFoundError...)."""
    folder = root
    for part in name.split("/")[:-1]:
        folder = folder / part
        if not stat.S_ISDIR(os.lstat(folder).st_mode):  # a link to a folder elsewhere, or a file
            raise _NotAFile(folder)
    try:
        fd = os.open(root / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW's answer for a symbolic link
            raise _NotAFile(root / name) from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise _NotAFile(root / name)
    return fd, info.st_size


class _NotAFile(Exception):
    """A name of the manifest is a symbolic link, a folder, a FIFO or a device: damage, not an I/O error."""


def _sha256_fd(fd: int, nbytes: int, stop: threading.Event | None = None) -> str:
    """The sha256 of the first `nbytes` of `fd`, never reading more (a file that grows while hashed, or a
    special file, cannot keep a reader busy); "" once `stop` is set (the check ended elsewhere)."""
    h = hashlib.sha256()
    left = nbytes
    while left > 0:
        if stop is not None and stop.is_set():
            return ""
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        h.update(chunk)
        left -= len(chunk)
    return h.hexdigest()


#: files hashed at once (sha256 and the reads release the GIL): a 70B checkpoint's terabyte in one thread takes
#: 10-40 minutes before `sample` or `convert` reads anything
HASH_THREADS = min(8, os.cpu_count() or 1)


def _check_file(root: Path, name: str, want: dict[str, Any], stop: threading.Event) -> str | None:
    f = root / name
    if stop.is_set():
        return None
    try:
        fd, size = _open_regular(root, name)
        try:
            if size != want["bytes"]:
                return f"{f}: {size} bytes, the manifest says {want['bytes']}"
            if _sha256_fd(fd, size, stop) != want["sha256"] and not stop.is_set():
                return f"{f}: checksum differs from the manifest's"
        finally:
            os.close(fd)
    except _NotAFile as e:
        return f"{e.args[0]}: a symbolic link or not a regular file; a checkpoint's files are its own"
    except (FileNotFoundError, NotADirectoryError):
        return f"{f}: missing"
    except OSError as e:
        raise UnreadableCheckpoint(_reason(e, f)) from None
    return None


def check_files(root: Path, files: FileEntries) -> str | None:
    """None when every listed file is a regular file of the checkpoint with its recorded size and sha256; else
    the first difference in the order of `files`, naming the file (missing, truncated, changed, a symbolic link
    or special file). A file that exists but cannot be read raises UnreadableCheckpoint. Names must have passed
    `read_manifest`. Up to HASH_THREADS files are hashed at once; once the answer is known (or a Ctrl-C comes),
    the hashes in flight stop at their next chunk."""
    from concurrent.futures import ThreadPoolExecutor

    stop = threading.Event()
    with ThreadPoolExecutor(max(1, min(HASH_THREADS, len(files)))) as pool:
        checks = [pool.submit(_check_file, root, name, want, stop) for name, want in files.items()]
        try:
            for check in checks:
                problem = check.result()  # (an UnreadableCheckpoint is raised here, in order)
                if problem is not None:
                    return problem
        finally:
            stop.set()
            for check in checks:
                check.cancel()
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
        verdict = ("unreadable", f"rank {_rank()}: {e}")
    except Exception as e:  # noqa: BLE001 - whatever else goes wrong is still gathered: no peer waits on this rank
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        verdict = ("damaged", f"{root}: cannot be checked on rank {_rank()} ({type(e).__name__}: {first})")
    verdicts = [verdict]
    if size > 1:
        verdicts = [None] * size  # type: ignore[list-item]
        dist.all_gather_object(verdicts, verdict, group=group)
    unreadable = [text for kind, text in verdicts if kind == "unreadable"]
    if unreadable:
        raise UnreadableCheckpoint(unreadable[0])
    return next((text for _, text in verdicts if text), None)
