"""What a run prints, and where: log lines that never land on the progress bar's line, rank 0 alone on the
console at INFO, every rank's everything in its log file."""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any, TextIO

#: `extra=` of a record meant for the rank's log file only (each log step's line: the bar shows its loss)
FILE_ONLY = {"console": False}


def _for_console(record: logging.LogRecord) -> bool:
    return getattr(record, "console", True)


class ConsoleHandler(logging.StreamHandler):
    """Writes through tqdm.write, which takes a live progress bar off its line, writes the message on a line of its
    own and draws the bar again below it. The bar is rank 0's: another rank's process cannot take it off, so in a
    terminal its lines begin by returning to the start of the line and clearing it (the bar comes back at its next
    refresh) rather than continuing the bar's line."""

    def __init__(self, stream: TextIO, *, clear_line: bool = False) -> None:
        super().__init__(stream)
        self.clear_line = clear_line and stream.isatty()

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm  # (light; the CLI's refusals come before it is imported)

        try:
            message = self.format(record)
            tqdm.write(("\r\x1b[K" if self.clear_line else "") + message, file=self.stream)
            self.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


def setup_logging(rank: int, log_dir: Path | None = None) -> None:
    """On the console rank 0 speaks at INFO and the others only warn; with `log_dir`, every rank also writes
    everything it logs to log_dir/rank_K.log (the FILE_ONLY records too)."""
    console = ConsoleHandler(sys.stderr, clear_line=rank != 0)
    console.setFormatter(logging.Formatter("%(message)s" if rank == 0 else f"[rank {rank}] %(message)s"))
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    console.addFilter(_for_console)
    handlers: list[logging.Handler] = [console]
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        to_file = logging.FileHandler(log_dir / f"rank_{rank}.log")
        to_file.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s"))
        to_file.setLevel(logging.DEBUG)  # (the tracebacks behind one-line errors: for a bug report, not the console)
        handlers.append(to_file)
    root = logging.getLogger("dist_llm")
    for old in root.handlers:
        old.close()
    root.handlers[:] = handlers
    root.setLevel(logging.DEBUG)
    root.propagate = False


def step_line(record: dict[str, Any]) -> str:
    """A metrics.jsonl record as one log line, every field of it: `step 10 | loss=4.5479 lr=0.0006 ...`; numbers to
    6 significant digits, nested fields (bytes per collective, peak memory per rank) as compact JSON."""

    def show(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.6g}"
        return json.dumps(value, separators=(",", ":")) if isinstance(value, (dict, list)) else str(value)

    fields = " ".join(f"{key}={show(value)}" for key, value in record.items() if key != "step")
    return f"step {record['step']} | {fields}"


def sample_command(run_dir: Path) -> str:
    """The `dist-llm sample` command for a run directory, as this shell can run it: `dist-llm` when that is the one
    on PATH, else the one beside this Python (a virtual environment not activated: `make train` runs
    .venv/bin/dist-llm), relative to the working directory when under it."""
    beside = Path(sys.executable).parent / "dist-llm"
    on_path = shutil.which("dist-llm")
    program = "dist-llm"
    if beside.is_file() and (on_path is None or Path(on_path).resolve() != beside.resolve()):
        program = os.path.relpath(beside) if beside.is_relative_to(Path.cwd()) else str(beside)
    return f"{shlex.quote(program)} sample --checkpoint {shlex.quote(str(run_dir))}"
