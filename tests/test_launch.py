"""The launchers of launch/: two torchrun "nodes", SLURM (with a fake srun/scontrol), Accelerate and DeepSpeed's
launcher, each training the same few steps as one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, made_once
from tests.test_readme import run_as_written

BIN = Path(sys.executable).parent
# a small run: dp x tp layouts of 4 ranks and the single process see the same global batches
RUN = ["model.n_layer=2", "model.n_embd=64", "model.block_size=64", "train.micro_batch_size=8",
       "train.global_batch_size=16", "train.max_steps=5", "train.eval_interval=0", "train.log_interval=1",
       "optim.warmup_steps=2", "train.plot=false"]  # (matplotlib: a second a rank 0; test_cli draws the plot)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONPATH": str(REPO), "PYTHON": sys.executable,
            "OMP_NUM_THREADS": "1", **extra}


def losses(out_dir: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def check(proc: subprocess.CompletedProcess, out_dir: Path, reference: list[float], ranks: int) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = losses(out_dir)
    assert got == pytest.approx(reference, rel=1e-5)
    assert sorted(p.name for p in (out_dir / "logs").iterdir()) == [f"rank_{r}.log" for r in range(ranks)]


@pytest.fixture(scope="module")
def reference(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    def make(out: Path) -> list[float]:
        proc = subprocess.run([sys.executable, "-m", "dist_llm.train", "--config", str(REPO / "configs/tiny.yaml"),
                               *RUN, f"train.out_dir={out}"], capture_output=True, text=True, env=env(), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return losses(out)

    return made_once(pytestconfig, tmp_path_factory, "launch_reference", make)


def test_two_torchrun_nodes_dp2_tp2(tmp_path: Path, reference: list[float]) -> None:
    """launch/torchrun_multi_node.sh twice, as node 0 and node 1 of a 2 x 2 job, c10d rendezvous on 127.0.0.1."""
    port = free_port()
    nodes = [subprocess.Popen(["bash", str(REPO / "launch/torchrun_multi_node.sh"), str(REPO / "configs/tiny.yaml"),
                               *RUN, "parallel.tp=2", f"train.out_dir={tmp_path}"],
                              env=env(NNODES="2", NODE_RANK=str(i), NPROC="2", RDZV_ENDPOINT=f"127.0.0.1:{port}",
                                      RDZV_ID="two-nodes", MAX_RESTARTS="0"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [n.communicate(timeout=300)[0] for n in nodes]
    for n, out in zip(nodes, outs):
        assert n.returncode == 0, out[-3000:]
    assert losses(tmp_path) == pytest.approx(reference, rel=1e-5)
    log = (tmp_path / "logs" / "rank_0.log").read_text()
    assert "world 4 (dp 2, tp 2, pp 1)" in log and "mesh (dp=2, pp=1, tp=2)" in log


FAKE_SRUN = r"""#!/usr/bin/env bash
# fake srun: log the call, then run the command once per node, here
echo "srun $*" >> "$FAKE_SLURM_LOG"
out=""
while [[ $# -gt 0 && "$1" == --* ]]; do
  case "$1" in --output) out=$2; shift 2;; --output=*) out=${1#--output=}; shift;; *) shift;; esac
done
pids=()
for ((n = 0; n < SLURM_NNODES; n++)); do
  f=${out//%n/$n}; f=${f//%x/$SLURM_JOB_NAME}; f=${f//%j/$SLURM_JOB_ID}
  SLURM_NODEID=$n SLURM_PROCID=$n "$@" > "${f:-/dev/null}" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""
FAKE_SCONTROL = r"""#!/usr/bin/env bash
echo "scontrol $*" >> "$FAKE_SLURM_LOG"
if [ "$1 $2" = "show hostnames" ]; then for ((n = 0; n < SLURM_NNODES; n++)); do echo localhost; done; fi
"""


def test_slurm_sbatch_with_fake_srun(tmp_path: Path, reference: list[float]) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, text in [("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)]:
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    port, log, out = free_port(), tmp_path / "slurm.log", tmp_path / "run"
    e = env(SLURM_JOB_NODELIST="gpu[01-02]", SLURM_NNODES="2", SLURM_JOB_ID="4242", SLURM_JOB_NAME="dist_llm",
            NPROC="1", MASTER_PORT=str(port), FAKE_SLURM_LOG=str(log))  # (one rank a node: two nodes, tp over them)
    e["PATH"] = f"{fake}:{e['PATH']}"
    proc = subprocess.run(["bash", str(REPO / "launch/slurm.sbatch"), str(REPO / "configs/tiny.yaml"), *RUN,
                           "parallel.tp=2", f"train.out_dir={out}"], capture_output=True, text=True, env=e,
                          cwd=tmp_path, timeout=300)
    check(proc, out, reference, ranks=2)
    calls = log.read_text()
    assert "scontrol show hostnames gpu[01-02]" in calls
    srun = next(line for line in calls.splitlines() if line.startswith("srun "))
    for arg in ["--nnodes 2", "--nproc-per-node 1", "--rdzv-backend c10d", f"--rdzv-endpoint localhost:{port}",
                "--rdzv-id 4242", "--max-restarts 3", "-m dist_llm.train", "train.resume=auto"]:
        assert arg in srun, arg
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["dist_llm-4242-node0.out", "dist_llm-4242-node1.out"]


def test_accelerate_launch_multi_cpu(request: pytest.FixtureRequest, tmp_path: Path, reference: list[float]) -> None:
    """README's Accelerate command (its default port, as written: no other test launches Accelerate)."""
    proc = run_as_written(request, *RUN, f"train.out_dir={tmp_path}")
    check(proc, tmp_path, reference, ranks=2)


def test_deepspeed_launcher(tmp_path: Path, reference: list[float]) -> None:
    proc = subprocess.run(["bash", str(REPO / "launch/deepspeed.sh"), str(REPO / "configs/tiny.yaml"), *RUN,
                           f"train.out_dir={tmp_path}"], capture_output=True, text=True,
                          env=env(NPROC="2", MASTER_PORT=str(free_port())), timeout=300)
    check(proc, tmp_path, reference, ranks=2)


def test_single_node_script(request: pytest.FixtureRequest, tmp_path: Path, reference: list[float]) -> None:
    """README's single-node script command: tp=2 (ZeRO-1 at dp=1 is plain)."""
    proc = run_as_written(request, *RUN, f"train.out_dir={tmp_path}")
    check(proc, tmp_path, reference, ranks=2)


def test_3d_config_fits_its_32_ranks() -> None:
    """configs/3d.yaml, the README's 4 nodes x 8 GPUs example: dp 2 x pp 2 x tp 8, and it fits an 80 GiB GPU."""
    proc = subprocess.run([sys.executable, "-m", "dist_llm.cli", "memory", "--config", str(REPO / "configs/3d.yaml"),
                           "--world-size", "32", "--json"], capture_output=True, text=True, env=env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["peak_bytes"] < 80 * 2**30


def test_the_single_node_script_says_a_bad_layout_in_one_line(tmp_path: Path) -> None:
    """The launch scripts start dist_llm.torchrun (torchrun with its failure report cut): under plain torchrun a
    layout the model cannot take was each rank's line plus torchrun's traceback and table of ranks, exit 1 (a
    review of the README's commands)."""
    proc = subprocess.run(["bash", str(REPO / "launch/torchrun_single_node.sh"), str(REPO / "configs/tiny.yaml"),
                           "parallel.tp=3", f"train.out_dir={tmp_path}"], capture_output=True, text=True,
                          env=env(NPROC="2"), timeout=300)
    assert (proc.returncode, proc.stderr.strip().splitlines()) == (
        2, ["dist-llm: error: model.n_head: 4 is not divisible by parallel.tp=3"]), proc.stderr[-3000:]
