"""Fine-tuning records: a JSONL file of {"prompt": ..., "completion": ...} or {"text": ...} lines.

Records are tokenized and packed one after another (SEPARATOR after each) into the same token files as a
text corpus, with a mask file beside them: 1 where a token is one to learn (completion, text, separator),
0 on prompt tokens. Batches turn masked targets into -100, which both cross-entropies ignore, so the loss
covers only what the model should produce. A record's split depends only on its line number.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from dist_llm.config import ConfigError, DataConfig
from dist_llm.data.tokenizer import Tokenizer

MASK_DTYPE = np.dtype("u1")


def read_records(path: Path) -> list[tuple[str, str]]:
    """(prompt, completion) of every non-blank line; a {"text": ...} record is ("", text)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"data.source: {path}:{n} is not JSON ({e.msg})") from None
            except RecursionError:
                raise ConfigError(f"data.source: {path}:{n} is nested too deeply to be a record") from None
            if isinstance(rec, dict) and isinstance(rec.get("text"), str):
                out.append(("", rec["text"]))
            elif isinstance(rec, dict) and isinstance(rec.get("prompt"), str) and isinstance(rec.get("completion"), str):
                out.append((rec["prompt"], rec["completion"]))
            else:
                raise ConfigError(f"data.source: {path}:{n} needs string fields prompt and completion, or text")
    if not out:
        raise ConfigError(f"data.source: {path} holds no records")
    return out


def build_records(tmp: Path, data: DataConfig, tok: Tokenizer, encode: Any, separator: str,
                  is_val: Any) -> dict[str, Any]:
    """Write train/val .bin token files and .mask files into `tmp`; `encode(tok, texts)` -> arrays."""
    path = Path(data.source).expanduser()
    records = read_records(path)
    sep = encode(tok, [separator])[0]
    splits: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {"train": ([], []), "val": ([], [])}
    for i, (prompt, completion) in enumerate(records):
        p, c = encode(tok, [prompt, completion]) if prompt else (sep[:0], encode(tok, [completion])[0])
        tokens, mask = splits["val" if is_val(f"record {i}", data.val_fraction) else "train"]
        tokens += [p, c, sep]
        mask += [np.zeros(len(p), MASK_DTYPE), np.ones(len(c) + len(sep), MASK_DTYPE)]
    sizes = {}
    for name, (tokens, mask) in splits.items():
        if not tokens:
            raise ConfigError(f"data.val_fraction: {data.val_fraction} leaves the {name} split of {len(records)} "
                              f"records in {path} empty; use more records or another fraction")
        t = np.concatenate(tokens)
        t.tofile(tmp / f"{name}.bin")
        np.concatenate(mask).tofile(tmp / f"{name}.mask")
        sizes[name] = len(t)
    return {"n_train": sizes["train"], "n_val": sizes["val"], "n_documents": len(records), "n_val_documents": 0,
            "split": "record", "vocab": tok.vocab_size, "max_token": None}
