"""Token files past 65,536 tokens: a Llama-3-sized vocabulary (128,256) is stored as uint32 and trains.

The tokenizer is built here, not downloaded: a small byte-level BPE padded with added tokens to exactly
Llama-3's 128,256 entries, with ids beyond the uint16 range that the corpus actually uses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dist_llm.config import ConfigError, DataConfig
from dist_llm.data.corpus import PreparedData, prepare_data
from dist_llm.data.tokenizer import BPETokenizer, load_tokenizer
from tests.conftest import REPO

LLAMA3_VOCAB = 128_256
# Two added tokens whose ids do not fit uint16 (each one is 1 token in the text below).
HIGH = ("<x70000>", "<x120000>")
TEXT = "".join(f"def f{i}(x):\n    return x + {i}  # {HIGH[i % 2]}\n" for i in range(400))


@pytest.fixture(scope="module")
def big_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tok")
    tok = BPETokenizer.train([TEXT], 300)
    # Added tokens fill the rest of the vocabulary; naming them by their rank makes "<xN>" id N-ish > 65,535.
    tok._tok.add_tokens([f"<x{i}>" for i in range(LLAMA3_VOCAB - tok.vocab_size)])
    path = folder / "tokenizer.json"
    tok._tok.save(str(path))
    assert load_tokenizer(str(path)).vocab_size == LLAMA3_VOCAB
    return path


def test_text_source_is_stored_as_uint32_and_round_trips(tmp_path: Path, big_tokenizer: Path) -> None:
    src = tmp_path / "corpus.txt"
    src.write_text(TEXT)
    prep = prepare_data(DataConfig(source=str(src), tokenizer=str(big_tokenizer), val_fraction=0.1,
                                   cache_dir=str(tmp_path / "cache")), LLAMA3_VOCAB)
    assert prep.meta["dtype"] == "<u4" and prep.dtype == np.dtype("<u4")
    train, val = prep.train_tokens(), prep.val_tokens()
    # 4 bytes a token on disk: the files hold exactly n tokens of uint32.
    assert prep.train_path.stat().st_size == 4 * prep.n_train == 4 * len(train)
    assert prep.val_path.stat().st_size == 4 * prep.n_val == 4 * len(val)
    tok = load_tokenizer(str(big_tokenizer))
    high_ids = {tok.encode(h)[0] for h in HIGH}
    assert min(high_ids) > 65_535 and len(high_ids) == 2
    # the ids past uint16 survive unchanged (uint16 would have wrapped them modulo 65,536)
    assert high_ids <= set(np.concatenate([train, val]).tolist())
    assert tok.decode(np.concatenate([train, val]).tolist()) == TEXT


def test_small_vocabularies_stay_uint16(tmp_path: Path) -> None:
    src = tmp_path / "corpus.txt"
    src.write_text(TEXT)
    prep = prepare_data(DataConfig(source=str(src), tokenizer="byte", cache_dir=str(tmp_path)), 256)
    assert prep.meta["dtype"] == "<u2" and prep.train_path.stat().st_size == 2 * prep.n_train


def test_folder_without_dtype_reads_as_uint16(tmp_path: Path) -> None:
    """Folders prepared before uint32 existed carry no dtype in meta.json and hold uint16 tokens."""
    np.array([1, 2, 65535], dtype="<u2").tofile(tmp_path / "train.bin")
    np.array([7], dtype="<u2").tofile(tmp_path / "val.bin")
    prep = PreparedData(tmp_path, tmp_path / "train.bin", tmp_path / "val.bin", "byte",
                        {"n_train": 3, "n_val": 1})
    assert prep.train_tokens().tolist() == [1, 2, 65535] and prep.val_tokens().tolist() == [7]


def test_bin_source_width_follows_the_tokenizer_or_the_key(tmp_path: Path, big_tokenizer: Path) -> None:
    ids = np.array([1, 70_000, 128_255, 5] * 50, dtype="<u4")
    src = tmp_path / "tokens.bin"
    ids.tofile(src)
    common = dict(source=str(src), tokenizer=str(big_tokenizer), val_fraction=0.1, cache_dir=str(tmp_path))
    prep = prepare_data(DataConfig(**common), LLAMA3_VOCAB)  # auto: a 128k tokenizer's .bin is uint32
    assert np.concatenate([prep.train_tokens(), prep.val_tokens()]).tolist() == ids.tolist()
    assert prep.meta["max_token"] == 128_255
    with pytest.raises(ConfigError, match=r"^data\.token_dtype: uint16 cannot hold the ids of a 128256-token"):
        prepare_data(DataConfig(**common, token_dtype="uint16"), LLAMA3_VOCAB)
    # a uint16 file read with the byte tokenizer but declared uint32: 3 tokens of 2 bytes is not a whole uint32
    odd = tmp_path / "odd.bin"
    np.array([1, 2, 3], dtype="<u2").tofile(odd)
    with pytest.raises(ConfigError, match=r"^data\.source: .*odd\.bin is 6 bytes; a \.bin of uint32 tokens"):
        prepare_data(DataConfig(source=str(odd), tokenizer="byte", cache_dir=str(tmp_path), token_dtype="uint32"),
                     256)


def test_cli_trains_a_llama3_vocabulary_from_uint32_files(tmp_path: Path, big_tokenizer: Path) -> None:
    src = tmp_path / "corpus.txt"
    src.write_text(TEXT * 3)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "dist_llm.cli", "train", "--config", "configs/tiny.yaml",
           f"data.source={src}", f"data.tokenizer={big_tokenizer}", "data.val_fraction=0.1",
           f"data.cache_dir={tmp_path / 'cache'}", f"model.vocab_size={LLAMA3_VOCAB}", "model.n_layer=1",
           "model.n_embd=32", "model.n_head=2", "model.block_size=32", "train.micro_batch_size=4",
           "train.global_batch_size=4", "train.max_steps=3", "train.log_interval=1", "train.eval_interval=3",
           "train.eval_steps=1", "train.ckpt_interval=0", f"train.out_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs if "loss" in r]
    assert len(losses) == 3 and all(np.isfinite(losses))
    # the first loss of an untrained model is near ln(V) of the 128,256-token vocabulary: the ids reach it
    assert abs(losses[0] - np.log(LLAMA3_VOCAB)) < 1.0
    metas = list((tmp_path / "cache").rglob("meta.json"))
    assert [json.loads(m.read_text())["dtype"] for m in metas] == ["<u4"]
