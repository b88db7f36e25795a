"""An engine's state (nested dicts, lists, tensors, numbers, a loss scaler) as one safetensors file: the tensors
as safetensors tensors, everything else as JSON in the file's header metadata. Reading it runs no code (no
pickle): tensors are raw bytes, the rest is JSON, and the only object it rebuilds is handed in by the caller
(the live loss scaler, whose attributes are set from the JSON).

JSON form of a value: None, bool, int, float and str stand for themselves; anything else is a one-key dict,
so tags and data never mix:
  {"tensor": "<key in the file>"}   {"dtype": "bfloat16"}   {"tuple": [...]}   {"list": [...]}
  {"dict": [[key, value], ...]}     (keys str or int: torch optimizer states key parameters by index)
  {"object": "<class name>", "attrs": {"dict": ...}}   (only classes the writer allows, see `encode`)
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Any

import torch

from dist_llm.fileio import atomic_path

_KEY = "dist_llm.engine_state"  # the header metadata entry that holds the JSON
# torch's dtypes by name, looked up once from what torch already holds: getattr(torch, name) on a name from a file
# would run torch's lazy imports of submodules
_DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in vars(torch).values()
                                   if isinstance(d, torch.dtype)}


class EngineStateError(ValueError):
    """The file is not an engine state this code wrote, or does not fit the live engine."""


def encode(value: Any, tensors: dict[str, torch.Tensor], *, objects: tuple[type, ...] = ()) -> Any:
    """The JSON form of `value`; its tensors are added to `tensors` under fresh keys. Instances of `objects`
    are stored as their class name and attributes; any other object raises TypeError, so no state is dropped
    silently."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):  # DeepSpeed's ZeroStageEnum is an IntEnum: its value is what it means
        return encode(value.value, tensors, objects=objects)
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, torch.Tensor):
        key = str(len(tensors))
        # safetensors wants each tensor dense and owning its bytes: views (DeepSpeed's unpadded partitions)
        # are copied, tensors that already are are stored as they are
        t = value.detach()
        tensors[key] = t if t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes else t.contiguous().clone()
        return {"tensor": key}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, (list, tuple)):
        items = [encode(v, tensors, objects=objects) for v in value]
        return {"tuple": items} if isinstance(value, tuple) else {"list": items}
    if isinstance(value, dict):
        for k in value:
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise TypeError(f"engine state: dict key {k!r} is neither str nor int")
        return {"dict": [[k, encode(v, tensors, objects=objects)] for k, v in value.items()]}
    if isinstance(value, objects):
        return {"object": type(value).__name__, "attrs": encode(vars(value), tensors, objects=objects)}
    raise TypeError(f"engine state: cannot store a {type(value).__name__} as tensors and JSON")


def decode(tree: Any, tensors: dict[str, torch.Tensor], *, objects: dict[str, Any]) -> Any:
    """Inverse of `encode`. An {"object": name} entry becomes `objects[name]`, a live object of that class, with
    the stored attributes set on it; a name not in `objects` raises EngineStateError."""
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if not isinstance(tree, dict) or len(tree) != (2 if "object" in tree else 1):
        raise EngineStateError(f"unexpected JSON value {str(tree)[:80]}")
    tag, body = next(iter(tree.items()))
    if tag == "tensor" and isinstance(body, str) and body in tensors:
        return tensors[body]
    if tag == "dtype" and isinstance(body, str) and body in _DTYPES:
        return _DTYPES[body]
    if tag in ("list", "tuple") and isinstance(body, list):
        items = [decode(v, tensors, objects=objects) for v in body]
        return tuple(items) if tag == "tuple" else items
    if tag == "dict" and isinstance(body, list) and all(isinstance(kv, list) and len(kv) == 2 for kv in body):
        return {_key(k): decode(v, tensors, objects=objects) for k, v in body}
    if tag == "object" and isinstance(body, str) and isinstance(tree.get("attrs"), dict):
        if body not in objects:
            raise EngineStateError(f"holds a {body}, this engine has {sorted(objects) or 'none'}")
        live = objects[body]
        attrs = decode(tree["attrs"], tensors, objects=objects)
        if not isinstance(attrs, dict):
            raise EngineStateError(f"attributes of {body} are not a dict")
        for name, v in attrs.items():
            _check_attr(live, body, name, v)
        for name, v in attrs.items():
            setattr(live, name, v)
        return live
    raise EngineStateError(f"unexpected JSON value {str(tree)[:80]}")


def _kind(value: Any) -> str | None:
    """What sort of data `value` is, for comparing a saved attribute with the live one: int and float are one
    sort (a dynamic loss scale starts as an int and becomes a float once halved); None for anything not data."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "str"
    if isinstance(value, torch.dtype):
        return "dtype"
    return "none" if value is None else None


def _check_attr(live: Any, cls: str, name: Any, value: Any) -> None:
    """Refuses a saved attribute unless the live object holds data under that name (not a method, a property or
    a new name) and the saved value is data of the same sort. None matches any sort either way: a scaler's
    optional fields start as None."""
    held = vars(live)
    if not isinstance(name, str) or name not in held:
        raise EngineStateError(f"attribute {name!r} of {cls}: this engine's {cls} has no such data attribute")
    saved, now = _kind(value), _kind(held[name])
    if saved is None or now is None or (saved != now and "none" not in (saved, now)):
        raise EngineStateError(f"attribute {name!r} of {cls}: saved a {type(value).__name__}, this engine holds a "
                               f"{type(held[name]).__name__}")


def _key(k: Any) -> str | int:
    if isinstance(k, bool) or not isinstance(k, (str, int)):
        raise EngineStateError(f"dict key {k!r} is neither str nor int")
    return k


_LAYOUT_KEY = "dist_llm.engine_layout"  # the header metadata entry that describes how the state was cut


def write_engine_state(path: Path, state: Any, *, objects: tuple[type, ...] = (),
                       layout: dict[str, Any] | None = None) -> None:
    """`state` into the safetensors file `path`, atomically (a crash leaves the old file or none). `layout`
    (JSON data) goes into the header on its own, so `read_engine_layout` gets it without reading the tensors."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    tree = encode(state, tensors, objects=objects)
    cpu = {k: t.cpu() for k, t in tensors.items()}
    metadata = {_KEY: json.dumps(tree)}
    if layout is not None:
        metadata[_LAYOUT_KEY] = json.dumps(layout, sort_keys=True)
    with atomic_path(path) as tmp:
        save_file(cpu, str(tmp), metadata=metadata)


def read_engine_layout(path: Path) -> Any:
    """The `layout` that `write_engine_state` stored in `path`'s header (None when it stored none); reads the
    header only. Raises EngineStateError naming the file when it is not such a file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            text = (f.metadata() or {}).get(_LAYOUT_KEY)
        return None if text is None else json.loads(text)
    except (SafetensorError, json.JSONDecodeError, RecursionError) as e:
        raise EngineStateError(f"{path}: not an engine state file ({e})") from None


def read_engine_state(path: Path, *, objects: dict[str, Any]) -> Any:
    """What `write_engine_state` wrote to `path` (tensors on the CPU). Raises EngineStateError naming the file
    when it is not such a file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            text = (f.metadata() or {}).get(_KEY)
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if text is None:
            raise EngineStateError(f"no {_KEY} entry in its header")
        return decode(json.loads(text), tensors, objects=objects)
    except (SafetensorError, json.JSONDecodeError, RecursionError) as e:
        raise EngineStateError(f"{path}: not an engine state file ({e})") from None
    except EngineStateError as e:
        raise EngineStateError(f"{path}: {e}") from None
