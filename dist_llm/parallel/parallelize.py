"""From a config to this rank's part of the model, without ever holding the whole of it.

The GPT is built on the meta device (shapes, no storage), its layers already tensor-parallel when built
through TensorParallelFactory. `parallelize` then, in this order:
  1. cuts the pipeline stage (other stages' blocks are dropped while they are still meta);
  2. FSDP2 (ZeRO-3): `fully_shard` on the meta model, so that only this rank's dim-0 shards are ever allocated
     (DeepSpeed's ZeRO-3 instead takes the meta model, adapters and QLoRA's NF4 layers included, and partitions
     each parameter as it is drawn or read from model.init_from whole, one at a time, an NF4 layer as its weight
     is quantised: `_one_by_one`; and native ZeRO-1/2 from a random start without PEFT takes it too, allocates
     its flat buffer and draws each parameter in fp32 on its own into it: `builds_flat_on_meta`, `_draw_one`);
  3. materialises this rank's parameters on its device (`to_empty`), recomputes the buffers, re-ties the
     embedding, and initialises: the pieces of each parameter that this rank's part overlaps (one expert, a
     chunk of rows), each from a generator of its own, cut to the part (model/init.py), or, with
     `model.init_from`, loaded instead (nothing random drawn first);
     under QLoRA each block linear is allocated, filled and quantised to NF4 one at a time (peft/qlora.py),
     under ZeRO-3 into this rank's shards of the NF4 layer built on meta;
  4. PEFT (LoRA on the NF4 base, adapters), activation checkpointing, compile;
  5. the other data-parallel forms wrap the real, tensor-parallel-local parameters (DDP, ZeRO-1/2 from
     model.init_from or with PEFT, and DeepSpeed's ZeRO-1/2 hold those in full by design).
Peak memory of the build: this rank's parameters plus the largest piece drawn (one expert, one chunk of
rows; a tensor-parallel fused QKV whole), or under QLoRA one block linear whole and its quantiser's working space,
under DeepSpeed's ZeRO-3 one parameter whole and its 16-bit copy, under native ZeRO-1/2 from the meta device one
parameter in fp32 beside the flat buffer, and from a materialised model the fp32 model it casts parameter by
parameter (`dist-llm memory`'s init transient).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn

from dist_llm.config import Config
from dist_llm.model import GPT, LayerFactory
from dist_llm.model.buffers import trained_buffers
from dist_llm.model.init import parameter_name
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.context_parallel.apply import apply_context_parallel
from dist_llm.parallel.data import DataParallel, build_data_parallel, builds_on_meta
from dist_llm.parallel.data.deepspeed_shards import Fill
from dist_llm.parallel.expert import apply_expert_parallel
from dist_llm.parallel.pipeline.stage import Blocks, cut_to_stage, describe_blocks
from dist_llm.parallel.tensor import TensorParallelFactory
from dist_llm.parallel.tensor.moe import apply_moe_tensor_parallel, mark_moe_parameters
from dist_llm.peft import apply_peft, parameter_counts, peft_parameter_names, qlora, reset_peft_parameters

log = logging.getLogger("dist_llm")

PP_SEED_STRIDE = 100  # the RNG seed of pipeline stage k is train.seed + 100 k

#: loads `model.init_from` into a model whose parameters are allocated but not initialised (train/init_from.py)
Loader = Callable[[GPT, Config, ParallelContext], None]
#: opens `model.init_from` to be read one whole tensor at a time, a `Fill` (by its name in the whole model, at its
#: tp=1 shape, in place; with source=False only joining the others) (train/init_from.open_initial_tensors)
Reader = Callable[[Config, ParallelContext], AbstractContextManager[Fill]]


@dataclass
class Parallelized:
    model: GPT  # this rank's part of the GPT (FSDP2 modules under ZeRO-3)
    stage: tuple[Blocks, bool, bool] | None  # (blocks, first, last) of this pipeline stage; None without pp
    dp: DataParallel | None  # the data-parallel form (None when parallelize was asked not to wrap)


def meta_model(cfg: Config, ctx: ParallelContext) -> GPT:
    """The GPT for `cfg` on the meta device: every shape, no storage, nothing drawn. Its layers are this
    rank's tensor-parallel ones when parallel.tp > 1, its MoE layers' experts this rank's when parallel.ep > 1, its
    attention a ring over the cp group when parallel.cp > 1."""
    with torch.device("meta"):
        layers = TensorParallelFactory(cfg, ctx) if ctx.tp > 1 else LayerFactory(vocab_size=cfg.model.vocab_size)
        model = GPT(cfg.model, layers)
        apply_expert_parallel(model, ctx)
        apply_moe_tensor_parallel(model, ctx, sequence_parallel=cfg.parallel.sequence_parallel)
    if layers.summary():
        log.info(layers.summary())
    if ctx.cp > 1:  # each rank holds a part of every sequence: global positions, attention by ring
        apply_context_parallel(layers, group=ctx.cp_group, rank=ctx.cp_rank, cp=ctx.cp, stats=ctx.comm)
    return model


def _to_empty(model: nn.Module, device: torch.device) -> None:
    """`model.to_empty(device)`, allocating a tensor shared by several modules (the tied embedding) once:
    to_empty visits each module's parameters apart and would allocate it twice."""
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (the meta tensor, kept alive so that its
    # id is not reused by a new tensor while this runs; its replacement)

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            made[id(t)] = (t, torch.empty_like(t, device=device))
        return made[id(t)][1]

    model._apply(empty)  # (what Module.to_empty does, with the sharing kept)


def materialize(model: GPT, cfg: Config, ctx: ParallelContext, *, load: Loader | None = None) -> None:
    """Allocate this rank's parameters and buffers on ctx.device (uninitialised), recompute the buffers, re-tie
    the embedding, then initialise from `train.seed`, or load `model.init_from` through `load`."""
    # to_empty gives meta parameters new Parameter objects: carry their marks (parallel/marks.py) across
    marks = {name: dict(vars(p)) for name, p in model.named_parameters(remove_duplicate=False) if vars(p)}
    # QLoRA: the block linears stay out of to_empty's reach, on the meta device; the random init or the loader
    # allocates, fills and quantises them one at a time (peft/qlora.py), so the fp32 base never exists at once
    deferred = qlora.defer_block_linears(model) if cfg.peft.method == "qlora" else []
    _to_empty(model, ctx.device)
    qlora.restore(deferred)
    model.tie_weights()
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, attrs in marks.items():
        for attr, value in attrs.items():
            setattr(params[name], attr, value)
    del params
    model.reset_buffers()
    adapters = peft_parameter_names(model)  # LoRA/adapters added on the meta device (ZeRO-3 shards them there)
    # QLoRA at ZeRO-3: the NF4 layers were built and sharded on the meta device; a meta stand-in takes each one's
    # place, and the fills below quantise into this rank's shards of it (peft/qlora.py)
    nf4_layers = qlora.stand_in_linears(model) if cfg.peft.method == "qlora" else []
    if cfg.model.init_from:
        if load is None:
            raise ValueError("model.init_from is set but parallelize() was given no loader")
        load(model, cfg, ctx)  # (the base only: the loaders pass over the adapters' tensors)
    else:
        names = [parameter_name(n, "") for n, _ in model.named_parameters()]
        model.reset_parameters(cfg.train.seed, only=[n for n in names if n not in adapters])  # (meta ones skipped)
        if deferred or nf4_layers:
            qlora.materialise_quantised(model, ctx.device,
                                        lambda name, _: model.reset_parameters(cfg.train.seed, only=[name]))
    qlora.check_filled(model, nf4_layers)
    if adapters:
        reset_peft_parameters(model, cfg.train.seed)  # the values apply_peft draws on a materialised model


def _one_by_one(model: GPT, cfg: Config, ctx: ParallelContext,
                read: Reader | None) -> Callable[[], AbstractContextManager[Fill]]:
    """For a build that takes one parameter at a time, whole (DeepSpeed's ZeRO-3): what fills each, as
    `materialize` would fill it (the one-process values): a LoRA or adapter tensor drawn as apply_peft draws it,
    a base tensor read from model.init_from through `read`, or drawn from train.seed."""

    @contextlib.contextmanager
    def opened() -> Iterator[Fill]:
        adapters = peft_parameter_names(model)
        buffers = set(trained_buffers(model))  # (reset_buffers gave their start: only model.init_from has more)
        if cfg.model.init_from and read is None:
            raise ValueError("model.init_from is set but parallelize() was given no reader")
        with read(cfg, ctx) if cfg.model.init_from and read is not None else contextlib.nullcontext() as base:

            def fill(name: str, t: torch.Tensor, *, source: bool = True) -> None:
                if name in adapters:
                    if source:
                        reset_peft_parameters(model, cfg.train.seed, only=name)
                elif base is not None:
                    base(name, t, source=source)  # (collective, read or not)
                elif source and name not in buffers:
                    model.reset_parameters(cfg.train.seed, only=[name])

            yield fill

    return opened


def _draw_one(model: GPT, seed: int, name: str) -> None:
    """Initialise parameter `name` (as the model names it), just allocated, as one process draws it."""
    if model.reset_parameters(seed, only=[parameter_name(name, "")]) != 1:
        raise RuntimeError(f"no initialisation drew parameter {name}")


def parallelize(model: GPT, cfg: Config, ctx: ParallelContext, *, cut: bool = True, wrap: bool = True,
                load: Loader | None = None, read: Reader | None = None) -> Parallelized:
    """This rank's part of a meta-device GPT (from `meta_model`), materialised on ctx.device and initialised
    identically at every layout; `cut=False` keeps every block (no stage cut), `wrap=False` skips the
    data-parallel form. With model.init_from, `load` fills a materialised model, `read` one tensor at a time
    (the build DeepSpeed's ZeRO-3 takes)."""
    stage = None
    if cut and ctx.pp > 1:  # keep this pipeline stage's part of the model, while nothing is allocated
        stage = cut_to_stage(model, cfg, ctx.pp, ctx.pp_rank)
        blocks, first, last = stage
        log.info("pipeline stage %d/%d: %s%s%s", ctx.pp_rank, ctx.pp, describe_blocks(blocks),
                 ", embedding" if first else "", ", head and loss" if last else "")
    t = cfg.train
    # FSDP2 shards the meta model and each rank then allocates only its shards (DeepSpeed's ZeRO-3 likewise,
    # one parameter at a time); LoRA and adapters are added on the meta device too and drawn once allocated.
    # QLoRA's NF4 layers too (FSDP2 shards their codes and scales; DeepSpeed partitions them as each is quantised).
    shard_on_meta = wrap and builds_on_meta(cfg, ctx)

    def adapt_and_compile() -> None:
        if cfg.peft.method != "none":
            apply_peft(model, cfg.peft, seed=t.seed, sequence_parallel=cfg.parallel.sequence_parallel)
            mark_moe_parameters(model, ctx)  # (adapters inside MoE layers see 1/tp of the tokens under tp)
            counts = parameter_counts(model)  # (a QLoRA base weight by its elements, not its packed bytes)
            nf4 = sum(o * i for o, i in counts.nf4_shapes)
            log.info("peft %s: %d trainable parameters of %d (%.3f%%), the base frozen%s", cfg.peft.method,
                     counts.trainable, counts.total, 100 * counts.trainable / max(1, counts.total),
                     f" ({nf4} of its weights stored in 4-bit NF4)" if nf4 else "")
        if t.activation_checkpointing != "none":
            model.set_activation_checkpointing(t.activation_checkpointing)
        if t.compile:
            for block in model.blocks:
                if any(True for _ in block.parameters()):  # (not a block another pipeline stage holds)
                    block.compile()  # in place, so parameter names (and checkpoints) do not change

    dp = None
    if shard_on_meta:  # fully_shard the meta model, then materialise straight into this rank's shards
        adapt_and_compile()
        dp = build_data_parallel(model, cfg, ctx, materialize=lambda _: materialize(model, cfg, ctx, load=load),
                                 fill_each=_one_by_one(model, cfg, ctx, read),
                                 draw=lambda name: _draw_one(model, t.seed, name))
    else:
        materialize(model, cfg, ctx, load=load)
        adapt_and_compile()
        if wrap:
            dp = build_data_parallel(model, cfg, ctx)
    if ctx.pp_rank > 0:
        # Dropout draws from this stream. One process draws layer after layer from one stream; with the same
        # stream, stage k's first block would replay stage 0's first block's masks (Megatron offsets likewise).
        # Stage 0 keeps the one-process stream.
        torch.manual_seed(t.seed + PP_SEED_STRIDE * ctx.pp_rank)
    else:
        torch.manual_seed(t.seed)
    return Parallelized(model=model, stage=stage, dp=dp)
