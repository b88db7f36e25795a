"""Tokenizers: raw UTF-8 bytes, or a byte-level BPE trained with the `tokenizers` library.

Both are byte-level, so every string round-trips exactly through encode/decode. A tokenizer's `save`
returns a path that `load_tokenizer` accepts, so a checkpoint can carry whatever it was trained with.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from dist_llm.config import ConfigError

# Token files are uint16 while every id fits (vocabularies up to 65,536 tokens) and uint32 beyond, so
# Llama-3 (128,256) and Qwen2 (151,646) tokenizers work; uint32 caps every vocabulary.
UINT16_VOCAB = 2**16
MAX_VOCAB = 2**32


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest little-endian unsigned dtype that holds ids 0..vocab_size-1 of a token file."""
    return np.dtype("<u2") if vocab_size <= UINT16_VOCAB else np.dtype("<u4")
# The byte tokenizer has nothing to save; this file only marks "byte" so `load_tokenizer` can read it back.
BYTE_MARKER_FILE = "byte_tokenizer.json"
_BYTE_MARKER_KEY = "dist_llm_tokenizer"


@runtime_checkable
class Tokenizer(Protocol):
    name: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def save(self, directory: Path) -> Path:
        """Write what is needed to reload into `directory`; return a path `load_tokenizer` accepts."""
        ...


class ByteTokenizer:
    """256 symbols: a token is one byte of the UTF-8 encoding."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """uint16 ids without a Python list per byte: the corpus path needs tens of MB per second."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: list[int] | np.ndarray) -> str:
        a = np.asarray(ids, dtype=np.int64)
        # A model with a padded vocabulary can emit ids >= 256; 0xFF is never valid UTF-8, so they show as U+FFFD
        # just like a window cut from the middle of a multi-byte character.
        a = np.where((a >= 0) & (a < 256), a, 0xFF).astype(np.uint8)
        return a.tobytes().decode("utf-8", errors="replace")

    def save(self, directory: Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / BYTE_MARKER_FILE
        path.write_text(json.dumps({_BYTE_MARKER_KEY: "byte"}) + "\n")
        return path


class BPETokenizer:
    """Byte-level BPE (ByteLevel pre-tokenizer and decoder, no prefix space, no special tokens)."""

    name = "bpe"

    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        self._tok = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

    @staticmethod
    def _empty() -> tokenizers.Tokenizer:
        tok = tokenizers.Tokenizer(models.BPE())
        # No prefix space: a space added on encode would come back on decode and break exact round trips.
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return tok

    @classmethod
    def train(cls, files_or_iterator: Iterable[str | Path], vocab_size: int) -> BPETokenizer:
        """Train to at most `vocab_size` tokens. `Path` items are files to read, `str` items are texts."""
        if not 256 <= vocab_size <= MAX_VOCAB:
            raise ConfigError(f"model.vocab_size: byte-level BPE needs 256..{MAX_VOCAB}, got {vocab_size}")
        tok = cls._empty()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            # All 256 byte symbols are in the vocabulary up front, so unseen text still encodes.
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=[],
            show_progress=False,
        )
        tok.train_from_iterator(_texts(files_or_iterator), trainer=trainer)
        return cls(tok)

    @classmethod
    def from_file(cls, path: str | Path) -> BPETokenizer:
        return cls(tokenizers.Tokenizer.from_file(str(path)))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many documents at once; the library spreads them over threads."""
        # The fast variant skips computing character offsets, which we never use (~30% quicker).
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in encode(texts)]

    def decode(self, ids: list[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, directory: Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "tokenizer.json"
        self._tok.save(str(path))
        return path


def _texts(items: Iterable[str | Path]) -> Iterator[str]:
    for item in items:
        # errors="replace" matches how the corpus reads documents.
        yield Path(item).read_bytes().decode("utf-8", errors="replace") if isinstance(item, Path) else item


def load_tokenizer(spec: str, directory: Path | None = None) -> Tokenizer:
    """'byte'; 'bpe' (the tokenizer.json in `directory`); or a path to a tokenizer.json (or byte marker file)."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "bpe":
        if directory is None:
            raise ConfigError("data.tokenizer: 'bpe' needs the prepared data directory to find tokenizer.json")
        return BPETokenizer.from_file(Path(directory) / "tokenizer.json")
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(f"data.tokenizer: must be byte, bpe or a tokenizer.json file; not found: {spec}")
    if _is_byte_marker(path):
        return ByteTokenizer()
    try:
        return BPETokenizer.from_file(path)
    except Exception as e:  # the library raises a bare Exception on a malformed file
        reason = str(e).splitlines()[0] if str(e) else repr(e)
        raise ConfigError(f"data.tokenizer: {spec} is not a Hugging Face tokenizer.json ({reason})") from None


def _is_byte_marker(path: Path) -> bool:
    if path.stat().st_size > 1024:  # a real tokenizer.json is far bigger; skip parsing it twice
        return False
    try:
        return json.loads(path.read_text()).get(_BYTE_MARKER_KEY) == "byte"
    except (ValueError, AttributeError, RecursionError):
        return False
