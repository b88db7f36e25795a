"""Layout-independent initialisation: each parameter from a generator of its own.

A parameter's values are drawn from a generator seeded by (seed, its name in the whole model), in the shape
it has in the whole model, on the device it lives on; the rank then keeps its part (a tensor-parallel slice,
and of that an FSDP2 shard). So one process, any tensor/pipeline/data-parallel layout and any build order
draw the same numbers for the same parameter, and the largest temporary is one parameter at full size.

Modules take part through duck-typed hooks, so the model stays free of parallelism:
  `full_shape(pname)` / `local_part(pname, full)`  a sharded layer's whole shape and this rank's part of it
  `init_rule(pname)`  a module with its own distribution (LoRA, adapters): a Fill, or None for the default
  `reset_buffers()`   recompute non-persistent buffers (after `to_empty`, a meta buffer holds no values)
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Iterable

import torch
from torch import nn

Fill = Callable[[torch.Tensor, torch.Generator], object]
Rule = Callable[[str, nn.Module, str], "Fill | None"]


def normal(std: float) -> Fill:
    return lambda t, g: t.normal_(0.0, std, generator=g)


def zeros(t: torch.Tensor, g: torch.Generator) -> object:
    return t.zero_()


def ones(t: torch.Tensor, g: torch.Generator) -> object:
    return t.fill_(1.0)


def kaiming_uniform(t: torch.Tensor, g: torch.Generator) -> object:
    """nn.Linear's default weight init (Kaiming-uniform, a=sqrt(5)), from generator g."""
    return nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g)


def fan_in_uniform(fan_in: int) -> Fill:
    """nn.Linear's default bias init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return lambda t, g: t.uniform_(-bound, bound, generator=g)


#: Levels that wrappers insert into module names (torch.compile's `_orig_mod`, activation checkpointing, FSDP1):
#: not part of a parameter's name in the whole model
WRAPPER_PARTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def parameter_name(module_name: str, pname: str) -> str:
    """The name of parameter `pname` of the module called `module_name` as one process's plain GPT calls it,
    whatever wraps it (compile, checkpointing, FSDP; FSDP2 and pipeline stages keep the names as they are):
    the one name that seeds its initial values (`param_seed`) and that loaders look it up by. With `pname`
    empty: the module's own name."""
    parts = [*module_name.split("."), pname]
    return ".".join(p for p in parts if p and p not in WRAPPER_PARTS)


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, parameter name): stable across processes and Python runs (unlike hash())."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def local_shard(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of `full` that DTensor `like` holds on this rank (FSDP2's dim-0 shard); `full` itself when
    `like` is a plain tensor. Pure layout arithmetic: no communication."""
    if not hasattr(like, "device_mesh"):
        return full
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    for dim, (size, start) in enumerate(zip(shape, offset)):
        full = full.narrow(dim, start, size)
    return full


@torch.no_grad()
def fill_parameter(module: nn.Module, pname: str, name: str, fill: Fill, seed: int) -> None:
    """Draw `module.<pname>` (called `name` in the whole model) in full and keep this rank's part of it."""
    p = getattr(module, pname)
    local = p.to_local() if hasattr(p, "to_local") else p
    if local.is_meta:  # built on the meta device and not materialised yet: nothing to fill
        return
    shape = module.full_shape(pname) if hasattr(module, "full_shape") else tuple(p.shape)
    # Drawn on the host, in fp32 whatever the parameter's dtype: CPU and CUDA generators give different numbers
    # for one seed, and the base of a random-start LoRA run is rebuilt on the CPU (export, sampling), so the
    # values must not depend on the device the run trained on. Only this rank's part is copied over.
    gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
    whole = not hasattr(module, "local_part") and not hasattr(p, "device_mesh") and tuple(local.shape) == tuple(shape)
    if whole and local.device.type == "cpu" and local.dtype == torch.float32 and local.is_contiguous():
        fill(local, gen)  # (the same numbers as drawing into a new tensor and copying, without the copy)
        return
    full = torch.empty(shape, dtype=torch.float32)
    fill(full, gen)
    part = module.local_part(pname, full) if hasattr(module, "local_part") else full
    local.copy_(local_shard(part, p))


def init_parameters(model: nn.Module, seed: int, rule: Rule, *, only: Iterable[str] | None = None) -> int:
    """Fill every parameter of `model` (those named in `only`, if given), a shared one once under its first
    name; `rule(module_name, module, pname)` gives the distribution unless the module has an `init_rule`.
    Returns the number of parameters filled."""
    wanted = None if only is None else set(only)
    seen: set[int] = set()
    count = 0
    for mod_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            name = parameter_name(mod_name, pname)
            if id(p) in seen or (wanted is not None and name not in wanted):
                continue
            seen.add(id(p))
            fill = module.init_rule(pname) if hasattr(module, "init_rule") else None
            fill = fill or rule(mod_name, module, pname)
            if fill is None:
                raise ValueError(f"no initialisation rule for parameter {name}")
            fill_parameter(module, pname, name, fill, seed)
            count += 1
    return count


def reset_buffers(model: nn.Module) -> None:
    """Recompute every module's non-persistent buffers (position tables, ALiBi slopes, tensor-parallel row
    indices). A module that holds buffers but cannot recompute them is refused: after `to_empty` they would
    hold garbage."""
    for name, module in model.named_modules():
        own = list(module.named_buffers(recurse=False))
        if not own:
            continue
        if not hasattr(module, "reset_buffers"):
            raise TypeError(f"{name or 'model'} ({type(module).__name__}) holds buffers {[n for n, _ in own]} but "
                            "has no reset_buffers(): it cannot be materialised from the meta device")
        module.reset_buffers()
