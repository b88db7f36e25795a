"""The vocabulary of `dist_llm.hf`'s mapping, shared with `dist_llm.hf_moe`: where the rows of one of our tensors
come from in a Hugging Face checkpoint (`Piece`, `Mapping`), one tensor of an export (`HFTensor`), and reading a
key of a config.json. Names and shapes only; a leaf (imports only dist_llm.config)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from dist_llm.config import ConfigError


def _lookup(config: dict[str, Any], file: Path, keys: tuple[str, ...], default: Any) -> tuple[str | None, Any]:
    """(the first of `keys` present in config, its value); (None, `default`) when none is; a ConfigError naming
    the first key when there is no default either."""
    for key in keys:
        if config.get(key) is not None:
            return key, config[key]
    if default is ...:
        raise ConfigError(f"{file}: missing key {keys[0]!r}")
    return None, default


def _get(config: dict[str, Any], file: Path, *keys: str, default: Any = ...) -> Any:
    """The first of `keys` present in config (aliases), else `default`, else a ConfigError naming the key."""
    return _lookup(config, file, keys, default)[1]


# Typed reads of config.json: int() and float() would take "1e-5", 64.9 or true, and turn a list into a traceback.
def _shown(value: Any) -> str:
    text = json.dumps(value)  # (as config.json writes it: true, "x", [64])
    return text if len(text) <= 80 else text[:77] + "..."


def _int(config: dict[str, Any], file: Path, *keys: str, default: Any = ..., minimum: int = 1) -> Any:
    """An integer key of at least `minimum` (as `_get`; a default is returned as it is); a ConfigError "<file>:
    <key> must be a positive integer, got <value>" otherwise (true is no integer, nor is 64.0)."""
    key, value = _lookup(config, file, keys, default)
    if key is not None and (type(value) is not int or value < minimum):
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"{file}: {key} must be {what}, got {_shown(value)}")
    return value


def _float(config: dict[str, Any], file: Path, *keys: str, default: Any = ...) -> Any:
    """A positive finite number (an integer too, not true), as float; a ConfigError naming the key otherwise."""
    key, value = _lookup(config, file, keys, default)
    if key is None:
        return value
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{file}: {key} must be a positive number, got {_shown(value)}")
    return float(value)


def _bool(config: dict[str, Any], file: Path, key: str, default: bool) -> bool:
    """A true/false key (bool("false") is True: a string is refused, not read as yes)."""
    key_found, value = _lookup(config, file, (key,), default)
    if key_found is not None and type(value) is not bool:
        raise ConfigError(f"{file}: {key} must be true or false, got {_shown(value)}")
    return value


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows [start, start + rows) of one of our tensors: rows [0, rows) of the Hugging Face tensor `name`
    (of its columns when `transposed`: GPT-2's Conv1D stores (in, out)), or zeros where `name` is None
    (vocabulary padding) or where an `optional` tensor is absent (a bias the family leaves out)."""

    start: int
    rows: int
    name: str | None = None  # without the family prefix ("transformer." / "model.")
    hf_shape: tuple[int, ...] = ()
    transposed: bool = False
    optional: bool = False
    # of a 3-d (experts, x, y) Hugging Face tensor: the range of x that is ours (a fused gate_up_proj's half)
    part: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class Mapping:
    """One of our tensors: its full (tp=1) shape and the pieces that fill its rows, in order."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


def _whole(name: str, shape: tuple[int, ...], *, transposed: bool = False, optional: bool = False) -> Mapping:
    hf_shape = (shape[1], shape[0]) if transposed else shape
    return Mapping(shape, (Piece(0, shape[0], name, hf_shape, transposed, optional),))


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One tensor of a Hugging Face export: rows [rows[0], rows[1]) of our tensor `source` (all rows when
    `rows` is None; of its expert `expert` alone, a 2-d slice, when that is set), transposed when `transpose`
    (GPT-2's Conv1D stores (in, out), our experts (in, out) too); `source` None: zeros (a bias GPT-2 always has
    and a bias-free GPT lacks)."""

    name: str
    shape: tuple[int, ...]
    source: str | None
    rows: tuple[int, int] | None = None
    transpose: bool = False
    expert: int | None = None
