"""`dist-llm` end to end, as a user runs it: train, resume, sample, `python -m dist_llm.train`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.test_readme import run_as_written


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def refused(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str]]:
    """`dist-llm ARGS` in this process, for what is refused before any process starts: the exit code and the lines
    on stderr."""
    from dist_llm.cli import main

    capsys.readouterr()
    code = main(list(args))
    return code, capsys.readouterr().err.strip().splitlines()


def losses(out_dir: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def test_train_then_sample(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run("-m", "dist_llm.train", "--config", "configs/tiny.yaml", "train.max_steps=10", "model.n_layer=2",
               "train.eval_steps=1", "model.block_size=64", "train.micro_batch_size=8", "train.global_batch_size=8",
               f"train.out_dir={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("metrics.jsonl", "config.yaml", "loss.png", "checkpoints/step_000010/manifest.json"):
        assert (out / name).is_file(), name
    sample = run("-m", "dist_llm.cli", "sample", "--checkpoint", str(out), "--prompt", "def ",
                 "--max-new-tokens", "40", "--seed", "1")
    assert sample.returncode == 0, sample.stderr[-2000:]
    assert sample.stdout.startswith("def ") and len(sample.stdout) >= 40
    again = run("-m", "dist_llm.cli", "sample", "--checkpoint", str(out / "checkpoints" / "step_000010"),
                "--prompt", "def ", "--max-new-tokens", "40", "--seed", "1")
    assert again.stdout == sample.stdout  # same seed, same text
    # an output that cannot be written (its parent is a file): one line naming the path, exit 1, no traceback
    (tmp_path / "file").write_text("x")
    bad = run("-m", "dist_llm.cli", "convert", "--to-full", str(out), "--out", str(tmp_path / "file" / "m.safetensors"))
    assert bad.returncode == 1, bad.stderr[-2000:]
    [line] = bad.stderr.strip().splitlines()
    assert line.startswith("dist-llm: error: ") and str(tmp_path / "file") in line


def test_sample_bad_checkpoint_exits_2(tmp_path: Path) -> None:
    proc = run("-m", "dist_llm.cli", "sample", "--checkpoint", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"dist-llm: error: --checkpoint: no complete checkpoint at {tmp_path}"]


def test_nproc_per_node_relaunches_under_torchrun(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """README's `--nproc-per-node 2` command, as written with a small run's overrides appended: two ranks through
    torchrun, ZeRO-2 over them, give the one-process losses."""
    small = ["train.max_steps=4", "train.log_interval=1", "train.eval_steps=1", "model.n_layer=1",
             "train.micro_batch_size=8", "train.global_batch_size=16", "train.resume=never",
             "train.plot=false"]  # (matplotlib: a second a run; test_train_then_sample draws the plot)
    one = run("-m", "dist_llm.cli", "train", "--config", "configs/tiny.yaml", *small, f"train.out_dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr[-2000:]
    out = tmp_path / "two"
    two = run_as_written(request, *small, f"train.out_dir={out}", timeout=240)
    assert two.returncode == 0, two.stderr[-3000:]
    header = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert header["layout"] == {"world_size": 2, "dp": 2, "tp": 1, "pp": 1}
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5)


def test_bad_layout_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert refused(capsys, "train", "--nproc-per-node", "2", "parallel.dp=4", "train.micro_batch_size=8",
                   f"train.out_dir={tmp_path}") == (2, [
        "dist-llm: error: --nproc-per-node 2: parallel: dp*tp*pp = 4*1*1 = 4 does not match WORLD_SIZE=2"])
    assert refused(capsys, "train", "--nproc-per-node", "3", "train.global_batch_size=32", "train.micro_batch_size=8",
                   f"train.out_dir={tmp_path}") == (2, [
        "dist-llm: error: --nproc-per-node 3: train.global_batch_size: 32 is not divisible by "
        "train.micro_batch_size * dp = 8 * 3"])


def test_layout_rules_that_need_dp_are_checked_before_the_launch(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Expert parallelism's share of dp and interleaving's micro-batch count: refused before torchrun starts
    (before, each rank refused it, and torchrun added its traceback and failure table to the line)."""
    assert refused(capsys, "train", "--config", str(REPO / "configs/moe.yaml"), "--nproc-per-node", "2",
                   "parallel.ep=4", "train.micro_batch_size=2", "train.global_batch_size=4",
                   f"train.out_dir={tmp_path}") == (2, [
        "dist-llm: error: --nproc-per-node 2: parallel.ep: 4 does not divide dp=2 (WORLD_SIZE=2 / (cp*tp*pp))"])
    assert refused(capsys, "train", "--nproc-per-node", "2", "parallel.pp=2", "parallel.pp_schedule=interleaved",
                   "parallel.pp_virtual=2", f"train.out_dir={tmp_path}") == (2, [
        "dist-llm: error: --nproc-per-node 2: parallel.pp_schedule: interleaved needs the micro-batches per step "
        "(train.global_batch_size / (train.micro_batch_size * dp) = 1) to be a multiple of parallel.pp=2"])


def test_bad_data_under_two_ranks_is_one_line(tmp_path: Path) -> None:
    """Empty data under --nproc-per-node 2, which only the ranks find (local rank 0 prepares the data): every rank
    stops on it, so the run ends in rank 0's one line and exit 2. Before, rank 1 waited in a barrier until rank 0's
    exit broke it, printed that traceback, and torchrun added its own and a failure table (exit 1)."""
    (tmp_path / "empty.txt").write_text("")
    proc = run("-m", "dist_llm.cli", "train", "--nproc-per-node", "2", f"data.source={tmp_path / 'empty.txt'}",
               "train.micro_batch_size=8", "train.global_batch_size=16", f"train.out_dir={tmp_path / 'run'}")
    assert (proc.returncode, proc.stderr.strip().splitlines()) == (2, [
        f"dist-llm: error: data.source: {tmp_path / 'empty.txt'} is empty"]), proc.stderr[-3000:]


def test_the_launcher_says_only_what_no_worker_could(tmp_path: Path) -> None:
    """dist_llm.torchrun on torchrun's failures {rank: ProcessFailure} (each read from its error file, as torchrun
    reads them): the cause's exit code is the launcher's; one line only where no worker printed it."""
    import io
    import json
    import signal

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from dist_llm.torchrun import exit_code

    def failure(rank: int, code: int, said: str | None = None, *, at: float = 0.0,
                printed: bool = False) -> ProcessFailure:
        error_file = tmp_path / f"error-{rank}-{code}-{at}.json"
        if said is not None:  # (what cli.fail leaves)
            error_file.write_text(json.dumps({"message": said, "timestamp": int(at), "time": at,
                                              "printed": printed}))
        return ProcessFailure(local_rank=rank, pid=4240 + rank, exitcode=code, error_file=str(error_file))

    def launcher(*failures: tuple[int, ProcessFailure], killed: frozenset[int] = frozenset()) -> tuple[int, str]:
        err = io.StringIO()
        return exit_code(dict(failures), err, killed_by_torchrun=set(killed)), err.getvalue()

    bad = "data.source: x is empty"
    # every rank met the bad input, rank 1 a moment first; rank 0 printed it: nothing more
    assert launcher((1, failure(1, 2, bad, at=1.1)), (0, failure(0, 2, bad, at=1.2, printed=True))) == (2, "")
    # rank 1 alone met it; torchrun stopped rank 0 before it said anything: rank 1's line
    assert launcher((1, failure(1, 2, bad, at=1.0)), (0, failure(0, -signal.SIGTERM))) == (
        2, f"dist-llm: error: {bad}\n")
    # ... and so when rank 0 then exited 1 on the broken connection, a line of its own (it comes later)
    broken = "rank 0: all_reduce failed: connection closed"
    assert launcher((0, failure(0, 1, broken, at=1.5, printed=True)), (1, failure(1, 2, bad, at=1.0))) == (
        2, f"dist-llm: error: {bad}\n")
    # ... and so when torchrun had to SIGKILL rank 0 (stuck where its SIGTERM handler could not run)
    assert launcher((1, failure(1, 2, bad, at=1.0)), (0, failure(0, -signal.SIGKILL)), killed=frozenset({4240})) == (
        2, f"dist-llm: error: {bad}\n")
    # a line every rank prints for itself (an OOM, a lost peer), printed by rank 1: nothing more
    oom = "rank 1: out of host memory: 2 GiB could not be allocated"
    assert launcher((1, failure(1, 1, oom, at=1.0, printed=True)), (0, failure(0, -signal.SIGTERM))) == (1, "")
    # no line from any rank (a library's sys.exit(3), a traceback): its rank and code
    assert launcher((1, failure(1, 3)), (0, failure(0, -signal.SIGTERM))) == (
        3, "dist-llm: error: rank 1 (pid 4241) exited with code 3\n")
    # killed by the OOM killer while its peer saw the connection close (exit 1): the kill
    assert launcher((0, failure(0, 1, broken, at=1.0, printed=True)), (1, failure(1, -signal.SIGKILL))) == (
        128 + signal.SIGKILL, "dist-llm: error: rank 1 (pid 4241) was killed by SIGKILL (out of memory?); the "
                              "other ranks were stopped\n")
    code, said = launcher((1, failure(1, -signal.SIGSEGV)))
    assert code == 128 + signal.SIGSEGV and "rank 1 (pid 4241) was killed by SIGSEGV;" in said


def test_tp_larger_than_the_world_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert refused(capsys, "train", "--nproc-per-node", "2", "parallel.tp=4", f"train.out_dir={tmp_path}") == (2, [
        "dist-llm: error: --nproc-per-node 2: parallel: WORLD_SIZE=2 is not divisible by tp*pp = 4*1"])


def test_pipeline_with_fsdp_offload_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # (FSDP2 composes with pp; its CPU offload under a pipeline does not yet: refused before any launch)
    assert refused(capsys, "train", "--nproc-per-node", "4", "parallel.pp=2", "parallel.zero_stage=3",
                   "parallel.offload=cpu", f"train.out_dir={tmp_path}") == (2, [
        "dist-llm: error: parallel.offload=cpu is not supported with parallel.pp>1; use parallel.offload=none"])


CUDA_OOM = ("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 3.12 GiB "
            "is free. Of the allocated memory 70.02 GiB is allocated by PyTorch")
CPU_OOM = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
           "allocate 400000000000 bytes. Error code 12 (Cannot allocate memory)")


@pytest.mark.parametrize(("where", "error", "said"), [
    ("train_step", "cuda", "rank 0: out of GPU memory: 20 GiB could not be allocated"),
    ("__init__", "cpu", "rank 0: out of host memory: 372.53 GiB could not be allocated"),  # (the build)
    ("__init__", "numpy", "rank 0: out of host memory: 745 GiB could not be allocated"),
])
def test_out_of_memory_is_one_line_naming_the_rank_and_the_memory_command(
        where: str, error: str, said: str, tmp_path: Path, corpus_file: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Before, 40-65 lines of traceback ending in the allocator's message (`ulimit -v` and model.vocab_size=2e9, or
    a huge micro-batch); the size of a config is what `dist-llm memory` predicts."""
    import shlex

    import torch

    from dist_llm import cli
    from dist_llm.train.trainer import Trainer
    from tests.conftest import tiny_overrides

    raised = {"cuda": torch.OutOfMemoryError(CUDA_OOM), "cpu": RuntimeError(CPU_OOM),
              "numpy": MemoryError("Unable to allocate 745. GiB for an array with shape (100000000000,) and data "
                                   "type float64")}[error]

    def allocate(*args: object, **kwargs: object) -> None:
        raise raised

    monkeypatch.setattr(Trainer, where, allocate)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = REPO / "configs" / "tiny.yaml"
    overrides = tiny_overrides(tmp_path / "run", data__source=str(corpus_file), train__max_steps=2)
    code = cli.main(["train", "--config", str(config), *overrides])
    err = capsys.readouterr().err
    command = shlex.join(["dist-llm", "memory", "--config", str(config), *overrides])
    assert "Traceback" not in err
    assert code == 1 and [line for line in err.splitlines() if line.startswith("dist-llm: error:")] == [
        f"dist-llm: error: {said}; `{command}` predicts what a rank of this config needs"]


def test_an_error_that_is_not_out_of_memory_is_not_taken_for_one(tmp_path: Path, corpus_file: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from dist_llm import cli
    from dist_llm.train.trainer import Trainer
    from tests.conftest import tiny_overrides

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug: shapes (2, 3) and (4, 5) do not multiply")

    monkeypatch.setattr(Trainer, "__init__", broken)
    with pytest.raises(RuntimeError, match="^a bug"):
        cli.main(["train", *tiny_overrides(tmp_path / "run", data__source=str(corpus_file))])
