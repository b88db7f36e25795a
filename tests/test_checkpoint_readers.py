"""Every reader of a checkpoint, not only resume, checks it against its manifest first: `sample`,
`convert --to-hf/--to-full` and `model.init_from=ckpt:` refuse a damaged file in one line naming it, exit 2 (before,
they loaded a changed shard silently). Under several ranks each checks a share of the files, as resume does; a
file that cannot be read is exit 1. A config.yaml that is not YAML, or not a config, is one line naming it too."""

from __future__ import annotations

import base64
import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

from dist_llm import cli
from dist_llm.config import ConfigError, load_config
from dist_llm.parallel.context import ParallelContext
from dist_llm.train import checksums
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed
from tests.test_checkpoint_security import _checkpoint, _files, _plant, _train_args, saved_run  # noqa: F401

# command -> (the flag its refusal names, argv for (run, saved_run, tmp_path))
READERS: dict[str, tuple[str, Callable[[Path, Path, Path], list[str]]]] = {
    "sample": ("--checkpoint", lambda run, saved, tmp: ["sample", "--checkpoint", str(run), "--max-new-tokens", "2"]),
    "train init_from=ckpt:": ("model.init_from", lambda run, saved, tmp: [
        *_train_args(tmp / "new", saved), f"model.init_from=ckpt:{_checkpoint(run)}"]),
    "convert --to-hf": ("--to-hf", lambda run, saved, tmp: ["convert", "--to-hf", str(run), "--out", str(tmp / "hf")]),
    "convert --to-full": ("--to-full", lambda run, saved, tmp: [
        "convert", "--to-full", str(run), "--out", str(tmp / "full.safetensors")]),
}


@pytest.fixture
def run(saved_run: Path, tmp_path: Path) -> Path:  # noqa: F811
    copy = tmp_path / "run"
    shutil.copytree(saved_run, copy)
    return copy


def _flip_a_byte(file: Path) -> None:
    """One byte changed, the size kept: only the checksum can tell."""
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 1
    file.write_bytes(bytes(data))


def _errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    return code, [line for line in err.splitlines() if line.startswith("dist-llm: error:")]


@pytest.mark.parametrize("command", list(READERS))
def test_every_reader_refuses_a_changed_shard_in_one_line(command: str, run: Path, saved_run: Path,  # noqa: F811
                                                           tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flag, argv = READERS[command]
    shard = _checkpoint(run) / "__0_0.distcp"
    _flip_a_byte(shard)
    code, errors = _errors(argv(run, saved_run, tmp_path), capsys)
    assert (code, errors) == (2, [f"dist-llm: error: {flag}: {shard}: checksum differs from the manifest's"])
    assert not (tmp_path / "hf").exists() and not (tmp_path / "full.safetensors").exists()
    assert not (tmp_path / "new" / "checkpoints").exists()


@pytest.mark.parametrize("command", list(READERS))
def test_a_config_yaml_that_is_not_yaml_is_one_line(command: str, run: Path, saved_run: Path,  # noqa: F811
                                                     tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Vouched for by the manifest, so that the checksum passes and the reader meets it (before: 68 lines of
    yaml's traceback from sample and convert)."""
    flag, argv = READERS[command]
    file = _plant(_checkpoint(run), "config.yaml", b"model: [\n")
    code, errors = _errors(argv(run, saved_run, tmp_path), capsys)
    assert (code, errors) == (2, [f"dist-llm: error: {flag}: {file} is not valid YAML at line 2, column 1: "
                                  "expected the node content, but found '<stream end>'"])


def test_a_config_yaml_that_is_not_a_config_names_the_file(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = _plant(_checkpoint(run), "config.yaml", b"- 1\n")
    code, errors = _errors(READERS["sample"][1](run, run, run), capsys)
    assert (code, errors) == (2, [f"dist-llm: error: --checkpoint: {file}: config: expected a mapping of keys, got [1]"])


def test_a_file_that_cannot_be_read_is_exit_1(run: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """An I/O error says nothing of the checkpoint: not called damaged (exit 2), but the disk's failure (exit 1)."""
    def sha256_fd(fd: int, nbytes: int, stop: object = None) -> str:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(checksums, "_sha256_fd", sha256_fd)
    path = _checkpoint(run)
    code, [error] = _errors(["convert", "--to-full", str(path), "--out", str(run / "full.safetensors")], capsys)
    first = next(iter(checksums.partition(checksums.read_manifest(path), 1)[0]))  # (the largest: checked first)
    assert (code, error) == (1, f"dist-llm: error: --to-full: cannot check {path}: rank 0: {path / first}: "
                                f"{os.strerror(errno.EIO)}")


def _init_from_on_2_ranks(rank: int, world_size: int, out: Path, checkpoint: Path) -> dict[str, Any]:
    """model.init_from=ckpt: built on each of 2 ranks: the files each rank checked; then, a file only rank 1
    checked changed, what each rank raises."""
    import torch.distributed as dist

    from dist_llm.parallel.parallelize import meta_model, parallelize
    from dist_llm.train.init_from import load_initial_weights

    opened: list[str] = []
    real = checksums._open_regular

    def recording(root: Path, name: str) -> tuple[int, int]:
        opened.append(name)
        return real(root, name)

    checksums._open_regular = recording  # type: ignore[assignment]  (this rank's process only)
    cfg = load_config(None, tiny_overrides(out, model__init_from=f"ckpt:{checkpoint}"))
    ctx = ParallelContext.from_config(cfg)
    try:
        parallelize(meta_model(cfg, ctx), cfg, ctx, load=load_initial_weights)
        checked = list(opened)
        victim = [checked[0] if rank == 1 else None]
        dist.broadcast_object_list(victim, src=1)
        if rank == 1:
            _flip_a_byte(checkpoint / victim[0])
        dist.barrier()
        try:
            parallelize(meta_model(cfg, ctx), cfg, ctx, load=load_initial_weights)
            error = None
        except ConfigError as e:
            error = str(e)
        return {"checked": checked, "victim": victim[0], "error": error}
    finally:
        ctx.destroy()


def test_init_from_on_several_ranks_checks_a_share_on_each(run: Path, tmp_path: Path) -> None:
    checkpoint = _checkpoint(run)
    ranks = run_distributed(_init_from_on_2_ranks, 2, tmp_path / "new", checkpoint, init_group=False, timeout=120)
    manifest = set(json.loads((checkpoint / "manifest.json").read_text())["files"])
    shares = [set(r["checked"]) for r in ranks]
    assert all(len(r["checked"]) == len(set(r["checked"])) for r in ranks)  # each file once
    assert shares[0] and shares[1] and not shares[0] & shares[1] and shares[0] | shares[1] == manifest
    victim = checkpoint / ranks[1]["victim"]
    assert ranks[0]["error"] == ranks[1]["error"] == (f"rank 0: model.init_from: {victim}: checksum differs from "
                                                      "the manifest's")


def test_the_check_timeout_covers_the_largest_share(tmp_path: Path) -> None:
    """`timeout_s` plus the largest share (an even share and one file: `checksums.partition`) at the slowest rate;
    at least the floor, also for a manifest that lists nothing or cannot be read."""
    from dist_llm.train import checkpoint as ckpt

    floor = ckpt.FLOOR_BYTES / ckpt.SLOWEST_BYTES_PER_S
    assert ckpt._check_timeout_s(tmp_path, 10.0, 4) == 10.0 + floor  # no manifest
    sha = "0" * 64
    (tmp_path / "manifest.json").write_text(json.dumps({"files": {}}))
    assert ckpt._check_timeout_s(tmp_path, 10.0, 4) == 10.0 + floor
    files = {f"__{i}_0.distcp": {"bytes": 4_000_000_000 if i else 2_000_000_000, "sha256": sha} for i in range(4)}
    (tmp_path / "manifest.json").write_text(json.dumps({"files": files}))
    assert ckpt._check_timeout_s(tmp_path, 10.0, 4) == 10.0 + (14e9 / 4 + 4e9) / ckpt.SLOWEST_BYTES_PER_S


def test_the_check_stops_the_hashes_in_flight_once_it_knows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files are hashed several at a time; once the answer is known (the first file in order is cut short) a hash
    in flight stops at its next chunk instead of reading its whole file (minutes for a large shard). The second
    file's hash here would take 60 s unless told to stop."""
    import hashlib
    import time

    (tmp_path / "a").write_bytes(b"x" * 10)
    (tmp_path / "b").write_bytes(b"y" * 10)
    files = {"a": {"bytes": 11, "sha256": hashlib.sha256(b"x" * 11).hexdigest()},
             "b": {"bytes": 10, "sha256": hashlib.sha256(b"y" * 10).hexdigest()}}
    real = checksums._sha256_fd

    def slow(fd: int, nbytes: int, stop: Any = None) -> str:
        if stop is not None and stop.wait(60):
            return ""
        return real(fd, nbytes, stop)

    monkeypatch.setattr(checksums, "_sha256_fd", slow)
    monkeypatch.setattr(checksums, "HASH_THREADS", 2)
    start = time.monotonic()
    assert checksums.check_files(tmp_path, files) == f"{tmp_path / 'a'}: 10 bytes, the manifest says 11"
    assert time.monotonic() - start < 30



@pytest.mark.parametrize("command", list(READERS))
def test_a_config_yaml_nested_past_the_recursion_limit_is_one_line(command: str, run: Path, saved_run: Path,  # noqa: F811
                                                                   tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """yaml's composer recurses once a level: 100,000 brackets were a RecursionError traceback (a review)."""
    flag, argv = READERS[command]
    file = _plant(_checkpoint(run), "config.yaml", b"[" * 100_000 + b"]" * 100_000)
    code, errors = _errors(argv(run, saved_run, tmp_path), capsys)
    assert (code, errors) == (2, [f"dist-llm: error: {flag}: {file} is nested too deeply to be a config"])


def _edit_json(name: str, edit: Callable[[Any], Any]) -> Callable[[Path], bytes]:
    def make(checkpoint: Path) -> bytes:
        return json.dumps(edit(json.loads((checkpoint / name).read_text()))).encode()
    return make


def _without(key: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda d: {k: v for k, v in d.items() if k != key}


# a small file of the checkpoint, rewritten and vouched for by the manifest -> the line resume must say about it
HOSTILE_STATE: dict[str, tuple[str, Callable[[Path], bytes], str]] = {
    "state a list": ("train_state.json", lambda c: b"[]", "train_state.json: a JSON list, not an object"),
    "step a string": ("train_state.json", _edit_json("train_state.json", lambda d: {**d, "step": "2"}),
                      "train_state.json: step is '2', not a count"),
    "step negative": ("train_state.json", _edit_json("train_state.json", lambda d: {**d, "step": -1}),
                      "train_state.json: step is -1, not a count"),
    "no sampler": ("train_state.json", _edit_json("train_state.json", _without("sampler")),
                   "train_state.json: sampler and scaler must be objects"),
    "sampler seed a float": ("train_state.json", _edit_json(
        "train_state.json", lambda d: {**d, "sampler": {**d["sampler"], "seed": 1.5}}),
        "train_state.json: sampler.seed is 1.5, not a count"),
    "scale zero": ("train_state.json", _edit_json(
        "train_state.json", lambda d: {**d, "scaler": {**d["scaler"], "scale": 0}}),
        "train_state.json: scaler.scale is 0, not a positive float32 number"),
    "another stream": ("train_state.json", _edit_json(
        "train_state.json", lambda d: {**d, "sampler": {**d["sampler"], "stream": 7}}),
        "train_state.json: sampler state is for stream 7, this sampler draws stream 0"),
    "nested": ("train_state.json", lambda c: b"[" * 100_000 + b"]" * 100_000,
               "train_state.json: not a train state (RecursionError: maximum recursion depth exceeded while "
               "decoding a JSON array from a unicode string)"),
    "scale enabled, missing": ("train_state.json", _edit_json(
        "train_state.json", lambda d: {**d, "scaler": {"enabled": True}}),
        "train_state.json: scaler.scale is missing, and the scaler is enabled"),
    "scale past float32": ("train_state.json", _edit_json(
        "train_state.json", lambda d: {**d, "scaler": {**d["scaler"], "scale": 1e300}}),
        "train_state.json: scaler.scale is 1e+300, not a positive float32 number"),
    "count past int64": ("train_state.json", _edit_json(
        "train_state.json", lambda d: {**d, "scaler": {**d["scaler"], "good_steps": 2**63}}),
        f"train_state.json: scaler.good_steps is {2**63}, not a count"),
    "sampler behind": ("train_state.json", _edit_json(
        "train_state.json", lambda d: {**d, "sampler": {**d["sampler"], "step": 1}}),
        "train_state.json: sampler.step is 1, step is 2: they are saved alike"),
    "rng not a generator's": ("rng/rank_00000.json", lambda c: json.dumps(
        {"cpu": base64.b64encode(b"\xff" * 5056).decode()}).encode(),
        "rng/rank_00000.json: not a generator state (Invalid mt19937 state)"),
    "rng of 3 bytes": ("rng/rank_00000.json", lambda c: b'{"cpu": "AAAA"}',
                       "rng/rank_00000.json: its cpu generator state is 3 bytes, this torch's holds 5056 bytes"),
    "rng a list": ("rng/rank_00000.json", lambda c: b"[1]",
                   "rng/rank_00000.json: its cpu generator state is missing, this torch's holds 5056 bytes"),
    "rng not base64": ("rng/rank_00000.json", lambda c: b'{"cpu": "#"}',
                       "rng/rank_00000.json: its cpu generator state is missing, this torch's holds 5056 bytes"),
}


@pytest.mark.parametrize("case", list(HOSTILE_STATE))
def test_a_hostile_train_state_or_rng_file_is_one_line_and_frees_the_run(case: str, run: Path, saved_run: Path,  # noqa: F811
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """train_state.json and the RNG files are read after the tensors: a file of the wrong shape (vouched for by a
    rewritten manifest) was a traceback from inside the resume (TypeError, KeyError, torch's RuntimeError), and a
    string step left run.lock behind. 5056 bytes: the size of torch's CPU (Mersenne Twister) generator state,
    624 32-bit words with their offsets and the normal-distribution cache."""
    name, make, message = HOSTILE_STATE[case]
    checkpoint = _checkpoint(run)
    _plant(checkpoint, name, make(checkpoint))
    before = _files(run / "checkpoints")
    code, errors = _errors(_train_args(run, saved_run), capsys)
    said = "train.resume: " if case == "another stream" else ""  # (the sampler's own check, named by resume)
    assert (code, errors) == (2, [f"dist-llm: error: {said}{checkpoint / name}{message.removeprefix(name)}"])
    assert not (run / "run.lock").exists()
    assert _files(run / "checkpoints") == before  # nothing moved or written
