"""The build (parallel/parallelize.py): initial values equal one process bit for bit at every layout; a rank
allocates only what it owns; with model.init_from nothing random is drawn."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dist_llm import memory
from dist_llm.config import load_config
from dist_llm.model import GPT
from dist_llm.model import init as model_init
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.parallelize import meta_model, parallelize
from dist_llm.parallel.tensor.checkpoint import TensorParallelState
from dist_llm.train.init_from import load_initial_weights, resolve_architecture
from dist_llm.train.trainer import build_model
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed
from tests.test_finetune import llama_dir  # noqa: F401
from tests.test_peft import LORA

SMALL = {"model__n_layer": 4, "model__bias": True}


def _initial(rank: int, world_size: int, out_dir: Path, extra: dict[str, Any]) -> dict[str, torch.Tensor]:
    """This rank's parameters right after the build (wrapped for data parallelism), at full shape."""
    cfg = resolve_architecture(load_config(None, tiny_overrides(out_dir, **{**SMALL, **extra})))
    ctx = ParallelContext.from_config(cfg)
    try:
        model = parallelize(meta_model(cfg, ctx), cfg, ctx, load=load_initial_weights).dp.module
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                  for n, p in model.named_parameters()}
        if ctx.tp > 1:
            params = TensorParallelState(model, ctx).to_full({"model": params, "optim": {"state": {}}})["model"]
        return params
    finally:
        ctx.destroy()


LAYOUTS = {
    "tp2": (2, {"parallel__tp": 2}),
    "tp2-gqa-untied": (2, {"parallel__tp": 2, "model__n_kv_head": 2, "model__pos_emb": "rope",
                           "model__tie_embeddings": False}),
    "pp2": (2, {"parallel__pp": 2}),
    "zero3-dp2": (2, {"parallel__dp": 2, "parallel__zero_stage": 3}),
    "zero3-dp2-tp2": (4, {"parallel__dp": 2, "parallel__tp": 2, "parallel__zero_stage": 3}),
    "lora-tp2": (2, {**LORA, "parallel__tp": 2}),
    "lora-pp2": (2, {**LORA, "parallel__pp": 2}),
    "adapter-pp2": (2, {"peft__method": "adapter", "peft__rank": 4, "parallel__pp": 2}),
    # FSDP2 shards the meta model with its adapters; each rank allocates its shards and draws them after
    "lora-zero3-dp2": (2, {**LORA, "parallel__dp": 2, "parallel__zero_stage": 3}),
    "adapter-zero3-dp2": (2, {"peft__method": "adapter", "peft__rank": 4, "parallel__dp": 2, "parallel__zero_stage": 3}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_initial_weights_equal_one_process_bit_for_bit(tmp_path: Path, layout: str) -> None:
    world_size, extra = LAYOUTS[layout]
    one = _initial(0, 1, tmp_path / "one", {k: v for k, v in extra.items() if not k.startswith("parallel__")})
    ranks = run_distributed(_initial, world_size, tmp_path / "many", extra, init_group=False)
    merged: dict[str, torch.Tensor] = {}
    for params in ranks:  # pipeline stages each hold their own blocks; the others hold everything
        for name, p in params.items():
            assert torch.equal(p, merged.setdefault(name, p)), f"{name} differs between ranks"
    assert merged.keys() == one.keys()
    for name, p in one.items():
        assert torch.equal(merged[name], p), f"{layout}: {name} differs from one process"


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes of all live CPU storages created while it is on (each storage counted once,
    from its creation until it is freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.set_.source_Storage:  # a file reader's buffer (safetensors' mapped file), not ours
            return out
        for t in out if isinstance(out, (tuple, list)) else [out]:
            # a DTensor's own storage is a placeholder of its global size: its local shard holds the bytes
            t = getattr(t, "_local_tensor", t)
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                if id(storage) not in self.seen:
                    self.seen.add(id(storage))
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, id(storage), storage.nbytes())
        return out


def _build_peak(rank: int, world_size: int, out_dir: Path) -> dict[str, int]:
    cfg = load_config(None, tiny_overrides(out_dir, parallel__pp=world_size, model__n_layer=4, model__n_embd=64))
    ctx = ParallelContext.from_config(cfg)
    try:
        with torch.device("meta"):
            whole = GPT(cfg.model)
        with LiveBytes() as meter:
            model = parallelize(meta_model(cfg, ctx), cfg, ctx, wrap=False).model
        own = sum(p.numel() * p.element_size() for p in model.parameters())
        return {"peak": meter.peak, "own": own, "buffers": sum(b.nbytes for b in model.buffers()),
                "whole": sum(p.numel() * p.element_size() for p in whole.parameters()),
                "largest": max(p.numel() * p.element_size() for p in whole.parameters()),
                "blocks": sum(1 for b in model.blocks if any(True for _ in b.parameters()))}
    finally:
        ctx.destroy()


def test_a_pipeline_stage_never_allocates_the_other_stages_blocks(tmp_path: Path) -> None:
    """At pp=2 each stage's build peaks at its own parameters plus one parameter drawn at full size (and the
    small buffers): the other stage's blocks are never allocated, so the peak stays under the whole model."""
    for stage in run_distributed(_build_peak, 2, tmp_path, init_group=False):
        assert stage["blocks"] == 2
        assert stage["own"] < 0.75 * stage["whole"]
        assert stage["peak"] <= stage["own"] + stage["largest"] + stage["buffers"], stage
        assert stage["peak"] < stage["whole"]
    one = _build_peak(0, 1, tmp_path / "one")  # the meter sees a whole build whole
    assert one["peak"] >= one["whole"]


ZERO2_BF16 = {"parallel__zero_stage": 2, "train__precision": "bf16", "model__n_layer": 4, "model__n_embd": 64}


def _zero_build_peak(rank: int, world_size: int, out_dir: Path, extra: dict[str, Any]) -> dict[str, int]:
    from dist_llm.parallel.data import zero

    cfg = resolve_architecture(load_config(None, tiny_overrides(out_dir, parallel__dp=world_size,
                                                                **{**SMALL, **ZERO2_BF16, **extra})))
    ctx = ParallelContext.from_config(cfg)
    built: dict[str, Any] = {}
    builds = {name: getattr(zero.ZeroDataParallel, name) for name in ("_build_from_meta", "_build_from_model")}

    def metered(name: str) -> Any:
        def build(self: Any, *args: Any) -> None:  # the peak up to the end of the parameters' build (before the
            builds[name](self, *args)              # gradient shard the form allocates next)
            built.update(how=name, peak=meter.peak)
        return build

    try:
        for name in builds:
            setattr(zero.ZeroDataParallel, name, metered(name))
        with LiveBytes() as meter:
            dp = parallelize(meta_model(cfg, ctx), cfg, ctx, load=load_initial_weights).dp
        params = [p for p in dp.module.parameters() if p.requires_grad]
        return {"peak": built["peak"], "meta": built["how"] == "_build_from_meta",
                "n": sum(p.numel() for p in params), "largest": max(p.numel() for p in params),
                "flat": dp.flat_params.numel(), "shard": dp.shard_numel, "dtypes": len({p.dtype for p in params}),
                "buffers": sum(b.nbytes for b in dp.module.buffers()),
                "first": {n: p.detach().float().clone() for n, p in dp.module.named_parameters()}}
    finally:
        for name, build in builds.items():
            setattr(zero.ZeroDataParallel, name, build)
        ctx.destroy()


def test_zero2_build_never_holds_the_fp32_model(tmp_path: Path, llama_dir: Path) -> None:  # noqa: F811
    """ZeRO-1/2 in bf16 (zero.py): the parameters become views of one flat bf16 buffer and the fp32 masters are this
    rank's half. From a random start the model comes on the meta device and each parameter is drawn in fp32 on its
    own, its masters taken, then cast into its view: the build peaks at the buffer (2 bytes a parameter), the
    masters (4/dp) and one parameter in fp32, to the byte. From model.init_from it takes the loaded fp32 model and
    casts each parameter on its own before making the buffer: the fp32 model (4 bytes) with one parameter's 16-bit
    copy and the masters, never the fp32 model beside the buffer (6 bytes a parameter on an accelerator, where
    `empty` takes the whole buffer at once: the meter counts it so). `dist-llm memory` (counted for CUDA) predicts
    both (memory/transients.py zero_flat_build_bytes); the values drawn are the one-process model's, in bf16."""
    one = _initial(0, 1, tmp_path / "one", {k: v for k, v in ZERO2_BF16.items() if k.startswith("model__")})
    for start in ("random", "hf"):
        extra = {"model__init_from": f"hf:{llama_dir}"} if start == "hf" else {}
        est = memory.predict(resolve_architecture(load_config(None, tiny_overrides(
            tmp_path, train__device="cuda", **{**SMALL, **ZERO2_BF16, **extra}))), 2)
        predicted = est.params_bytes + est.master_bytes + est.init_transient_bytes
        for rank in run_distributed(_zero_build_peak, 2, tmp_path / start, extra, init_group=False):
            assert rank["meta"] == (start == "random") and rank["dtypes"] == 1 and rank["flat"] >= rank["n"]
            flat, masters, largest = 2 * rank["flat"], 4 * rank["shard"], rank["largest"]
            if start == "random":  # the buffer, the masters, the buffers allocated first, one parameter in fp32
                assert rank["peak"] == flat + masters + rank["buffers"] + 4 * largest == predicted + rank["buffers"], (
                    rank["peak"], predicted)
                for name, p in one.items():  # (bf16: the one-process fp32 values rounded once)
                    assert torch.equal(rank["first"][name], p.to(torch.bfloat16).float()), name
            else:  # (the prediction holds the largest parameter's 16-bit copy; the meter saw the first one cast)
                # (+64: the loader's checks hold a few scalars at the peak, 12 bytes here)
                assert predicted - 2 * largest <= rank["peak"] - rank["buffers"] <= predicted + 64, (rank, predicted)
                assert rank["peak"] < 4 * rank["n"] + flat + masters  # (what casting after the buffer held at once)


def test_init_from_draws_nothing_random(tmp_path: Path, llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """With model.init_from the weights are loaded into the materialised, uninitialised model: no parameter is
    drawn first and then overwritten."""
    from dist_llm.hf import load_hf

    cfg = resolve_architecture(load_config(None, tiny_overrides(tmp_path, model__init_from=f"hf:{llama_dir}")))

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a parameter was randomly initialised before the load")

    expected = load_hf(llama_dir, cfg.model).state_dict()
    monkeypatch.setattr(model_init, "fill_parameter", refuse)
    monkeypatch.setattr(GPT, "reset_parameters", refuse)
    model = build_model(cfg, ParallelContext.from_config(cfg))
    for name, t in model.state_dict().items():
        assert torch.equal(t, expected[name]), name


@pytest.mark.parametrize("layout", ["zero3-dp2", "tp2", "lora-zero3-dp2"])
def test_init_from_loads_into_each_layout(tmp_path: Path, llama_dir: Path, layout: str) -> None:  # noqa: F811
    """model.init_from=hf: into FSDP2's shards of a meta-built model, and into tensor-parallel slices."""
    world_size, extra = LAYOUTS[layout]
    start = {"model__init_from": f"hf:{llama_dir}"}
    one = _initial(0, 1, tmp_path / "one", {**start, **{k: v for k, v in extra.items() if not k.startswith("parallel__")}})
    ranks = run_distributed(_initial, world_size, tmp_path / "many", {**start, **extra}, init_group=False)
    for params in ranks:
        assert params.keys() == one.keys()
        for name, p in one.items():
            assert torch.equal(params[name], p), f"{layout}: {name}"


def _lora_zero3_peak(rank: int, world_size: int, out_dir: Path, hf_dir: Path) -> dict[str, int]:
    cfg = resolve_architecture(load_config(None, tiny_overrides(
        out_dir, model__init_from=f"hf:{hf_dir}", parallel__dp=world_size, parallel__zero_stage=3, **LORA)))
    ctx = ParallelContext.from_config(cfg)
    try:
        with torch.device("meta"):
            whole = GPT(cfg.model)
        with LiveBytes() as meter:
            model = parallelize(meta_model(cfg, ctx), cfg, ctx, load=load_initial_weights).dp.module
        own = sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in model.parameters())
        return {"peak": meter.peak, "own": own, "whole": sum(p.nbytes for p in whole.parameters()),
                "largest": max(p.nbytes for p in whole.parameters())}
    finally:
        ctx.destroy()


def test_lora_at_zero3_from_hf_never_allocates_the_whole_base(tmp_path: Path, llama_dir: Path) -> None:  # noqa: F811
    """LoRA at ZeRO-3 dp=2 from a Hugging Face directory: FSDP2 shards the meta model (adapters included) and
    each rank reads its shards straight into them, so its build peaks at its own half plus one tensor read in
    full at most (an embedding row block, a bias), never at the whole base as a materialise-then-shard would."""
    for rank in run_distributed(_lora_zero3_peak, 2, tmp_path, llama_dir, init_group=False):
        assert rank["own"] < 0.6 * rank["whole"], rank
        assert rank["peak"] <= rank["own"] + rank["largest"], rank
        assert rank["peak"] < 0.8 * rank["whole"], rank


def test_qlora_from_hf_never_holds_the_fp32_base(tmp_path: Path, llama_dir: Path,  # noqa: F811
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """QLoRA from a Hugging Face directory: the block linears stay on the meta device through `to_empty`, and
    the loader allocates, reads and quantises them one at a time. The build peaks at what it keeps (NF4 base,
    fp32 embedding, head and norms, the adapters) plus one tensor at full size, below the fp32 base; the
    earlier materialise-everything-first build peaked at the whole fp32 model."""
    from torch.utils._python_dispatch import _disable_current_modes

    from dist_llm.parallel.data.base import quantised_bytes
    from dist_llm.peft.nf4 import NF4Linear, NF4Weight

    # The quantiser's own working space (a few copies of one layer, a 16-level search in chunks of 2**20
    # elements) is a fixed per-layer transient that at this tiny size outweighs the whole model: kept out of
    # the meter, which is about whether the fp32 base ever exists at once.
    quantize = NF4Weight.quantize.__func__

    def unmetered(cls: type, *args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return quantize(cls, *args, **kwargs)

    monkeypatch.setattr(NF4Weight, "quantize", classmethod(unmetered))
    cfg = resolve_architecture(load_config(None, tiny_overrides(
        tmp_path, model__init_from=f"hf:{llama_dir}", peft__method="qlora", peft__rank=4)))
    ctx = ParallelContext.from_config(cfg)
    with torch.device("meta"):
        whole = GPT(cfg.model)
    with LiveBytes() as meter:
        model = parallelize(meta_model(cfg, ctx), cfg, ctx, load=load_initial_weights).dp.module
    kept = sum(p.nbytes for p in model.parameters()) + quantised_bytes(model)  # (NF4 codes/scales: parameters)
    fp32_whole = sum(p.nbytes for p in whole.parameters())
    largest = max(p.nbytes for p in whole.parameters())
    assert any(isinstance(m, NF4Linear) for m in model.modules())
    assert meter.peak <= kept + largest + sum(b.nbytes for b in model.buffers()), (meter.peak, kept, largest)
    assert meter.peak < fp32_whole, (meter.peak, fp32_whole)
