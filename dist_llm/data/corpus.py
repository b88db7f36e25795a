"""Turn `data.source` into two token files (uint16, or uint32 for vocabularies over 65,536), train.bin and val.bin, prepared once and cached.

Sources: 'stdlib' (the running Python's standard library, *.py, without site-packages), a directory of
text files, a single text file, a .bin of tokens, or a .jsonl of fine-tuning records (records.py). Documents are read as UTF-8 with
errors="replace": a stray non-UTF-8 file (the stdlib has four) costs a few U+FFFD characters rather
than a failed run. Within a split, documents are joined with SEPARATOR between them, so decoding a
split's tokens gives back exactly SEPARATOR.join(its documents' text).

Multi-document sources are split by document, by a hash of each relative name; single-file and .bin
sources are split by position, the last `val_fraction` of the tokens going to val.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from dist_llm.config import ConfigError, DataConfig
from dist_llm.data.cache import COMPLETE_FILE, build_once, folder_name, ready_cache_root
from dist_llm.data.records import MASK_DTYPE, build_records
from dist_llm.data.tokenizer import (MAX_VOCAB, UINT16_VOCAB, BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer,
                                     token_dtype)

# Bump when the content of a prepared folder would change for the same inputs.
FORMAT_VERSION = 1
SEPARATOR = "\n"
# Little-endian spelled out so a folder on a shared filesystem reads the same on every host. Folders
# written before uint32 existed have no "dtype" in their meta and hold uint16.
LEGACY_DTYPE = np.dtype("<u2")
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
# Text per encode_batch call: large enough to keep the library's threads busy, small enough to stream.
_BATCH_CHARS = 8_000_000
# Tokens copied per step when splitting a .bin, to keep memory flat for big files.
_COPY_TOKENS = 1 << 24


@dataclass
class PreparedData:
    directory: Path
    train_path: Path
    val_path: Path
    tokenizer_spec: str
    """'byte' or an absolute path to a tokenizer file; what `load_tokenizer` accepts."""
    meta: dict[str, Any] = field(default_factory=dict)
    """The folder's meta.json: n_train, n_val, n_documents, tokenizer, source, split, ..."""

    @property
    def n_train(self) -> int:
        return int(self.meta["n_train"])

    @property
    def n_val(self) -> int:
        return int(self.meta["n_val"])

    @property
    def dtype(self) -> np.dtype:
        """The token files' dtype, as recorded in meta.json."""
        return np.dtype(self.meta.get("dtype", LEGACY_DTYPE.str))

    def train_tokens(self) -> np.ndarray:
        return np.memmap(self.train_path, dtype=self.dtype, mode="r")

    def val_tokens(self) -> np.ndarray:
        return np.memmap(self.val_path, dtype=self.dtype, mode="r")

    def train_mask(self) -> np.ndarray | None:
        """For fine-tuning records: 1 where a token is a target to learn, 0 on prompt tokens; else None."""
        return self._mask("train")

    def val_mask(self) -> np.ndarray | None:
        return self._mask("val")

    def _mask(self, split: str) -> np.ndarray | None:
        path = self.directory / f"{split}.mask"
        return np.memmap(path, dtype=MASK_DTYPE, mode="r") if path.is_file() else None

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.tokenizer_spec)


# --- listing and splitting -------------------------------------------------------------------------

def _unreadable(e: OSError) -> ConfigError:
    """An OSError met listing or opening data.source, as one line naming the key (a permission, not a bug)."""
    return ConfigError(f"data.source: cannot read {e.filename}: {e.strerror or e}")


def _raise_unreadable(e: OSError) -> None:
    # os.walk's onerror: without it a subdirectory it cannot list is skipped in silence, and the run trains on
    # part of the data (or, the top one, finds "no documents")
    raise _unreadable(e)


def _source_kind(source: str) -> str:
    if source == "stdlib":
        return "stdlib"
    path = Path(source).expanduser()
    try:  # (a folder above it that cannot be searched: the stat is refused, not "not found")
        if path.is_dir():
            return "dir"
        if path.is_file():
            return {".bin": "bin", ".jsonl": "jsonl"}.get(path.suffix, "file")
        if path.exists():  # a fifo, a socket, a device such as /dev/null: reading one would block or give nothing
            raise ConfigError(f"data.source: {source} is not a regular file or directory")
    except OSError as e:
        raise _unreadable(e) from None
    raise ConfigError(f"data.source: file or directory not found: {source}")


def _check_readable(path: Path) -> None:
    """Open `path` once now, so a document this process may not read is one line naming data.source before any
    work, not an OSError from whichever reader (text, records, a memmap, BPE training) meets it first."""
    try:
        os.close(os.open(path, os.O_RDONLY))
    except OSError as e:
        raise _unreadable(e) from None


def documents(source: str) -> list[tuple[str, Path]]:
    """(relative name, path) of every text document of `source`, sorted by name.

    'stdlib': *.py under the stdlib, skipping site-packages/dist-packages so installed packages do not
    change the corpus. A directory: every regular file under it except hidden ones. A file: itself. A folder
    this process cannot list or search is a ConfigError naming data.source, never a part of the data left out
    (a document it cannot read: `prepare_data`, where the data is built).
    """
    kind = _source_kind(source)
    if kind in ("file", "bin", "jsonl"):
        path = Path(source).expanduser().resolve()
        return [(path.name, path)]
    stdlib = kind == "stdlib"
    root = Path(sysconfig.get_paths()["stdlib"] if stdlib else source).expanduser().resolve()
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=_raise_unreadable):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and not (stdlib and d in _EXCLUDED_DIRS)]
        for name in filenames:
            if name.startswith(".") or (stdlib and not name.endswith(".py")):
                continue
            path = Path(dirpath, name)
            try:
                if path.is_file():  # skips sockets, fifos and dangling links
                    found.append((path.relative_to(root).as_posix(), path))
            except OSError as e:  # (a folder that can be listed but not searched: the stat is refused)
                raise _unreadable(e) from None
    return sorted(found)


def is_val_document(name: str, val_fraction: float) -> bool:
    """A document's split depends only on its name, not on which other documents exist or their order."""
    h = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big")
    return h / 2**64 < val_fraction


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


# --- tokenizing ------------------------------------------------------------------------------------

def _encode_stream(tok: Tokenizer, texts: Iterable[str], out: BinaryIO, dtype: np.dtype) -> int:
    """Write the tokens of SEPARATOR.join(texts) to `out` as `dtype`; return how many were written."""
    sep = _encode_many(tok, [SEPARATOR])[0].astype(dtype)
    n = 0
    first = True
    for arr in _encode_batches(tok, texts):
        if not first:
            out.write(sep.tobytes())
            n += len(sep)
        out.write(arr.astype(dtype, copy=False).tobytes())
        n += len(arr)
        first = False
    return n


def _encode_batches(tok: Tokenizer, texts: Iterable[str]) -> Iterator[np.ndarray]:
    """Encode each text, grouping texts into batches so BPE can encode them in parallel."""
    batch: list[str] = []
    chars = 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if chars >= _BATCH_CHARS:
            yield from _encode_many(tok, batch)
            batch, chars = [], 0
    if batch:
        yield from _encode_many(tok, batch)


def _encode_many(tok: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Token arrays in the tokenizer's file dtype (`token_dtype` of its vocabulary)."""
    if isinstance(tok, ByteTokenizer):
        return [tok.encode_array(t) for t in texts]
    ids = tok.encode_batch(texts) if isinstance(tok, BPETokenizer) else [tok.encode(t) for t in texts]
    dtype = token_dtype(tok.vocab_size)
    return [np.asarray(i, dtype=dtype) for i in ids]


def _line_pieces(text: str, size: int) -> Iterator[str]:
    """Cut one big text at line ends into pieces of about `size` characters, for batched encoding."""
    start = 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        yield text[start:end]
        start = end


def _position_split(n: int, val_fraction: float) -> int:
    """Number of val tokens at the end of an n-token stream; both sides must be non-empty."""
    n_val = int(n * val_fraction)
    if n_val == 0 or n_val == n:
        raise ConfigError(
            f"data.val_fraction: {val_fraction} of {n} tokens leaves an empty "
            f"{'val' if n_val == 0 else 'train'} split; use a larger source or another fraction")
    return n_val


def _copy_tokens(tokens: np.ndarray, path: Path, dtype: np.dtype) -> None:
    with open(path, "wb") as out:
        for i in range(0, len(tokens), _COPY_TOKENS):
            out.write(np.ascontiguousarray(tokens[i:i + _COPY_TOKENS], dtype=dtype).tobytes())


def _file_dtype(data: DataConfig, vocab: int) -> np.dtype:
    """The dtype of the token files for a `vocab`-token tokenizer under `data.token_dtype`."""
    if data.token_dtype == "auto":
        return token_dtype(vocab)
    dtype = _DTYPES[data.token_dtype]
    if vocab > UINT16_VOCAB and dtype.itemsize == 2:
        raise ConfigError(f"data.token_dtype: uint16 cannot hold the ids of a {vocab}-token vocabulary "
                          f"(at most {UINT16_VOCAB}); use auto or uint32")
    return dtype


# --- building a folder -----------------------------------------------------------------------------

def _resolve_tokenizer(spec: str, kind: str) -> str:
    if spec in ("byte", "bpe"):
        if spec == "bpe" and kind == "bin":
            raise ConfigError("data.tokenizer: a .bin source is already tokenized; "
                              "use byte or a tokenizer.json path, not bpe")
        return spec
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(f"data.tokenizer: must be byte, bpe or a tokenizer.json file; not found: {spec}")
    return str(path.resolve())


def _check_vocab(tok: Tokenizer, vocab_size: int) -> None:
    if tok.vocab_size > MAX_VOCAB:
        raise ConfigError(
            f"data.tokenizer: {tok.vocab_size} tokens do not fit the uint32 token files (max {MAX_VOCAB})")
    if tok.vocab_size > vocab_size:
        raise ConfigError(
            f"model.vocab_size: {vocab_size} is smaller than the tokenizer's vocabulary of {tok.vocab_size}")


def _file_stats(paths: Iterable[tuple[str, Path]]) -> list[list[Any]]:
    stats = []
    for name, path in paths:
        st = path.stat()
        stats.append([name, st.st_size, st.st_mtime_ns])
    return stats


def _cache_key(data: DataConfig, kind: str, tok_spec: str, vocab_size: int,
               docs: list[tuple[str, Path]]) -> dict[str, Any]:
    key: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "kind": kind,
        "source": "stdlib" if kind == "stdlib" else str(Path(data.source).expanduser().resolve()),
        "files": _file_stats(docs),
        "tokenizer": tok_spec,
        "val_fraction": data.val_fraction,
    }
    if data.token_dtype != "auto":  # only when set, so folders prepared before the key existed are reused
        key["token_dtype"] = data.token_dtype
    if kind == "stdlib":
        key["python"] = f"{platform.python_implementation()}-{platform.python_version()}"
    if tok_spec == "bpe":
        key["vocab_size"] = vocab_size
    elif tok_spec != "byte":  # a tokenizer.json: changing it must re-tokenize
        key["tokenizer_file"] = _file_stats([("tokenizer", Path(tok_spec))])[0][1:]
    return key


def _label(data: DataConfig, kind: str, tok_spec: str) -> str:
    source = "stdlib" if kind == "stdlib" else Path(data.source).expanduser().resolve().name
    tok = tok_spec if tok_spec in ("byte", "bpe") else "custom"
    return f"{source}-{tok}"


def _build_text(tmp: Path, data: DataConfig, kind: str, tok_spec: str, vocab_size: int,
                docs: list[tuple[str, Path]]) -> dict[str, Any]:
    if kind == "file":
        text = _read(docs[0][1])
        if tok_spec == "bpe":
            # Train on the leading share only, so the tokenizer has not seen the held-out tail.
            head = text[: int(len(text) * (1 - data.val_fraction))]
            tok: Tokenizer = BPETokenizer.train([head], vocab_size)
        else:
            tok = load_tokenizer(tok_spec)
        _check_vocab(tok, vocab_size)
        dtype = _file_dtype(data, tok.vocab_size)
        pieces = _encode_many(tok, list(_line_pieces(text, _BATCH_CHARS // 8)))
        tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
        n_val = _position_split(len(tokens), data.val_fraction)
        _copy_tokens(tokens[: len(tokens) - n_val], tmp / "train.bin", dtype)
        _copy_tokens(tokens[len(tokens) - n_val:], tmp / "val.bin", dtype)
        n_train, split, n_val_docs = len(tokens) - n_val, "position", 0
    else:
        val_docs = [p for name, p in docs if is_val_document(name, data.val_fraction)]
        train_docs = [p for name, p in docs if not is_val_document(name, data.val_fraction)]
        if not val_docs or not train_docs:
            raise ConfigError(
                f"data.val_fraction: {data.val_fraction} puts {len(val_docs)} of {len(docs)} documents in val; "
                f"both splits need at least one (use more documents, another fraction, or a single file)")
        if tok_spec == "bpe":
            tok = BPETokenizer.train(train_docs, vocab_size)
        else:
            tok = load_tokenizer(tok_spec)
        _check_vocab(tok, vocab_size)
        dtype = _file_dtype(data, tok.vocab_size)
        with open(tmp / "train.bin", "wb") as f:
            n_train = _encode_stream(tok, map(_read, train_docs), f, dtype)
        with open(tmp / "val.bin", "wb") as f:
            n_val = _encode_stream(tok, map(_read, val_docs), f, dtype)
        split, n_val_docs = "document", len(val_docs)
    if n_train == 0 or n_val == 0:
        raise ConfigError(
            f"data.source: {data.source} yields {n_train} train and {n_val} val tokens; both must be non-empty")
    if tok_spec == "bpe":
        tok.save(tmp)
    return {"n_train": n_train, "n_val": n_val, "n_documents": len(docs), "n_val_documents": n_val_docs,
            "split": split, "vocab": tok.vocab_size, "max_token": None, "dtype": dtype.str}


def _build_bin(tmp: Path, data: DataConfig, tok_spec: str, vocab_size: int) -> dict[str, Any]:
    path = Path(data.source).expanduser()
    size = path.stat().st_size
    vocab = load_tokenizer(tok_spec).vocab_size
    # The file's own width: what data.token_dtype says, or what the tokenizer's ids need.
    dtype = _file_dtype(data, vocab)
    if size == 0 or size % dtype.itemsize:
        raise ConfigError(
            f"data.source: {data.source} is {size} bytes; a .bin of {_NAMES[dtype]} tokens needs a positive "
            f"multiple of {dtype.itemsize} (data.token_dtype={data.token_dtype})")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    n_val = _position_split(len(tokens), data.val_fraction)
    _copy_tokens(tokens[: len(tokens) - n_val], tmp / "train.bin", dtype)
    _copy_tokens(tokens[len(tokens) - n_val:], tmp / "val.bin", dtype)
    max_token = max(int(tokens[i:i + _COPY_TOKENS].max()) for i in range(0, len(tokens), _COPY_TOKENS))
    if max_token >= vocab:
        raise ConfigError(
            f"data.tokenizer: {data.source} holds token id {max_token}, beyond the tokenizer's {vocab} tokens")
    return {"n_train": len(tokens) - n_val, "n_val": n_val, "n_documents": 1, "n_val_documents": 0,
            "split": "position", "vocab": vocab, "max_token": max_token, "dtype": dtype.str}


def _spec_in(folder: Path, tok_spec: str) -> str:
    return str(folder / "tokenizer.json") if tok_spec == "bpe" else tok_spec


def prepare_data(data: DataConfig, vocab_size: int) -> PreparedData:
    """Tokenize `data.source` once into train.bin / val.bin in the cache; later calls reuse them.

    Safe to call from every rank at once. Raises ConfigError naming the key at fault.
    """
    kind = _source_kind(data.source)
    if not 0.0 < data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction: must be in (0, 1), got {data.val_fraction}")
    tok_spec = _resolve_tokenizer(data.tokenizer, kind)
    if tok_spec == "bpe" and not 256 <= vocab_size <= MAX_VOCAB:
        raise ConfigError(f"model.vocab_size: byte-level BPE needs 256..{MAX_VOCAB}, got {vocab_size}")
    if tok_spec != "bpe":  # checked before any work; a trained BPE is checked as it is built
        _check_vocab(load_tokenizer(tok_spec), vocab_size)
    docs = documents(data.source)
    if kind != "bin" and not docs:
        raise ConfigError(f"data.source: no documents found in {data.source}")
    if all(path.stat().st_size == 0 for _, path in docs):
        raise ConfigError(f"data.source: {data.source} is empty" if kind != "dir" and len(docs) == 1
                          else f"data.source: every file under {data.source} is empty")

    def build(tmp: Path) -> None:
        # every document opened once first, only where the data is built (one rank per host, on a cache miss:
        # on a shared file system every rank opening every file would be ranks x files metadata operations)
        for _, path in docs:
            _check_readable(path)
        if kind == "bin":
            info = _build_bin(tmp, data, tok_spec, vocab_size)
        elif kind == "jsonl":
            if tok_spec == "bpe":
                raise ConfigError("data.tokenizer: fine-tuning records need byte or the base model's tokenizer.json, not bpe")
            tok = load_tokenizer(tok_spec)
            dtype = _file_dtype(data, tok.vocab_size)
            info = build_records(tmp, data, tok, lambda t, texts: [a.astype(dtype) for a in _encode_many(t, texts)],
                                 SEPARATOR, is_val_document)
            info["dtype"] = dtype.str
        else:
            info = _build_text(tmp, data, kind, tok_spec, vocab_size, docs)
        meta = {"format": FORMAT_VERSION, "source": data.source, "kind": kind,
                "tokenizer": tok_spec, "val_fraction": data.val_fraction, "separator": SEPARATOR,
                **info}
        (tmp / COMPLETE_FILE).write_text(json.dumps(meta, indent=2) + "\n")

    key = _cache_key(data, kind, tok_spec, vocab_size, docs)
    folder = build_once(ready_cache_root(data.cache_dir), folder_name(_label(data, kind, tok_spec), key), build)
    meta = json.loads((folder / COMPLETE_FILE).read_text())
    return PreparedData(directory=folder, train_path=folder / "train.bin", val_path=folder / "val.bin",
                        tokenizer_spec=_spec_in(folder, tok_spec), meta=meta)
