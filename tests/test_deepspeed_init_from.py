"""DeepSpeed ZeRO-3 from `model.init_from` (hf: and ckpt:) and with LoRA/adapters, on 2 gloo ranks: built straight
into DeepSpeed's partitions one whole tensor at a time, as the random start is (no rank ever holds the whole
model), with the one-process values bit for bit, and training to the one-process losses."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_data_parallel import STEPS, corpus, reference, train  # noqa: F401 - corpus is a fixture
from tests.test_deepspeed_shards import DS, _config
from tests.test_finetune import llama_dir  # noqa: F401 - a fixture
from tests.test_parallelize import LiveBytes
from tests.test_peft import LORA

ZERO3 = {**DS, "parallel__zero_stage": 3}


@pytest.fixture(scope="module")
def base_step(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:  # noqa: F811
    """A dist_llm checkpoint of the tiny model (trained 2 steps, so that it differs from the random start)."""
    out = tmp_path_factory.mktemp("base")
    train(0, 1, out, corpus, {"train__max_steps": 2, "train__ckpt_interval": 2})
    return out / "checkpoints" / "step_000002"


def _start(kind: str, hf: Path, ckpt: Path) -> dict[str, Any]:
    return {"hf": {"model__init_from": f"hf:{hf}"}, "ckpt": {"model__init_from": f"ckpt:{ckpt}"},
            "lora-hf": {**LORA, "model__init_from": f"hf:{hf}"},
            "adapter": {"peft__method": "adapter", "peft__rank": 4}}[kind]


def _count_reads(patch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count what this process reads of model.init_from's tensors: bytes of Hugging Face safetensors files (every
    explicit read, whole rows) and elements of a dist_llm checkpoint's tensors (every DCP read item)."""
    from torch.distributed.checkpoint.planner import LoadItemType

    from dist_llm.safetensors_read import ShardFile
    from dist_llm.train.checkpoint import SafeReader

    reads = {"hf_bytes": 0, "ckpt_elements": 0}
    real_read, real_data = ShardFile._read_into, SafeReader.read_data

    def read_into(self: ShardFile, view: memoryview, offset: int) -> None:
        reads["hf_bytes"] += len(view)
        real_read(self, view, offset)

    def read_data(self: SafeReader, plan: Any, planner: Any) -> Any:
        reads["ckpt_elements"] += sum(math.prod(i.lengths) for i in plan.items if i.type == LoadItemType.TENSOR)
        return real_data(self, plan, planner)

    patch.setattr(ShardFile, "_read_into", read_into)
    patch.setattr(SafeReader, "read_data", read_data)
    return reads


def _build(rank: int, world_size: int, out_dir: Path, corpus: Path, extra: dict[str, Any]) -> dict[str, Any]:  # noqa: F811
    """Build as the trainer does (world_size 1: one process, not wrapped; else DeepSpeed ZeRO-3) and return every
    parameter whole, and what the build read of model.init_from. Under DeepSpeed, also: the elements held whole
    outside its partitions at each hand-over to the partitioner, and the peak of live CPU bytes during the
    partitioned build with what it is bounded by."""
    import deepspeed

    from dist_llm.parallel.context import ParallelContext
    from dist_llm.parallel.data import deepspeed as ds_backend
    from dist_llm.parallel.parallelize import meta_model, parallelize
    from dist_llm.train.init_from import load_initial_weights, open_initial_tensors, resolve_architecture

    cfg = resolve_architecture(_config(out_dir, corpus, {**(ZERO3 if world_size > 1 else {}), **extra}))
    ctx = ParallelContext.from_config(cfg)
    try:
        model = meta_model(cfg, ctx)
        if world_size == 1:
            with pytest.MonkeyPatch.context() as patch:
                reads = _count_reads(patch)
                one = parallelize(model, cfg, ctx, wrap=False, load=load_initial_weights).model
            return {"full": {n: p.detach().clone() for n, p in one.named_parameters()}, "reads": reads}
        held: list[int] = []
        meter = LiveBytes()
        convert, build = deepspeed.zero.Init._convert_to_zero_parameters, ds_backend.build_partitioned

        def converting(self: Any, params: Any) -> None:
            whole = [p for p in model.parameters() if not p.is_meta and not hasattr(p, "ds_id")]
            held.append(sum(p.numel() for p in whole))
            convert(self, params)

        def metered(*args: Any, **kwargs: Any) -> None:
            with meter:
                build(*args, **kwargs)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(deepspeed.zero.Init, "_convert_to_zero_parameters", converting)
            patch.setattr(ds_backend, "build_partitioned", metered)
            reads = _count_reads(patch)
            par = parallelize(model, cfg, ctx, load=load_initial_weights, read=open_initial_tensors)
        params = list(model.parameters())
        out = {"held": held, "peak": meter.peak, "reads": reads, "largest": max(p.ds_numel for p in params) * 4,
               "partitions": sum(p.ds_tensor.numel() for p in params) * 4,
               "buffers": sum(b.nbytes for b in model.buffers()), "whole": sum(p.ds_numel for p in params) * 4,
               "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
               "base_elements": sum(p.ds_numel for n, p in model.named_parameters() if ".lora." not in n and
                                    ".adapter." not in n)}
        with deepspeed.zero.GatheredParameters(params):
            out["full"] = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        del par
        return out
    finally:
        ctx.destroy()


@pytest.mark.parametrize("kind", ["hf", "ckpt", "lora-hf", "adapter"])
def test_zero3_build_from_any_start_is_one_process_and_partitioned(tmp_path: Path, corpus: Path, llama_dir: Path,  # noqa: F811
                                                                   base_step: Path, kind: str) -> None:
    """Every parameter (base read from hf: or ckpt:, LoRA/adapter drawn) bit for bit the one-process build's;
    while building, a rank held one parameter whole at a time beside its partitions, and its live bytes never
    passed its partitions + twice the largest tensor (the parameter being handed over, and the reader's copy of
    it: DCP reads a whole tensor and copies it in, the Hugging Face reader a block of up to 16 MiB) + the
    buffers; below the whole model (before, init_from and PEFT materialised the whole model on every rank, then
    DeepSpeed partitioned it)."""
    extra = _start(kind, llama_dir, base_step)
    one = _build(0, 1, tmp_path / "one", corpus, extra)
    want = one["full"]
    ranks = run_distributed(_build, 2, tmp_path / "ds", corpus, extra, init_group=False, timeout=600)
    # only the first rank reads the base, each tensor once (DeepSpeed broadcasts its values to the other): the
    # bytes one process reads from hf:, every element of the base from ckpt: (one process reads the tied
    # embedding twice, under both its names)
    base = {"hf": "hf_bytes", "lora-hf": "hf_bytes", "ckpt": "ckpt_elements"}.get(kind)
    reads = [r["reads"] for r in (one, *ranks)]
    assert ranks[1]["reads"] == {"hf_bytes": 0, "ckpt_elements": 0}, reads
    if base == "hf_bytes":
        assert ranks[0]["reads"] == one["reads"] and one["reads"]["hf_bytes"] > 0, reads
    elif base == "ckpt_elements":
        assert ranks[0]["reads"] == {"hf_bytes": 0, "ckpt_elements": ranks[0]["base_elements"]}, reads
    for rank in ranks:
        assert rank["full"].keys() == want.keys()
        for name, p in want.items():
            assert torch.equal(rank["full"][name], p), f"{kind}: {name}"
        assert len(rank["held"]) == len(want)  # one hand-over per parameter
        assert max(rank["held"]) * 4 == rank["largest"], rank["held"]  # only the parameter being handed over
        sizes = {k: v for k, v in rank.items() if k not in ("full", "held", "trainable")}
        assert rank["peak"] <= rank["partitions"] + 2 * rank["largest"] + rank["buffers"], sizes
        assert rank["peak"] < rank["whole"], sizes
        if kind in ("lora-hf", "adapter"):  # the base frozen, the adapters trained
            assert rank["trainable"] and all((".lora." in n) or (".adapter." in n) for n in rank["trainable"])


@pytest.mark.parametrize("kind", ["ckpt", "lora-hf"])
def test_zero3_from_init_from_trains_to_the_one_process_losses(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                               corpus: Path, llama_dir: Path,  # noqa: F811
                                                               base_step: Path, kind: str) -> None:
    """DeepSpeed ZeRO-3 at dp=2 trained 8 steps from a checkpoint (all weights trained) and with LoRA on a
    Hugging Face Llama: the one-process losses (fp32, other summation orders: 1e-5)."""
    extra = _start(kind, llama_dir, base_step)
    got = run_distributed(train, 2, tmp_path, corpus, {**ZERO3, **extra}, init_group=False, timeout=600)[0]
    ref = reference(tmp_path_factory, corpus, **extra)
    assert got["dp"] == "deepspeed"
    assert len(got["losses"]) == STEPS
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)


def _build_error(rank: int, world_size: int, out_dir: Path, corpus: Path, hf: Path) -> str | None:  # noqa: F811
    from dist_llm.config import ConfigError
    from dist_llm.parallel.context import ParallelContext
    from dist_llm.parallel.parallelize import meta_model, parallelize
    from dist_llm.train.init_from import load_initial_weights, open_initial_tensors, resolve_architecture

    cfg = resolve_architecture(_config(out_dir, corpus, {**ZERO3, "model__init_from": f"hf:{hf}"}))
    ctx = ParallelContext.from_config(cfg)
    try:
        parallelize(meta_model(cfg, ctx), cfg, ctx, load=load_initial_weights, read=open_initial_tensors)
    except ConfigError as e:
        return str(e)
    finally:
        ctx.destroy()
    return None


def test_a_failed_read_on_the_reading_rank_is_one_line_on_every_rank(tmp_path: Path, corpus: Path,  # noqa: F811
                                                                   llama_dir: Path) -> None:  # noqa: F811
    """A Hugging Face file cut short: rank 0, the only one that reads, finds it; rank 1, which reads nothing,
    raises the same one line (agreed before DeepSpeed's broadcast, so neither waits in it for the other)."""
    import shutil

    hf = tmp_path / "hf"
    shutil.copytree(llama_dir, hf)
    with open(hf / "model.safetensors", "r+b") as f:
        f.truncate((hf / "model.safetensors").stat().st_size - 1000)
    errors = run_distributed(_build_error, 2, tmp_path / "ds", corpus, hf, init_group=False, timeout=300)
    assert errors[0] is not None and errors[1] == errors[0] and len(errors[0].splitlines()) == 1, errors
    assert errors[0].startswith(f"rank 0: {hf / 'model.safetensors'}: cannot read weights for tensor "), errors
