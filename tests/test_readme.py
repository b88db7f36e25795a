"""Every command in README.md's ```bash blocks runs as written (issue 18, item 10), so the README cannot drift.

Each runs in a scratch folder that holds the checkout's configs/, launch/ and scripts/ and a `.venv` that is the
interpreter running the tests (CI's .venv): `dist-llm`, `torchrun`, `accelerate` and `python` are that venv's, as
after `source .venv/bin/activate`. A command that trains gets a few overrides appended (2 steps, a short block,
its own `train.out_dir`), nothing else changes; the `make` commands are read with `make -n` and the recipe
`make train` would run is run. A command that cannot run here is listed in NOT_RUN with the reason, one that another
test runs as written (its overrides appended) and checks further in RUN_ELSEWHERE, and both lists must match the
README. `dist-llm` commands that do not train run in one process (`dist_llm.cli.main`, each argv
as written: a Python start costs seconds here), after the default run in the same folder, since some read it.
Each job is a test case of its own, so that pytest-xdist spreads them over its workers."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from dist_llm.config import ConfigError
from tests.conftest import REPO

README = (REPO / "README.md").read_text()
DIST_LLM = ("dist-llm", ".venv/bin/dist-llm")

#: what cannot run on this machine, with the reason; each must still be a README command
NOT_RUN: dict[str, str] = {
    "NNODES=4 RDZV_ENDPOINT=node0:29500 launch/torchrun_multi_node.sh configs/3d.yaml":
        "4 hosts (node0...); tests/test_launch.py runs the script as two nodes on 127.0.0.1",
    "NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 launch/torchrun_multi_node.sh configs/3d.yaml":
        "4 hosts (node0...); tests/test_launch.py runs the script as two nodes on 127.0.0.1",
    "sbatch --nodes=4 launch/slurm.sbatch configs/3d.yaml":
        "a SLURM cluster; tests/test_launch.py runs the script with a stand-in srun",
    "HOSTFILE=hostfile launch/deepspeed.sh configs/tiny.yaml parallel.backend=deepspeed "
    "parallel.deepspeed_config=ds_config.json":
        "a hostfile of several hosts and a ds_config.json the user writes; tests/test_launch.py runs the script",
    "dist-llm convert --from-hf ~/models/gpt2 --out ckpt/gpt2":
        "GPT-2 downloaded by the user (no network here); tests/test_hf.py converts a GPT-2 made offline",
    "dist-llm train --config configs/tiny.yaml model.init_from=hf:$HOME/models/gpt2 train.out_dir=runs/gpt2-lora "
    "data.source=sft.jsonl peft.method=lora peft.rank=8 peft.alpha=16 peft.targets='[qkv, mlp_up]'":
        "GPT-2 downloaded and sft.jsonl written by the user; tests/test_finetune.py trains LoRA on a local model",
    'dist-llm sample --checkpoint runs/gpt2-lora --prompt "Q: ..."': "the run of the GPT-2 command above",
    "dist-llm convert --to-hf runs/gpt2-lora --out hf/tuned": "the run of the GPT-2 command above",
}
#: README commands that another test runs as written, its own overrides appended, and checks further (the losses
#: of one process): run there, not here as well (each a multi-process run of many seconds of the suite)
RUN_ELSEWHERE: dict[str, str] = {
    "dist-llm train --config configs/tiny.yaml --nproc-per-node 2 parallel.zero_stage=2 train.micro_batch_size=16":
        "tests/test_cli.py::test_nproc_per_node_relaunches_under_torchrun",
    "NPROC=2 launch/torchrun_single_node.sh configs/tiny.yaml parallel.tp=2 parallel.zero_stage=1":
        "tests/test_launch.py::test_single_node_script",
    "ACCELERATE_USE_CPU=1 accelerate launch --config_file launch/accelerate.yaml --multi_gpu --num_processes 2 "
    "-m dist_llm.train --config configs/tiny.yaml train.micro_batch_size=16":
        "tests/test_launch.py::test_accelerate_launch_multi_cpu",
}
#: the run that later commands read (sample, convert, report runs/tiny) keeps the config's out_dir
MAKES_RUNS_TINY = "dist-llm train --config configs/tiny.yaml"
#: appended to every command that trains (later overrides win), and those appended only when the command
#: does not set the key itself
TRAIN_FORCED = ["train.max_steps=2", "train.eval_steps=1"]
TRAIN_DEFAULTS = {"model.block_size": "32"}


@dataclass(frozen=True)
class Command:
    line: int  # where it starts in README.md
    text: str  # as written: continuation lines joined, the comment dropped

    def __str__(self) -> str:
        return f"README.md:{self.line}: {self.text}"


def readme_commands(md: str = README) -> list[Command]:
    """The commands of every ```bash block, in order."""
    commands: list[Command] = []
    lines = md.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```bash":
            i += 1
            continue
        i += 1
        while lines[i].strip() != "```":
            start, text = i + 1, lines[i]
            while text.rstrip().endswith("\\"):
                i += 1
                text = text.rstrip()[:-1].rstrip() + " " + lines[i].strip()
            i += 1
            code = re.split(r"(?:^|\s+)#", text, maxsplit=1)[0].strip()
            if code:
                # no '#' inside quotes here: cutting at it must leave what bash would run
                assert shlex.split(code) == shlex.split(text, comments=True), text
                commands.append(Command(start, " ".join(code.split())))
        i += 1
    return commands


def readme_command(request: pytest.FixtureRequest) -> str:
    """The README command RUN_ELSEWHERE hands to the requesting test, checked to be in README.md as written and
    valid as written at its world size (the test appends its own overrides, which could hide a bad value)."""
    test = f"{request.node.path.relative_to(REPO)}::{request.node.originalname}"
    texts = [text for text, name in RUN_ELSEWHERE.items() if name == test]
    assert len(texts) == 1, f"RUN_ELSEWHERE names {test} for {len(texts)} commands, not 1"
    [text] = texts
    assert text in {c.text for c in readme_commands()}, f"README.md no longer shows {text!r}"
    check_as_written(text)
    return text


def run_as_written(request: pytest.FixtureRequest, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The requesting test's README command (readme_command) run by bash from the checkout as written, in an
    activated .venv's environment, `overrides` appended."""
    return subprocess.run(["bash", "-c", f"{readme_command(request)} {shlex.join(overrides)}"], capture_output=True,
                          text=True, cwd=REPO, env=activated(), timeout=timeout)


def check_as_written(text: str) -> None:
    """A training command's config (its --config and key=value overrides) loads, and its layout fits the world
    size it starts (--nproc-per-node, --num_processes or NPROC=): what the run would refuse at its start."""
    from dist_llm.config import load_config
    from dist_llm.parallel.context import resolve_degrees

    tokens = shlex.split(text)
    config = tokens[tokens.index("--config") + 1] if "--config" in tokens else next(
        t for t in tokens if t.startswith("configs/"))
    overrides = [t for t in tokens if re.fullmatch(r"[a-z_][a-z0-9_]*(\.[a-z0-9_]+)+=.*", t)]
    flags = ("--nproc-per-node", "--nproc_per_node", "--num_processes", "--num-processes")
    sizes = [tokens[i + 1] for i, t in enumerate(tokens[:-1]) if t in flags]
    sizes += [t.split("=", 1)[1] for t in tokens if t.split("=", 1)[0] in (*flags, "NPROC") and "=" in t]
    assert len(sizes) == 1, f"{text!r}: no world size found (--nproc-per-node N, --num_processes N or NPROC=N)"
    world = int(sizes[0])
    cfg = load_config(REPO / config, overrides)
    p = cfg.parallel
    resolve_degrees(world, p.dp, p.tp, p.pp, global_batch_size=cfg.train.global_batch_size,
                    micro_batch_size=cfg.train.micro_batch_size, cp=p.cp)


def program(cmd: Command) -> tuple[list[str], int]:
    """The tokens and the index of the program (after VAR=value assignments)."""
    tokens = shlex.split(cmd.text)
    k = 0
    while k < len(tokens) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[k]):
        k += 1
    return tokens, k


def kind(cmd: Command) -> str:
    """make | train (runs with the overrides) | cli (a dist-llm command that does not train) | shell."""
    tokens, k = program(cmd)
    if tokens[k] == "make":
        return "make"
    # only a plain argv runs in the shared process: no variables, pipes, redirections or expansions
    plain = k == 0 and tokens[0] in DIST_LLM and not re.search(r"[|&;<>$`~*?]", cmd.text)
    if {"--help", "--list-keys"} & set(tokens):
        return "cli" if plain else "shell"
    if "dist_llm.train" in tokens or tokens[k].startswith("launch/") or tokens[k:k + 2] in (
            [d, "train"] for d in DIST_LLM):
        return "train"
    return "cli" if plain else "shell"


def with_overrides(text: str, index: int) -> str:
    """A training command as run here: the README's text, then the small overrides."""
    normal = text.replace(".venv/bin/dist-llm", "dist-llm")
    keys = {t.split("=", 1)[0] for t in shlex.split(normal) if "=" in t}
    extra = list(TRAIN_FORCED)
    extra += [f"{k}={v}" for k, v in TRAIN_DEFAULTS.items() if k not in keys]
    if normal != MAKES_RUNS_TINY:  # (the first run keeps its out_dir and its loss.png, what a new user looks at)
        if "train.out_dir" not in keys:
            extra.append(f"train.out_dir=runs/readme-{index}")
        if "train.plot" not in keys:  # (matplotlib: a second a run; the plot is the first run's to draw)
            extra.append("train.plot=false")
    return f"{normal} {' '.join(extra)}"


# one process runs a stretch of non-training dist-llm commands; a marker line after each tells them apart
_MARK = "@@readme-exit"
_RUNNER = f"""
import json, sys
from dist_llm.cli import main
for argv in json.loads(sys.argv[1]):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    for stream in (sys.stdout, sys.stderr):
        print("\\n{_MARK}", rc, file=stream, flush=True)
"""


def sandbox(tmp: Path) -> dict[str, str]:
    """A user's checkout as far as the commands see it; the environment of an activated .venv."""
    for name in ("configs", "launch", "scripts"):
        (tmp / name).symlink_to(REPO / name)
    (tmp / ".venv").symlink_to(sys.prefix)
    return activated()


def activated() -> dict[str, str]:
    """The environment after `source .venv/bin/activate`: the venv's programs (and python, which the launch
    scripts run by default) first on the PATH."""
    bin_dir = str(Path(sys.prefix) / "bin")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "VIRTUAL_ENV": sys.prefix,
           "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHON", None)  # (a launch script's override of that default)
    return env


def make_recipe(cmd: Command) -> list[str]:
    """What `make` would run for the README's make command (dry run, every rule as if out of date)."""
    tokens, k = program(cmd)
    # as a user's shell runs it: not as a sub-make of `make test` (CI), which would print its directory and
    # pass its own flags and variables down
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    proc = subprocess.run(["make", "--no-print-directory", "-n", "-B", *tokens[k + 1:]], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 0, f"{cmd}: make -n: {proc.stderr}"
    return [line.strip() for line in proc.stdout.splitlines() if line.strip()]


def check_make(cmd: Command, recipe: list[str]) -> str | None:
    """None when the target does what the README says; for `make train` the command it runs."""
    joined = "\n".join(recipe)
    assert "-m venv .venv" in joined and re.search(r"pip install \S* ?-e \.$", joined, re.M), (cmd, joined)
    target = program(cmd)[0][program(cmd)[1] + 1:]
    if "test" in target:
        assert '-e ".[test]"' in joined and recipe[-1].startswith(".venv/bin/python -m pytest "), (cmd, joined)
        return None
    if "train" in target:
        assert recipe[-1].startswith(".venv/bin/dist-llm train --config "), (cmd, joined)
        assert '".[test]"' not in joined, f"{cmd}: training installs the test extra"
        return recipe[-1]
    assert '".[test]"' not in joined, f"{cmd}: the set-up installs the test extra"
    return None


@dataclass
class Job:
    commands: list[Command]  # one, or a stretch of dist-llm commands run in one process
    text: str = ""  # what bash runs (shell jobs)


def plan() -> list[Job]:
    """The README's commands as jobs: the default run first (later commands read runs/tiny), then the rest in
    README order; every dist-llm command that does not train in one process, a training command that is
    another's text (make train is the default run) once."""
    jobs: list[Job] = []
    cli = Job([])
    seen: set[str] = set()
    for index, cmd in enumerate(readme_commands()):
        if cmd.text in NOT_RUN or cmd.text in RUN_ELSEWHERE:
            continue
        k = kind(cmd)
        if k == "cli":
            cli.commands.append(cmd)
            continue
        if k == "make":
            runs = check_make(cmd, make_recipe(cmd))
            if runs is None:
                continue
            text = with_overrides(runs, index)
        else:
            text = with_overrides(cmd.text, index) if k == "train" else cmd.text
        if text not in seen:
            seen.add(text)
            jobs.append(Job([cmd], text))
    first = next(i for i, job in enumerate(jobs) if job.text == with_overrides(MAKES_RUNS_TINY, 0))
    return [jobs.pop(first), cli, *jobs]


def run_job(job: Job, tmp: Path, env: dict[str, str]) -> list[str]:
    """The failures of one job, each with its output."""
    if job.text:
        proc = subprocess.run(["bash", "-c", job.text], cwd=tmp, env=env, capture_output=True, text=True,
                              timeout=300, check=False)
        if proc.returncode == 0:
            return []
        return [f"{job.commands[0]}\n  ran: {job.text}\n  exit {proc.returncode}\n{proc.stdout[-1500:]}"
                f"{proc.stderr[-3000:]}"]
    argvs = [shlex.split(c.text)[1:] for c in job.commands]
    proc = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(argvs)], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    outs, errs = proc.stdout.split(_MARK), proc.stderr.split(_MARK)
    failures = []
    for n, cmd in enumerate(job.commands):
        rc = outs[n + 1].split(None, 1)[0] if n + 1 < len(outs) else f"none (the process exited {proc.returncode})"
        if rc != "0":
            failures.append(f"{cmd}\n  exit {rc}\n{outs[n][-1500:]}{errs[n][-3000:] if n < len(errs) else ''}")
    return failures


def _job_ids() -> list[str]:
    """One test id per job, fixed at collection (every xdist worker must collect the same ids). A README or
    Makefile that breaks the plan gives one case, "plan", which fails with plan()'s own error."""
    try:
        jobs = plan()
    except Exception:  # noqa: BLE001 - reported by the test, not as a collection error
        return ["plan"]
    ids = ["default-run-then-cli"]
    for job in jobs[2:]:
        tokens, k = program(job.commands[0])
        ids.append(f"L{job.commands[0].line}-{tokens[k].rsplit('/', 1)[-1]}")
    return ids


JOB_IDS = _job_ids()


# each command has its own 300 s; this bounds a case (the first runs two jobs) under a loaded machine
@pytest.mark.timeout(700)
@pytest.mark.parametrize("job_id", JOB_IDS)
def test_every_readme_command_runs_as_written(tmp_path: Path, job_id: str) -> None:
    jobs = plan()
    assert job_id != "plan", "plan() passed here but failed at collection"
    env = sandbox(tmp_path)
    index = JOB_IDS.index(job_id)
    if index == 0:  # the default run, then the dist-llm commands that read it (sample, convert, report runs/tiny)
        failures = run_job(jobs[0], tmp_path, env)
        failures = failures or run_job(jobs[1], tmp_path, env)
    else:
        failures = run_job(jobs[index + 1], tmp_path, env)
    assert not failures, f"{len(failures)} README command(s) failed:\n\n" + "\n\n".join(failures)
    if index == 0:  # the commands that read the default run found it, and the export loads its tokenizer files
        assert (tmp_path / "runs/tiny/report.md").is_file()
        assert (tmp_path / "hf/tiny/tokenizer.json").is_file()


def test_the_commands_not_run_are_still_in_the_readme() -> None:
    """A command left out here that the README no longer shows would hide a new one; each has its reason."""
    texts = {c.text for c in readme_commands()}
    assert sorted(set(NOT_RUN) - texts) == []
    assert sorted(set(RUN_ELSEWHERE) - texts) == []
    for text, test in RUN_ELSEWHERE.items():  # the test named runs it (run_as_written knows it by the test's id)
        path, name = test.split("::")
        source = inspect.getsource(getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), name))
        assert "run_as_written(request" in source, f"{test} does not run {text!r}"
        check_as_written(text)
    with pytest.raises(ConfigError, match=r"train.global_batch_size: 32 is not divisible by"):  # the check can fail
        check_as_written("dist-llm train --config configs/tiny.yaml --nproc-per-node 2 train.micro_batch_size=32")
    assert MAKES_RUNS_TINY in texts
    for cmd in readme_commands():
        # the files a command names exist in the checkout, run or not
        for token in program(cmd)[0]:
            path = token.split("=", 1)[-1]
            if re.match(r"(configs|launch|scripts)/", path):
                assert (REPO / path).exists(), f"{cmd}: {path} does not exist"


def test_readme_commands_are_parsed_as_bash_would() -> None:
    md = "\n".join(["text", "```bash", "# a comment", "make venv   # set-up", "",
                    "A=1 dist-llm train --config c.yaml \\", "    x.y='[a, b]'   # trains", "```",
                    "```", "not bash", "```", "```bash", 'dist-llm sample --prompt "def "', "```"])
    got = readme_commands(md)
    assert got == [Command(4, "make venv"), Command(6, "A=1 dist-llm train --config c.yaml x.y='[a, b]'"),
                   Command(13, 'dist-llm sample --prompt "def "')]
    assert [kind(c) for c in got] == ["make", "train", "cli"]
    assert kind(Command(1, ".venv/bin/dist-llm train --help")) == "cli"
    assert kind(Command(1, "torchrun --nproc-per-node 2 -m dist_llm.train --config c.yaml")) == "train"
    assert kind(Command(1, "NPROC=2 launch/torchrun_single_node.sh c.yaml")) == "train"
    assert kind(Command(1, "source .venv/bin/activate")) == "shell"
    assert kind(Command(1, "dist-llm train --list-keys | grep optim")) == "shell"
    assert kind(Command(1, "dist-llm memory --config c.yaml --json > m.json")) == "shell"
    assert with_overrides("dist-llm train --config c.yaml model.block_size=64", 7) == (
        "dist-llm train --config c.yaml model.block_size=64 train.max_steps=2 train.eval_steps=1 "
        "train.out_dir=runs/readme-7 train.plot=false")
    assert with_overrides(".venv/bin/dist-llm train --config configs/tiny.yaml", 0) == (
        f"{MAKES_RUNS_TINY} train.max_steps=2 train.eval_steps=1 model.block_size=32")
