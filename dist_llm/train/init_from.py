"""`model.init_from`: start training from Hugging Face weights (`hf:DIR`) or a dist_llm checkpoint (`ckpt:DIR`).

With `hf:DIR` each rank reads only the regions of the Hugging Face tensors it keeps (its tensor-parallel
slices, pipeline stage and FSDP2 shards); from `ckpt:DIR` each rank reads only its own chunks of the weights
(DCP reshards into this layout). No rank holds the whole model, and the start is the same at every layout.
With `hf:DIR` the directory's config.json decides the architecture keys of model.*, and its tokenizer.json is
used when data.tokenizer is left at 'byte'.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from typing import Any

import torch
import yaml
from torch import nn
from torch.distributed.tensor import DTensor

from dist_llm.config import Config, ConfigError, config_from_dict
from dist_llm.model import GPT
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.marks import partition_dim
from dist_llm.peft import peft_parameter_names

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


def initial_state(cfg: Config) -> dict[str, torch.Tensor]:
    """The full (tp=1) weights to start from, by parameter name, read whole (`hf:` starts; a `ckpt:` start
    loads into the model shard by shard instead, see `load_initial_weights`)."""
    kind, where = _split(cfg.model.init_from)
    if kind == "hf":
        from dist_llm.hf import load_hf_state_dict

        return load_hf_state_dict(where, cfg.model)
    where = _checked_checkpoint(cfg)
    from dist_llm.train import checkpoint as ckpt

    model = GPT(config_from_dict(yaml.safe_load((where / "config.yaml").read_text()), check=False).model)
    ckpt.load_model_weights(where, model)
    return model.state_dict()


def _checked_checkpoint(cfg: Config) -> Path:
    from dist_llm.train import checkpoint as ckpt

    _, where = _split(cfg.model.init_from)
    if not ckpt.is_complete(where):
        raise ConfigError(f"model.init_from: {where} is not a complete checkpoint (no {ckpt.MANIFEST})")
    saved = config_from_dict(yaml.safe_load((where / "config.yaml").read_text()), check=False)
    if saved.fingerprint() != cfg.fingerprint():
        raise ConfigError(f"model.init_from: {where} holds a different model than the model.* settings describe")
    return where


def _load_checkpoint_shards(model: GPT, cfg: Config, tp_state: object | None) -> None:
    """DCP reads this rank's chunks of each full weight straight into the model (resharding from whatever
    layout saved them): no rank reads or holds a whole weight it does not keep."""
    from dist_llm.train import checkpoint as ckpt

    where = _checked_checkpoint(cfg)
    adapters = peft_parameter_names(model)  # (drawn by parallelize: a base checkpoint has none)
    current = {k: v for k, v in model.state_dict().items() if k not in adapters}  # views: the load writes into them
    index = ckpt.SafeReader(str(where)).read_metadata().state_dict_metadata
    for name, t in current.items():
        saved = index.get(f"model.{name}")
        if saved is None:
            raise ConfigError(f"model.init_from: {cfg.model.init_from} has no weight for {name}")
        want = tp_state.global_shape(name, t.shape) if tp_state is not None else t.shape  # type: ignore[attr-defined]
        if tuple(saved.size) != tuple(want):
            raise ConfigError(f"model.init_from: weight {name} has shape {tuple(saved.size)}, this model "
                              f"wants {tuple(want)}")
    state = {"model": current, "optim": {"state": {}}}
    if tp_state is not None:
        state = tp_state.shard_state(state)  # type: ignore[attr-defined]
    ckpt.load_model_state(where, {"model": state["model"]})


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

        _load_checkpoint_shards(model, cfg, TensorParallelState(model, ctx) if ctx.tp > 1 else None)
    log.info("initialised from %s", cfg.model.init_from)


# Wrappers that insert a level into parameter names (torch.compile, activation checkpointing, FSDP1)
_WRAPPER_PARTS = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}


def _global_name(module_name: str, param_name: str) -> str:
    parts = [*module_name.split("."), param_name] if module_name else [param_name]
    return ".".join(p for p in parts if p not in _WRAPPER_PARTS)


def _runs(rows: torch.Tensor) -> list[tuple[int, int]]:
    """An index of rows -> its contiguous ranges [a, b), in order (fused QKV heads, shared KV heads)."""
    runs: list[tuple[int, int]] = []
    for r in rows.tolist():
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    return runs


def _tp_rows(name: str, module: nn.Module, rows: int, cfg: Config, ctx: ParallelContext) -> torch.Tensor:
    """The full-tensor rows a dim-0 tensor-parallel slice of `rows` rows holds: the module's vocabulary range
    or `rows` index; where that index has no values (built on the meta device, or uninitialised by to_empty:
    it is a non-persistent buffer), the same rows from the plan."""
    if hasattr(module, "vocab_start"):
        return torch.arange(module.vocab_start, module.vocab_end)
    index = getattr(module, "rows", None)
    if isinstance(index, torch.Tensor) and not index.is_meta and len(index) == rows:
        index = index.cpu()
        out_features = getattr(module, "out_features", None)
        # the plan's indexes are strictly increasing and in range; an uninitialised buffer is not
        increasing = bool((index[1:] > index[:-1]).all())
        if rows and increasing and index[0] >= 0 and (out_features is None or index[-1] < out_features):
            return index
    if name.rpartition(".")[0].endswith("attn.qkv"):
        from dist_llm.parallel.tensor.plan import qkv_rows

        return qkv_rows(cfg.model, ctx.tp, ctx.tp_rank)[0]
    return torch.arange(ctx.tp_rank * rows, (ctx.tp_rank + 1) * rows)


def _region(name: str, module: nn.Module, p: torch.Tensor, cfg: Config,
            ctx: ParallelContext) -> tuple[list[tuple[int, int]], tuple[int, int] | None]:
    """The global (tp=1) rows and columns of parameter `p`'s local data on this rank."""
    shape = tuple(p.shape)  # the tensor-parallel slice's shape (a DTensor's global shape is that slice's)
    dim = partition_dim(p)
    rows = _tp_rows(name, module, shape[0], cfg, ctx) if dim == 0 else torch.arange(shape[0])
    cols = None
    if len(shape) == 2:
        cols = (ctx.tp_rank * shape[1], (ctx.tp_rank + 1) * shape[1]) if dim == 1 else (0, shape[1])
    if isinstance(p, DTensor):  # FSDP2 shards the slice again along dim 0: this rank's part of it
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        rows = rows[offset[0] : offset[0] + local[0]]
        if cols is not None:
            cols = (cols[0] + offset[1], cols[0] + offset[1] + local[1])
    return _runs(rows), cols


def _load_hf(model: GPT, cfg: Config, ctx: ParallelContext, where: Path) -> None:
    from dist_llm.hf import HFCheckpoint
    from dist_llm.peft import BLOCK_LINEARS

    qlora = cfg.peft.method == "qlora"
    adapters = peft_parameter_names(model)  # (drawn by parallelize, not read)
    done: dict[int, nn.Parameter] = {}  # id of a parameter read (before materialising) -> the one that holds it
    with HFCheckpoint(where, cfg.model) as src:
        for module_name, module in list(model.named_modules()):
            for param_name, p in list(module.named_parameters(recurse=False)):
                if id(p) in done:  # a tied head: the embedding's parameter, read once
                    setattr(module, param_name, done[id(p)])
                    continue
                name = _global_name(module_name, param_name)
                if name in adapters:
                    continue
                if (name == "lm_head.weight" and cfg.model.tie_embeddings and getattr(model, "wte", None) is not None
                        and not isinstance(p, DTensor)):  # (re-)tied to the embedding read before it
                    setattr(module, param_name, model.wte.weight)
                    continue
                if name not in src.layout:
                    raise ConfigError(f"model.init_from: {where} has no weight for {name}")
                rows, cols = _region(name, module, p, cfg, ctx)
                done[id(p)] = _fill(src, name, module, param_name, p, rows, cols, ctx.device, model)
            path = _global_name(module_name, "").rstrip(".")
            if qlora and isinstance(module, nn.Linear) and path.startswith("blocks.") and path.endswith(BLOCK_LINEARS):
                _quantise(model, module_name, module)  # before the next layer is read
                # and its fp32 weight freed now: the list of modules above still holds the replaced linear
                for key in [k for k, v in done.items() if v is module.weight]:
                    del done[key]
                module._parameters["weight"] = None


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


def _quantise(model: nn.Module, module_name: str, linear: nn.Linear) -> None:
    from dist_llm.peft.nf4 import NF4Linear

    parent_name, _, child = module_name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, NF4Linear.from_linear(linear))
