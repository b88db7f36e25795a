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
  enum, pathlib's path), each on arguments of the types it takes; NEWOBJ and BUILD make and fill only DCP's
  own dataclasses, each once and with its own field names only (so `__setstate__` or `__class__` cannot be
  set), and APPEND/SETITEM only plain lists and dicts;
- work: nothing is hashed, compared or printed before its type is known. A dict key is a str or a
  MetadataIndex whose fields are already typed (a key made of tuples nested through the memo would take
  2**depth steps to hash), sizes have at most _MAX_DIMS dimensions and a path at most _MAX_PATH characters,
  so every step costs at most a bounded multiple of the bytes read;
- then every field of the Metadata is checked against the types DCP gives it (a dict where DCP iterates a
  dict, ints where it computes offsets, chunks inside their tensor), each object once, so what DCP and
  dist_llm do with the index afterwards cannot fail or run long on something an index never holds.

The allowed pairs are those real DCP indexes are pickled with (listed from torch 2.13's; the tests load
checkpoints of every layout dist_llm saves through this reader), plus BytesStorageMetadata, so that a
non-tensor entry is refused by name after the read. collections.OrderedDict, which older readers allowed,
appears in no index.
"""

from __future__ import annotations

import io
import math
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
# No dist_llm tensor has more than a few dimensions; the cap bounds what hashing or checking one size costs,
# however often the index refers to it.
_MAX_DIMS = 64
_MAX_PATH = 4096  # Linux's PATH_MAX: a checkpoint's path, as StorageMeta records it, is never longer
_FIELDS: dict[type, frozenset[str]] = {cls: frozenset(cls.__dataclass_fields__) for cls in _CLASSES}
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


def _is_size(obj: Any) -> bool:
    return type(obj) is torch.Size and len(obj) <= _MAX_DIMS  # torch.Size holds ints only


def _int_or_none(obj: Any) -> bool:
    return obj is None or type(obj) is int


def _index_fields_fit(key: dcp_md.MetadataIndex) -> bool:
    """Whether a MetadataIndex's fields are typed (the class's defaults stand for fields BUILD did not set)."""
    fields = vars(key)
    offset = fields.get("offset")
    return (type(fields.get("fqn")) is str and (offset is None or _is_size(offset))
            and _int_or_none(fields.get("index")))


def _arguments_fit(func: Any, args: tuple[Any, ...]) -> bool:
    """Whether `args` are what `func` (one of _CALLABLES) is called with in an index."""
    if func is torch.Size:
        return (len(args) == 1 and type(args[0]) in (tuple, list) and len(args[0]) <= _MAX_DIMS
                and all(type(n) is int for n in args[0]))
    if func is _get_layout:
        return len(args) == 1 and type(args[0]) is str and len(args[0]) <= 64
    if func is dcp_md._MEM_FORMAT_ENCODING:
        return len(args) == 1 and type(args[0]) is int
    # pathlib.PosixPath / WindowsPath: a path's parts
    return all(type(a) is str for a in args) and sum(map(len, args)) <= _MAX_PATH


def _properties_state_fits(state: Any) -> bool:
    """TensorProperties' pickled form: (dtype, layout, requires_grad, memory format's enum, pin_memory)."""
    return (type(state) is tuple and len(state) == 5 and type(state[0]) is torch.dtype
            and type(state[1]) is torch.layout and type(state[2]) is bool
            and type(state[3]) is dcp_md._MEM_FORMAT_ENCODING and type(state[4]) is bool)


def _describe_items(items: Any) -> str:
    kinds = sorted({type(item).__qualname__ for item in items}) if type(items) in (tuple, list) else []
    return ", ".join(kinds[:4]) or "nothing"


def _describe(obj: Any) -> str:
    if isinstance(obj, type) or callable(obj):
        return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"
    return f"a {type(obj).__qualname__}"


class _IndexUnpickler(pickle._Unpickler):  # the reference implementation: its dispatch table can be replaced
    """Unpickles a DCP index, refusing (with ConfigError naming `path`) anything an index is not made of."""

    def __init__(self, file: IO[bytes], path: Path) -> None:
        super().__init__(file)
        self.path = path
        self.built: dict[int, Any] = {}

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
        args = self.stack[-1]
        if type(args) is not tuple or not _arguments_fit(func, args):
            raise self.refuse(f"calls {_describe(func)} on {_describe(args)} of {_describe_items(args)}")
        pickle._Unpickler.load_reduce(self)

    def load_newobj(self) -> None:
        cls = self.stack[-2]
        if id(cls) not in _CLASS_IDS:
            raise self.refuse(f"creates {_describe(cls)}")
        if type(self.stack[-1]) is not tuple or self.stack[-1]:  # DCP's dataclasses pickle with no arguments to __new__
            raise self.refuse(f"creates {_describe(cls)} from arguments")
        pickle._Unpickler.load_newobj(self)

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        if id(type(inst)) not in _CLASS_IDS:
            raise self.refuse(f"sets the state of {_describe(inst)}")
        # a class's own __setstate__ (TensorProperties') takes its own form; otherwise a plain dict of fields,
        # never the (dict, slots) form, which would setattr
        own_form = "__setstate__" in vars(type(inst))
        if not own_form and type(state) is not dict:
            raise self.refuse(f"sets the state of {_describe(inst)} from {_describe(state)}")
        # once: a first BUILD could put a field into the instance that a second one would then call
        if id(inst) in self.built:
            raise self.refuse(f"sets the state of {_describe(inst)} twice")
        if own_form and not _properties_state_fits(state):
            raise self.refuse(f"sets the state of {_describe(inst)} from {_describe(state)} of "
                              f"{_describe_items(state)}")
        if not own_form:
            for key in state:  # a field of the class, never a dunder (`__setstate__`, `__class__`, ...)
                if type(key) is not str or key not in _FIELDS[type(inst)]:
                    shown = repr(key[:40]) if type(key) is str else _describe(key)
                    raise self.refuse(f"sets the field {shown} of {_describe(inst)}")
        self.built[id(inst)] = inst  # held, so that no later object can take its id
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

    def _check_key(self, key: Any) -> None:
        """A dict key is hashed when it is set: only a str or a MetadataIndex of typed fields (whose hash is
        that of a str and a short size) is, never a tuple or anything else whose hash could run long."""
        if type(key) is str or (type(key) is dcp_md.MetadataIndex and _index_fields_fit(key)):
            return
        raise ConfigError(f"{self.path}: not a DCP checkpoint index (a dict keyed by {_describe(key)}, "
                          "which no index holds)")

    def load_setitem(self) -> None:
        self._fill(self.stack[-3], dict)
        self._check_key(self.stack[-2])
        pickle._Unpickler.load_setitem(self)

    def load_setitems(self) -> None:
        self._fill(self._below_mark(), dict)
        for key in self.stack[0::2]:  # the items above the mark: key, value, key, value, ...
            self._check_key(key)
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
    """The DCP index in `file` (named `path` in errors): a Metadata whose fields have the types DCP gives them,
    whose entries are all tensors and whose shards are files of the checkpoint's own directory; anything else
    is a ConfigError naming `path`."""
    # in memory first: a string's length field then reads at most the file, never allocates what it claims
    data = file.read()
    try:
        metadata = _IndexUnpickler(io.BytesIO(data), path).load()
        _IndexCheck(path).metadata(metadata)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or malformed: any failure is a bad index to the user
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ConfigError(f"{path}: not a DCP checkpoint index ({first})") from None
    return metadata


class _IndexCheck:
    """Checks an unpickled index field by field, to the fixed depth of DCP's dataclasses (never recursing
    into what the file nests), each shared object once (an index may refer to one object many times)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: set[tuple[int, str]] = set()
        self.chunk_lists: dict[int, tuple[int, ...]] = {}

    def fail(self, what: str, value: Any, expected: str) -> ConfigError:
        return ConfigError(f"{self.path}: not a DCP checkpoint index ({what} is {_describe(value)}, "
                           f"not {expected})")

    def first_time(self, obj: Any, kind: str) -> bool:
        key = (id(obj), kind)  # every object stays alive in the index while it is checked: ids are stable
        if key in self.seen:
            return False
        self.seen.add(key)
        return True

    def field(self, obj: Any, name: str) -> Any:
        """A field as DCP reads it: set by BUILD, or the class's default; a field with neither is missing."""
        try:
            return getattr(obj, name)
        except AttributeError:
            raise ConfigError(f"{self.path}: not a DCP checkpoint index (a {type(obj).__qualname__} "
                              f"without its field {name})") from None

    def typed(self, obj: Any, name: str, test: Callable[[Any], bool], expected: str) -> Any:
        value = self.field(obj, name)
        if not test(value):
            raise self.fail(f"{type(obj).__qualname__}.{name}", value, expected)
        return value

    def metadata(self, metadata: Any) -> None:
        if type(metadata) is not dcp_md.Metadata:
            raise self.fail("the index", metadata, "a Metadata")
        entries = self.typed(metadata, "state_dict_metadata", lambda v: type(v) is dict, "a dict")
        for key, entry in entries.items():  # keys are str or MetadataIndex: checked as the dict was filled
            if type(key) is not str:
                raise self.fail("a key of state_dict_metadata", key, "a str")
            if type(entry) is not dcp_md.TensorStorageMetadata:
                raise ConfigError(f"{self.path}: entry {key[:200]!r} is not a tensor; dist_llm checkpoints "
                                  "hold tensors only")
            self.tensor(entry)
        self.typed(metadata, "planner_data", self.planner_data_fits, "None or a dict of str to a tuple of str")
        storage = self.typed(metadata, "storage_data", lambda v: type(v) is dict, "a dict")
        for key, info in storage.items():
            if type(key) is not dcp_md.MetadataIndex:
                raise self.fail("a key of storage_data", key, "a MetadataIndex")
            self.storage_info(info)
        meta = self.typed(metadata, "storage_meta",
                          lambda v: v is None or type(v) is dcp_md.StorageMeta, "None or a StorageMeta")
        if meta is not None:
            self.storage_meta(meta)
        self.typed(metadata, "version", lambda v: v is None or type(v) is str, "None or a str")

    def all_of(self, items: list[Any] | tuple[Any, ...], kinds: tuple[type, ...]) -> bool:
        """Whether every item is of one of `kinds`; a list or tuple the index shares is looked at once."""
        return not self.first_time(items, f"items of {kinds}") or all(type(item) in kinds for item in items)

    def planner_data_fits(self, value: Any) -> bool:
        """The default planners' planner_data: each flattened name's path in the nested state dict."""
        if value is None:
            return True
        return type(value) is dict and all(
            type(key) is str and type(path) is tuple and self.all_of(path, (str, int)) for key, path in value.items())

    def tensor(self, entry: dcp_md.TensorStorageMetadata) -> None:
        if not self.first_time(entry, "tensor"):
            return
        props = self.typed(entry, "properties", lambda v: type(v) is dcp_md.TensorProperties, "a TensorProperties")
        if self.first_time(props, "properties"):
            for name, kind in (("dtype", torch.dtype), ("layout", torch.layout), ("requires_grad", bool),
                               ("memory_format", torch.memory_format), ("pin_memory", bool)):
                self.typed(props, name, lambda v, kind=kind: type(v) is kind, f"a {kind.__qualname__}")
        size = self.typed(entry, "size", _is_size, f"a torch.Size of at most {_MAX_DIMS} dimensions")
        chunks = self.typed(entry, "chunks", lambda v: type(v) is list, "a list")
        # checked once: a list shared by tensors of different sizes (DCP makes one per tensor) would be checked
        # once per tensor, a cost of their product
        checked_for = self.chunk_lists.setdefault(id(chunks), tuple(size))
        if checked_for != tuple(size):
            raise ConfigError(f"{self.path}: not a DCP checkpoint index (one list of chunks for tensors of "
                              f"{checked_for} and {tuple(size)})")
        if not self.first_time(chunks, "chunks"):
            return
        for chunk in chunks:
            self.chunk(chunk, size)
        self.tiling(chunks, size)

    def chunk(self, chunk: Any, size: torch.Size) -> None:
        if type(chunk) is not dcp_md.ChunkStorageMetadata:
            raise self.fail("a chunk", chunk, "a ChunkStorageMetadata")
        shape = f"a torch.Size of {len(size)} dimensions"
        offsets = self.typed(chunk, "offsets", lambda v: _is_size(v) and len(v) == len(size), shape)
        sizes = self.typed(chunk, "sizes", lambda v: _is_size(v) and len(v) == len(size), shape)
        # DCP narrows tensors by these: a chunk outside its tensor would read or write past it
        if not all(0 <= o and 0 <= n and o + n <= d for o, n, d in zip(offsets, sizes, size)):
            raise ConfigError(f"{self.path}: not a DCP checkpoint index (a chunk at {tuple(offsets)} of "
                              f"{tuple(sizes)} outside its tensor of {tuple(size)})")

    def tiling(self, chunks: list[Any], size: torch.Size) -> None:
        """The chunks cover their tensor exactly once. A load writes each chunk into the parameters' and
        moments' own storage, which starts uninitialised: an element no chunk covers would keep that garbage
        without an error, and overlapping chunks would mean one of them is stale."""
        numel = math.prod(size)
        covered = sum(math.prod(c.sizes) for c in chunks)
        if covered != numel:
            raise ConfigError(f"{self.path}: not a DCP checkpoint index (the chunks of a tensor of {tuple(size)} "
                              f"cover {covered} of its {numel} elements)")
        if not size:
            return
        # Equal volumes: a gap exists exactly when two chunks overlap. Sweep along dim 0, comparing only the
        # chunks whose rows meet (for row runs and ZeRO ranges that is a few neighbours, not every pair).
        active: list[Any] = []
        for c in sorted((c for c in chunks if math.prod(c.sizes)), key=lambda c: c.offsets[0]):
            active = [a for a in active if a.offsets[0] + a.sizes[0] > c.offsets[0]]
            for a in active:
                if all(max(o, p) < min(o + n, p + m) for o, n, p, m in zip(a.offsets, a.sizes, c.offsets, c.sizes)):
                    raise ConfigError(f"{self.path}: not a DCP checkpoint index (chunks at {tuple(a.offsets)} and "
                                      f"{tuple(c.offsets)} of a tensor of {tuple(size)} overlap)")
            active.append(c)

    def storage_info(self, info: Any) -> None:
        if type(info) is not dcp_fs._StorageInfo:
            raise self.fail("a value of storage_data", info, "a _StorageInfo")
        if not self.first_time(info, "storage"):
            return
        name = self.typed(info, "relative_path", lambda v: type(v) is str, "a str")
        # DCP joins this to the checkpoint's directory: a path elsewhere would read another file into a tensor
        if Path(name).name != name or name in ("", ".", ".."):
            raise ConfigError(f"{self.path}: names a shard file {name[:200]!r} outside the checkpoint's directory")
        for field in ("offset", "length"):
            self.typed(info, field, lambda v: type(v) is int and v >= 0, "an int >= 0")
        self.typed(info, "transform_descriptors",
                   lambda v: v is None or (type(v) in (list, tuple) and self.all_of(v, (str,))),
                   "None or a list of str")

    def storage_meta(self, meta: dcp_md.StorageMeta) -> None:
        self.typed(meta, "checkpoint_id", lambda v: v is None or type(v) in (str, pathlib.PosixPath,
                                                                              pathlib.WindowsPath),
                   "None, a str or a path")
        for field in ("save_id", "load_id"):
            self.typed(meta, field, lambda v: v is None or type(v) is str, "None or a str")
        self.typed(meta, "modules", lambda v: type(v) is list and all(type(m) is str for m in v), "a list of str")


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
