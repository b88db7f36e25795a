"""One training run per out_dir: a lock file created exclusively (O_EXCL), naming its process and host."""

from __future__ import annotations

import json
import logging
import os
import socket
from datetime import datetime, timezone
from pathlib import Path

RUN_LOCK = "run.lock"
log = logging.getLogger("dist_llm")


def job_id() -> str | None:
    """The job this process belongs to, the same across its restarts: torchrun's rendezvous id (not its default
    'none', which every job shares) or SLURM's job id (kept by a requeue). None when neither says."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return run_id
    return os.environ.get("SLURM_JOB_ID") or None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: nothing is sent, only whether the process exists
    except (ProcessLookupError, OverflowError):  # (a pid beyond a C pid_t: no process has it)
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def _holder(path: Path) -> tuple[int, str, object]:
    """(pid, host, job) of the lock at `path`. ValueError (or KeyError, TypeError) when it names no process: the
    pid must be a positive JSON integer, since os.kill reads 0 and -1 as process groups (-1: every process this
    user may signal, so a pid of -1 was "in use" forever), and a true would read as 1, init."""
    holder = json.loads(path.read_text())
    pid = holder["pid"]
    if type(pid) is not int or pid <= 0:
        raise ValueError(f"pid {pid!r} is not a process id")
    return pid, str(holder["host"]), holder.get("job")


def _create(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "job": job_id(),
                   "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}, f)
    return True


def take(path: Path) -> str | None:
    """Take the lock at `path`; None when taken, else why not (one line naming the holder and the file). This
    very process may take it again (a run restarted in-process); a dead holder's lock on this host is stale;
    on another host, whose processes cannot be checked from here, only the holder's own job may take it over
    (torchrun's restart of a failed group, a SLURM requeue: its rank 0 may now be on another host)."""
    host = socket.gethostname()
    for _ in range(3):  # a stale lock removed, or a race with another starter: look again
        if _create(path):
            return None
        try:
            pid, their_host, their_job = _holder(path)
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError):
            return f"{path} exists but names no process; if no run uses this out_dir, remove it"
        if their_host == host:
            if pid != os.getpid() and _alive(pid):
                return f"{path}: in use by process {pid} on this host; wait for it, or use another train.out_dir"
            if pid != os.getpid():
                log.warning("%s: taking over the lock of process %d, which is gone (a run that did not end "
                            "cleanly)", path, pid)
            path.unlink(missing_ok=True)  # ours already, or its process is gone
            continue
        if their_job is not None and their_job == job_id():
            log.warning("%s: taking over the lock of process %d on host %s: an earlier attempt of this job %s",
                        path, pid, their_host, their_job)
            path.unlink(missing_ok=True)  # an earlier attempt of this very job, restarted on another host
            continue
        return (f"{path}: in use by process {pid} on host {their_host}, which cannot be checked from here; if "
                "that run has ended, remove the file")
    return f"{path}: cannot be created (another run keeps taking it)"


def held_elsewhere(path: Path) -> str | None:
    """Why a run may not start in this out_dir (take()'s refusal for a live holder), checked without taking
    the lock: before any process is started or anything built. A stale lock is left for take() to take over."""
    try:
        pid, their_host, their_job = _holder(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return f"{path} exists but names no process; if no run uses this out_dir, remove it"
    if their_host == socket.gethostname():
        alive = pid != os.getpid() and _alive(pid)
        return f"{path}: in use by process {pid} on this host; wait for it, or use another train.out_dir" if alive else None
    if their_job is not None and their_job == job_id():
        return None
    return (f"{path}: in use by process {pid} on host {their_host}, which cannot be checked from here; if "
            "that run has ended, remove the file")


def release(path: Path) -> None:
    """Remove the lock if this process holds it."""
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return
    if isinstance(holder, dict) and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        path.unlink(missing_ok=True)
