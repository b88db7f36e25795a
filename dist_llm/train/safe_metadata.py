"""Reading DCP's `.metadata` index, a pickle, without running any code from it.

DCP writes a checkpoint's index (which tensor, which chunk, which file and offset) with `pickle.dump` and its
own reader reads it back with `pickle.load`. A pickle is a small program: whoever can write a checkpoint's
files (and so its manifest's checksums) could make loading it call any importable function, e.g. through
protocol 4's dotted names (`os.system` is an attribute of every module that imports os). So the index is
read here by pickle's reference unpickler with a dispatch table of our own, which fails closed:

- opcodes: only those `pickle.dump` writes for an index at protocols 4 and 5 (strings, ints, tuples, lists,
  dicts, the memo, STACK_GLOBAL, NEWOBJ, REDUCE, BUILD); GLOBAL, INST, OBJ, EXT*, PERSID, NEWOBJ_EX, the
  buffer and set opcodes are refused;
- globals: exact (module, name) pairs, resolved to objects here, once: the index never makes the unpickler
  import a module or follow an attribute;
- REDUCE calls only the few callables an index needs (torch.Size, torch's layout lookup, DCP's memory-format
  enum, pathlib's path); NEWOBJ and BUILD make and fill only DCP's own dataclasses, and APPEND/SETITEM only
  plain lists and dicts.

The allowed pairs are those real DCP indexes are pickled with (listed from torch 2.13's; the tests load
checkpoints of every layout dist_llm saves through this reader), plus BytesStorageMetadata, so that a
non-tensor entry is refused by name after the read. collections.OrderedDict, which older readers allowed,
appears in no index.
"""

from __future__ import annotations

import pathlib
import pickle
import pickletools
from pathlib import Path
from typing import IO, Any, Callable

import torch
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.api import CheckpointException
from torch.serialization import _get_layout

from dist_llm.config import ConfigError

# The dataclasses an index is made of: created by NEWOBJ (no __init__ runs), filled by BUILD.
_CLASSES: tuple[type, ...] = (dcp_md.Metadata, dcp_md.StorageMeta, dcp_md.MetadataIndex, dcp_md.TensorStorageMetadata,
                              dcp_md.BytesStorageMetadata, dcp_md.ChunkStorageMetadata, dcp_md.TensorProperties,
                              dcp_fs._StorageInfo)
# The callables REDUCE may call, each on plain data: sizes and offsets, layouts (pickled by name through
# `_get_layout`), memory formats (pickled as DCP's enum) and the checkpoint's path in StorageMeta (the
# concrete class `Path()` makes on the saving machine).
_CALLABLES: tuple[Callable[..., Any], ...] = (torch.Size, _get_layout, dcp_md._MEM_FORMAT_ENCODING,
                                              pathlib.PosixPath, pathlib.WindowsPath)


def _global_name(obj: Any) -> tuple[str, str]:
    """The (module, name) pair `pickle.dump` writes for a class or function."""
    return obj.__module__, obj.__qualname__


def _allowed_globals() -> dict[tuple[str, str], Any]:
    allowed = {_global_name(obj): obj for obj in (*_CLASSES, *_CALLABLES)}
    # paths of a checkpoint saved by a Python whose pathlib is one module (3.11) or a package (3.13: pathlib._local)
    allowed.update({("pathlib", cls.__name__): cls for cls in (pathlib.PosixPath, pathlib.WindowsPath)})
    # dtypes pickle as globals of torch by their attribute name ("float32", "bfloat16", ...); values, not callables
    allowed.update({("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)})
    return allowed


_GLOBALS = _allowed_globals()
# by identity: an index's object may define __eq__, and these checks run once per object of a large index
_CLASS_IDS = frozenset(map(id, _CLASSES))
_CALLABLE_IDS = frozenset(map(id, _CALLABLES))

_OPCODES = frozenset({
    "PROTO", "FRAME", "STOP", "MARK",
    "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1",  # LONG1: offsets into files over 2 GiB
    "SHORT_BINUNICODE", "BINUNICODE",
    "EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "TUPLE",
    "EMPTY_LIST", "APPEND", "APPENDS", "EMPTY_DICT", "SETITEM", "SETITEMS",
    "MEMOIZE", "BINGET", "LONG_BINGET",
    "STACK_GLOBAL", "NEWOBJ", "REDUCE", "BUILD",
})


def _describe(obj: Any) -> str:
    if isinstance(obj, type) or callable(obj):
        return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"
    return f"a {type(obj).__qualname__}"


class _IndexUnpickler(pickle._Unpickler):  # the reference implementation: its dispatch table can be replaced
    """Unpickles a DCP index, refusing (with ConfigError naming `path`) anything an index is not made of."""

    def __init__(self, file: IO[bytes], path: Path) -> None:
        super().__init__(file)
        self.path = path

    def refuse(self, what: str) -> ConfigError:
        return ConfigError(f"{self.path}: {what}, which no checkpoint index holds; not loaded "
                           "(unpickling it could run code)")

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _GLOBALS[(module, name)]
        except (KeyError, TypeError):
            raise self.refuse(f"refers to {module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:  # unreachable (PERSID is refused); no object by id either way
        raise self.refuse("holds a persistent id")

    def load_reduce(self) -> None:
        func = self.stack[-2]
        if id(func) not in _CALLABLE_IDS:
            raise self.refuse(f"calls {_describe(func)}")
        pickle._Unpickler.load_reduce(self)

    def load_newobj(self) -> None:
        cls = self.stack[-2]
        if id(cls) not in _CLASS_IDS:
            raise self.refuse(f"creates {_describe(cls)}")
        pickle._Unpickler.load_newobj(self)

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        if id(type(inst)) not in _CLASS_IDS:
            raise self.refuse(f"sets the state of {_describe(inst)}")
        # a class's own __setstate__ (TensorProperties') takes its own form; otherwise a plain dict of fields,
        # never the (dict, slots) form, which would setattr
        if "__setstate__" not in vars(type(inst)) and type(state) is not dict:
            raise self.refuse(f"sets the state of {_describe(inst)} from {_describe(state)}")
        pickle._Unpickler.load_build(self)

    def _fill(self, target: Any, kind: type) -> None:
        if type(target) is not kind:
            raise self.refuse(f"adds items to {_describe(target)}")

    def _below_mark(self) -> Any:
        """What APPENDS/SETITEMS fill: the top of the stack below their mark."""
        return self.metastack[-1][-1] if self.metastack and self.metastack[-1] else None

    def load_append(self) -> None:
        self._fill(self.stack[-2], list)
        pickle._Unpickler.load_append(self)

    def load_appends(self) -> None:
        self._fill(self._below_mark(), list)
        pickle._Unpickler.load_appends(self)

    def load_setitem(self) -> None:
        self._fill(self.stack[-3], dict)
        pickle._Unpickler.load_setitem(self)

    def load_setitems(self) -> None:
        self._fill(self._below_mark(), dict)
        pickle._Unpickler.load_setitems(self)


def _refuse_opcode(op: pickletools.OpcodeInfo) -> Callable[[_IndexUnpickler], None]:
    def refuse(self: _IndexUnpickler) -> None:
        raise self.refuse(f"holds the pickle opcode {op.name}")

    return refuse


def _dispatch() -> dict[int, Callable[[_IndexUnpickler], None]]:
    """Every byte maps to a handler: the base unpickler's for allowed opcodes (ours where we check more), a
    refusal for every other opcode, and an error for bytes that are no opcode."""
    table: dict[int, Callable[[_IndexUnpickler], None]] = {}
    for code in range(256):
        table[code] = _not_an_opcode
    for op in pickletools.opcodes:
        code = op.code.encode("latin-1")[0]
        if op.name not in _OPCODES:
            table[code] = _refuse_opcode(op)
        else:
            handler = pickle._Unpickler.dispatch[code]
            table[code] = getattr(_IndexUnpickler, handler.__name__)
    return table


def _not_an_opcode(self: _IndexUnpickler) -> None:
    raise self.refuse("holds a byte that is no pickle opcode")


_IndexUnpickler.dispatch = _dispatch()


def load_index(file: IO[bytes], path: Path) -> dcp_md.Metadata:
    """The DCP index in `file` (named `path` in errors): a Metadata whose entries are all tensors and whose
    shards are files of the checkpoint's own directory; anything else is a ConfigError naming `path`."""
    try:
        metadata = _IndexUnpickler(file, path).load()
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or malformed: any failure is a bad index to the user
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{path}: not a DCP checkpoint index ({first})") from None
    if type(metadata) is not dcp_md.Metadata or not isinstance(metadata.state_dict_metadata, dict):
        raise ConfigError(f"{path}: not a DCP checkpoint index")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, dcp_md.TensorStorageMetadata):
            raise ConfigError(f"{path}: entry {key!r} is not a tensor; dist_llm checkpoints hold tensors only")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        # DCP joins this to the checkpoint's directory: a path elsewhere would read another file into a tensor
        if type(name) is not str or Path(name).name != name or name in ("", ".", ".."):
            raise ConfigError(f"{path}: names a shard file {name!r} outside the checkpoint's directory")
    return metadata


def load_failure(path: Path, error: CheckpointException) -> BaseException:
    """What to raise for a failed `dcp.load` of the checkpoint at `path`: one line naming it and the first
    rank's reason (e.g. torch.load, weights_only=True, refusing a shard whose bytes are no plain tensor),
    instead of DCP's exception, which holds every rank's traceback. An interrupt stays itself."""
    if not error.failures or not all(isinstance(exc, Exception) for exc, _ in error.failures.values()):
        return error
    rank = min(error.failures)
    exc = error.failures[rank][0]
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    # torch.load's weights_only refusal opens with a paragraph on its defaults; the line naming the global says why
    reason = next((line for line in lines if "unsupported" in line.lower()), lines[0])
    return ConfigError(f"{path}: its tensors cannot be read (rank {rank}: {reason})")
