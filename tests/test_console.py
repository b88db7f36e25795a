"""Issue 18, item 12: what a run prints. Log lines never land on the progress bar's line; only rank 0 speaks on the
console (val_loss once); every rank's log file has each log step's line; the run ends with a short summary (last
losses, wall time, average tokens/s as report.md counts it, where its files are, the sample command)."""

from __future__ import annotations

import fcntl
import io
import logging
import os
import pty
import re
import select
import shlex
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from tqdm import tqdm

from dist_llm.config import Config, ModelConfig
from dist_llm.console import FILE_ONLY, sample_command, setup_logging, step_line
from dist_llm.train.metrics import read_metrics
from dist_llm.train.report import build_report, human_duration, summary_lines, write_report
from tests.conftest import REPO, tiny_overrides
from tests.test_report import write_run


def run_in_terminal(args: list[str], timeout: float = 240) -> tuple[int, str]:
    """`python -m dist_llm.cli ARGS` on a pseudo-terminal 120 columns wide (so tqdm draws its bar as in a shell):
    its exit code and everything it wrote, \\r and all."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "dist_llm.cli", *args], stdin=slave, stdout=slave, stderr=slave,
                            cwd=REPO, env=env, start_new_session=True)
    os.close(slave)
    chunks = []
    try:
        while True:  # (read as it comes: a full pty buffer would block the writer)
            if select.select([master], [], [], 1.0)[0]:
                try:
                    data = os.read(master, 1 << 16)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        code = proc.wait(timeout=timeout)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return code, b"".join(chunks).decode(errors="replace")


def screen_segments(output: str) -> list[str]:
    """What a terminal shows as the start of each write: the text after each newline or carriage return (a bar
    redraw begins with \\r), with the erase-line sequence another rank's lines begin with taken off."""
    return [s.removeprefix("\x1b[K") for s in re.split(r"[\r\n]", output)]


def assert_unglued(output: str, messages: list[str]) -> None:
    """Each message begins a line of its own: never after a progress bar's text on the same line."""
    for segment in screen_segments(output):
        for message in messages:
            if message in segment:
                assert segment.startswith(message) or segment.startswith(f"  {message}"), repr(segment)


def test_log_lines_take_the_bar_off_its_line_and_step_lines_go_to_the_file_only(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    root = logging.getLogger("dist_llm")
    saved = root.handlers[:], root.level, root.propagate
    setup_logging(0, tmp_path / "logs")
    try:
        bar = tqdm(total=10, desc="train", file=screen, ncols=80, mininterval=0)
        bar.update(3)
        root.info("memory on rank 0: 1 MiB")
        root.info(step_line({"step": 3, "loss": 4.25, "lr": 1e-3, "comm_bytes": {"all_reduce": 8}}), extra=FILE_ONLY)
        bar.update(1)
        bar.close()
        root.info("finished at step 4")
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers[:], root.level, root.propagate = saved
    shown = screen.getvalue()
    assert "| loss=" not in shown  # the bar shows the loss; the step line is the file's
    assert_unglued(shown, ["memory on rank 0", "finished at step 4"])
    assert shown.count("memory on rank 0: 1 MiB\n") == 1 and shown.endswith("\nfinished at step 4\n")
    logged = (tmp_path / "logs" / "rank_0.log").read_text()
    assert 'INFO step 3 | loss=4.25 lr=0.001 comm_bytes={"all_reduce":8}\n' in logged
    assert "INFO memory on rank 0: 1 MiB\n" in logged and "INFO finished at step 4\n" in logged


def test_summary_takes_the_reports_numbers_and_names_the_files(tmp_path: Path) -> None:
    cfg = Config()
    cfg.model = ModelConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=256, block_size=128)
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 32, 32
    run = tmp_path / "run"
    write_run(run, cfg)  # steps 10 and 20, 40 s of training; val_loss at step 20
    newest = run / "checkpoints" / "step_000020"
    newest.mkdir(parents=True)
    write_report(run)
    (run / "loss.png").write_bytes(b"")
    lines = summary_lines(run, step=20, stop=20, newest=newest, command="dist-llm sample --checkpoint RUN")
    assert lines == ["finished at step 20 of 20: train loss 2.5000, val loss 2.4000",
                     "  wall time 40.0 s of training (evaluation and checkpoints included), 2,048 tokens/s on average",
                     f"  checkpoints: {run / 'checkpoints'} (newest: step_000020)",
                     f"  report:      {run / 'report.md'}",
                     f"  loss plot:   {run / 'loss.png'}",
                     "  sample:      dist-llm sample --checkpoint RUN"]
    assert "- tokens/s, run average: 2,048 " in build_report(run)  # the same average as the report's
    # a stop (Ctrl-C, SIGTERM) between log steps: the last logged losses, with their step
    (run / "loss.png").unlink()
    stopped = summary_lines(run, step=23, stop=1000, newest=None, command="unused")
    assert stopped[0] == "stopped at step 23 of 1000: train loss 2.5000 at step 20, val loss 2.4000 at step 20"
    assert not any("loss plot" in line or "sample" in line for line in stopped)  # no file, no checkpoint: not named


def test_human_duration() -> None:
    assert [human_duration(s) for s in (0.26, 59.94, 188, 3600 + 125.4)] == ["0.3 s", "59.9 s", "3m 08s", "1h 02m 05s"]


def test_sample_command_names_the_program_this_shell_can_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "dist-llm").write_text("#!/bin/sh\n")
    (venv / "dist-llm").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(venv / "python"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/nonexistent")  # not activated (`make train`): the environment's program, relative
    assert sample_command(Path("runs/my run")) == ".venv/bin/dist-llm sample --checkpoint 'runs/my run'"
    monkeypatch.setenv("PATH", str(venv))  # activated: the bare name
    assert sample_command(Path("runs/tiny")) == "dist-llm sample --checkpoint runs/tiny"


def test_two_ranks_print_one_bar_val_loss_once_a_summary_and_log_every_step(tmp_path: Path) -> None:
    """`dist-llm train --nproc-per-node 2` on a terminal, as `make train` runs it: set-up and evaluation lines each
    on a line of their own, once; the summary once at the end; each rank's log has every log step's line."""
    out = tmp_path / "run"
    code, shown = run_in_terminal(["train", "--nproc-per-node", "2", *tiny_overrides(
        out, model__n_layer=1, parallel__dp=2, train__max_steps=4, train__log_interval=2, train__eval_interval=2,
        train__plot=True)])
    assert code == 0, shown[-3000:]
    summary = ["finished at step 4 of 4: train loss", "wall time ", "checkpoints:", "report:", "loss plot:", "sample:"]
    messages = ["attention: SDPA", "starting fresh", "dist_llm |", "data parallel:", "memory on rank 0",
                "step 2: val_loss", "step 4: val_loss", *summary]
    assert_unglued(shown, messages)
    segments = screen_segments(shown)
    for message in messages:  # once: from rank 0 (the other rank logs to its file)
        assert sum(s.startswith(message) or s.startswith(f"  {message}") for s in segments) == 1, message
    assert "[rank 1]" not in shown and "| loss=" not in shown
    # the summary is the last thing said, in order, and its command samples this run
    tail = [s.strip() for s in segments if s.strip()][-len(summary):]
    assert [any(line.startswith(m) for line in tail[i:i + 1]) for i, m in enumerate(summary)] == [True] * len(summary)
    command = shlex.split(tail[-1].removeprefix("sample:").strip())
    assert command[1:] == ["sample", "--checkpoint", str(out)] and command[0].endswith("dist-llm")
    sampled = subprocess.run([sys.executable, "-m", "dist_llm.cli", *command[1:], "--max-new-tokens", "3"], cwd=REPO,
                             capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    # every rank's log: a line per log step with the metrics record's fields, and the evaluations
    metrics = {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if "loss" in r}
    assert sorted(metrics) == [2, 4]
    for rank in (0, 1):
        logged = (out / "logs" / f"rank_{rank}.log").read_text().splitlines()
        steps = [line.split(" INFO ", 1)[1] for line in logged if re.search(r" INFO step \d+ \| ", line)]
        assert len(steps) == 2, logged
        for line, (step, record) in zip(steps, sorted(metrics.items())):
            if rank == 0:
                assert line == step_line(record)  # rank 0 wrote this record
            else:  # the same fields; its own clock for tokens_per_s and elapsed_s
                fields = dict(field.split("=", 1) for field in line.split(" | ", 1)[1].split(" "))
                assert list(fields) == [k for k in record if k != "step"]
                assert fields["loss"] == f"{record['loss']:.6g}" and fields["lr"] == f"{record['lr']:.6g}"
        assert sum("INFO step 2: val_loss" in line for line in logged) == 1
        assert sum("INFO step 4: val_loss" in line for line in logged) == 1
