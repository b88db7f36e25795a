"""A cache of prepared folders that concurrent processes can share safely.

Each folder is built in a temporary sibling and renamed into place whole, so a reader sees either no
folder or a complete one, never half-written token files. A lock file lets processes on one host
build once instead of racing; across hosts (shared filesystems where locks may not work) the rename
alone keeps things correct, the loser discarding its copy and using the winner's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dist_llm.config import ConfigError
from dist_llm.fileio import folder_error

try:
    import fcntl
except ImportError:  # not POSIX: no host lock, the atomic rename still keeps readers safe
    fcntl = None  # type: ignore[assignment]

# Written last inside a folder; its presence is what makes a folder complete.
COMPLETE_FILE = "meta.json"


def cache_root(cache_dir: str) -> Path:
    """`cache_dir` if set, else $DIST_LLM_CACHE, else ~/.cache/dist_llm."""
    root = cache_dir or os.environ.get("DIST_LLM_CACHE") or "~/.cache/dist_llm"
    return Path(root).expanduser().resolve()


def ready_cache_root(cache_dir: str) -> Path:
    """`cache_root(cache_dir)`, created if missing. One that cannot be a folder (it, or a folder above it, is a
    file) is one line naming data.cache_dir, not an OSError from deep in the build. Its writability is not
    probed: a read-only cache that already holds the prepared folder is fine."""
    root = cache_root(cache_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        # (unset, the value came from the environment or the default: say so, the key alone would mislead)
        origin = "" if cache_dir else " (from $DIST_LLM_CACHE)" if os.environ.get("DIST_LLM_CACHE") else " (the default)"
        raise ConfigError(f"data.cache_dir: cannot create {root}{origin}: {folder_error(root, e)}") from None
    return root


def folder_name(label: str, key: dict[str, Any]) -> str:
    """A readable label plus a hash of everything the folder's content depends on."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', label)[:48]}-{digest}"


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE_FILE).is_file()


@contextlib.contextmanager
def _host_lock(path: Path) -> Iterator[None]:
    if fcntl is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_once(root: Path, name: str, build: Callable[[Path], None]) -> Path:
    """Return root/name, first calling `build(tmp)` to fill it if no complete copy exists yet.

    `build` must write COMPLETE_FILE last. It runs in a temporary folder that is removed if it fails.
    """
    final = root / name
    if is_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _host_lock(root / f".{name}.lock"):
        if is_complete(final):  # another process on this host built it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=root))
        try:
            build(tmp)
            if not is_complete(tmp):
                raise RuntimeError(f"building {final} did not write {COMPLETE_FILE}")
            try:
                os.rename(tmp, final)
            except OSError:
                # A process on another host won the race; its folder is as good as ours.
                if not is_complete(final):
                    raise RuntimeError(f"{final} exists but is incomplete; delete it and retry") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final
