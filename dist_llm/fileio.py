"""Atomic file and folder writes: a reader (or a crash) sees the old content or the new, never a part.

Each write goes to a temporary name in the destination's own folder (so the final rename stays on one file
system), is flushed to disk, and is renamed over the destination with `os.replace`; the folder is then
flushed too, so the rename itself survives a power loss (where the file system can flush a directory: one
that refuses with EINVAL or ENOTSUP, as some FUSE and CIFS mounts do, is not a failed write). On failure the temporary is removed and the
destination is untouched.

Final files get the mode a plain `open(path, "w")` would give (0o666 less the umask): `tempfile` and
safetensors (which writes to its own temporary) create 0o600 files, which other users of a shared run folder
could not read.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path


def folder_error(folder: Path, e: OSError) -> str:
    """Why `folder` could not be made or written, for a one-line message: where it (or a folder above it) is a
    file, that file; else the system's reason."""
    if isinstance(e, (NotADirectoryError, FileExistsError)):
        blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            return f"{blocker} is a file, not a folder"
    return e.strerror or str(e)


def _temp_name(path: Path) -> Path:
    # hidden and unique: ranks or threads writing the same folder never collide, and listings skip it
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")


# What some file systems (FUSE mounts, CIFS/SMB, some network file systems) answer to fsync on a directory:
# they cannot flush one, and the rename is as durable there as they make anything. Not a failed write.
_DIR_FSYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP})


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new entry in `folder` durable, where the file system can flush a directory."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _DIR_FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary name beside `path` for the caller (or a library) to write; on a clean exit it is
    synced and renamed to `path` with the umask's mode, on an exception it is removed and `path` kept."""
    path = Path(path)
    tmp = _temp_name(path)
    # created here with 0o666 so the kernel applies the umask: its mode is the one the final file should have,
    # even if the writer replaces this file with one of its own (safetensors does, as 0o600)
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    try:
        mode = os.stat(tmp).st_mode & 0o777
        yield tmp
        _fsync_file(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)


@contextlib.contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """Yield a temporary folder beside `path` to fill; on a clean exit every file in it is synced, given the
    umask's mode, and the folder is renamed to `path` (which must be absent or an empty folder), so `path`
    appears complete or not at all. On an exception the temporary folder is removed."""
    path = Path(path)
    tmp = _temp_name(path)
    os.mkdir(tmp, 0o777)  # the kernel applies the umask: this is the folders' mode, files get it less x
    try:
        dir_mode = os.stat(tmp).st_mode & 0o777
        yield tmp
        _finish_tree(tmp, dir_mode=dir_mode, file_mode=dir_mode & 0o666)
        try:
            os.replace(tmp, path)  # replaces an empty folder; fails on a non-empty one
        except OSError as e:
            raise FileExistsError(f"{path}: cannot put the new folder in place ({e.strerror}); "
                                  f"it must be absent or empty") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(path.parent)


def _finish_tree(root: Path, *, dir_mode: int, file_mode: int) -> None:
    for folder, dirs, files in os.walk(root):
        for name in files:
            file = Path(folder) / name
            os.chmod(file, file_mode)
            _fsync_file(file)
        for name in dirs:
            os.chmod(Path(folder) / name, dir_mode)
        fsync_dir(Path(folder))


__all__ = ["atomic_folder", "atomic_path", "atomic_write_bytes", "atomic_write_text", "fsync_dir"]
