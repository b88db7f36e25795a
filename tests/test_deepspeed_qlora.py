"""QLoRA at DeepSpeed ZeRO-3 on 2 gloo ranks: built straight into DeepSpeed's partitions one tensor at a time, each
frozen base weight read (hf:) or drawn (random start) whole, quantised to NF4 and its codes, block scales and group
factors (uint8, int8, int32 bits) partitioned by DeepSpeed, as FSDP2 shards them; no rank holds the whole model."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_llm.peft.nf4 import NF4Linear, NF4Weight, nf4_nbytes
from tests.distributed import run_distributed
from tests.test_data_parallel import corpus, reference, train  # noqa: F401 - corpus is a fixture
from tests.test_deepspeed_init_from import ZERO3
from tests.test_deepspeed_shards import _config
from tests.test_finetune import llama_dir  # noqa: F401 - a fixture
from tests.test_peft import ALL
from tests.test_qlora_zero3 import _Peak, unmetered_quantise

QLORA = {"peft__method": "qlora", "peft__rank": 4, "peft__targets": ALL, "optim__lr": 1e-2}
# (a random start: 6 blocks of width 64, so that the NF4 base outweighs the largest single tensor; hf: takes the
# Llama's own shape)
RANDOM = {"model__n_layer": 6, "model__n_embd": 64}


def _start(kind: str, hf: Path) -> dict[str, Any]:
    return {**QLORA, **({"model__init_from": f"hf:{hf}"} if kind == "hf" else RANDOM)}


def _build(rank: int, world_size: int, out_dir: Path, corpus: Path, extra: dict[str, Any]) -> dict[str, Any]:  # noqa: F811
    """Build as the trainer does (world_size 1: one process, not wrapped; else DeepSpeed ZeRO-3) and return every
    parameter and NF4 mean whole. Under DeepSpeed also: the peaks of live CPU bytes (all, and of NF4's dtypes) until
    the model is handed to deepspeed.initialize (the build), and what bounds them."""
    import deepspeed

    from dist_llm.model import GPT
    from dist_llm.parallel.context import ParallelContext
    from dist_llm.parallel.parallelize import meta_model, parallelize
    from dist_llm.train.init_from import load_initial_weights, open_initial_tensors, resolve_architecture

    cfg = resolve_architecture(_config(out_dir, corpus, {**(ZERO3 if world_size > 1 else {}), **extra}))
    ctx = ParallelContext.from_config(cfg)
    try:
        model = meta_model(cfg, ctx)
        means = lambda: {n: m.scale_mean.clone() for n, m in model.named_modules()  # noqa: E731
                         if isinstance(m, NF4Linear)}
        if world_size == 1:
            parallelize(model, cfg, ctx, wrap=False, load=load_initial_weights)
            return {"full": {n: p.detach().clone() for n, p in model.named_parameters()}, "means": means()}
        with torch.device("meta"):
            base = GPT(cfg.model)
        meter, at_init = _Peak(), {}
        initialize = deepspeed.initialize

        def initializing(*args: Any, **kwargs: Any) -> Any:
            at_init.update(meter.peak)  # (the peaks only grow: these are the build's)
            return initialize(*args, **kwargs)

        warnings: list[str] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("dist_llm").addHandler(handler)
        with pytest.MonkeyPatch.context() as patch, meter:
            unmetered_quantise(patch)
            patch.setattr(deepspeed, "initialize", initializing)
            par = parallelize(model, cfg, ctx, load=load_initial_weights, read=open_initial_tensors)
        logging.getLogger("dist_llm").removeHandler(handler)
        params = list(model.parameters())
        layers = [m for m in model.modules() if isinstance(m, NF4Linear)]
        nf4_ids = {id(getattr(m, n)) for m in layers for n in ("packed", "scale_q", "scale_factor")}
        part = lambda p: p.ds_tensor.numel() * p.ds_tensor.element_size()  # noqa: E731
        nf4_whole = [nf4_nbytes(m.out_features * m.in_features) for m in layers]
        out = {"peak": at_init["all"], "nf4_peak": at_init["nf4"],
               "partitions": sum(part(p) for p in params), "nf4_partitions": sum(part(p) for p in params
                                                                                 if id(p) in nf4_ids),
               # (each NF4 layer's mean and 16-level table are whole buffers on every rank)
               "buffers": sum(b.nbytes for b in model.buffers()),
               "largest": max(p.nbytes for p in base.parameters()), "nf4_largest": max(nf4_whole),
               "nf4_whole": sum(nf4_whole), "fp32_base": sum(p.nbytes for p in base.parameters()),
               "dtypes": sorted({str(p.ds_tensor.dtype) for p in params}), "warnings": warnings}
        with deepspeed.zero.GatheredParameters(params):
            out["full"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out["means"] = means()
        del par
        return out
    finally:
        ctx.destroy()


@pytest.mark.parametrize("kind", ["hf", "random"])
def test_qlora_at_zero3_is_built_partitioned_and_bit_for_bit_one_process(
        tmp_path: Path, corpus: Path, llama_dir: Path, kind: str) -> None:  # noqa: F811
    """Every NF4 code, block scale, group factor and mean, and every other tensor (LoRA drawn), bit for bit those
    of quantising the one-process model; DeepSpeed partitions the NF4 tensors in their own dtypes. While building, a
    rank's NF4 bytes stay at its partitions plus one layer's whole NF4 (before: the whole NF4 base on every rank),
    and all its bytes at its partitions + the largest fp32 tensor + one layer's NF4 + the buffers, within
    partitions + 2 x the largest tensor + buffers, and below the whole fp32 base (before: the embedding, head and
    norms and the whole NF4 base materialised on every rank, then partitioned)."""
    extra = _start(kind, llama_dir)
    one = _build(0, 1, tmp_path / "one", corpus, extra)
    ranks = run_distributed(_build, 2, tmp_path / "ds", corpus, extra, init_group=False, timeout=600)
    assert any(".packed" in n for n in one["full"])
    for rank in ranks:
        assert rank["warnings"] == [], rank["warnings"]  # (before: "... materialises the embedding, head and norms")
        assert rank["full"].keys() == one["full"].keys() and rank["means"].keys() == one["means"].keys()
        for name, p in one["full"].items():
            assert p.dtype == rank["full"][name].dtype and torch.equal(rank["full"][name], p), f"{kind}: {name}"
        for name, m in one["means"].items():
            assert torch.equal(rank["means"][name], m), name
        assert {"torch.uint8", "torch.int8", "torch.int32", "torch.float32"} <= set(rank["dtypes"]), rank["dtypes"]
        sizes = str({k: v for k, v in rank.items() if k not in ("full", "means", "warnings")})
        # (+ 64: scalars made along the way that the built model does not keep, e.g. the failure flag each
        # collective read exchanges)
        assert rank["nf4_peak"] <= rank["nf4_partitions"] + rank["nf4_largest"] + 64, sizes
        # and well below the whole NF4 base, which every rank held before: at dp=2 the partitions are half of it,
        # one layer's NF4 (the largest) a fifth here, so the bound above stays under 0.7 of the whole
        assert rank["nf4_peak"] < 0.7 * rank["nf4_whole"], sizes
        assert rank["peak"] <= rank["partitions"] + rank["largest"] + rank["nf4_largest"] + rank["buffers"] + 64, sizes
        assert rank["peak"] <= rank["partitions"] + 2 * rank["largest"] + rank["buffers"], sizes
        assert rank["peak"] < rank["fp32_base"], sizes


@pytest.mark.parametrize("kind", ["hf", "random"])
def test_qlora_at_zero3_trains_to_the_one_process_losses(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                         corpus: Path, llama_dir: Path, kind: str) -> None:  # noqa: F811
    """DeepSpeed ZeRO-3 at dp=2, 8 QLoRA steps: the one-process losses at 1e-5 relative. The NF4 base is the same
    bits and dequantises to the same weights; only the fp32 gradient reductions of the LoRA tensors sum in another
    order (over ranks and micro-steps), which moves a loss by a few ulps."""
    extra = _start(kind, llama_dir)
    got = run_distributed(train, 2, tmp_path, corpus, {**ZERO3, **extra}, init_group=False, timeout=600)[0]
    ref = reference(tmp_path_factory, corpus, **extra)
    assert got["dp"] == "deepspeed"
    assert len(got["losses"]) == len(ref["losses"]) == 8
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    # the checkpoint holds the trained (LoRA) tensors and their moments, as before ZeRO-3 saved buffers for MoE's
    # expert bias: none of NF4's mean and table (the build recomputes them), so a resume asks for no key that a
    # checkpoint written before lacks
    from dist_llm.train import checkpoint as ckpt

    keys = ckpt.SafeReader(str(tmp_path / "checkpoints" / "step_000008")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and [k for k in model_keys if ".lora." not in k] == []


def _build_failing_to_quantise(rank: int, world_size: int, out_dir: Path, corpus: Path,  # noqa: F811
                               extra: dict[str, Any]) -> str:
    """The build with the source rank's quantiser failing (as running out of memory there alone would)."""
    def failing(cls: type, *args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError("out of memory (quantiser's working space)")

    with pytest.MonkeyPatch.context() as patch:
        if rank == 0:
            patch.setattr(NF4Weight, "quantize", classmethod(failing))
        try:
            _build(rank, world_size, out_dir, corpus, extra)
        except RuntimeError as e:
            return str(e)
    return "built"


def test_a_quantiser_failing_on_the_source_rank_stops_every_rank(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """Only the partition group's first rank quantises; its failure must reach the other rank as the same line
    before that rank waits in the broadcast of the NF4 tensors (before: rank 1 waited there until the timeout)."""
    got = run_distributed(_build_failing_to_quantise, 2, tmp_path, corpus, _start("random", tmp_path),
                          init_group=False, timeout=120)
    assert got[0] == got[1] == ("rank 0: quantising blocks.0.attn.qkv.weight to NF4 failed: out of memory "
                                "(quantiser's working space)"), got
