"""The run lock (dist_llm.train.run_lock) read back from a file another process, or a person, wrote."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from dist_llm.train import run_lock


@pytest.mark.parametrize("pid", [99999999999999999999, 2**31 - 1])
def test_a_pid_no_process_can_have_is_a_stale_lock_taken_over(pid: int, tmp_path: Path) -> None:
    """Before, a pid beyond a C pid_t raised OverflowError (a traceback) from os.kill."""
    lock = tmp_path / "run.lock"
    lock.write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))
    assert run_lock.held_elsewhere(lock) is None
    assert run_lock.take(lock) is None
    assert json.loads(lock.read_text())["pid"] == os.getpid()


@pytest.mark.parametrize("pid", [-1, 0, True, "123", 1.5, None])
@pytest.mark.parametrize("host", ["this", "elsewhere"])
def test_a_pid_that_is_not_a_positive_integer_names_no_process(pid: object, host: str, tmp_path: Path) -> None:
    """Before, os.kill(-1, 0) (every process this user may signal) succeeded: "in use by process -1" for ever; a
    true read as 1 (init, always alive), "123" and 1.5 as processes 123 and 1."""
    lock = tmp_path / "run.lock"
    lock.write_text(json.dumps({"pid": pid, "host": socket.gethostname() if host == "this" else host}))
    refusal = f"{lock} exists but names no process; if no run uses this out_dir, remove it"
    assert run_lock.held_elsewhere(lock) == refusal
    assert run_lock.take(lock) == refusal
