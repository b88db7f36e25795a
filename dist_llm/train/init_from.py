"""`model.init_from`: start training from Hugging Face weights (`hf:DIR`) or a dist_llm checkpoint (`ckpt:DIR`).

With `hf:DIR` each rank reads only the regions of the Hugging Face tensors it keeps (its tensor-parallel
slices, pipeline stage and FSDP2 shards); from `ckpt:DIR` each rank reads only its own chunks of the weights
(DCP reshards into this layout). No rank holds the whole model, and the start is the same at every layout.
With `hf:DIR` the directory's config.json decides the architecture keys of model.*, and its tokenizer.json is
used when data.tokenizer is left at 'byte'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dist_llm.config import Config, ConfigError
from dist_llm.model import GPT
from dist_llm.model.init import parameter_name
from dist_llm.parallel.comm import shared_error
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.data.deepspeed_shards import Fill
from dist_llm.parallel.tensor.checkpoint import row_runs, tp_slice
from dist_llm.peft import peft_parameter_names, qlora
from dist_llm.train.errors import ReadError

log = logging.getLogger("dist_llm")


def _split(spec: str) -> tuple[str, Path]:
    kind, _, where = spec.partition(":")
    return kind, Path(where).expanduser()


def resolve_architecture(cfg: Config) -> Config:
    """`cfg` with the model.* architecture of an `hf:` start (unchanged otherwise)."""
    if not cfg.model.init_from.startswith("hf:"):
        return cfg
    from dist_llm.hf import model_config_from_hf

    _, where = _split(cfg.model.init_from)
    model = model_config_from_hf(where, base=cfg.model)
    data = cfg.data
    if data.tokenizer == "byte" and (where / "tokenizer.json").is_file():
        data = dataclasses.replace(data, tokenizer=str(where / "tokenizer.json"))
    if model.vocab_size < 256 and data.tokenizer == "byte":
        raise ConfigError(f"model.init_from: {where} has a vocabulary of {model.vocab_size}, too small for the byte "
                          "tokenizer; set data.tokenizer to its tokenizer.json")
    return dataclasses.replace(cfg, model=model, data=data)


def _checked_checkpoint(cfg: Config) -> Path:
    """The `ckpt:` directory, once its files match its manifest (collective: every rank checks a share, and
    every rank reaches the check, before anything that could fail on one rank alone) and it holds this model."""
    from dist_llm.train import checkpoint as ckpt

    _, where = _split(cfg.model.init_from)
    complete = ckpt.is_complete(where)
    problem = ckpt.damage(where, "model.init_from", timeout_s=cfg.parallel.timeout_s)
    if not complete:
        raise ConfigError(f"model.init_from: {where} is not a complete checkpoint (no {ckpt.MANIFEST})")
    if problem is not None:
        raise ConfigError(f"model.init_from: {problem}")
    saved = ckpt.saved_config(where, "model.init_from")
    if saved.fingerprint() != cfg.fingerprint():
        raise ConfigError(f"model.init_from: {where} holds a different model than the model.* settings describe")
    return where


def _load_checkpoint_shards(model: GPT, cfg: Config, tp_state: object | None, ctx: ParallelContext) -> None:
    """DCP reads this rank's chunks of each full weight straight into the model (resharding from whatever
    layout saved them): no rank reads or holds a whole weight it does not keep. QLoRA's block linears, left on
    the meta device, are then read one at a time, each quantised before the next is allocated. One reader
    serves every read, so the checkpoint's index is read (and checked) once."""
    from dist_llm.train import checkpoint as ckpt

    error = None
    try:  # (a pipeline stage checks only its own weights: its verdict must reach the others before DCP's load)
        where = _checked_checkpoint(cfg)
        reader = ckpt.SafeReader(str(where))
        current = _checked_weights(model, cfg, tp_state, reader)
    except Exception as e:  # noqa: BLE001 - whatever failed here, the peers must hear of it, not wait
        error = _failure(e, ctx)
    _raise_shared(error)
    state = {"model": {k: v for k, v in current.items() if not v.is_meta}, "optim": {"state": {}}}
    if tp_state is not None:
        state = tp_state.shard_state(state)  # type: ignore[attr-defined]
    ckpt.load_model_state(where, {"model": state["model"]}, reader=reader)  # (collective: DCP shares its failures)
    try:  # each rank reads its own block linears alone (no_dist: the stages hold different ones)
        qlora.materialise_quantised(model, ctx.device, lambda name, t: _read_alone(reader, where, name, t))
    except Exception as e:  # noqa: BLE001
        error = _failure(e, ctx)
    _raise_shared(error)


def _checked_weights(model: GPT, cfg: Config, tp_state: object | None, reader: Any) -> dict[str, torch.Tensor]:
    """The model's base tensors to fill from the checkpoint `reader` reads (views of the parameters), each
    checked to be in it at the shape this model wants."""
    adapters = peft_parameter_names(model)  # (drawn by parallelize: a base checkpoint has none)
    current = {k: v for k, v in model.state_dict().items() if k not in adapters}  # views: the load writes into them
    index = reader.read_metadata().state_dict_metadata
    for name, t in current.items():
        want = tp_state.global_shape(name, t.shape) if tp_state is not None else t.shape  # type: ignore[attr-defined]
        _check_saved(index, cfg, name, want)
    return current


def _check_saved(index: dict[str, Any], cfg: Config, name: str, want: tuple[int, ...] | torch.Size) -> None:
    """That a checkpoint whose DCP index is `index` holds weight `name` at (full) shape `want`."""
    saved = index.get(f"model.{name}")
    if saved is None:
        raise ConfigError(f"model.init_from: {cfg.model.init_from} has no weight for {name}")
    if tuple(saved.size) != tuple(want):
        raise ConfigError(f"model.init_from: weight {name} has shape {tuple(saved.size)}, this model "
                          f"wants {tuple(want)}")


#: a rank's failure as every rank raises it: (whether the input is at fault, the one line)
Failure = tuple[bool, str]


def _raise_shared(error: Failure | None) -> None:
    """Collective over every rank: raise the first rank's error on all of them, if any rank failed: a
    ConfigError where the input is at fault (exit 2), a ReadError otherwise (an I/O error, a bug: exit 1)."""
    shared: Any = shared_error(error, None)  # type: ignore[arg-type]  # (any picklable object travels)
    if shared is not None:
        bad_input, line = shared
        raise ConfigError(line) if bad_input else ReadError(line)


def _read_alone(reader: Any, where: Path, name: str, out: torch.Tensor) -> None:
    """Fill `out` (parameter `name`, whole) from checkpoint `where` through its SafeReader `reader` (whose
    index it read once), without talking to other ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException

    from dist_llm.train.safe_metadata import load_failure

    try:
        dcp.load({"model": {name: out}}, storage_reader=reader, no_dist=True)
    except CheckpointException as e:
        raise load_failure(where, e) from None


#: fills a whole base tensor (given by its name in the whole model, at its tp=1 shape) in place; with
#: source=False reads nothing, only joins the others (parallel/data/deepspeed_shards.Fill)
TensorFill = Fill


@contextlib.contextmanager
def open_initial_tensors(cfg: Config, ctx: ParallelContext) -> Iterator[TensorFill]:
    """model.init_from one whole tensor at a time: `fill(name, out)` reads base tensor `name` into `out`, in
    the file's dtype, converted into out's. For a build that takes each parameter in full, one after another
    (DeepSpeed's ZeRO-3 partitioner keeps this rank's range of it): the largest temporary is one tensor.
    `fill(name, out, source=False)` reads nothing (the partitioner broadcasts its source rank's values over out):
    only the source rank reads each tensor, the others just learn whether that read failed.
    Opening and each `fill` are collective over every rank: a failure on one (a damaged file, a missing or
    misshapen weight) is raised on all as the same one line, before DeepSpeed's broadcast, so that none waits in
    it for a rank that gave up (under NCCL it would wait forever)."""
    kind, where = _split(cfg.model.init_from)
    src: Any = None
    error = None
    try:
        if kind == "hf":
            from dist_llm.hf import HFCheckpoint

            src = HFCheckpoint(where, cfg.model)
        else:
            from dist_llm.train.checkpoint import SafeReader

            where = _checked_checkpoint(cfg)
            src = SafeReader(str(where))
            index = src.read_metadata().state_dict_metadata  # (read once, for every tensor)
    except Exception as e:  # noqa: BLE001 - the peers must hear of it, not wait
        error = _failure(e, ctx)
    _raise_shared(error)

    def fill(name: str, out: torch.Tensor, *, source: bool = True) -> None:
        error = None
        try:
            if not source:
                pass  # (the source rank's read, checks included, speaks for all)
            elif kind == "hf":
                if name not in src.layout:
                    raise ConfigError(f"model.init_from: {where} has no weight for {name}")
                src.read_into(name, out)
            else:
                _check_saved(index, cfg, name, out.shape)
                _read_alone(src, where, name, out)
        except Exception as e:  # noqa: BLE001
            error = _failure(e, ctx)
        _raise_shared(error)

    try:
        yield fill
    finally:
        if kind == "hf":
            src.close()
    log.info("initialised from %s", cfg.model.init_from)


def _failure(e: BaseException, ctx: ParallelContext) -> Failure:
    """A failure on this rank as every rank raises it (see _raise_shared): the input is at fault when it was named
    as bad (a ConfigError: a damaged, truncated or misshapen file, a missing weight)."""
    return isinstance(e, ConfigError), _one_line(e, ctx)


def _one_line(e: BaseException, ctx: ParallelContext) -> str:
    """A failure on this rank as the one line every rank raises (naming the rank where there are several)."""
    if not isinstance(e, ConfigError):  # not a damaged input we named: keep the traceback in the rank's log
        log.debug("model.init_from failed on rank %d", ctx.rank, exc_info=e)
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, (ConfigError, ReadError)):  # (a ReadError names what it read already)
        line = text
    elif isinstance(e, OSError) and e.strerror:  # the file and what the system said
        line = f"model.init_from: {e.filename + ': ' if e.filename else ''}{e.strerror}"
    else:
        line = f"model.init_from: {type(e).__name__}: {text}"
    return f"rank {ctx.rank}: {line}" if ctx.world_size > 1 else line


@torch.no_grad()
def load_initial_weights(model: GPT, cfg: Config, ctx: ParallelContext) -> None:
    """Fill `model`'s parameters (this rank's part: tensor-parallel slices, its pipeline stage's blocks, its
    FSDP2 shards) from model.init_from, instead of a random init.

    Parameters still on the meta device are allocated on ctx.device one at a time (keeping their marks and
    requires_grad; a tied head re-tied); materialised ones are filled in place. With `hf:` each rank reads only
    the regions it keeps, and under peft.method=qlora each block linear is quantised to NF4 as soon as it is
    read, so the base never exists in fp32 beyond one layer."""
    kind, where = _split(cfg.model.init_from)
    if kind == "hf":
        _load_hf(model, cfg, ctx, where)
    else:
        from dist_llm.parallel.tensor.checkpoint import TensorParallelState

        _load_checkpoint_shards(model, cfg, TensorParallelState(model, ctx) if ctx.tp > 1 or ctx.ep > 1 else None, ctx)
    log.info("initialised from %s", cfg.model.init_from)


def _region(module: nn.Module, param_name: str, p: torch.Tensor) -> tuple[list[tuple[int, int]], tuple[int, int] | None]:
    """The global (tp=1) row ranges and columns of parameter `p`'s local data on this rank: its tensor-parallel
    slice (`tp_slice`, the one answer the checkpoints use too), and of that its FSDP2 shard."""
    shape = tuple(p.shape)  # the tensor-parallel slice's shape (a DTensor's global shape is that slice's)
    part = tp_slice(module, param_name)
    rows = part.rows if part is not None and part.rows is not None else torch.arange(shape[0])
    cols = None
    if len(shape) == 2:
        start = part.col_start if part is not None and part.col_start is not None else 0
        cols = (start, start + shape[1])
    if isinstance(p, DTensor):  # FSDP2 shards the slice again along dim 0: this rank's part of it
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        rows = rows[offset[0] : offset[0] + local[0]]
        if cols is not None:
            cols = (cols[0] + offset[1], cols[0] + offset[1] + local[1])
    return [(first, first + end - start) for start, end, first in row_runs(rows.tolist())], cols


def _load_hf(model: GPT, cfg: Config, ctx: ParallelContext, where: Path) -> None:
    """Read this rank's regions; a failure on any rank (a damaged or truncated shard, a missing tensor) is
    raised on every rank as the same one line, so that none waits in a later collective for the one that
    failed (every rank reaches the exchange, failed or not)."""
    error = None
    try:
        _read_hf(model, cfg, ctx, where)
    except Exception as e:  # noqa: BLE001 - whatever failed here, the peers must hear of it, not wait
        error = _failure(e, ctx)
    _raise_shared(error)


def _read_hf(model: GPT, cfg: Config, ctx: ParallelContext, where: Path) -> None:
    from dist_llm.hf import HFCheckpoint

    quantised = {id(layer) for _, layer in qlora.block_linears(model)} if cfg.peft.method == "qlora" else set()
    adapters = peft_parameter_names(model)  # (drawn by parallelize, not read)
    done: dict[int, nn.Parameter] = {}  # id of a parameter read (before materialising) -> the one that holds it
    with HFCheckpoint(where, cfg.model) as src:
        for module_name, module in list(model.named_modules()):
            for param_name, p in list(module.named_parameters(recurse=False)):
                if id(p) in done:  # a tied head: the embedding's parameter, read once
                    setattr(module, param_name, done[id(p)])
                    continue
                name = parameter_name(module_name, param_name)
                if name in adapters:
                    continue
                if (name == "lm_head.weight" and cfg.model.tie_embeddings and getattr(model, "wte", None) is not None
                        and not isinstance(p, DTensor)):  # (re-)tied to the embedding read before it
                    setattr(module, param_name, model.wte.weight)
                    continue
                if name not in src.layout:
                    raise ConfigError(f"model.init_from: {where} has no weight for {name}")
                rows, cols = _region(module, param_name, p)
                done[id(p)] = _fill(src, name, module, param_name, p, rows, cols, ctx.device, model)
            if id(module) in quantised:
                for key in [k for k, v in done.items() if v is module.weight]:
                    del done[key]
                qlora.quantise(model, parameter_name(module_name, ""), module)  # before the next layer is read


def _fill(src: Any, name: str, module: nn.Module, param_name: str, p: nn.Parameter, rows: list[tuple[int, int]],
          cols: tuple[int, int] | None, device: torch.device, model: nn.Module) -> nn.Parameter:
    """Read `name`'s region into `p`, allocating it on `device` first when it is on the meta device."""
    if isinstance(p, DTensor):
        local = p.to_local()
        if not local.is_meta:
            if local.numel():  # (a small parameter may have no rows on this dp rank)
                src.read_into(name, local, rows, cols)
            return p
        local = torch.empty(local.shape, dtype=p.dtype, device=device)
        if local.numel():
            src.read_into(name, local, rows, cols)
        data: torch.Tensor = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                                stride=p.stride())
    elif p.is_meta:
        data = torch.empty(p.shape, dtype=p.dtype, device=device)
        src.read_into(name, data, rows, cols)
    else:
        src.read_into(name, p.data, rows, cols)
        return p
    new = nn.Parameter(data, requires_grad=p.requires_grad)
    new.__dict__.update(p.__dict__)  # the parallel marks (parallel/marks.py), and anything else set on it
    setattr(module, param_name, new)
    if isinstance(p, DTensor):
        _fsdp_param(model, module, param_name).reset_sharded_param()  # FSDP2 re-points (and pads) its shard
    return new


def _fsdp_param(model: nn.Module, module: nn.Module, param_name: str) -> Any:
    """The FSDP2 record of a parameter, which must learn of a new one (as FSDPModule._apply tells it, which
    to_empty goes through: that materialises a whole unit at once, this one parameter)."""
    from torch.distributed.fsdp import FSDPModule

    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            for group in unit._get_fsdp_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    info = fsdp_param._module_info
                    if info.module is module and info.param_name == param_name:
                        return fsdp_param
    raise ConfigError(f"model.init_from: {param_name} of {type(module).__name__} is a DTensor that FSDP2 does not "
                      "manage: cannot materialise it")  # pragma: no cover - a wrapping bug
