"""Loading a checkpoint runs no code from it (`dist_llm.train.safe_metadata`).

A real tiny checkpoint is saved through the CLI; then its DCP `.metadata` index, a pickle, is replaced by one
written by hand for a route to os.system, subprocess.Popen, builtins.eval or a getattr chain, and its
manifest's checksum is rewritten to match (whoever can write the files can), so only the reader stands
between the file and the code. Every command that loads a checkpoint (`sample`, `train` resuming,
`model.init_from=ckpt:`, `convert`) must refuse it in one line naming the file, exit 2, and the file the
payload would create must not exist. Tensor shards and Hugging Face `pytorch_model.bin` files go through
torch.load(weights_only=True): a pickle calling os.system there is refused in one line too.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)

from dist_llm import cli
from dist_llm.config import ConfigError
from dist_llm.train.safe_metadata import load_index
from tests.conftest import made_once, tiny_overrides
from tests.test_launch import env

MD = "torch.distributed.checkpoint.metadata"  # the module the reader used to trust wholesale (it imports os)
STEP = "step_000002"
REFUSED_TEXT = "which no checkpoint index holds; not loaded (unpickling it could run code)"
REFUSED = r"which no checkpoint index holds; not loaded \(unpickling it could run code\)"


# -- pickles written by hand (protocol 4, as DCP writes its index) -----------------------------------------
def _str(s: str) -> bytes:
    b = s.encode()
    return (b"\x8c" + bytes([len(b)]) if len(b) < 256 else b"X" + struct.pack("<I", len(b))) + b


def _global(module: str, name: str) -> bytes:
    return _str(module) + _str(name) + b"\x93"  # STACK_GLOBAL


def _call(fn: bytes, *args: bytes) -> bytes:
    return fn + b"(" + b"".join(args) + b"tR"  # MARK args TUPLE REDUCE


def _list(*items: bytes) -> bytes:
    return b"](" + b"".join(items) + b"e"  # EMPTY_LIST MARK items APPENDS


def _program(body: bytes) -> bytes:
    return b"\x80\x04" + body + b"."  # PROTO 4 ... STOP


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def _getattr_chain(m: Path) -> bytes:
    """os.system reached as getattr(getattr(getattr(torch, "serialization"), "os"), "system")."""
    getattr_ = _global(MD, "torch.builtins.getattr")
    os_module = _call(getattr_, _call(getattr_, _global(MD, "torch"), _str("serialization")), _str("os"))
    return _program(_call(_call(getattr_, os_module, _str("system")), _str(f"touch {m}")))


def _popen_by_import(m: Path) -> bytes:
    """subprocess.Popen reached as getattr(__import__("subprocess"), "Popen")."""
    module = _call(_global(MD, "torch.builtins.__import__"), _str("subprocess"))
    popen = _call(_global(MD, "torch.builtins.getattr"), module, _str("Popen"))
    return _program(_call(popen, _list(_str("touch"), _str(str(m)))))


def _text_opcode(opcode: bytes, m: Path) -> bytes:
    """GLOBAL and INST name their global as text lines, outside STACK_GLOBAL."""
    where = f"{MD}\nos.system\n".encode()
    if opcode == b"c":
        return _program(b"c" + where + b"(" + _str(f"touch {m}") + b"tR")
    return _program(b"(" + _str(f"touch {m}") + b"i" + where)


# route -> (payload for a marker path, what the error names)
ROUTES: dict[str, tuple[Callable[[Path], bytes], str]] = {
    "os.system, a dotted name in DCP's module": (
        lambda m: _program(_call(_global(MD, "os.system"), _str(f"touch {m}"))), f"refers to {MD}.os.system"),
    "os.system through torch.serialization": (
        lambda m: _program(_call(_global(MD, "torch.serialization.os.system"), _str(f"touch {m}"))),
        f"refers to {MD}.torch.serialization.os.system"),
    "subprocess.Popen": (
        lambda m: _program(_call(_global("subprocess", "Popen"), _list(_str("touch"), _str(str(m))))),
        "refers to subprocess.Popen"),
    "subprocess.Popen through __import__ and getattr": (_popen_by_import, f"refers to {MD}.torch.builtins.getattr"),
    "builtins.eval": (
        lambda m: _program(_call(_global("builtins", "eval"), _str(f"__import__('os').system('touch {m}')"))),
        "refers to builtins.eval"),
    "builtins.eval, dotted": (
        lambda m: _program(_call(_global(MD, "torch.builtins.eval"), _str(f"__import__('os').system('touch {m}')"))),
        f"refers to {MD}.torch.builtins.eval"),
    "a getattr chain to os.system": (_getattr_chain, f"refers to {MD}.torch.builtins.getattr"),
    "an object's __reduce__": (lambda m: pickle.dumps(_RunsCode(m), protocol=4), "refers to posix.system"),
    "the GLOBAL opcode, dotted": (lambda m: _text_opcode(b"c", m), "holds the pickle opcode GLOBAL"),
    "the INST opcode, dotted": (lambda m: _text_opcode(b"i", m), "holds the pickle opcode INST"),
}


# -- a real checkpoint, and planting a payload in it --------------------------------------------------------
@pytest.fixture(scope="module")
def saved_run(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run trained 2 steps through the CLI, with its checkpoint at step 2."""
    def make(root: Path) -> Path:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        corpus = root / "corpus.txt"
        corpus.write_text("\n".join((stdlib / n).read_text() for n in ["argparse.py", "functools.py", "textwrap.py"]))
        out = root / "run"
        proc = subprocess.run([sys.executable, "-m", "dist_llm.cli", "train",
                               *tiny_overrides(out, data__source=corpus, train__max_steps=2, train__ckpt_interval=2,
                                               train__eval_interval=0)],
                              capture_output=True, text=True, env=env(), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (out / "checkpoints" / STEP / "manifest.json").is_file()
        return out

    return made_once(pytestconfig, tmp_path_factory, "saved_run", make)


@pytest.fixture
def run(saved_run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(saved_run, copy)
    return copy


def _checkpoint(run: Path) -> Path:
    return run / "checkpoints" / STEP


def _plant(checkpoint: Path, name: str, data: bytes) -> Path:
    """Write `data` as the checkpoint's file `name` and make the manifest vouch for it."""
    (checkpoint / name).write_bytes(data)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    return checkpoint / name


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _ran(marker: Path, route: str) -> bool:
    if "Popen" in route:  # Popen does not wait for its child: give a touch the time it needs
        time.sleep(0.3)
    return marker.exists()


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    code = cli.main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


# -- every route, through `dist-llm sample` ----------------------------------------------------------------
@pytest.mark.parametrize("route", list(ROUTES))
def test_sample_refuses_an_index_that_would_run_code(route: str, run: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    payload, culprit = ROUTES[route]
    marker = tmp_path / "PWNED"
    index = _plant(_checkpoint(run), ".metadata", payload(marker))
    code, err = _cli(["sample", "--checkpoint", str(run), "--max-new-tokens", "2"], capsys)
    assert not _ran(marker, route)
    assert code == 2
    assert len(err) == 1 and re.fullmatch(rf"dist-llm: error: {re.escape(str(index))}: {re.escape(culprit)}, "
                                          f"{REFUSED}", err[0]), err


# -- every command that loads a checkpoint, as the user runs it ----------------------------------------------
def _train_args(out: Path, saved_run: Path) -> list[str]:
    corpus = saved_run.parent / "corpus.txt"
    return ["train", *tiny_overrides(out, data__source=corpus, train__max_steps=4, train__eval_interval=0)]


COMMANDS: dict[str, tuple[str, Callable[[Path, Path, Path], list[str]]]] = {
    # command -> (route, argv for (run, saved_run, tmp_path))
    "sample": ("subprocess.Popen through __import__ and getattr",
               lambda run, saved, tmp: ["sample", "--checkpoint", str(run), "--max-new-tokens", "2"]),
    "train resume": ("os.system through torch.serialization", lambda run, saved, tmp: _train_args(run, saved)),
    "train init_from=ckpt:": ("builtins.eval, dotted", lambda run, saved, tmp: [
        *_train_args(tmp / "new", saved), f"model.init_from=ckpt:{_checkpoint(run)}"]),
    "convert --to-hf": ("a getattr chain to os.system",
                        lambda run, saved, tmp: ["convert", "--to-hf", str(run), "--out", str(tmp / "hf")]),
    "convert --to-full": ("the INST opcode, dotted", lambda run, saved, tmp: [
        "convert", "--to-full", str(run), "--out", str(tmp / "full.safetensors")]),
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_refuses_it_in_one_line_exit_2(command: str, run: Path, saved_run: Path,
                                                     tmp_path: Path) -> None:
    route, argv = COMMANDS[command]
    payload, culprit = ROUTES[route]
    marker = tmp_path / "PWNED"
    index = _plant(_checkpoint(run), ".metadata", payload(marker))
    before = _files(run / "checkpoints")
    proc = subprocess.run([sys.executable, "-m", "dist_llm.cli", *argv(run, saved_run, tmp_path)],
                          capture_output=True, text=True, env=env(), timeout=120)
    assert not _ran(marker, route)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    err = proc.stderr.strip().splitlines()
    if command == "train resume":  # the model is built (and says which attention kernel it uses) before the resume
        err = [line for line in err if not line.startswith("attention: ")]
    assert len(err) == 1 and re.fullmatch(rf"dist-llm: error: {re.escape(str(index))}: {re.escape(culprit)}, "
                                          f"{REFUSED}", err[0]), proc.stderr
    assert _files(run / "checkpoints") == before  # nothing of the run is lost
    assert not (tmp_path / "hf").exists() and not (tmp_path / "full.safetensors").exists()


# -- the reader itself -----------------------------------------------------------------------------------------
def _rich_index(tmp_path: Path) -> Metadata:
    """An index using every form a DCP index takes: several chunks, 0-d to 4-d shapes, dtypes of mixed training,
    a non-contiguous memory format, offsets past 2 GiB (pickled as LONG1), a one-item dict and list, long names."""
    long_name = "model." + "x" * 300
    entries = {
        "model.w": TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([4, 6]),
                                         [ChunkStorageMetadata(torch.Size([r * 2, 0]), torch.Size([2, 6]))
                                          for r in range(2)]),
        "optim.step": TensorStorageMetadata(TensorProperties(dtype=torch.int64), torch.Size([]),
                                            [ChunkStorageMetadata(torch.Size([]), torch.Size([]))]),
        "model.conv": TensorStorageMetadata(
            TensorProperties(dtype=torch.float16, memory_format=torch.channels_last, requires_grad=True),
            torch.Size([2, 3, 4, 5]), [ChunkStorageMetadata(torch.Size([0, 0, 0, 0]), torch.Size([2, 3, 4, 5]))]),
        long_name: TensorStorageMetadata(TensorProperties(dtype=torch.float32, memory_format=torch.preserve_format),
                                         torch.Size([3, 1, 2]),
                                         [ChunkStorageMetadata(torch.Size([0, 0, 0]), torch.Size([3, 1, 2]))]),
    }
    storage = {MetadataIndex("model.w", torch.Size([2, 0]), 1): _StorageInfo("__1_0.distcp", 2**33, 5),
               MetadataIndex(long_name, torch.Size([0, 0, 0])): _StorageInfo("__0_0.distcp", 2**40 + 3, 2**31)}
    return Metadata(entries, planner_data={"model.w": ("model", "w")}, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=tmp_path, save_id="s", modules=["m"]), version="1.0.0")


@pytest.mark.parametrize("protocol", [4, 5])  # DCP pickles at the default protocol: 4 on Python 3.11, 5 from 3.14
def test_genuine_indexes_read_as_pickle_reads_them(protocol: int, saved_run: Path, tmp_path: Path) -> None:
    real = (_checkpoint(saved_run) / ".metadata").read_bytes()
    rich = pickle.dumps(_rich_index(tmp_path), protocol=protocol)
    for data in (real, rich):
        # the reference: the stdlib's unrestricted unpickler, on bytes we made ourselves
        assert load_index(io.BytesIO(data), tmp_path / ".metadata") == pickle.loads(data)


# hand-written programs refused for their shape, not their names: each would otherwise do something an index never does
STRUCTURE: dict[str, tuple[bytes, str]] = {
    **{f"opcode {name}": (b"\x80\x04" + code + b".", f"holds the pickle opcode {name}") for name, code in [
        ("INST", b"i"), ("OBJ", b"o"), ("GLOBAL", b"c"), ("EXT1", b"\x82"), ("EXT2", b"\x83"), ("EXT4", b"\x84"),
        ("PERSID", b"P"), ("BINPERSID", b"Q"), ("NEWOBJ_EX", b"\x92"), ("BINBYTES", b"B"), ("BYTEARRAY8", b"\x96"),
        ("NEXT_BUFFER", b"\x97"), ("ADDITEMS", b"\x90"), ("BINFLOAT", b"G")]},
    "setting an attribute of an index class": (  # BUILD with slot state on the class itself: setattr(Metadata, ...)
        _program(_global(MD, "Metadata") + b"N}" + _str("pwned") + b"\x88s\x86b"), f"sets the state of {MD}.Metadata"),
    "setting attributes of an index object": (  # the slot-state form setattr()s any name, e.g. __class__
        _program(_global(MD, "Metadata") + b")\x81N}" + _str("__class__") + _global(MD, "StorageMeta") + b"s\x86b"),
        "sets the state of a Metadata from a tuple"),
    "calling an index class": (_program(_call(_global(MD, "Metadata"), _str("x"))), f"calls {MD}.Metadata"),
    "NEWOBJ of a callable that is no index class": (
        _program(_global("torch", "Size") + b")\x81"), "creates torch.Size"),
    "appending to an index object": (
        _program(_global(MD, "StorageMeta") + b")\x81" + _str("x") + b"a"), "adds items to a StorageMeta"),
    "setting items of an index object": (
        _program(_global(MD, "StorageMeta") + b")\x81(" + _str("k") + _str("v") + b"u"),
        "adds items to a StorageMeta"),
}


@pytest.mark.parametrize("case", list(STRUCTURE))
def test_refused_for_its_shape(case: str, tmp_path: Path) -> None:
    data, culprit = STRUCTURE[case]
    path = tmp_path / ".metadata"
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: {re.escape(culprit)}, {REFUSED}$"):
        load_index(io.BytesIO(data), path)
    assert not hasattr(Metadata, "pwned")


def test_a_shard_outside_the_checkpoint_is_refused(saved_run: Path, tmp_path: Path) -> None:
    metadata = pickle.loads((_checkpoint(saved_run) / ".metadata").read_bytes())
    first = next(iter(metadata.storage_data))
    metadata.storage_data[first].relative_path = "../other_run/__0_0.distcp"
    path = tmp_path / ".metadata"
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: names a shard file '../other_run/__0_0.distcp' "
                                          "outside the checkpoint's directory$"):
        load_index(io.BytesIO(pickle.dumps(metadata)), path)


# -- what torch.load reads: tensor shards and Hugging Face .bin files ---------------------------------------
def test_a_shard_that_would_run_code_is_refused_in_one_line(run: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """DCP reads each tensor of a shard with torch.load(weights_only=True); a tensor's bytes replaced by a pickle
    calling os.system (the index rewritten to point at it, as an attacker would) is refused, in one line."""
    checkpoint, marker = _checkpoint(run), tmp_path / "PWNED"
    blob = io.BytesIO()
    torch.save(_RunsCode(marker), blob)
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())
    key, info = next((k, v) for k, v in metadata.storage_data.items() if k.fqn == "model.wte.weight")
    evil = f"__evil_{info.relative_path}"
    metadata.storage_data[key] = _StorageInfo(evil, 0, len(blob.getvalue()))
    _plant(checkpoint, evil, blob.getvalue())
    _plant(checkpoint, ".metadata", pickle.dumps(metadata))
    code, err = _cli(["sample", "--checkpoint", str(run), "--max-new-tokens", "2"], capsys)
    assert not marker.exists()
    assert code == 2 and err == [f"dist-llm: error: {checkpoint}: its tensors cannot be read (rank 0: Trying to load "
                                 "unsupported GLOBAL posix.system whose module posix is blocked.)"], err


def test_a_pytorch_model_bin_that_would_run_code_is_refused(tmp_path: Path) -> None:
    hf_dir, marker = tmp_path / "hf", tmp_path / "PWNED"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 8,
                                                    "vocab_size": 16, "n_positions": 8}))
    torch.save({"transformer.wte.weight": _RunsCode(marker)}, hf_dir / "pytorch_model.bin")
    proc = subprocess.run([sys.executable, "-m", "dist_llm.cli", "convert", "--from-hf", str(hf_dir),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, env=env(), timeout=120)
    assert not marker.exists()
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"dist-llm: error: {hf_dir / 'pytorch_model.bin'}: cannot read weights (Trying to load unsupported GLOBAL "
        "posix.system whose module posix is blocked.)"), proc.stderr
    assert not (tmp_path / "out").exists()


# -- indexes that are no index: refused in one line, before anything hashes, iterates or prints them ------------
NO_INDEX = "not a DCP checkpoint index"


def _nested_tuple(depth: int) -> bytes:
    """t_0 = None, t_(k+1) = (t_k, t_k), each level one memo reference: 4 bytes a level, while hashing or
    printing t_depth takes 2**depth steps. The memo must be empty before it."""
    out = b"N\x94"  # NONE MEMOIZE: memo 0
    for k in range(depth):
        out += (b"h" + bytes([k]) if k < 256 else b"j" + struct.pack("<I", k)) + b"\x86\x94"  # GET TUPLE2 MEMOIZE
    return out


# each would hang on hashing a 2**100-step key, forever: the CLI must refuse it at once
HANGS: dict[str, tuple[bytes, str]] = {
    "a dict keyed by nested tuples": (  # the reviewer's 408-byte file: EMPTY_DICT key NONE SETITEM
        _program(b"}" + _nested_tuple(100) + b"Ns"), f"{NO_INDEX} (a dict keyed by a tuple, which no index holds)"),
    "DCP's memory-format enum looked up by nested tuples": (  # Enum(value) hashes value
        _program(_global(MD, "_MEM_FORMAT_ENCODING") + _nested_tuple(100) + b"\x85R"),
        f"calls {MD}._MEM_FORMAT_ENCODING on a tuple of tuple, {REFUSED_TEXT}"),
    "torch's layout table looked up by nested tuples": (
        _program(_global("torch.serialization", "_get_layout") + _nested_tuple(100) + b"\x85R"),
        f"calls torch.serialization._get_layout on a tuple of tuple, {REFUSED_TEXT}"),
}


@pytest.mark.parametrize("case", list(HANGS))
def test_an_index_that_takes_forever_to_hash_is_refused_at_once(case: str, run: Path) -> None:
    data, culprit = HANGS[case]
    index = _plant(_checkpoint(run), ".metadata", data)
    before = _files(run / "checkpoints")
    # a subprocess with a timeout: a regression fails here instead of hanging the suite
    proc = subprocess.run([sys.executable, "-m", "dist_llm.cli", "sample", "--checkpoint", str(run),
                           "--max-new-tokens", "2"], capture_output=True, text=True, env=env(), timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == f"dist-llm: error: {index}: {culprit}", proc.stderr
    assert _files(run / "checkpoints") == before


def test_the_408_byte_hang_file_is_refused_in_well_under_a_second(tmp_path: Path) -> None:
    data = HANGS["a dict keyed by nested tuples"][0]
    assert len(data) == 408  # the size the review found it at: 100 levels of 4 bytes
    path = tmp_path / ".metadata"
    path.write_bytes(data)
    timer = ("import time; from pathlib import Path; from dist_llm.config import ConfigError; "
             "from dist_llm.train.safe_metadata import load_index\n"
             f"path = Path({str(path)!r}); t = time.perf_counter()\n"
             "try:\n    load_index(path.open('rb'), path)\nexcept ConfigError:\n    print(time.perf_counter() - t)")
    proc = subprocess.run([sys.executable, "-c", timer], capture_output=True, text=True, env=env(), timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr
    assert float(proc.stdout) < 0.1  # a read of 408 bytes; the hash it refuses would take 2**100 steps


def _edited_index(saved_run: Path, edit: Callable[[Metadata], None]) -> bytes:
    metadata = pickle.loads((_checkpoint(saved_run) / ".metadata").read_bytes())
    edit(metadata)
    return pickle.dumps(metadata, protocol=4)


def _drop_field(name: str) -> Callable[[Metadata], None]:
    return lambda metadata: vars(metadata).pop(name)


def _set_field(name: str, value: object) -> Callable[[Metadata], None]:
    return lambda metadata: setattr(metadata, name, value)


# a real index edited (as pickle.dumps writes it) into something DCP or dist_llm would trip on with a traceback
EDITED: dict[str, tuple[Callable[[Metadata], None], str]] = {
    "storage_data a list": (_set_field("storage_data", [1]),
                            f"{NO_INDEX} (Metadata.storage_data is a list, not a dict)"),
    "no state_dict_metadata": (_drop_field("state_dict_metadata"),
                               f"{NO_INDEX} (a Metadata without its field state_dict_metadata)"),
    "storage_meta a str": (_set_field("storage_meta", "x"),
                           f"{NO_INDEX} (Metadata.storage_meta is a str, not None or a StorageMeta)"),
}
# `__setstate__` put into an index object by one BUILD, so that the next BUILD calls what it names
_SETSTATE_THEN_BUILD = _program(_global(MD, "Metadata") + b")\x81}" + _str("__setstate__") + _global(MD, "Metadata")
                                + b"sb}" + _str("state_dict_metadata") + b"}sb")


@pytest.mark.parametrize("case", [*EDITED, "__setstate__ then BUILD"])
def test_sample_refuses_a_malformed_index_in_one_line_exit_2(case: str, run: Path, saved_run: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    if case in EDITED:
        edit, culprit = EDITED[case]
        data = _edited_index(saved_run, edit)
    else:
        data, culprit = _SETSTATE_THEN_BUILD, f"sets the field '__setstate__' of a Metadata, {REFUSED_TEXT}"
    index = _plant(_checkpoint(run), ".metadata", data)
    code, err = _cli(["sample", "--checkpoint", str(run), "--max-new-tokens", "2"], capsys)
    assert code == 2 and err == [f"dist-llm: error: {index}: {culprit}"], err


def _nested_lists(depth: int) -> bytes:
    return b"]" * depth + b"a" * (depth - 1)  # EMPTY_LIST x depth, then APPEND each into the one below


def _index_with(field: str, value: bytes) -> bytes:
    """A Metadata of no tensors whose `field` is `value` (pickle bytes), written by hand."""
    return _program(_global(MD, "Metadata") + b")\x81}(" + _str("state_dict_metadata") + b"}" + _str("storage_data")
                    + b"}" + _str(field) + value + b"ub")


SHAPES: dict[str, tuple[bytes, str]] = {
    "a second BUILD of one object": (
        _program(_global(MD, "Metadata") + b")\x81}" + _str("version") + _str("1") + b"sb}b"),
        f"sets the state of a Metadata twice, {REFUSED_TEXT}"),
    "NEWOBJ with arguments": (_program(_global(MD, "Metadata") + b"(K\x01t\x81"),
                              f"creates {MD}.Metadata from arguments, {REFUSED_TEXT}"),
    "a dict filled by SETITEMS with a tuple key": (
        _program(b"}(NN\x86Nu"), f"{NO_INDEX} (a dict keyed by a tuple, which no index holds)"),
    "a torch.Size of 65 dimensions": (
        _program(_call(_global("torch", "Size"), _list(*[b"K\x01"] * 65))), f"calls torch.Size on a tuple of list, "
                                                                             f"{REFUSED_TEXT}"),
    "a path of 5000 characters": (
        _program(_call(_global("pathlib", "PosixPath"), _str("x" * 5000))), f"calls pathlib.PosixPath on a tuple of "
                                                                            f"str, {REFUSED_TEXT}"),
    # built without recursion, checked without recursion: a RecursionError anywhere would be a traceback
    "100000 nested lists as the version": (
        _index_with("version", _nested_lists(100_000)), f"{NO_INDEX} (Metadata.version is a list, not None or a str)"),
    "a shard offset below 0": (
        _program(_global(MD, "Metadata") + b")\x81}(" + _str("state_dict_metadata") + b"}" + _str("storage_data")
                 + b"}" + _global(MD, "MetadataIndex") + b")\x81}" + _str("fqn") + _str("w") + b"sb"
                 + _global("torch.distributed.checkpoint.filesystem", "_StorageInfo") + b")\x81}("
                 + _str("relative_path") + _str("__0_0.distcp") + _str("offset") + b"J\xff\xff\xff\xff"
                 + _str("length") + b"K\x01ubsub"),
        f"{NO_INDEX} (_StorageInfo.offset is a int, not an int >= 0)"),
}


@pytest.mark.parametrize("case", list(SHAPES))
def test_refused_as_no_index(case: str, tmp_path: Path) -> None:
    data, culprit = SHAPES[case]
    path = tmp_path / ".metadata"
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: {re.escape(culprit)}$"):
        load_index(io.BytesIO(data), path)


def test_a_chunk_outside_its_tensor_is_refused(saved_run: Path, tmp_path: Path) -> None:
    """DCP narrows the tensor it loads by a chunk's offsets and sizes: they must lie inside the tensor."""
    def grow(metadata: Metadata) -> None:
        metadata.state_dict_metadata["model.wte.weight"].chunks[0].sizes = torch.Size([257, 32])

    path = tmp_path / ".metadata"
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: {NO_INDEX} \(a chunk at \(0, 0\) of "
                                          r"\(257, 32\) outside its tensor of \(256, 32\)\)$"):
        load_index(io.BytesIO(_edited_index(saved_run, grow)), path)


def test_chunks_that_do_not_tile_their_tensor_are_refused(saved_run: Path, tmp_path: Path) -> None:
    """A load writes each chunk into storage that starts uninitialised (to_empty, fresh moments): a gap would
    leave garbage in the model without an error, an overlap would mean a stale chunk. Both are refused."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    def gap(metadata: Metadata) -> None:  # the tensor's one chunk shrunk: its last row covered by none
        metadata.state_dict_metadata["model.wte.weight"].chunks[0].sizes = torch.Size([255, 32])

    def overlap(metadata: Metadata) -> None:  # the right total volume, row 127 twice and row 255 never
        metadata.state_dict_metadata["model.wte.weight"].chunks[:] = [
            ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([128, 32])),
            ChunkStorageMetadata(offsets=torch.Size([255, 0]), sizes=torch.Size([0, 32])),  # empty: no overlap
            ChunkStorageMetadata(offsets=torch.Size([127, 0]), sizes=torch.Size([128, 32]))]

    path = tmp_path / ".metadata"
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: {NO_INDEX} \(the chunks of a tensor of "
                                          r"\(256, 32\) cover 8160 of its 8192 elements\)$"):
        load_index(io.BytesIO(_edited_index(saved_run, gap)), path)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: {NO_INDEX} \(chunks at \(0, 0\) and "
                                          r"\(127, 0\) of a tensor of \(256, 32\) overlap\)$"):
        load_index(io.BytesIO(_edited_index(saved_run, overlap)), path)
