"""Issue 18, "the first hour", through the CLI as a new user meets it: an unwritable out_dir, two runs in one
out_dir, Ctrl-C, resume (metrics, incomplete checkpoints, a finished run), config errors, --help, sampling a
LoRA checkpoint from elsewhere. One tiny run is shared by the tests that read or resume it; each training
process costs seconds of CPU (torch's import, a save), so they are few and the refusals come before any."""

from __future__ import annotations

import contextlib
import json
import re
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from dist_llm.train.checkpoint import latest_checkpoint
from dist_llm.train.errors import CheckpointError
from tests.conftest import REPO, made_once, tiny_overrides


def cli(*args: str, cwd: Path = REPO, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "dist_llm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env, check=False)


def tiny(out_dir: Path, **extra: object) -> list[str]:
    """A one-block model on the stdlib corpus (cached), three steps, a checkpoint at step 2 and at the end."""
    return tiny_overrides(out_dir, **{"model__n_layer": 1, "train__max_steps": 3, "train__ckpt_interval": 2,
                                      "train__eval_interval": 0, "train__keep_checkpoints": 5, **extra})


def one_error_line(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    """The process failed with `code` and said so in exactly one line, no traceback."""
    assert proc.returncode == code, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("dist-llm: error: ")]
    assert errors == lines[-1:] and "Traceback" not in proc.stderr, proc.stderr[-3000:]  # (after set-up's log lines)
    return lines[-1].removeprefix("dist-llm: error: ")


def records(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


# -- 1. an unwritable out_dir ---------------------------------------------------------------------------------
@pytest.mark.parametrize("nproc", ["1", "2"])
def test_an_unwritable_out_dir_is_one_line_before_anything_starts(tmp_path: Path, nproc: str) -> None:
    (tmp_path / "file").write_text("kept")
    out = tmp_path / "file" / "run"
    said = one_error_line(cli("train", "--nproc-per-node", nproc, *tiny(out, parallel__dp=int(nproc))))
    assert said == f"train.out_dir: cannot write {out}: {tmp_path / 'file'} is a file, not a folder"
    assert (tmp_path / "file").read_text() == "kept"  # nothing written before is lost


# -- 2. one run per out_dir (a stale lock's takeover: in the resume test below) ------------------------------------
@pytest.mark.parametrize("nproc", ["1", "2"])
def test_a_second_run_in_a_busy_out_dir_is_refused_before_anything_starts(tmp_path: Path, nproc: str) -> None:
    out = tmp_path / "run"
    out.mkdir()
    lock = out / "run.lock"
    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "job": None}))  # this live process
    said = one_error_line(cli("train", "--nproc-per-node", nproc, *tiny(out, parallel__dp=int(nproc))))
    assert said == f"train.out_dir: {lock}: in use by process {os.getpid()} on this host; wait for it, or use another train.out_dir"
    assert json.loads(lock.read_text())["pid"] == os.getpid()  # the holder's lock is left alone
    assert sorted(p.name for p in out.iterdir()) == ["run.lock"]  # nothing started


# -- 3. Ctrl-C --------------------------------------------------------------------------------------------------
def as_in_a_terminal() -> None:
    """A terminal's foreground job takes Ctrl-C; a job started with `&` by a shell without job control (a CI
    script run in the background) inherits SIGINT ignored, and would then train on through every Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt(out: Path, *args: str, again: bool = False,
              after_step: int = 1) -> tuple[subprocess.CompletedProcess, float]:
    """Start `dist-llm train` as a terminal would (its own process group), press Ctrl-C once it has logged
    `after_step`, and with `again` once more as soon as the first press's save has begun (a step folder appears);
    (the finished process, seconds from the first Ctrl-C to its end). (Two presses 50 ms apart were one on a loaded
    machine: a signal that comes while the interpreter is inside a long C call, before it ran the handler of the
    first, is not counted again, and the run then stopped as after one press.)"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "dist_llm.cli", "train", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=as_in_a_terminal)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    try:
        while not (metrics.is_file() and f'"step": {after_step}, "loss"' in metrics.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "it logged no step"
            time.sleep(0.1)
        pressed = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what a Ctrl-C in the terminal does: the whole foreground group
        if again:
            ckpts = out / "checkpoints"
            while proc.poll() is None and not (ckpts.is_dir() and any(ckpts.iterdir())):
                assert time.monotonic() < pressed + 120, "the first Ctrl-C began no save"
                time.sleep(0.002)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:  # (an assertion above, or a timeout: no training process left behind, its output said)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), time.monotonic() - pressed


@pytest.fixture(scope="module")
def run_dir(pytestconfig: pytest.Config,
            tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """A two-rank run stopped by Ctrl-C after step 3 or later (checkpoints every 2 steps and where it stopped),
    made once: the Ctrl-C test reads it, the resume and LoRA tests start from copies of it."""
    def make(folder: Path) -> tuple[Path, subprocess.CompletedProcess]:
        out = folder / "run"
        proc, _ = interrupt(out, "--nproc-per-node", "2", *tiny(out, train__max_steps=100_000, parallel__dp=2),
                            after_step=3)
        return out, proc

    return made_once(pytestconfig, tmp_path_factory, "first_hour", make)


def test_ctrl_c_saves_at_the_step_boundary_and_says_how_to_resume(run_dir: tuple) -> None:
    """Every rank stops at the same step (the ranks agree at each step boundary), saves, and the command exits 130
    with one line naming the checkpoint."""
    out, proc = run_dir
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert f"starting fresh: no complete checkpoint in {out / 'checkpoints'}" in proc.stderr
    beats = [json.loads((out / "heartbeat" / f"rank_{r}.json").read_text())["step"] for r in range(2)]
    step = beats[0]
    assert beats == [step, step] and step >= 3  # no rank went past the agreed step
    step_dir = out / "checkpoints" / f"step_{step:06d}"
    assert latest_checkpoint(out / "checkpoints") == step_dir
    said = [line[line.index("interrupted (Ctrl-C)"):] for line in proc.stderr.replace("\r", "\n").splitlines()
            if "interrupted (Ctrl-C)" in line]
    assert said == [(f"interrupted (Ctrl-C) after step {step}: saved {step_dir}; run the same command again to "
                     "resume from it")]
    assert "Traceback" not in proc.stderr and not (out / "run.lock").exists()


def test_a_second_ctrl_c_aborts_at_once_without_saving(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc, seconds = interrupt(out, *tiny(out, train__max_steps=100_000, train__ckpt_interval=0), again=True)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].endswith("interrupted: nothing saved since the last complete checkpoint (during training, a single "
                         "Ctrl-C saves one at the end of the step)")
    # The second Ctrl-C may come during the save the first began (that half checkpoint is removed) or, on a loaded
    # machine, after that save finished (a complete one stays): what may never stay is a checkpoint without its
    # manifest. (CI once saw the second case: the sleep between the two presses ran long.)
    ckpts = out / "checkpoints"
    left = sorted(ckpts.iterdir()) if ckpts.exists() else []
    assert all((d / "manifest.json").is_file() for d in left), [p.name for p in left]
    assert not (out / "run.lock").exists()
    assert seconds < 30  # (no save, no report: a step and the interpreter's exit)


def test_a_second_ctrl_c_ends_the_process_even_when_clean_up_hangs() -> None:
    """The second Ctrl-C raises KeyboardInterrupt wherever the main thread is; clean-up after it can wait forever
    on a lock the interrupt left held (here: a lock taken and never released, as an interrupted `with` leaves
    it). A process of its own is ended within the grace `abort_within` set, with code 130 and one line."""
    script = """if True:
        import os, signal, threading
        from dist_llm.train.preemption import Preemption, abort_within
        abort_within(1.0)
        Preemption().install()
        held = threading.Lock()
        held.acquire()
        try:
            os.kill(os.getpid(), signal.SIGINT)  # the first: a stop is asked for
            os.kill(os.getpid(), signal.SIGINT)  # the second: KeyboardInterrupt
        except KeyboardInterrupt:
            held.acquire()  # clean-up that never ends
        """
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                          preexec_fn=as_in_a_terminal)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("dist-llm: error: interrupted: clean-up after the second "
                                                    "Ctrl-C did not finish; stopped")
    assert time.monotonic() - started < 30


# -- 2, 4, 5, 6: resume (15: a checkpoint of another shape is in test_reliability, on a trainer in-process) ---
def test_resume_warns_of_an_incomplete_checkpoint_and_keeps_one_metrics_line_per_step(run_dir: tuple,
                                                                                      tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(run_dir[0], out)
    newest = latest_checkpoint(out / "checkpoints")
    last = int(newest.name.removeprefix("step_"))
    (newest / "manifest.json").unlink()  # a save that did not finish
    previous = latest_checkpoint(out / "checkpoints")
    resumed = int(previous.name.removeprefix("step_"))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (out / "run.lock").write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname(), "job": None}))
    before = records(out)
    proc = cli("train", *tiny(out, train__max_steps=last))  # (one process now: a checkpoint loads into any layout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{out / 'run.lock'}: taking over the lock of process {gone.pid}, which is gone" in proc.stderr
    assert not (out / "run.lock").exists()  # released at the end
    assert f"ignoring checkpoint {newest}: it has no manifest.json (its save did not finish)" in proc.stderr
    assert f"resumed from {previous} at step {resumed}" in proc.stderr
    after = records(out)
    assert [r["step"] for r in after if "loss" in r] == list(range(1, last + 1))  # each step once
    kept = [r for r in before if r.get("step", 0) <= resumed]
    assert after[:len(kept)] == kept  # the lines up to the checkpoint's step, as they were
    assert [r["step"] for r in after if r.get("event") == "start"] == [0, resumed]
    # 6. run again, it is complete: nothing is trained or written, and it says how to go on
    done = cli("train", *tiny(out, train__max_steps=last))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (f"nothing to train: {out} is complete at step {last} (train.max_steps={last}); to train on, raise "
            f"train.max_steps (e.g. train.max_steps={2 * last}); to start over, train.resume=never") in done.stderr
    assert records(out) == after
    assert not (out / "run.lock").exists()


# -- 15. config errors --------------------------------------------------------------------------------------------
def test_config_errors_say_why_and_suggest_the_section(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  n_layer: 2\n n_head: 3\n")
    said = one_error_line(cli("train", "--config", str(bad)))
    assert said == (f"--config: {bad} is not valid YAML at line 3, column 2: expected <block end>, but found "
                    "'<block mapping start>'")
    said = one_error_line(cli("train", "modle.n_layer=2"))
    assert said == "unknown config key 'modle.n_layer' (did you mean 'model.n_layer'?)"
    said = one_error_line(cli("train", "train.max_steps=1.5"))
    assert said == "train.max_steps: expected an integer, got 1.5"
    ok = tmp_path / "ok.yaml"
    ok.write_text("train:\n  max_steps: 1e3\n  eval_steps: 2.0\n")
    (tmp_path / "file").write_text("")
    # integral floats are taken for integer keys: the config loads, and the next check (no torch needed) speaks
    said = one_error_line(cli("train", "--config", str(ok), "train.global_batch_size=4e1", "train.micro_batch_size=8",
                              f"train.out_dir={tmp_path / 'file'}"))
    assert said == f"train.out_dir: cannot write {tmp_path / 'file'}: {tmp_path / 'file'} is a file, not a folder"


# -- 16. --help and the sample command ------------------------------------------------------------------------------
def test_help_lists_keys_version_and_sample_options(tmp_path: Path) -> None:
    helped = cli("sample", "--help").stdout
    assert "0 is greedy" in helped and "(default: 200)" in helped and "(default: 0.8)" in helped
    assert "dist-llm train --list-keys" in cli("train", "--help").stdout
    assert "{0,1,2,3}" in cli("memory", "--help").stdout
    from dist_llm import __version__

    assert cli("--version").stdout.strip() == f"dist-llm {__version__}"
    keys = cli("train", "--list-keys").stdout.splitlines()
    from dist_llm.config import all_keys

    assert [line.split()[0] for line in keys] == all_keys()
    assert any(line.split()[:2] == ["train.max_steps", "1000"] and len(line.split()) > 3 for line in keys)
    said = one_error_line(cli("sample", "--checkpoint", str(tmp_path / "nowhere")))
    assert said == f"--checkpoint: {tmp_path / 'nowhere'} not found"
    said = one_error_line(cli("sample", "--checkpoint", str(tmp_path), "--max-new-tokens", "-5"))
    assert said == "--max-new-tokens: must be at least 1, got -5"


# -- 9. a LoRA checkpoint sampled from another directory -----------------------------------------------------------
def test_lora_checkpoint_stores_its_base_resolved_and_names_it_when_missing(run_dir: tuple, tmp_path: Path) -> None:
    base = tmp_path / "base"
    shutil.copytree(latest_checkpoint(run_dir[0] / "checkpoints"), base)
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "lora"
    proc = cli("train", *tiny(out, train__max_steps=1, peft__method="lora", peft__rank=2,
                              model__init_from="ckpt:../base"), cwd=work)  # relative to where it was started
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"init_from: ckpt:{base.resolve()}\n" in (out / "config.yaml").read_text()
    base.rename(tmp_path / "moved")
    ckpt = out / "checkpoints" / "step_000001"
    said = one_error_line(cli("sample", "--checkpoint", str(out), "--max-new-tokens", "4"))
    assert said == (f"model.init_from in {ckpt / 'config.yaml'}: the base model directory {base.resolve()} is not "
                    "found; give where it is now with --init-from ckpt:DIR")
    moved = cli("sample", "--checkpoint", str(out), "--max-new-tokens", "4", "--init-from", f"ckpt:{tmp_path / 'moved'}",
                cwd=tmp_path)
    assert moved.returncode == 0, moved.stderr[-3000:]


def test_truncating_metrics_keeps_the_lines_up_to_the_step_and_drops_a_torn_one(tmp_path: Path) -> None:
    from dist_llm.train.metrics import read_metrics, truncate_after

    path = tmp_path / "metrics.jsonl"
    kept = ['{"event": "start", "step": 0}', '{"step": 1, "loss": 2.0}', '{"step": 2, "val_loss": 1.5}']
    path.write_text("\n".join([*kept, '{"step": 3, "loss": 1.0}', '{"step": 4, "lo']))  # killed mid-write
    assert truncate_after(path, 2) == 2
    assert path.read_text() == "".join(f"{line}\n" for line in kept)
    assert truncate_after(path, 2) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary left
    # a line that is not JSON in the middle was not torn by a crash: it stays, as what was written before does
    path.write_text("\n".join(["a note", *kept, '{"step": 3, "loss": 1.0}']) + "\n")
    assert truncate_after(path, 2) == 1
    assert path.read_text() == "".join(f"{line}\n" for line in ["a note", *kept])
    assert read_metrics(path) == [json.loads(line) for line in kept]  # the plot and report read past it


# -- 3. a SIGTERM to the launching command (a scheduler's preemption) reaches the workers ------------------------
FAKE_LAUNCHER = """
import subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)  # as torchrun starts them
sys.exit(worker.wait())
"""
FAKE_WORKER = """
import os, pathlib, signal, sys, time
out = pathlib.Path({out!r})
signal.signal(signal.SIGTERM, lambda *_: (out.joinpath("got").write_text("SIGTERM"), sys.exit(0)))
out.joinpath("ready").write_text(str(os.getpid()))
time.sleep(60)
sys.exit(3)
"""


def stand_in(worker: str, out: Path) -> tuple[subprocess.Popen, int]:
    """`run_launcher` over a stand-in launcher and `worker` (formatted with `out`), once the worker is up:
    (the process running run_launcher, the worker's pid)."""
    code = ("import sys; from dist_llm.cli import run_launcher; "
            f"sys.exit(run_launcher([sys.executable, '-c', {FAKE_LAUNCHER!r}, {worker.format(out=str(out))!r}]))")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (out / "ready").exists() or not (out / "ready").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
        time.sleep(0.05)
    time.sleep(0.2)  # (the worker's handler is set before it writes "ready"; the launcher has seen it start)
    return proc, int((out / "ready").read_text())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_sigterm_to_the_command_reaches_torchruns_workers(tmp_path: Path, sig: int) -> None:
    """torchrun runs in a session of its own (so that a Ctrl-C reaches only dist-llm, which hands it on): a SIGTERM
    or SIGHUP sent to dist-llm alone, as a scheduler or a closing terminal does, must be passed to the workers (as
    SIGTERM: they save at the step boundary), and the command ends with 128 + the signal. A stand-in launcher and
    worker (no torch) keep it to a second."""
    proc, _ = stand_in(FAKE_WORKER, tmp_path)  # (the worker's handler is set before it writes "ready"; the launcher has seen it start)
    proc.send_signal(sig)  # this process only, not its group
    assert proc.wait(timeout=30) == 128 + sig, proc.communicate()[1]
    assert (tmp_path / "got").read_text() == "SIGTERM"


def test_an_older_peft_manifest_with_a_relative_base_still_matches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints written before model.init_from was stored resolved hold it as typed ("ckpt:../base"): a resume
    from the directory the run was started in must still recognise its base (it failed as "adapts another base
    model" when the manifest's path was compared as written)."""
    from dist_llm.train.state import _same_base

    monkeypatch.chdir(tmp_path)
    old = {"init_from": "ckpt:../base", "model_fingerprint": "f"}
    assert _same_base(old) == {"init_from": f"ckpt:{(tmp_path.parent / 'base').resolve()}", "model_fingerprint": "f"}
    assert _same_base(None) is None and _same_base({"init_from": ""}) == {"init_from": ""}


STUCK_WORKER = """
import os, pathlib, signal, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a worker inside a blocking collective runs no Python handler
pathlib.Path({out!r}).joinpath("ready").write_text(str(os.getpid()))
time.sleep(60)
"""


def _gone(pid: int) -> bool:
    try:  # (a zombie counts as gone: its parent was killed and whatever reaps orphans here may not)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finding torchrun's workers reads /proc (Linux)")
def test_a_second_ctrl_c_kills_workers_in_their_own_sessions(tmp_path: Path) -> None:
    """torchrun starts each worker in a session of its own, so killing torchrun's process group does not reach them:
    a second Ctrl-C must kill every worker's own group, or a worker stuck in a collective is left running, orphaned,
    holding its GPU and the run lock (the launcher returned 130 while the stand-in worker lived on, before)."""
    proc, pid = stand_in(STUCK_WORKER, tmp_path)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130, proc.communicate()[1]
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid), "the worker outlived the launcher"


def _raised_while_interrupted(error: Exception) -> Exception:
    """`error` as a writer that a KeyboardInterrupt stopped raises it on closing: the interrupt its context."""
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise error  # noqa: B904 - as torch.save's zip writer does
    except Exception as e:  # noqa: BLE001
        return e


UNEXPECTED_POS = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"  # (torch's zip writer)


@pytest.mark.parametrize("failure", ["wrapped", "wrapped, the writer failing to close", "the writer failing to close",
                                     "shared by DCP (the chain lost), after a second Ctrl-C here"])
def test_a_second_ctrl_c_that_dcp_wraps_as_a_save_failure_still_aborts(tmp_path: Path, failure: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP catches what interrupts its writers and raises a CheckpointException holding it: a second Ctrl-C during
    a save came out as "saving checkpoint ... failed (rank 0: KeyboardInterrupt)", exit 1, not the abort (130).
    A writer it stops can then fail to close, so the failure held is torch's zip writer's "unexpected pos" (seen in
    test_a_second_ctrl_c_aborts_at_once_without_saving when the Ctrl-C landed in a write), the interrupt its
    context; or an OSError so raised. With a process group DCP shares each rank's failure pickled, which keeps no
    __context__: then it is this process's own second Ctrl-C that says so. The half checkpoint is removed."""
    import pickle
    from types import SimpleNamespace

    from torch.distributed.checkpoint.api import CheckpointException

    from dist_llm.train import preemption
    from dist_llm.train.state import RunState

    half = tmp_path / "checkpoints" / "step_000003"
    half.mkdir(parents=True)
    fake = SimpleNamespace(ctx=SimpleNamespace(is_main=True), ckpt_root=tmp_path / "checkpoints", step=3)
    closing = _raised_while_interrupted(RuntimeError(UNEXPECTED_POS))
    shared = pickle.loads(pickle.dumps(closing))
    assert shared.__context__ is None  # (what a peer, or DCP's own gather, hands back)
    raised = {"wrapped": CheckpointException("save", {0: (KeyboardInterrupt(), None)}),
              "wrapped, the writer failing to close": CheckpointException("save", {0: (closing, None)}),
              "the writer failing to close": _raised_while_interrupted(OSError(5, "Input/output error")),
              "shared by DCP (the chain lost), after a second Ctrl-C here": CheckpointException("save", {0: (shared, None)}),
              }[failure]
    monkeypatch.setattr(preemption, "_aborting", False)  # (put back after the test)
    if failure.startswith("shared"):  # the second Ctrl-C, as Preemption's handler takes it
        stop = preemption.Preemption()
        stop.signal_name = "SIGINT"  # (the first)
        handler = signal.getsignal(signal.SIGINT)
        try:
            with pytest.raises(KeyboardInterrupt):
                stop._handle(signal.SIGINT, None)
        finally:
            signal.signal(signal.SIGINT, handler)  # (the handler leaves SIGINT's default action: not this worker's)
    with pytest.raises(KeyboardInterrupt), RunState._saving(fake, half) as ours:  # type: ignore[arg-type]
        ours()
        raise raised
    assert not half.exists()


def test_a_failed_write_without_a_second_ctrl_c_is_reported_as_one(tmp_path: Path) -> None:
    """The same failures with no Ctrl-C behind them: one line naming the checkpoint, and the engine's files' writer
    (DeepSpeed's torch.save) reports its rank's error; a second Ctrl-C that stopped that writer aborts."""
    import pickle
    from types import SimpleNamespace

    import torch
    from torch.distributed.checkpoint.api import CheckpointException

    from dist_llm.train.checkpoint import _write_own_files
    from dist_llm.train.state import RunState

    half = tmp_path / "checkpoints" / "step_000003"
    half.mkdir(parents=True)
    fake = SimpleNamespace(ctx=SimpleNamespace(is_main=True), ckpt_root=tmp_path / "checkpoints", step=3)
    shared = pickle.loads(pickle.dumps(RuntimeError(UNEXPECTED_POS)))
    with pytest.raises(CheckpointError, match=rf"^saving checkpoint {re.escape(str(half))} failed \(.*unexpected pos"
                                              r".*\); training stopped at step 3, the last complete checkpoint is none$"):
        with RunState._saving(fake, half) as ours:  # type: ignore[arg-type]
            ours()
            raise CheckpointException("save", {0: (shared, None)})
    assert not half.exists()

    ctx = SimpleNamespace(rank=1, is_main=False, device=torch.device("cpu"))

    def engine(error: BaseException) -> Callable[[Path], None]:
        def write(path: Path) -> None:
            raise error
        return write

    own = dict(train_state={}, cfg=None, ctx=ctx, extra_files=None)
    assert _write_own_files(tmp_path / "a", **own, engine_files=engine(RuntimeError(UNEXPECTED_POS))) == (
        f"rank 1: {tmp_path / 'a'}: RuntimeError: {UNEXPECTED_POS}")
    with pytest.raises(KeyboardInterrupt):
        _write_own_files(tmp_path / "b", **own, engine_files=engine(_raised_while_interrupted(RuntimeError(UNEXPECTED_POS))))
