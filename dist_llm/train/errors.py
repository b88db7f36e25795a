"""What stops a training run, each with one line that names the cause."""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Sequence
from pathlib import Path


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. too many non-finite steps in a row); the last good checkpoint is kept."""


class CheckpointError(TrainingError):
    """A checkpoint could not be written (disk full, an I/O error); the previous complete one is untouched."""


class CollectiveError(TrainingError):
    """A collective failed: a rank stuck past `parallel.timeout_s`, or a peer gone."""


class ReadError(TrainingError):
    """Reading an input (model.init_from) failed in the operating system (an I/O error) or for a reason that is no
    fault of the input (a bug): exit 1, not 2, which says the input itself is bad."""


# What the allocators say: torch's CUDA and CPU ones ("Tried to allocate 20.00 GiB", "you tried to allocate 400000000000
# bytes") and numpy's ("Unable to allocate 745. GiB").
_OOM_MARKS = ("out of memory", "can't allocate memory")
_OOM_SIZE = re.compile(r"(?:tried to|unable to) allocate ([0-9.]+) ?(bytes|[KMGTP]i?B)", re.IGNORECASE)


def out_of_memory(e: BaseException, *, rank: str, config: Path | None = None,
                  overrides: Sequence[str] | None = None) -> str | None:
    """One line for an allocation that failed (torch.OutOfMemoryError, a RuntimeError of torch's CPU allocator,
    Python's or numpy's MemoryError): the rank, the device's kind and the size; for a command with a config, the
    `dist-llm memory` command that predicts what a rank of it needs. None for any other error.

    It is the config's size, not a bug, so the 40-65 lines of traceback through the allocator say nothing more."""
    text = str(e).strip()
    if not (isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError"
            or any(mark in text for mark in _OOM_MARKS)):
        return None
    device = "GPU" if any(word in text for word in ("CUDA", "GPU", "HIP")) else "host"
    match = _OOM_SIZE.search(text)
    if match is not None:
        amount, unit = float(match.group(1)), match.group(2)
        size = f"{amount / 2**30:.2f} GiB" if unit == "bytes" else f"{amount:g} {unit}"
        line = f"rank {rank}: out of {device} memory: {size} could not be allocated"
    else:
        first = text.splitlines()[0][:300] if text else type(e).__name__
        line = f"rank {rank}: out of {device} memory: {first}"
    if overrides is None:  # (sample, convert: no config to plan)
        return line
    world = int(os.environ.get("WORLD_SIZE", "1"))
    command = shlex.join(["dist-llm", "memory", *(["--config", str(config)] if config is not None else []),
                          *(["--world-size", str(world)] if world > 1 else []), *overrides])
    return f"{line}; `{command}` predicts what a rank of this config needs"
