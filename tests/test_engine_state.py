"""The DeepSpeed backend's per-rank state file (tensors + JSON in one safetensors file), without processes: what
goes in comes back bit for bit, nothing in it is a pickle, and what it refuses it names."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_llm.parallel.data.engine_state import EngineStateError, read_engine_state, write_engine_state
from dist_llm.train.checksums import written_by


class Scaler:
    """Stands in for DeepSpeed's loss scaler: an object whose attributes are state."""

    def __init__(self) -> None:
        self.cur_scale, self.cur_iter, self.dtype, self.last_overflow_iter = 1.0, 0, torch.float32, -1


def _state() -> dict[str, Any]:
    flat = torch.arange(10, dtype=torch.float32) / 3
    return {"loss_scaler": Scaler(), "overflow": False, "clip_grad": 1.0, "zero_stage": 2, "ds_version": "0.19.8",
            "single_partition_of_fp32_groups": [flat[:7]],  # a view, as DeepSpeed's unpadded partitions are
            "base_optimizer_state": {"state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.randn(7),
                                                   "exp_avg_sq": torch.rand(7, dtype=torch.float64)}},
                                     "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0]}]},
            "group_paddings": [3], "nan": float("nan")}


def test_round_trip_is_exact(tmp_path: Path) -> None:
    saved = _state()
    scaler = saved["loss_scaler"]
    scaler.cur_scale, scaler.cur_iter, scaler.dtype = 2.0**14, 37, torch.bfloat16
    write_engine_state(tmp_path / "rank_00000.safetensors", saved, objects=(Scaler,))
    live = Scaler()
    got = read_engine_state(tmp_path / "rank_00000.safetensors", objects={"Scaler": live})
    assert got["loss_scaler"] is live  # the live object, its attributes set from the file
    assert (live.cur_scale, live.cur_iter, live.dtype, live.last_overflow_iter) == (2.0**14, 37, torch.bfloat16, -1)
    want_adam, got_adam = saved["base_optimizer_state"], got["base_optimizer_state"]
    assert list(got_adam["state"]) == [0]  # int keys stay ints: torch's optimizer load_state_dict needs them
    for k, t in want_adam["state"][0].items():
        assert got_adam["state"][0][k].dtype == t.dtype and torch.equal(got_adam["state"][0][k], t), k
    assert got_adam["param_groups"] == [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0]}]
    assert torch.equal(got["single_partition_of_fp32_groups"][0], torch.arange(7, dtype=torch.float32) / 3)
    assert got["overflow"] is False and got["group_paddings"] == [3] and got["ds_version"] == "0.19.8"
    assert got["nan"] != got["nan"]


def test_file_is_safetensors_with_json_header(tmp_path: Path) -> None:
    """Read by hand from the safetensors layout (8-byte little-endian header length, JSON header, raw bytes): the
    tensor's float32 bytes and the JSON state are all there is."""
    path = tmp_path / "rank_00000.safetensors"
    write_engine_state(path, {"w": torch.tensor([1.5, -2.0])})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    assert header["0"]["dtype"] == "F32" and header["0"]["shape"] == [2]
    start, end = header["0"]["data_offsets"]
    assert raw[8 + n + start:8 + n + end] == struct.pack("<2f", 1.5, -2.0)
    assert json.loads(header["__metadata__"]["dist_llm.engine_state"]) == {"dict": [["w", {"tensor": "0"}]]}


def test_unknown_objects_are_refused_on_both_sides(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="cannot store a Scaler"):
        write_engine_state(tmp_path / "a.safetensors", {"s": Scaler()})  # not allowed: not dropped silently
    write_engine_state(tmp_path / "b.safetensors", {"s": Scaler()}, objects=(Scaler,))
    with pytest.raises(EngineStateError, match=r"b\.safetensors: holds a Scaler, this engine has \['Other'\]"):
        read_engine_state(tmp_path / "b.safetensors", objects={"Other": object()})


def _with_header(path: Path, tree: Any) -> None:
    from safetensors.torch import save_file

    save_file({}, str(path), metadata={"dist_llm.engine_state": json.dumps(tree)})


@pytest.mark.parametrize("tree, words", [
    ({"object": "Scaler", "attrs": {"dict": [["__class__", None]]}},
     "attribute '__class__' of Scaler: this engine's Scaler has no such data attribute"),
    ({"tensor": "7"}, "unexpected JSON value"),
    ({"dtype": "Tensor"}, "unexpected JSON value"),
    ({"eval": "1"}, "unexpected JSON value"),
    ({"tensor": "0", "extra": 1}, "unexpected JSON value"),
    ({"object": "Scaler", "attrs": {"list": []}}, "attributes of Scaler are not a dict"),
])
def test_hostile_json_is_one_error_naming_the_file(tmp_path: Path, tree: Any, words: str) -> None:
    path = tmp_path / "rank_00001.safetensors"
    _with_header(path, tree)
    with pytest.raises(EngineStateError, match=f"rank_00001.safetensors: {words}"):
        read_engine_state(path, objects={"Scaler": Scaler()})


def test_not_an_engine_state_file(tmp_path: Path) -> None:
    path = tmp_path / "rank_00000.safetensors"
    path.write_bytes(b"\x80\x04not safetensors")
    with pytest.raises(EngineStateError, match="rank_00000.safetensors: not an engine state file"):
        read_engine_state(path, objects={})


def test_each_rank_claims_only_its_own_engine_file() -> None:
    names = ["__0_0.distcp", "__1_0.distcp", "rng/rank_00000.json", "rng/rank_00001.json",
             "deepspeed/rank_00000.safetensors", "deepspeed/rank_00001.safetensors", "config.yaml"]
    assert written_by(names, rank=1, group_rank=1) == ["__1_0.distcp", "rng/rank_00001.json",
                                                        "deepspeed/rank_00001.safetensors"]
    assert written_by(names, rank=0, group_rank=0) == ["__0_0.distcp", "rng/rank_00000.json",
                                                        "deepspeed/rank_00000.safetensors"]


def _scaler_file(path: Path, attrs: dict[str, Any]) -> None:
    _with_header(path, {"object": "LossScaler", "attrs": {"dict": [[k, v] for k, v in attrs.items()]}})


@pytest.mark.parametrize("attrs, words", [
    # a property of DeepSpeed's scaler: setattr raised a bare AttributeError ('property has no setter')
    ({"loss_scale": 5}, "attribute 'loss_scale' of LossScaler: this engine's LossScaler has no such data attribute"),
    # a method replaced by data, and the scale by a string: both were set
    ({"update_scale": 5, "cur_scale": "x"},
     "attribute 'update_scale' of LossScaler: this engine's LossScaler has no such data attribute"),
    ({"cur_scale": "x"}, "attribute 'cur_scale' of LossScaler: saved a str, this engine holds a int"),
    ({"dynamic": 1}, "attribute 'dynamic' of LossScaler: saved a int, this engine holds a bool"),
    ({"dynamic": False, "brand_new": 1}, "attribute 'brand_new' of LossScaler: this engine's LossScaler has no such"),
])
def test_only_data_attributes_of_the_same_sort_are_set(tmp_path: Path, attrs: dict[str, Any], words: str) -> None:
    """Against DeepSpeed's own static loss scaler (cur_scale 1, dynamic False): each file is refused in one line
    naming the file and the attribute, and the live scaler is left as it was (nothing set before the refusal)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    path = tmp_path / "rank_00001.safetensors"
    _scaler_file(path, attrs)
    live = LossScaler(scale=1)
    before = dict(vars(live))
    with pytest.raises(EngineStateError, match=f"^{path}: {words}"):
        read_engine_state(path, objects={"LossScaler": live})
    assert vars(live) == before and live.loss_scale == 1


def test_a_dynamic_scale_may_come_back_as_a_float(tmp_path: Path) -> None:
    """DeepSpeed's dynamic scaler starts at an int scale and halves it into a float: a saved float scale, and
    an optional field that was None, are set."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    path = tmp_path / "rank_00000.safetensors"
    _scaler_file(path, {"cur_scale": 1024.0, "cur_iter": 7, "dtype": {"dtype": "bfloat16"}})
    live = DynamicLossScaler(init_scale=2**16, scale_window=10, min_scale=1, delayed_shift=1,
                             consecutive_hysteresis=False)
    read_engine_state(path, objects={"DynamicLossScaler": live} | {"LossScaler": live})
    assert (live.cur_scale, live.cur_iter, live.dtype) == (1024.0, 7, torch.bfloat16)
