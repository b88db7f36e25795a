"""`dist_llm.safetensors_read`: regions of safetensors files read with explicit reads, bit for bit what
safetensors' own slices give, in bounded blocks of whole rows, without mapping the file; a file damaged or cut
short is one line naming it."""

from __future__ import annotations

import json
import re
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dist_llm.config import ConfigError, ModelConfig
from dist_llm.hf import HFCheckpoint
from dist_llm.safetensors_read import NonFinite, ShardFile, check_finite, read_header

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    tensors = {f"w_{str(d).removeprefix('torch.')}": (torch.randn(37, 53, generator=g) * 100).to(d) for d in DTYPES}
    tensors["bias"] = torch.randn(29, generator=g)
    file = tmp_path / "w.safetensors"
    save_file(tensors, str(file))
    return file


REGIONS = [((0, 37), None), ((5, 6), (0, 53)), ((3, 30), (7, 41)), ((36, 37), (52, 53)), ((10, 10), (0, 5))]


@pytest.mark.parametrize("block_bytes", [1, 300, 1 << 20], ids=["row-by-row", "some-rows", "whole"])
def test_every_region_is_what_safetensors_slices_give(weights: Path, block_bytes: int) -> None:
    """Row ranges and column ranges of every float dtype, at block sizes from one row to the whole tensor: the
    blocks put together equal safetensors' get_slice of the same region exactly, in the file's dtype; no block
    holds more rows than fit the bound (at least one)."""
    shard = ShardFile(weights, read_header(weights))
    try:
        for key, (r0, r1), cols, want in _regions(weights):
            got = torch.empty_like(want)
            for at, block in shard.blocks(key, (r0, r1), cols, block_bytes=block_bytes):
                row_bytes = (53 if block.dim() == 2 else 1) * block.element_size()  # whole rows read
                assert block.dtype == want.dtype and len(block) <= max(1, block_bytes // row_bytes)
                got[at : at + len(block)] = block
            assert torch.equal(got, want), (key, r0, r1, cols)
    finally:
        shard.close()


def _regions(weights: Path) -> Iterator[tuple[str, tuple[int, int], tuple[int, int] | None, torch.Tensor]]:
    """(key, rows, columns, safetensors' own slice of that region) for every tensor of the file and REGIONS."""
    with safe_open(str(weights), framework="pt") as ref:
        for key in ref.keys():  # noqa: SIM118 - safe_open is no dict
            for (r0, r1), cols in REGIONS if key != "bias" else [((0, 29), None), ((4, 17), None)]:
                yield key, (r0, r1), cols, (ref.get_slice(key)[r0:r1] if cols is None
                                            else ref.get_slice(key)[r0:r1, cols[0]:cols[1]])


def _maps(file: Path) -> list[str]:
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(str(file))]


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs Linux's /proc")
def test_a_column_slice_maps_no_file(tmp_path: Path) -> None:
    """A row-parallel rank's slice ([:, a:b]) of a Llama: read, and the file open for more, no page of it is
    mapped into the process (safe_open mapped the file whole, and the pages a slice touched, across the whole
    tensor, stayed resident until the file was closed)."""
    from tests.test_hf import hf_llama, save

    torch.manual_seed(3)
    path = save(hf_llama(), tmp_path / "llama")
    from dist_llm.hf import model_config_from_hf

    cfg: ModelConfig = model_config_from_hf(path)
    file = path / "model.safetensors"
    with HFCheckpoint(path, cfg) as src:
        part = src.read("blocks.0.mlp.down.weight", cols=(24, 48))
        assert src._open and not _maps(file)  # open for the next read, not mapped
        with safe_open(str(file), framework="pt") as ref:
            assert torch.equal(part, ref.get_slice("model.layers.0.mlp.down_proj.weight")[:, 24:48])
            assert _maps(file)  # (the check sees a mapping where there is one)


def _forge(file: Path, edit: dict) -> None:
    """Rewrite `file`'s header with `edit` merged into its first tensor's entry (the data left as it is)."""
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    key = next(k for k in header if k != "__metadata__")
    header[key].update(edit)
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new)) if len(new) <= n else b""
    assert len(new) == n, "the forged header must keep its length (the data offsets count from its end)"
    file.write_bytes(raw[:8] + new + raw[8 + n :])


def test_offsets_that_do_not_hold_the_shape_are_refused_at_the_header(tmp_path: Path) -> None:
    """A header whose data_offsets span other than shape x dtype bytes would read a neighbour's bytes (or past
    the tensor): refused when the header is read, before any data."""
    file = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(4, 4), "b": torch.ones(4)}, str(file))
    _forge(file, {"data_offsets": [0, 32]})  # (a's entry: 64 bytes of 4 x 4 fp32, said to be 32)
    with pytest.raises(ValueError, match=r"data_offsets \[0, 32\] do not hold \(4, 4\) of F32"):
        read_header(file)


def _rewrite(file: Path, edit: Callable[[dict], None]) -> None:
    """Rewrite `file`'s header with `edit` applied (its length recounted; the data left as it is)."""
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    file.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n :])


def _set(key: str, **entry: object) -> Callable[[dict], None]:
    return lambda header: header[key].update(entry)


@pytest.mark.parametrize("edit, why", [
    (_set("b", data_offsets=[0, 16]), "tensor 'a': data_offsets [0, 64] overlap those of 'b' [0, 16]"),
    (_set("b", data_offsets=[60, 76]), "tensor 'b': data_offsets [60, 76] overlap those of 'a' [0, 64]"),
    (_set("b", data_offsets=[68, 84]), "tensor 'b': data_offsets [68, 84] leave a gap after those of 'a' [0, 64]"),
    (_set("b", data_offsets=[16, 32]), "tensor 'b': data_offsets [16, 32] overlap those of 'a' [0, 64]"),
    (lambda h: (h.pop("a"), h["b"].update(data_offsets=[64, 80])),
     "tensor 'b': data_offsets [64, 80] leave a gap at the start of the data"),
], ids=["same-start", "into-the-previous", "gap", "inside-the-previous", "gap-at-start"])
def test_tensors_must_tile_the_data_without_overlap_or_gap(tmp_path: Path, edit: Callable[[dict], None],
                                                           why: str) -> None:
    """Two tensors reading the same bytes (or bytes no tensor owns) are refused, as safetensors' reference reader
    refuses them ('invalid offset'): before, a forged header could make one weight another's bytes."""
    file = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(4, 4), "b": torch.ones(4)}, str(file))  # a: [0, 64), b: [64, 80)
    _rewrite(file, edit)
    with pytest.raises(ValueError) as e:
        read_header(file)
    assert str(e.value) == f"{why}: invalid offset"


@pytest.mark.parametrize("entry, why", [
    ({"shape": [4.9, 4]}, "shape [4.9, 4] is not a list of integers"),
    ({"shape": [True, 16]}, "shape [True, 16] is not a list of integers"),
    ({"shape": "4"}, "shape '4' is not a list of integers"),
    ({"data_offsets": [False, 64]}, "data_offsets [False, 64] are not two integers"),
    ({"data_offsets": [0, 64.0]}, "data_offsets [0, 64.0] are not two integers"),
    ({"data_offsets": None}, "data_offsets None are not two integers"),
    ({"data_offsets": [0, 64, 80]}, "data_offsets [0, 64, 80] are not two integers"),
], ids=["float-dim", "true-dim", "string-shape", "false-offset", "float-offset", "null-offsets", "three-offsets"])
def test_shapes_and_offsets_must_be_exact_integers(tmp_path: Path, entry: dict, why: str) -> None:
    """int() would have read 64.9 as 64 and true as 1: a header that says something else than it means."""
    file = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(4, 4), "b": torch.ones(4)}, str(file))
    _rewrite(file, _set("a", **entry))
    with pytest.raises(ValueError) as e:
        read_header(file)
    assert str(e.value) == f"tensor 'a': {why}"


def test_two_weights_on_the_same_bytes_are_one_line_from_convert(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Through `convert --from-hf`: exit 2, one line naming the file and the tensors (before: v_proj read k_proj's
    bytes, of the same shape, and the conversion succeeded)."""
    from dist_llm.cli import main
    from tests.test_hf import hf_llama, save

    torch.manual_seed(4)
    path = save(hf_llama(), tmp_path / "llama")
    k, v = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "kv")
    _rewrite(path / "model.safetensors", lambda header: header[v].update(data_offsets=header[k]["data_offsets"]))
    capsys.readouterr()
    assert main(["convert", "--from-hf", str(path), "--out", str(tmp_path / "out")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    pair = rf"(tensor '{k}': .* overlap those of '{v}'|tensor '{v}': .* overlap those of '{k}')"
    assert re.fullmatch(rf"dist-llm: error: {re.escape(str(path / 'model.safetensors'))}: cannot read weights \(not a "
                        rf"safetensors file: {pair} \[\d+, \d+\]: invalid offset\)", line), line
    assert not (tmp_path / "out").exists()


def test_an_entry_that_is_not_an_object_is_one_line(tmp_path: Path) -> None:
    file = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(4, 4)}, str(file))
    _rewrite(file, lambda header: header.update(a=[1]))
    with pytest.raises(ValueError) as e:
        read_header(file)
    assert str(e.value) == "tensor 'a': its entry is not an object"


def test_a_file_cut_short_is_one_line_at_its_first_read(tmp_path: Path) -> None:
    """Headers intact, data cut short: opening the checkpoint (headers only) succeeds; the first read of any of
    the file's tensors fails with one line naming the file and tensor."""
    from dist_llm.hf import model_config_from_hf
    from tests.test_hf import hf_llama, save

    torch.manual_seed(4)
    path = save(hf_llama(), tmp_path / "llama")
    cfg = model_config_from_hf(path)
    file = path / "model.safetensors"
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size - 1)
    with HFCheckpoint(path, cfg) as src, pytest.raises(ConfigError) as e:  # every header parses; the read fails
        src.read("ln_f.weight")
    message = str(e.value)
    assert len(message.splitlines()) == 1
    assert re.fullmatch(rf"{re.escape(str(file))}: cannot read weights for tensor 'model\.norm\.weight' \(the file "
                        r"has \d+ bytes, its header describes \d+: truncated\)", message), message


@pytest.mark.parametrize("out_dtype", [None, torch.float32], ids=["file-dtype", "float32"])
def test_read_rows_into_is_what_safetensors_slices_give(weights: Path, out_dtype: torch.dtype | None) -> None:
    """`read_rows_into` (straight into the destination when it has the file's dtype and whole rows are asked for,
    through the block buffer otherwise) gives safetensors' slice of every region, converted to the destination's
    dtype, at block sizes down to one row."""
    shard = ShardFile(weights, read_header(weights))
    try:
        for key, (r0, r1), cols, want in _regions(weights):
            for block_bytes in (1, 1 << 20):
                got = torch.full_like(want, float("nan"), dtype=out_dtype or want.dtype)
                shard.read_rows_into(key, (r0, r1), got, cols, block_bytes=block_bytes)
                assert torch.equal(got, want.to(got.dtype)), (key, r0, r1, cols, block_bytes)
    finally:
        shard.close()


def _traced_peak(read: Callable[[], object]) -> int:
    """The most bytes Python's allocators held at once beyond what they held before, during `read()` (a read
    buffer is a bytearray: traced; a torch tensor is not)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        read()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("file_dtype", [torch.float32, torch.bfloat16])
def test_a_read_in_the_files_dtype_goes_straight_into_the_destination(tmp_path: Path, file_dtype: torch.dtype) -> None:
    """HFCheckpoint reading a 1 MiB (fp32) weight of a Llama whole, or a tensor-parallel row range of it, into a
    destination of the file's dtype allocates no read buffer (before: a block of up to 16 MiB, here the whole
    tensor); into another dtype, or a column slice, it takes the block (so the meter sees one where there is
    one). The values are safetensors' either way."""
    from tests.test_hf import hf_llama, save

    torch.manual_seed(4)
    path = save(hf_llama(intermediate_size=4096).to(file_dtype), tmp_path / "llama")
    from dist_llm.hf import model_config_from_hf

    cfg: ModelConfig = model_config_from_hf(path)
    other = torch.bfloat16 if file_dtype == torch.float32 else torch.float32
    with HFCheckpoint(path, cfg) as src, safe_open(str(path / "model.safetensors"), framework="pt") as ref:
        whole = ref.get_tensor("model.layers.0.mlp.up_proj.weight")  # (4096, 64)
        nbytes = whole.numel() * whole.element_size()
        for rows, cols, dtype, direct in [(None, None, file_dtype, True), ([(1024, 3072)], None, file_dtype, True),
                                          (None, None, other, False), (None, (0, 32), file_dtype, False)]:
            r = rows or [(0, 4096)]
            want = whole[r[0][0] : r[0][1], slice(*cols) if cols else slice(None)]
            out = torch.empty(want.shape, dtype=dtype)
            src.read_into("blocks.0.mlp.up.weight", out[:1], [(0, 1)], cols)  # (the shard opened before measuring)
            peak = _traced_peak(lambda: src.read_into("blocks.0.mlp.up.weight", out, rows, cols))
            assert torch.equal(out, want.to(dtype)), (rows, cols, dtype)
            read = want.shape[0] * whole.shape[1] * whole.element_size()  # whole rows read
            if direct:
                assert peak < 16 * 1024, (rows, cols, dtype, peak)  # some small Python objects, no buffer
            else:
                assert peak >= read, (rows, cols, dtype, peak, nbytes)


@pytest.mark.parametrize("out_dtype, cols", [(torch.float32, None), (torch.float64, None), (torch.float32, (0, 3))],
                         ids=["straight-into-out", "through-the-buffer", "a-column-slice"])
def test_a_nan_is_found_by_the_read_that_keeps_it(tmp_path: Path, out_dtype: torch.dtype,
                                                   cols: tuple[int, int] | None) -> None:
    """Both ways a read goes (straight into the destination, or block by block through the buffer) check what they
    keep, naming the tensor's row; a NaN in columns the read does not keep is another read's to find."""
    t = torch.zeros(40, 6)
    t[29, 4] = float("nan")
    file = tmp_path / "w.safetensors"
    save_file({"w": t}, str(file))
    shard = ShardFile(file, read_header(file))
    out = torch.empty(20, 6 if cols is None else 3, dtype=out_dtype)
    shard.read_rows_into("w", (0, 20), out, cols, block_bytes=48)  # (rows without it)
    if cols is not None:
        shard.read_rows_into("w", (20, 40), out, cols, block_bytes=48)
        return
    with pytest.raises(NonFinite) as e:
        shard.read_rows_into("w", (20, 40), out, cols, block_bytes=48)
    assert str(e.value) == "tensor 'w' holds a NaN or infinite value (row 29)"


def test_check_finite_counts_rows_across_its_pieces() -> None:
    t = torch.zeros(10, 3)
    t[7, 1] = float("inf")
    with pytest.raises(NonFinite, match=r"^tensor 'k' holds a NaN or infinite value \(row 12\)$"):
        check_finite("k", t, 5, block_bytes=6)  # (two rows a piece)
    check_finite("k", torch.zeros(10, 3))
    with pytest.raises(NonFinite, match=r"\(row 0\)$"):
        check_finite("k", torch.tensor(float("nan")))  # a 0-d tensor: one row
