"""Which parameters a rank holds, by name and shape, before any data-parallel form: the whole model's, built once
on the meta device per model (PEFT applied or not); a pipeline stage's, as `cut_to_stage` keeps them; each one's
piece on tensor-parallel rank 0 and, for stacked experts, its E/ep experts (moe.py); QLoRA's NF4 storage."""

from __future__ import annotations

import dataclasses
import math

import torch

from dist_llm.config import Config
from dist_llm.memory import moe as memory_moe


# (name, shape, requires_grad) of every parameter of the whole model, PEFT applied or not, built once on the meta
# device per model: `suggest` asks for hundreds of layouts of one model, and a build of a 1.3B GPT takes 0.2 s
_PARAMS: dict[str, list[tuple[str, tuple[int, ...], bool]]] = {}


def _model_params(cfg: Config, *, peft: bool = True) -> list[tuple[str, tuple[int, ...], bool]]:
    from dist_llm.model import GPT
    from dist_llm.peft import apply_peft

    # (QLoRA's trainable and frozen shapes are LoRA's; model_state_bytes counts its frozen weights in NF4 bytes)
    method = cfg.peft if cfg.peft.method != "qlora" else dataclasses.replace(cfg.peft, method="lora")
    key = repr((cfg.model, method if peft and method.method != "none" else None))
    if key not in _PARAMS:
        with torch.device("meta"):
            model = GPT(cfg.model)
            apply_peft(model, method if peft else dataclasses.replace(method, method="none"), seed=0)
        if len(_PARAMS) >= 16:
            _PARAMS.pop(next(iter(_PARAMS)))
        _PARAMS[key] = [(n, tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()]
    return _PARAMS[key]


def _stage_layers(cfg: Config, pp: int, pp_rank: int) -> list[int]:
    """This stage's blocks, as `cut_to_stage` splits them (balanced by training FLOPs, or parallel.pp_layers;
    interleaved: its chunks' blocks)."""
    from dist_llm.parallel.pipeline.stage import stage_ranges

    # remembered per model and split: the search is the dearest part of counting a layout
    v = cfg.parallel.pp_virtual
    key = repr((cfg.model, pp, cfg.parallel.pp_layers, v))
    if key not in _RANGES:
        shapes = [(n, s) for n, s, _ in _model_params(cfg, peft=False)]
        _RANGES[key] = stage_ranges(cfg.model, pp * v, shapes, cfg.parallel.pp_layers or None)
    return [i for c in range(v) for i in _RANGES[key][c * pp + pp_rank]]


_RANGES: dict[str, list[range]] = {}


def _block_params(cfg: Config) -> int:
    key = repr(cfg.model)
    if key not in _BLOCK:
        _BLOCK[key] = sum(math.prod(s) for name, s, _ in _model_params(cfg, peft=False) if name.startswith("blocks.0."))
    return _BLOCK[key]


_BLOCK: dict[str, int] = {}


def _params16(cfg: Config, dp: int) -> bool:
    """Parameters held in the compute dtype: our ZeRO-1/2 (with fp32 masters), DeepSpeed at every stage."""
    return cfg.parallel.backend == "deepspeed" or (dp > 1 and cfg.parallel.zero_stage in (1, 2))


def _local_shape(name: str, shape: tuple[int, ...], cfg: Config, tp: int) -> tuple[int, ...]:
    """This parameter's shape on tensor-parallel rank 0."""
    if tp == 1:
        return shape
    from dist_llm.parallel.tensor.plan import qkv_rows

    base, _, leaf = name.rpartition(".")
    lora = base.endswith(".lora")
    layer = base[: -len(".lora")] if lora else base
    kind = ("qkv" if layer.endswith("attn.qkv") else "column" if layer.endswith(("mlp.up", "mlp.gate"))
            else "row" if layer.endswith(("attn.proj", "mlp.down")) else "vocab" if layer in ("wte", "lm_head")
            else "whole")
    rows_split = kind in ("qkv", "column", "vocab")
    if lora:  # column layers: B split by rows, A whole; row layers: A split by columns, B whole
        if kind == "row" and leaf == "A":
            return shape[0], shape[1] // tp
        if rows_split and leaf == "B":
            rows = len(qkv_rows(cfg.model, tp, 0)[0]) if kind == "qkv" else shape[0] // tp
            return (rows, *shape[1:])
        return shape
    if kind == "qkv":
        return (len(qkv_rows(cfg.model, tp, 0)[0]), *shape[1:])
    if kind in ("column", "vocab"):
        return (shape[0] // tp, *shape[1:])
    if kind == "row" and leaf == "weight":
        return shape[0], shape[1] // tp
    return shape


def _rank_shape(name: str, shape: tuple[int, ...], cfg: Config, tp: int, ep: int) -> tuple[int, ...]:
    """The shape of `name` this rank holds before ZeRO: its tp piece, and of a stacked expert tensor E/ep
    experts."""
    local = _local_shape(name, shape, cfg, tp)
    return memory_moe.local_expert_shape(local, ep) if ep > 1 and memory_moe.is_expert(name) else local


def _nf4_nbytes(numel: int, block: int = 64, scale_block: int = 256, *, dp: int = 1) -> int:
    """QLoRA's storage of a weight of `numel` values on dp rank 0: packed codes, int8 block scales and fp32 group
    factors (each 1-D, split by FSDP2 into chunks of ceil(len/dp) at ZeRO-3), and the 4-byte mean every rank holds."""
    blocks = -(-numel // block)
    return sum(-(-n // dp) * size for n, size in ((blocks * block // 2, 1), (blocks, 1), (-(-blocks // scale_block), 4))) + 4


def _stage_params(cfg: Config, pp: int, pp_rank: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, requires_grad) of the parameters a rank of this pipeline stage holds: the whole model's
    (`_model_params`) kept as `cut_to_stage` keeps them (its blocks; the embedding on the first stage, and on the
    last with tied embeddings; the final norm and head on the last). A test checks it against the cut model."""
    params = _model_params(cfg)
    if pp == 1:
        return params
    first, last = pp_rank == 0, pp_rank == pp - 1
    blocks = _stage_layers(cfg, pp, pp_rank)

    def kept(name: str) -> bool:
        top, _, rest = name.partition(".")
        if top == "blocks":
            return int(rest.partition(".")[0]) in blocks
        if top == "wte":
            return first or (last and cfg.model.tie_embeddings)
        if top == "wpe":
            return first
        if top in ("ln_f", "lm_head"):
            return last
        raise AssertionError(f"memory: no rule for parameter {name} under a pipeline")

    return [x for x in params if kept(x[0])]


def _stage_model(cfg: Config, pp: int, pp_rank: int) -> torch.nn.Module:
    """The whole GPT on the meta device, PEFT applied, cut to this pipeline stage."""
    from dist_llm.model import GPT
    from dist_llm.parallel.pipeline.stage import cut_to_stage
    from dist_llm.peft import apply_peft

    peft = cfg.peft if cfg.peft.method != "qlora" else dataclasses.replace(cfg.peft, method="lora")
    with torch.device("meta"):
        model = GPT(cfg.model)
        apply_peft(model, peft, seed=0)
    if pp > 1:
        cut_to_stage(model, cfg, pp, pp_rank)
    return model
