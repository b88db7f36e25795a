"""A Ctrl-C or SIGTERM before training begins (while the model is built, or a checkpoint resumed): one line, exit
130 or 143 (128 + 15), no traceback, the run lock released, nothing half-written. Training's own handlers
(train/preemption.py) are installed only when training starts; before that, a SIGTERM ended the process where
it stood (the run lock left behind, and under torchrun its failure report and exit 1).

The build of a tiny model takes milliseconds, so the child process is made to pause inside it: a `sitecustomize.py`
of the test's own, on PYTHONPATH, wraps the function named by $PAUSE_IN (the real one, called at its real place in
the run) to write a file named by its pid into $PAUSE_MARK and sleep before going on, as a slow build or load
would; the test signals the process once the mark is there. Nothing of this is in dist_llm."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.test_first_hour import as_in_a_terminal, tiny

SITECUSTOMIZE = '''
import os
if os.environ.get("PAUSE_IN"):
    import functools, importlib, pathlib, time
    module_name, _, qualname = os.environ["PAUSE_IN"].partition(":")
    owner_name, _, attr = qualname.rpartition(".")
    owner = importlib.import_module(module_name)
    for part in filter(None, owner_name.split(".")):
        owner = getattr(owner, part)
    real = getattr(owner, attr)

    @functools.wraps(real)
    def paused(*args, **kwargs):
        pathlib.Path(os.environ["PAUSE_MARK"], str(os.getpid())).write_text("")
        time.sleep(float(os.environ.get("PAUSE_S", "120")))  # a slow build or load: the signal comes now
        pathlib.Path(os.environ["PAUSE_MARK"] + ".ended", str(os.getpid())).write_text(str(time.monotonic()))
        return real(*args, **kwargs)

    setattr(owner, attr, paused)
'''
BUILD = "dist_llm.parallel.parallelize:materialize"  # inside Trainer(): the model's parameters being made
RESUME = "dist_llm.train.state:RunState.resume"  # inside Trainer(), the run lock taken: looking for a checkpoint
NOTHING_SAVED = "nothing saved since the last complete checkpoint"


def _signal_when_paused(tmp_path: Path, pause_in: str, sig: int, *args: str, ranks: int = 1,
                        pause_s: float = 120) -> subprocess.CompletedProcess:
    """Run `dist-llm train *args`, and send `sig` once all its `ranks` have paused in `pause_in` (for `pause_s`
    seconds, unless the signal ends the pause)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    mark = tmp_path / "paused"
    mark.mkdir()
    (tmp_path / "paused.ended").mkdir()  # (a pause that ran to its end, signal or not: the time it ended)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{REPO}", "PAUSE_IN": pause_in,
           "PAUSE_MARK": str(mark), "PAUSE_S": str(pause_s)}
    proc = subprocess.Popen([sys.executable, "-m", "dist_llm.cli", "train", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=as_in_a_terminal)
    deadline = time.monotonic() + 120
    while len(list(mark.iterdir())) < ranks:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run never reached {pause_in}: {proc.communicate()[1][-3000:]}")
        time.sleep(0.05)
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # what a Ctrl-C in the terminal does: the whole foreground group
    else:
        proc.send_signal(sig)  # a scheduler: this process only
    sent = time.monotonic()  # (Linux: one clock for every process)
    stdout, stderr = proc.communicate(timeout=120)
    for ended in (tmp_path / "paused.ended").iterdir():  # the signal reached a paused run, not one already past it
        assert float(ended.read_text()) > sent, f"the pause in {pause_in} ended before the signal was sent"
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _last_line(proc: subprocess.CompletedProcess, code: int) -> str:
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert [line for line in lines if line.startswith("dist-llm: error:")] == lines[-1:], proc.stderr[-3000:]
    return lines[-1].removeprefix("dist-llm: error: ")


@pytest.mark.parametrize(("sig", "code", "said"), [
    (signal.SIGTERM, 143, f"terminated (SIGTERM): {NOTHING_SAVED} (during training, SIGTERM saves one at the end "
                          "of the step)"),
    (signal.SIGINT, 130, f"interrupted: {NOTHING_SAVED} (during training, a single Ctrl-C saves one at the end of "
                         "the step)"),
], ids=["sigterm", "ctrl-c"])
def test_a_signal_during_the_build_is_one_line_and_its_exit_code(tmp_path: Path, sig: int, code: int,
                                                                 said: str) -> None:
    out = tmp_path / "run"
    proc = _signal_when_paused(tmp_path, BUILD, sig, *tiny(out))
    assert _last_line(proc, code) == said
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()  # training never began
    # (the run lock is taken after the build: its release is the resume case's to show)


def test_a_sigterm_during_the_resume_releases_the_run_lock(tmp_path: Path) -> None:
    """The run lock is taken before the resume looks for a checkpoint: a SIGTERM there gives it back (before, the
    default action ended the process and left it for the next run to find stale)."""
    out = tmp_path / "run"
    proc = _signal_when_paused(tmp_path, RESUME, signal.SIGTERM, *tiny(out))
    assert _last_line(proc, 143).startswith(f"terminated (SIGTERM): {NOTHING_SAVED}")
    assert out.is_dir() and not (out / "run.lock").exists()
    assert not (out / "checkpoints").exists()


def test_a_sigterm_to_the_launcher_during_the_build_of_two_ranks(tmp_path: Path) -> None:
    """`--nproc-per-node 2`: dist-llm hands the SIGTERM to both workers (torchrun runs in a session of its own);
    each stops its build, exits 0 so that torchrun neither restarts the group nor prints its failure report, rank
    0 says the one line, and the command exits 143."""
    out = tmp_path / "run"
    proc = _signal_when_paused(tmp_path, BUILD, signal.SIGTERM, "--nproc-per-node", "2", *tiny(out, parallel__dp=2),
                               ranks=2)
    assert _last_line(proc, 143).startswith(f"terminated (SIGTERM): {NOTHING_SAVED}")
    assert "ChildFailedError" not in proc.stderr and not (out / "run.lock").exists()


def test_a_sigterm_after_the_last_save_lets_the_complete_run_exit_0(tmp_path: Path) -> None:
    """A SIGTERM while the report is written, after the last checkpoint is down: the run is complete, so it is
    recorded as one during training is and the run exits 0 with its report (before: training's handler was gone
    by then, and the build's raised a Terminated, exit 143 and "nothing saved", for a run that saved everything)."""
    out = tmp_path / "run"
    # (paused 10 s: the signal, sent within milliseconds of the pause mark on a quiet machine, is recorded and does
    # not end the pause)
    proc = _signal_when_paused(tmp_path, "dist_llm.train.trainer:write_report", signal.SIGTERM, *tiny(out), pause_s=10)
    assert len(list((tmp_path / "paused.ended").iterdir())) == 1  # the pause ran to its end, the signal recorded
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dist-llm: error" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (out / "checkpoints" / "step_000003" / "manifest.json").is_file()
    assert (out / "report.md").is_file() and not (out / "run.lock").exists()
