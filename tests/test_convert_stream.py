"""`dist-llm convert --from-hf` streams: one tensor made, written and freed at a time, no optimizer moments; the
result round-trips bit for bit, and a run resumed (or started) from it at another layout is the run started
from the Hugging Face directory itself."""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
pytest.importorskip("transformers")

from dist_llm import convert
from dist_llm.hf import HFCheckpoint, export_plan, model_config_from_hf, read_hf_tensors, weight_shapes
from dist_llm.train.checkpoint import SafeReader
from tests.distributed import run_distributed
from tests.test_data_parallel import corpus, train  # noqa: F401
from tests.test_hf import hf_gpt2, hf_llama, save


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama (grouped-query attention, untied head, vocabulary 300 padded to 384) and GPT-2 (Conv1D
    weights stored transposed, tied head), random norms and biases so that every mapping shows."""
    torch.manual_seed(3)
    root = tmp_path_factory.mktemp("hf")
    return {"llama": save(hf_llama(), root / "llama"), "gpt2": save(hf_gpt2(), root / "gpt2")}


def index_of(path: Path) -> dict[str, Any]:
    return SafeReader(str(path)).read_metadata().state_dict_metadata


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hf_to_checkpoint_to_hf_is_bitwise(tmp_path: Path, hf_dirs: dict[str, Path], kind: str) -> None:
    src = hf_dirs[kind]
    ckpt_dir = convert.convert_hf_to_checkpoint(src, tmp_path / "ckpt")
    convert.convert_checkpoint_to_hf(ckpt_dir, tmp_path / "back")
    a, b = read_hf_tensors(src), read_hf_tensors(tmp_path / "back")
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_checkpoint_holds_the_model_and_no_optimizer_state(tmp_path: Path, hf_dirs: dict[str, Path], kind: str) -> None:
    """Every weight of the plain GPT at its full shape in fp32 (the padding rows zero), nothing else: AdamW's
    moments of a model never trained are zeros, which a resume makes itself."""
    ckpt_dir = convert.convert_hf_to_checkpoint(hf_dirs[kind], tmp_path / "ckpt", pad_vocab_to=128)
    cfg = model_config_from_hf(hf_dirs[kind], convert.ModelConfig(pad_vocab_to=128))
    index = index_of(ckpt_dir)
    assert {k: tuple(v.size) for k, v in index.items()} == {f"model.{k}": s for k, s in weight_shapes(cfg).items()}
    assert {v.properties.dtype for v in index.values()} == {torch.float32}
    model = convert.load_checkpoint_model(ckpt_dir)  # what `dist-llm sample` loads
    with HFCheckpoint(hf_dirs[kind], cfg) as src:
        for name, p in model.state_dict().items():
            assert torch.equal(p, src.read(name)), name
    assert cfg.padded_vocab > cfg.vocab_size and not model.wte.weight[cfg.vocab_size:].any()


def test_from_hf_reads_one_tensor_at_a_time(tmp_path: Path, hf_dirs: dict[str, Path],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of our tensors is read once, in the checkpoint's order, and the one before it is freed (dead, or its
    storage released) before the next is read: the conversion never holds two, let alone the model."""
    reads: list[str] = []
    made: list[tuple[str, weakref.ref]] = []
    real = HFCheckpoint.read_into

    def read_into(self: HFCheckpoint, name: str, out: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        whole = out._base if out._base is not None else out  # (a block of rows is a view of the whole tensor)
        if not reads or reads[-1] != name:
            assert name not in reads, f"{name} read a second time"
            for earlier, ref in made:
                t = ref()
                assert t is None or t.untyped_storage().nbytes() == 0, f"{earlier} still held while {name} is read"
            reads.append(name)
            made.append((name, weakref.ref(whole)))
        return real(self, name, out, *args, **kwargs)

    monkeypatch.setattr(HFCheckpoint, "read_into", read_into)
    ckpt_dir = convert.convert_hf_to_checkpoint(hf_dirs["llama"], tmp_path / "ckpt")
    assert sorted(reads) == sorted(k.removeprefix("model.") for k in index_of(ckpt_dir))


def test_to_hf_holds_one_model_tensor_at_a_time(tmp_path: Path, hf_dirs: dict[str, Path],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """--to-hf loads each of our tensors once, in export order, and each is gone before the next is loaded."""
    ckpt_dir = convert.convert_hf_to_checkpoint(hf_dirs["gpt2"], tmp_path / "ckpt")
    loaded: list[tuple[str, weakref.ref]] = []
    real = convert.CheckpointWeights.get

    def get(self: convert.CheckpointWeights, name: str) -> torch.Tensor:
        for earlier, ref in loaded:
            assert ref() is None, f"{earlier} still held while {name} is loaded"
        t = real(self, name)
        loaded.append((name, weakref.ref(t)))
        return t

    monkeypatch.setattr(convert.CheckpointWeights, "get", get)
    convert.convert_checkpoint_to_hf(ckpt_dir, tmp_path / "back")
    cfg = model_config_from_hf(hf_dirs["gpt2"])
    sources = [e.source for e in export_plan(cfg) if e.source is not None]
    assert [n for n, _ in loaded] == list(dict.fromkeys(sources))


def _model_overrides(ckpt_dir: Path) -> dict[str, Any]:
    """The converted checkpoint's model.* keys as overrides: a run of that very model (its fingerprint)."""
    model = yaml.safe_load((ckpt_dir / "config.yaml").read_text())["model"]
    return {f"model__{k}": v for k, v in model.items() if k != "init_from"}


# The converted checkpoint's data order is that of the default train.seed and global batch size (32): the runs
# compared use them.
BATCH = {"train__global_batch_size": 32, "train__micro_batch_size": 8, "train__max_steps": 4}


def test_resume_and_init_from_of_the_checkpoint_are_the_hf_start(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                                 hf_dirs: dict[str, Path], corpus: Path) -> None:  # noqa: F811
    """One process started from the Hugging Face directory; two ranks (dp=2, ZeRO-1) resumed from the converted
    checkpoint (a fresh optimizer: it holds none) and two ranks (tp=2) started from it with model.init_from:
    the same losses and weights (fp32 on the CPU: only the reductions' order differs)."""
    src = hf_dirs["llama"]
    ckpt_dir = convert.convert_hf_to_checkpoint(src, tmp_path / "ckpt")
    ref = train(0, 1, tmp_path / "ref", corpus, {**BATCH, "model__init_from": f"hf:{src}"})
    model = _model_overrides(ckpt_dir)
    resumed = run_distributed(train, 2, tmp_path / "resumed", corpus,
                              {**BATCH, **model, "train__resume": str(ckpt_dir), "parallel__zero_stage": 1},
                              init_group=False)[0]
    started = run_distributed(train, 2, tmp_path / "started", corpus,
                              {**BATCH, **model, "model__init_from": f"ckpt:{ckpt_dir}", "parallel__tp": 2},
                              init_group=False)[0]
    for got in (resumed, started):
        assert len(got["losses"]) == BATCH["train__max_steps"]
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        for name, p in ref["params"].items():
            torch.testing.assert_close(got["params"][name], p, rtol=1e-5, atol=3e-5)  # (test_data_parallel's)


def test_writer_converts_views_and_dtypes_block_by_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A transposed view (GPT-2's Conv1D export) and a tensor of another dtype are written, a few rows at a time,
    as their contiguous, converted copies would be: safetensors reads back the same values, bit for bit."""
    from safetensors.torch import load_file

    from dist_llm import safetensors_shards
    from dist_llm.safetensors_shards import Entry, write_file

    monkeypatch.setattr(safetensors_shards, "WRITE_BLOCK_BYTES", 100)  # 1-2 rows per block
    a = torch.randn(40, 24)
    entries = [Entry("t", (24, 40), torch.float32), Entry("c", (40, 24), torch.bfloat16), Entry("v", (7,), torch.float32)]
    write_file(tmp_path / "ours.safetensors", entries, iter([("t", a.t()), ("c", a), ("v", a[0, :7])]), {})
    expected = {"t": a.t().contiguous(), "c": a.to(torch.bfloat16), "v": a[0, :7].clone()}
    got = load_file(tmp_path / "ours.safetensors")
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())
    # a float is never cast into an integer entry (a plan that disagrees with the stream is a bug, said as one)
    with pytest.raises(AssertionError, match=r"i: got \(3,\) torch.float32, planned \(3,\) torch.int64"):
        write_file(tmp_path / "bad.safetensors", [Entry("i", (3,), torch.int64)], iter([("i", torch.ones(3))]), {})


def test_a_stored_chunk_that_is_no_tensor_is_one_line(tmp_path: Path, hf_dirs: dict[str, Path],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A damaged or foreign checkpoint whose chunk unpickles (weights_only) to a dict, not a tensor: the reader says
    so in one ConfigError naming the file, not an AttributeError from deep inside."""
    from dist_llm.config import ConfigError
    from dist_llm.convert_io import ChunkReader

    ckpt = convert.convert_hf_to_checkpoint(hf_dirs["llama"], tmp_path / "ckpt")
    reader = ChunkReader(ckpt)
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: {"not": real_load(*a, **k)})
    with pytest.raises(ConfigError, match=r"a stored chunk is a dict, not a tensor"):
        reader.read_whole("model.lm_head.weight")


@pytest.mark.parametrize("folder", ["new", "an empty one the user made"])
def test_a_failed_import_leaves_no_half_checkpoint_and_keeps_what_was_there(tmp_path: Path, hf_dirs: dict[str, Path],
                                                                           monkeypatch: pytest.MonkeyPatch,
                                                                           folder: str) -> None:
    """A read that fails half-way (an I/O error, a Ctrl-C) removes what the import wrote, and says the reader's
    error as itself, not as DCP's save failure; an empty folder the user made first (--out allows one) stays."""
    out = tmp_path / "ckpt"
    if folder != "new":
        out.mkdir()
    real, calls = convert._read_converted, []

    def failing(*args: Any) -> torch.Tensor:
        calls.append(args[1])
        if len(calls) == 3:
            raise OSError("the third tensor cannot be read")
        return real(*args)

    monkeypatch.setattr(convert, "_read_converted", failing)
    with pytest.raises(OSError, match="^the third tensor cannot be read$"):
        convert.convert_hf_to_checkpoint(hf_dirs["llama"], out)
    assert len(calls) == 3
    assert (out.is_dir() and not any(out.iterdir())) if folder != "new" else not out.exists()
