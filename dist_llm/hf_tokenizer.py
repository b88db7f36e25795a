"""The tokenizer files of a Hugging Face export: `tokenizer.json` and `tokenizer_config.json`, which
transformers' `AutoTokenizer.from_pretrained` loads as a fast tokenizer that encodes and decodes exactly as
the run's own tokenizer does.

- A BPE run already has a `tokenizer.json` (the `tokenizers` library's own file, in the checkpoint): it is
  copied as it is.
- A byte-level run has no file: it is written here as a byte-level BPE with the 256 byte symbols and no
  merges, id b for byte b, the same ids `ByteTokenizer` gives (decoding invalid UTF-8 to U+FFFD as it does).

`tokenizer_config.json` names `PreTrainedTokenizerFast` (so neither GPT-2's nor Llama's slow tokenizer
classes are picked from the model type: they would want vocab.json/merges.txt or a SentencePiece model) and
turns off the clean-up of spaces before punctuation that transformers otherwise applies on decode.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def _byte_symbols() -> list[str]:
    """GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's): byte b is symbols[b].
    Printable Latin-1 bytes stand for themselves; the other 68 take the characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    kept = set(printable)
    others = [b for b in range(256) if b not in kept]
    table = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return [table[b] for b in range(256)]


def byte_tokenizer() -> tokenizers.Tokenizer:
    """A `tokenizers` tokenizer equal to dist_llm's ByteTokenizer: one token per UTF-8 byte, id = byte value."""
    symbols = _byte_symbols()
    # the library's own alphabet is the same 256 characters: a mismatch would make bytes unencodable
    assert set(symbols) == set(pre_tokenizers.ByteLevel.alphabet())
    tok = tokenizers.Tokenizer(models.BPE(vocab={s: b for b, s in enumerate(symbols)}, merges=[]))
    # no prefix space (it would come back on decode) and no regex split (no merges, so the split changes nothing)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def tokenizer_config(*, model_max_length: int) -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,  # decode must give back the text exactly
        "model_max_length": model_max_length,
        "add_bos_token": False, "add_eos_token": False,  # the model was trained without them
    }


def write_hf_tokenizer(folder: Path, tokenizer_json: Path | None, *, model_max_length: int) -> None:
    """Write `folder`/tokenizer.json (a copy of `tokenizer_json`, or the byte-level one when it is None) and
    tokenizer_config.json. The files take the mode of a plain open() (the caller's folder sets the umask's)."""
    folder = Path(folder)
    if tokenizer_json is None:
        byte_tokenizer().save(str(folder / TOKENIZER_FILE))
    else:
        shutil.copyfile(tokenizer_json, folder / TOKENIZER_FILE)
    config = tokenizer_config(model_max_length=model_max_length)
    (folder / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


__all__ = ["TOKENIZER_CONFIG_FILE", "TOKENIZER_FILE", "byte_tokenizer", "tokenizer_config", "write_hf_tokenizer"]
