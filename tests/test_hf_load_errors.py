"""A Hugging Face directory damaged where only one rank reads: every rank raises the same one line (naming the
rank, file and tensor), none waits in a collective for the one that failed."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_llm.config import ConfigError, load_config
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.parallelize import meta_model, parallelize
from dist_llm.train.init_from import load_initial_weights, resolve_architecture
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed
from tests.test_hf_slices import sharded_dir  # noqa: F401


def _build_pp(rank: int, world_size: int, out_dir: Path, hf_dir: Path) -> dict[str, Any]:
    cfg = resolve_architecture(load_config(None, tiny_overrides(out_dir, parallel__pp=world_size,
                                                                model__init_from=f"hf:{hf_dir}")))
    ctx = ParallelContext.from_config(cfg)
    try:
        start = time.monotonic()
        try:
            parallelize(meta_model(cfg, ctx), cfg, ctx, load=load_initial_weights)
        except ConfigError as e:
            return {"error": str(e), "seconds": time.monotonic() - start}
        return {"error": None, "seconds": time.monotonic() - start}
    finally:
        ctx.destroy()


def test_a_shard_truncated_where_only_rank_1_reads_fails_on_every_rank(
        tmp_path: Path, sharded_dir: tuple[Path, torch.Tensor]) -> None:  # noqa: F811
    """pp=2: the last stage alone reads the shard holding the head. Truncated, its header still parses (every
    rank checks headers on opening), but rank 1 finds the damage when it reads: rank 0, which read its blocks
    without a fault, must raise the same line rather than go on into training's first collective alone."""
    hf_dir = tmp_path / "hf"
    shutil.copytree(sharded_dir[0], hf_dir)
    weight_map: dict[str, str] = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    damaged = hf_dir / weight_map["lm_head.weight"]
    held = sorted(k for k, f in weight_map.items() if f == damaged.name)
    # nothing that stage 0 (embedding, blocks 0 and 1) reads is in that file
    assert not any(k.startswith(("model.embed_tokens.", "model.layers.0.", "model.layers.1.")) for k in held), held
    with open(damaged, "r+b") as f:
        f.truncate(damaged.stat().st_size - 1000)
    ranks = run_distributed(_build_pp, 2, tmp_path / "run", hf_dir, init_group=False, timeout=60)
    error = ranks[0]["error"]
    assert error is not None and ranks[1]["error"] == error, ranks
    assert len(error.splitlines()) == 1
    tensors = "|".join(re.escape(k) for k in held)
    assert re.match(rf"^rank 1: {re.escape(str(damaged))}: cannot read weights for tensor '({tensors})' \(.+\)$",
                    error), error


def test_an_unexpected_failure_keeps_its_traceback_in_the_rank_log(tmp_path: Path) -> None:
    """A failure that is not a named bad input (a bug) is still one line on every rank, and its traceback goes to
    the rank's log file (DEBUG there, not on the console), so that a bug report has it."""
    import logging

    from dist_llm.cli import setup_logging
    from dist_llm.train.init_from import _one_line

    root = logging.getLogger("dist_llm")
    saved = root.handlers[:], root.level, root.propagate
    setup_logging(0, tmp_path / "logs")
    try:
        try:
            raise KeyError("blocks.0.attn.qkv.weight")
        except KeyError as e:
            line = _one_line(e, ParallelContext.from_config(load_config(None, tiny_overrides(tmp_path))))
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers[:], root.level, root.propagate = saved[0], saved[1], saved[2]
    assert line == "model.init_from: KeyError: 'blocks.0.attn.qkv.weight'"
    text = (tmp_path / "logs" / "rank_0.log").read_text()
    assert "Traceback (most recent call last)" in text and "raise KeyError" in text


@pytest.mark.parametrize("fault", ["io-error", "truncated"])
def test_an_io_error_exits_1_a_damaged_file_exits_2(tmp_path: Path, corpus_file: Path, fault: str,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI's codes: 2 says the input is bad (a file cut short), 1 that something else failed (here the
    disk: EIO from the read of a sound file, which before came out as 2, as if the file were at fault).
    Either way one line naming the file."""
    import errno
    import os

    from dist_llm import cli
    from dist_llm import safetensors_read
    from tests.test_hf import hf_llama, save

    torch.manual_seed(5)
    hf = save(hf_llama(), tmp_path / "hf")
    file = hf / "model.safetensors"
    if fault == "truncated":
        with open(file, "r+b") as f:
            f.truncate(file.stat().st_size - 1000)
    else:
        def preadv(fd: int, buffers: Any, offset: int) -> int:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(safetensors_read.os, "preadv", preadv)
    capsys.readouterr()
    code = cli.main(["train", f"model.init_from=hf:{hf}", f"data.source={corpus_file}", f"train.out_dir={tmp_path / 'run'}",
                     "train.max_steps=1", "train.device=cpu", "train.micro_batch_size=2", "train.global_batch_size=2",
                     "model.block_size=16", "train.eval_interval=0"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("dist-llm: error:")]
    assert "Traceback" not in err and len(errors) == 1, err[-3000:]
    if fault == "truncated":
        assert code == 2, err[-3000:]
        assert errors[0].startswith(f"dist-llm: error: {file}: cannot read weights for tensor "), errors
    else:
        assert code == 1, err[-3000:]
        assert re.match(rf"^dist-llm: error: model.init_from: {re.escape(str(file))}: cannot read tensor '[^']+': "
                        rf"{os.strerror(errno.EIO)}$", errors[0]), errors


# -- a NaN or an infinity in the weights ------------------------------------------------------------------------
def _poison(path: Path, pattern: str, row: int, value: float) -> tuple[Path, str]:
    """Set one value in row `row` of the first weight matching `pattern` in the directory's weight file; (the file,
    the tensor's name in it)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    file = next(f for f in (path / "model.safetensors", path / "pytorch_model.bin") if f.is_file())
    tensors = load_file(str(file)) if file.suffix == ".safetensors" else torch.load(file, weights_only=True)
    key = next(k for k in sorted(tensors) if re.search(pattern, k))
    tensors[key] = tensors[key].clone()
    tensors[key][row].view(-1)[-1] = value  # (the row's last value: a read that stops short of it misses it)
    if file.suffix == ".safetensors":
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata()
        save_file(tensors, str(file), metadata=metadata)
    else:
        torch.save(tensors, file)
    return file, key


def _hf(kind: str, path: Path) -> Path:
    from tests.test_hf import hf_gpt2, hf_llama

    if kind == "mixtral":
        from tests.test_hf_moe import hf_moe

        hf_moe("mixtral").save_pretrained(path)
    else:
        (hf_gpt2() if kind == "gpt2" else hf_llama()).save_pretrained(path, safe_serialization=kind != "llama-bin")
    return path


@pytest.mark.parametrize("kind, pattern, row, value", [
    ("llama", r"layers\.0\.mlp\.up_proj\.weight", 3, float("nan")),  # read straight into the destination
    ("llama", r"norm\.weight", 17, float("inf")),  # a vector
    ("gpt2", r"h\.1\.attn\.c_attn\.weight", 5, float("-inf")),  # Conv1D, transposed block by block
    ("llama-bin", r"layers\.1\.self_attn\.k_proj\.weight", 2, float("nan")),  # pytorch_model.bin, mapped
    ("mixtral", r"experts\.1\.w2\.weight", 4, float("nan")),  # one expert's weight
], ids=["llama-nan", "llama-norm-inf", "gpt2-conv1d", "pytorch-model-bin", "mixtral-expert"])
def test_a_nan_or_inf_weight_is_refused_naming_the_file_and_tensor(kind: str, pattern: str, row: int, value: float,
                                                                   tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Before, it was read as any value, and training from it skipped every step: each block is checked as it is
    read (`convert --from-hf` reads every tensor)."""
    from dist_llm import cli

    torch.manual_seed(6)
    file, key = _poison(_hf(kind, tmp_path / "hf"), pattern, row, value)
    capsys.readouterr()
    assert cli.main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"dist-llm: error: {file}: tensor {key!r} holds a NaN or infinite value (row {row})"]
    assert not (tmp_path / "out").exists()


def test_a_nan_weight_stops_init_from_hf_on_every_rank(tmp_path: Path) -> None:
    """pp=2: the stage that reads the poisoned block finds it; both ranks raise the same line."""
    torch.manual_seed(6)
    file, key = _poison(_hf("llama", tmp_path / "hf"), r"layers\.1\.mlp\.down_proj\.weight", 0, float("nan"))
    ranks = run_distributed(_build_pp, 2, tmp_path / "run", tmp_path / "hf", init_group=False, timeout=60)
    assert ranks[0]["error"] == ranks[1]["error"] == f"rank 1: {file}: tensor {key!r} holds a NaN or infinite value (row 0)"


# -- a sharded directory's index ---------------------------------------------------------------------------------
def _index(hf: Path) -> dict[str, str]:
    return json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]


def _set_index(hf: Path, weight_map: dict[str, str]) -> None:
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    (hf / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map}))


def _add_tensor(file: Path, key: str, value: torch.Tensor) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(file))
    tensors[key] = value
    save_file(tensors, str(file), metadata={"format": "pt"})


def _stale_copy(hf: Path) -> tuple[Path, str]:
    """A stale copy of the embedding (all 7s) in a shard other than the index names: before, the last read won."""
    from tests.test_hf import VOCAB

    embed = "model.embed_tokens.weight"
    shards = sorted(set(_index(hf).values()))
    last = hf / next(s for s in reversed(shards) if s != _index(hf)[embed])
    _add_tensor(last, embed, torch.full((VOCAB, 64), 7.0))
    return last, f"holds tensor {embed!r}, but model.safetensors.index.json places it in {_index(hf)[embed]}"


def _moved_in_the_index(hf: Path) -> tuple[Path, str]:
    """The index names another shard for a tensor than the one holding it."""
    weight_map = _index(hf)
    key = "model.norm.weight"
    other = next(s for s in sorted(set(weight_map.values())) if s != weight_map[key])
    _set_index(hf, {**weight_map, key: other})
    return hf / weight_map[key], f"holds tensor {key!r}, but model.safetensors.index.json places it in {other}"


@pytest.mark.parametrize("damage", [_stale_copy, _moved_in_the_index],
                         ids=["a-copy-in-another-shard", "the-index-names-another-shard"])
def test_a_tensor_where_the_index_does_not_place_it_is_refused(damage: Any, tmp_path: Path,
                                                               sharded_dir: tuple[Path, torch.Tensor],  # noqa: F811
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The index's weight_map says which shard holds each tensor: a tensor elsewhere (a stale copy: which one is
    meant?) is one line naming the file, exit 2 (before: the shard read last won, in silence)."""
    from dist_llm import cli

    hf = tmp_path / "hf"
    shutil.copytree(sharded_dir[0], hf)
    file, says = damage(hf)
    capsys.readouterr()
    assert cli.main(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"dist-llm: error: {file}: {says}"]


def test_a_tensor_the_index_leaves_out_is_read_as_transformers_reads_it(
        tmp_path: Path, sharded_dir: tuple[Path, torch.Tensor],  # noqa: F811
        capsys: pytest.CaptureFixture[str]) -> None:
    """A shard's tensor the weight_map does not list (an index written by a tool that forgot one): read, as
    transformers reads it, to the same checkpoint as with the full index."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from dist_llm import cli

    hf = tmp_path / "hf"
    shutil.copytree(sharded_dir[0], hf)
    _set_index(hf, {k: v for k, v in _index(hf).items() if k != "model.layers.0.mlp.up_proj.weight"})
    tensors = []
    for source, out in ((sharded_dir[0], tmp_path / "whole"), (hf, tmp_path / "left-out")):
        assert cli.main(["convert", "--from-hf", str(source), "--out", str(out)]) == 0, capsys.readouterr().err
        dcp_to_torch_save(str(out), str(out.with_suffix(".pt")))
        tensors.append(torch.load(out.with_suffix(".pt"), weights_only=True)["model"])
    whole, left_out = tensors
    assert whole.keys() == left_out.keys() and any("mlp.up" in name for name in whole)
    for name, t in whole.items():
        assert torch.equal(t, left_out[name]), name


def test_one_weight_under_two_names_is_refused(tmp_path: Path) -> None:
    """A file holding a weight with and without its family prefix: both are the same weight of ours."""
    from dist_llm.hf import HFCheckpoint, model_config_from_hf

    torch.manual_seed(6)
    hf = _hf("llama", tmp_path / "hf")
    _add_tensor(hf / "model.safetensors", "norm.weight", torch.full((64,), 7.0))
    with pytest.raises(ConfigError) as e:
        HFCheckpoint(hf, model_config_from_hf(hf))
    assert str(e.value) in [f"{hf / 'model.safetensors'}: holds tensor {a!r}, which is also in "
                            f"{hf / 'model.safetensors'} (as {b!r}): a weight is read from one place"
                            for a, b in [("norm.weight", "model.norm.weight"), ("model.norm.weight", "norm.weight")]]
