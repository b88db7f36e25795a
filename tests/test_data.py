"""dist_llm.data: tokenizers, corpus preparation and caching, and the layout-independent sampler."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_llm.config import ConfigError, DataConfig
from dist_llm.data import (
    BPETokenizer,
    ByteTokenizer,
    GlobalBatchSampler,
    Tokenizer,
    documents,
    get_batch,
    is_val_document,
    load_tokenizer,
    prepare_data,
    val_sampler,
)
from dist_llm.data.cache import build_once

UNSEEN = "Ünïcödé ☃ and emoji 🚀\n\tindented  double  spaces\r\nend without newline"
TRAIN_TEXT = "\n".join(
    f"def function_{i}(value):\n    return value * {i} + len('text number {i}')\n" for i in range(200))


def _write_docs(root: Path, n: int = 12) -> dict[str, str]:
    texts = {}
    for i in range(n):
        name = f"doc{i:02d}.txt" if i % 3 else f"sub/doc{i:02d}.txt"
        text = f"Document {i}: caf\u00e9 na\u00efve \u2014 {'lorem ipsum ' * (40 + i)}\n"
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
        texts[name] = text
    return texts


# --- tokenizers --------------------------------------------------------------------------------------

def test_byte_tokenizer_round_trip_and_ids_are_utf8_bytes(tmp_path: Path) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(UNSEEN)
    assert ids == list(UNSEEN.encode("utf-8"))
    assert max(ids) < tok.vocab_size == 256
    assert tok.decode(ids) == UNSEEN
    assert tok.decode([0xE2, 0x98]) == "\ufffd"  # a cut multi-byte character decodes, replaced
    assert tok.decode([104, 300, 105]) == "h\ufffdi"  # ids of a padded model vocabulary beyond the bytes
    assert tok.decode(np.array(ids, dtype=np.uint16)) == UNSEEN
    assert isinstance(tok, Tokenizer)
    reloaded = load_tokenizer(str(tok.save(tmp_path)))
    assert isinstance(reloaded, ByteTokenizer)


def test_bpe_trains_round_trips_unseen_text_and_respects_vocab(tmp_path: Path) -> None:
    tok = BPETokenizer.train([TRAIN_TEXT], vocab_size=300)
    assert 256 < tok.vocab_size <= 300  # learned some merges, no more than asked
    ids = tok.encode(TRAIN_TEXT)
    assert len(ids) < len(TRAIN_TEXT.encode()) / 2  # merges actually compress the training text
    assert tok.decode(ids) == TRAIN_TEXT
    for text in (UNSEEN, "", " leading space", "trailing space ", "\n\n\n"):
        assert tok.decode(tok.encode(text)) == text
    assert max(tok.encode(UNSEEN)) < tok.vocab_size

    path = tok.save(tmp_path)
    assert path == tmp_path / "tokenizer.json"
    for again in (BPETokenizer.from_file(path), load_tokenizer(str(path)), load_tokenizer("bpe", tmp_path)):
        assert isinstance(again, BPETokenizer)
        assert again.vocab_size == tok.vocab_size
        assert again.encode(UNSEEN) == tok.encode(UNSEEN)
    assert tok.encode_batch([UNSEEN, TRAIN_TEXT]) == [tok.encode(UNSEEN), tok.encode(TRAIN_TEXT)]


def test_bpe_trains_from_files(tmp_path: Path) -> None:
    f = tmp_path / "a.txt"
    f.write_text(TRAIN_TEXT)
    assert BPETokenizer.train([f], 300).encode(TRAIN_TEXT) == BPETokenizer.train([TRAIN_TEXT], 300).encode(TRAIN_TEXT)


# --- corpus ------------------------------------------------------------------------------------------

def test_documents_of_a_directory_sorted_without_hidden_files(tmp_path: Path) -> None:
    texts = _write_docs(tmp_path)
    (tmp_path / ".hidden").write_text("secret")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("secret")
    docs = documents(str(tmp_path))
    assert [name for name, _ in docs] == sorted(texts)
    assert all(path.read_text() == texts[name] for name, path in docs)
    assert documents(str(tmp_path / "doc01.txt")) == [("doc01.txt", (tmp_path / "doc01.txt").resolve())]


def test_val_split_hash_is_by_name_and_near_fraction() -> None:
    names = [f"pkg/module_{i}.py" for i in range(20000)]
    share = sum(is_val_document(n, 0.05) for n in names) / len(names)
    assert 0.04 < share < 0.06
    assert [is_val_document(n, 0.05) for n in names[:500]] == [is_val_document(n, 0.05) for n in names[:500]]
    assert not any(is_val_document(n, 0.05) and not is_val_document(n, 0.2) for n in names)  # nested


def test_prepare_directory_round_trips_and_splits_by_document(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    texts = _write_docs(src)
    data = DataConfig(source=str(src), tokenizer="byte", val_fraction=0.3, cache_dir=str(tmp_path / "cache"))
    prep = prepare_data(data, vocab_size=256)

    assert prep.train_path.is_file() and prep.val_path.is_file()
    assert prep.directory.parent == tmp_path / "cache"
    train, val = prep.train_tokens(), prep.val_tokens()
    assert isinstance(train, np.memmap) and train.dtype == np.uint16 and val.dtype == np.uint16
    val_names = sorted(n for n in texts if is_val_document(n, 0.3))
    train_names = sorted(n for n in texts if not is_val_document(n, 0.3))
    assert val_names and train_names
    tok = prep.tokenizer()
    assert tok.decode(train) == "\n".join(texts[n] for n in train_names)
    assert tok.decode(val) == "\n".join(texts[n] for n in val_names)
    assert prep.meta["n_train"] == len(train) and prep.meta["n_val"] == len(val)
    assert prep.meta["n_documents"] == len(texts) and prep.meta["n_val_documents"] == len(val_names)

    # Same inputs in a fresh cache: byte-identical files (nothing depends on time or file order).
    other = prepare_data(DataConfig(source=str(src), val_fraction=0.3, cache_dir=str(tmp_path / "cache2")), 256)
    assert other.directory.name == prep.directory.name
    assert other.train_path.read_bytes() == prep.train_path.read_bytes()


def test_prepare_reuses_cache_and_rebuilds_when_a_file_changes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    texts = _write_docs(src)
    data = DataConfig(source=str(src), val_fraction=0.3, cache_dir=str(tmp_path / "cache"))
    first = prepare_data(data, 256)
    stamp = first.train_path.stat().st_mtime_ns
    time.sleep(0.01)
    second = prepare_data(data, 256)
    assert second.directory == first.directory
    assert second.train_path.stat().st_mtime_ns == stamp  # not rewritten
    assert second.meta == first.meta

    name = next(n for n in sorted(texts) if not is_val_document(n, 0.3))
    (src / name).write_text("changed\n")
    third = prepare_data(data, 256)
    assert third.directory != first.directory
    assert "changed\n" in third.tokenizer().decode(third.train_tokens())
    leftovers = [p.name for p in (tmp_path / "cache").iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_cache_dir_defaults_to_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "one.txt"
    src.write_text("hello world\n" * 50)
    monkeypatch.setenv("DIST_LLM_CACHE", str(tmp_path / "envcache"))
    prep = prepare_data(DataConfig(source=str(src), val_fraction=0.1), 256)
    assert prep.directory.parent == (tmp_path / "envcache").resolve()


def test_prepare_single_file_splits_by_position(tmp_path: Path) -> None:
    text = "".join(f"line {i} \u00e9\n" for i in range(300))
    src = tmp_path / "corpus.txt"
    src.write_text(text)
    prep = prepare_data(DataConfig(source=str(src), val_fraction=0.1, cache_dir=str(tmp_path)), 256)
    train, val = prep.train_tokens(), prep.val_tokens()
    total = len(text.encode())
    assert len(val) == int(total * 0.1) and len(train) + len(val) == total
    assert bytes(np.concatenate([train, val]).astype(np.uint8)) == text.encode()
    assert prep.meta["split"] == "position"


def test_prepare_bpe_trains_tokenizer_into_the_cache(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    texts = _write_docs(src)
    prep = prepare_data(DataConfig(source=str(src), tokenizer="bpe", val_fraction=0.3, cache_dir=str(tmp_path)), 300)
    assert Path(prep.tokenizer_spec).is_absolute()
    assert Path(prep.tokenizer_spec) == prep.directory / "tokenizer.json"
    tok = prep.tokenizer()
    assert isinstance(tok, BPETokenizer) and tok.vocab_size <= 300
    train = prep.train_tokens()
    assert int(train.max()) < tok.vocab_size
    train_names = sorted(n for n in texts if not is_val_document(n, 0.3))
    assert tok.decode(train) == "\n".join(texts[n] for n in train_names)
    assert len(train) < sum(len(texts[n].encode()) for n in train_names) / 2


def test_prepare_bin_source_splits_by_position(tmp_path: Path) -> None:
    tokens = (np.arange(1000) % 256).astype(np.uint16)
    src = tmp_path / "tokens.bin"
    tokens.tofile(src)
    prep = prepare_data(DataConfig(source=str(src), tokenizer="byte", val_fraction=0.1, cache_dir=str(tmp_path)), 256)
    np.testing.assert_array_equal(prep.train_tokens(), tokens[:900])
    np.testing.assert_array_equal(prep.val_tokens(), tokens[900:])
    assert prep.tokenizer_spec == "byte"

    with pytest.raises(ConfigError, match=r"^data\.tokenizer:"):
        prepare_data(DataConfig(source=str(src), tokenizer="bpe", cache_dir=str(tmp_path)), 256)
    big = tmp_path / "big.bin"
    np.array([1, 2, 300, 4] * 10, dtype=np.uint16).tofile(big)
    with pytest.raises(ConfigError, match=r"^data\.tokenizer:.*300"):
        prepare_data(DataConfig(source=str(big), tokenizer="byte", cache_dir=str(tmp_path)), 256)


def test_concurrent_prepare_builds_once_and_agrees(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    _write_docs(src)
    data = DataConfig(source=str(src), val_fraction=0.3, cache_dir=str(tmp_path / "cache"))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(prepare_data(data, 256).directory)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and len(set(results)) == 1
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")) == [results[0].name]


def test_build_once_uses_the_winners_folder_when_another_host_wins(tmp_path: Path) -> None:
    def build(tmp: Path) -> None:
        # Another host renames its complete folder into place while we are still building ours.
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        (theirs / "meta.json").write_text("{}")
        (theirs / "who").write_text("them")
        os.rename(theirs, tmp_path / "name")
        (tmp / "who").write_text("us")
        (tmp / "meta.json").write_text("{}")

    folder = build_once(tmp_path, "name", build)
    assert (folder / "who").read_text() == "them"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_stdlib_corpus_lists_only_stdlib_sources(tmp_path: Path) -> None:
    docs = documents("stdlib")
    assert len(docs) > 1000
    names = [n for n, _ in docs]
    assert names == sorted(names)
    assert all(n.endswith(".py") for n in names)
    assert not any(part in ("site-packages", "dist-packages") for n in names for part in n.split("/"))
    assert not any("site-packages" in p.parts or "dist-packages" in p.parts for _, p in docs)

    start = time.perf_counter()
    prep = prepare_data(DataConfig(source="stdlib", cache_dir=str(tmp_path)), 256)
    assert time.perf_counter() - start < 5.0
    assert prep.meta["n_documents"] == len(docs)
    assert prep.n_train > 10_000_000 and 0.01 < prep.n_val / (prep.n_train + prep.n_val) < 0.15


# --- errors ------------------------------------------------------------------------------------------

def test_bad_sources_and_vocab_raise_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^data\.source:"):
        prepare_data(DataConfig(source=str(tmp_path / "missing"), cache_dir=str(tmp_path)), 256)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"^data\.source:"):
        prepare_data(DataConfig(source=str(empty), cache_dir=str(tmp_path)), 256)
    src = tmp_path / "a.txt"
    src.write_text("x" * 100)
    with pytest.raises(ConfigError, match=r"^model\.vocab_size:"):
        prepare_data(DataConfig(source=str(src), tokenizer="byte", cache_dir=str(tmp_path)), 100)
    with pytest.raises(ConfigError, match=r"^model\.vocab_size:"):
        prepare_data(DataConfig(source=str(src), tokenizer="bpe", cache_dir=str(tmp_path)), 200)
    with pytest.raises(ConfigError, match=r"^data\.val_fraction:"):
        prepare_data(DataConfig(source=str(src), val_fraction=0.001, cache_dir=str(tmp_path)), 256)
    with pytest.raises(ConfigError, match=r"^data\.tokenizer:"):
        prepare_data(DataConfig(source=str(src), tokenizer=str(tmp_path / "nope.json"), cache_dir=str(tmp_path)), 256)


def _refuse(monkeypatch: pytest.MonkeyPatch, name: str, refused: Path) -> None:
    """Make os.<name> refuse `refused` as a folder or file without read permission would: the tests run as root,
    which the permission bits do not stop, so a chmod would prove nothing here."""
    real = getattr(os, name)

    def refusing(path: object, *args: object, **kwargs: object) -> object:
        if Path(path) == refused:  # type: ignore[arg-type]
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, name, refusing)


@pytest.mark.parametrize("what", ["subfolder", "top folder", "document", "folder above"])
def test_a_source_this_process_cannot_read_is_one_line_naming_data_source(
        what: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = (tmp_path / "corpus").resolve()
    root.mkdir()
    _write_docs(root)
    # os.walk lists with os.scandir (its onerror gets the refusal), a document is opened with os.open, and a source
    # under a folder that cannot be searched is refused its stat
    name, refused, source = {"subfolder": ("scandir", root / "sub", root),
                             "top folder": ("scandir", root, root),
                             "document": ("open", root / "doc01.txt", root),
                             "folder above": ("stat", root / "doc01.txt", root / "doc01.txt")}[what]
    _refuse(monkeypatch, name, refused)
    with pytest.raises(ConfigError) as e:
        prepare_data(DataConfig(source=str(source), cache_dir=str(tmp_path / "cache")), 256)
    assert str(e.value) == f"data.source: cannot read {refused}: Permission denied"


def test_a_single_file_source_this_process_cannot_read_is_one_line(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    src = (tmp_path / "a.txt").resolve()
    src.write_text(TRAIN_TEXT)
    _refuse(monkeypatch, "open", src)
    with pytest.raises(ConfigError) as e:
        prepare_data(DataConfig(source=str(src), cache_dir=str(tmp_path / "cache")), 256)
    assert str(e.value) == f"data.source: cannot read {src}: Permission denied"


def test_a_source_that_is_not_a_regular_file_or_folder_is_named_so(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for source in (str(fifo), os.devnull):  # (reading a fifo would block; /dev/null gives nothing)
        with pytest.raises(ConfigError) as e:
            prepare_data(DataConfig(source=source, cache_dir=str(tmp_path / "cache")), 256)
        assert str(e.value) == f"data.source: {source} is not a regular file or directory"


@pytest.mark.parametrize("where", ["the folder", "a folder above"])
def test_a_cache_dir_that_is_a_file_is_one_line_naming_data_cache_dir(where: str, tmp_path: Path) -> None:
    src = tmp_path / "a.txt"
    src.write_text(TRAIN_TEXT)
    blocker = (tmp_path / "cache").resolve()
    blocker.write_text("not a folder")
    cache = blocker if where == "the folder" else blocker / "sub"
    with pytest.raises(ConfigError) as e:
        prepare_data(DataConfig(source=str(src), cache_dir=str(cache)), 256)
    assert str(e.value) == f"data.cache_dir: cannot create {cache}: {blocker} is a file, not a folder"


def test_external_tokenizer_larger_than_model_vocab(tmp_path: Path) -> None:
    path = BPETokenizer.train([TRAIN_TEXT], 300).save(tmp_path / "tok")
    src = tmp_path / "a.txt"
    src.write_text(TRAIN_TEXT)
    with pytest.raises(ConfigError, match=r"^model\.vocab_size:"):
        prepare_data(DataConfig(source=str(src), tokenizer=str(path), cache_dir=str(tmp_path)), 256)
    data = DataConfig(source=str(src), tokenizer=str(path), val_fraction=0.1, cache_dir=str(tmp_path))
    prep = prepare_data(data, 512)
    assert prep.tokenizer_spec == str(path.resolve())
    assert prep.tokenizer().decode(np.concatenate([prep.train_tokens(), prep.val_tokens()])) == TRAIN_TEXT


# --- sampler -----------------------------------------------------------------------------------------

def test_sampler_is_deterministic_and_in_range() -> None:
    a = GlobalBatchSampler(10_000, 64, 16, seed=1)
    b = GlobalBatchSampler(10_000, 64, 16, seed=1)
    s0 = a.starts(0)
    assert s0.dtype == np.int64 and s0.shape == (16,)
    np.testing.assert_array_equal(s0, b.starts(0))
    assert not np.array_equal(s0, a.starts(1))
    assert not np.array_equal(s0, GlobalBatchSampler(10_000, 64, 16, seed=2).starts(0))
    assert not np.array_equal(s0, GlobalBatchSampler(10_000, 64, 16, seed=1, stream=1).starts(0))
    # Every legal start, and only those, can be drawn: the smallest split allows offsets 0 and 1.
    tight = GlobalBatchSampler(66, 64, 256, seed=0)
    assert set(np.concatenate([tight.starts(s) for s in range(4)]).tolist()) == {0, 1}


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_micro_batches_tile_the_global_batch_for_any_layout(dp: int) -> None:
    sampler = GlobalBatchSampler(50_000, 32, 16, seed=7)
    for micro in (1, 2, 4):
        if 16 % (dp * micro):
            continue
        for step in (0, 5):
            parts = [m for r in range(dp)
                     for m in sampler.micro_batch_starts(step, dp_rank=r, dp_size=dp, micro_batch_size=micro)]
            assert all(len(m) == micro for m in parts)
            np.testing.assert_array_equal(np.concatenate(parts), sampler.starts(step))
    with pytest.raises(ValueError):
        sampler.micro_batch_starts(0, dp_rank=0, dp_size=3, micro_batch_size=1)
    with pytest.raises(ValueError):
        sampler.micro_batch_starts(0, dp_rank=0, dp_size=2, micro_batch_size=3)


def test_sampler_state_dict_resumes_the_same_batches() -> None:
    run = GlobalBatchSampler(50_000, 32, 8, seed=3)
    seen = []
    for _ in range(6):
        seen.append(run.starts(run.step))
        run.step += 1
        if run.step == 3:
            state = run.state_dict()
    assert state == {"step": 3, "seed": 3, "global_batch_size": 8, "stream": 0}
    resumed = GlobalBatchSampler(50_000, 32, 8, seed=3)
    resumed.load_state_dict(state)
    for expected in seen[3:]:
        np.testing.assert_array_equal(resumed.starts(resumed.step), expected)
        resumed.step += 1
    with pytest.raises(ConfigError, match=r"^train\.seed:"):
        GlobalBatchSampler(50_000, 32, 8, seed=4).load_state_dict(state)


def test_val_sampler_ignores_training_seed() -> None:
    v = val_sampler(10_000, 32, 8)
    assert (v.seed, v.stream) == (0, 1)
    np.testing.assert_array_equal(v.starts(2), val_sampler(10_000, 32, 8).starts(2))
    assert not np.array_equal(v.starts(0), GlobalBatchSampler(10_000, 32, 8, seed=0).starts(0))


def test_block_size_too_large_for_split() -> None:
    with pytest.raises(ConfigError, match=r"^model\.block_size:"):
        GlobalBatchSampler(100, 99, 4, seed=0)
    GlobalBatchSampler(100, 98, 4, seed=0)


def test_get_batch_shifts_targets_by_one(tmp_path: Path) -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    tokens.tofile(tmp_path / "t.bin")
    mm = np.memmap(tmp_path / "t.bin", dtype=np.uint16, mode="r")
    starts = np.array([0, 17, 1000 - 9], dtype=np.int64)
    x, y = get_batch(mm, starts, 8)
    assert x.shape == y.shape == (3, 8) and x.dtype == y.dtype == torch.int64
    assert x.device.type == "cpu"
    for row, s in enumerate(starts):
        assert x[row].tolist() == list(range(s, s + 8))
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y[:, -1], torch.from_numpy(starts + 8))
    assert y.view(-1).shape == (24,)  # contiguous, so losses can flatten it
