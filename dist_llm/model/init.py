"""Layout-independent initialisation: each parameter from generators of its own.

A parameter's values are defined at the shape it has in the whole model, in chunks of whole dim-0 rows, chunk c
drawn from a generator seeded by (seed, its name in the whole model, c) on the host in fp32; a rank draws only
the chunks that overlap its part (a tensor-parallel slice, an expert-parallel slice, and of that an FSDP2 shard)
and keeps the overlap. So one process, any tensor/pipeline/data/expert-parallel layout and any build order give
the same numbers for the same parameter, and the largest temporary is one chunk:

  - a stack of independent tensors along dim 0 (`init_rows(pname)` = 1: the experts of an MoE layer, their LoRA
    pairs) is drawn one element at a time: a rank draws the experts it holds and no other;
  - any other parameter in chunks of CHUNK_NUMEL elements' worth of rows (16 MiB in fp32; a GPT-2 token embedding
    of 50,304 x 768 is ten chunks): a vocab-parallel rank draws about its 1/tp of the embedding. A parameter of
    one chunk (every one of a small model) draws what one generator over the whole tensor draws.

Chunk 0 keeps the parameter's own seed (seed, name); chunk c > 0 is seeded by (seed, f"{name}[{c}]"). A fill sees
the chunk with every dimension but dim 0 whole, so a distribution that reads the fan-in (Kaiming's default mode)
gets the whole tensor's; none reads dim 0's size. The rank's part is found by applying `local_part` and the FSDP2
shard to a meta tensor of the full shape (no memory): where it is not one box of the full tensor (rows picked by
index: the fused QKV under tp, the rank's q, k and v heads) the parameter is drawn whole, chunk by chunk, and
the part taken from it.

Modules take part through duck-typed hooks, so the model stays free of parallelism:
  `full_shape(pname)` / `local_part(pname, full)`  a sharded layer's whole shape and this rank's part of it
  `init_rows(pname)`  dim-0 rows one generator draws (1: a stack whose elements are drawn one by one)
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


#: the most elements one generator draws for a parameter that is not a stack (module docstring)
CHUNK_NUMEL = 1 << 22

#: The version of how initial values are drawn, recorded in each checkpoint's manifest (`init_scheme`; missing: 1).
#: 1: each parameter from one generator over its whole shape; 2: by chunks and by expert (module docstring). A
#: PEFT run without model.init_from keeps no base: sampling, export and resume rebuild it from train.seed, and a
#: scheme other than the one it trained on gives another base wherever the schemes differ (`drawn_otherwise`).
INIT_SCHEME = 2


def drawn_otherwise(model: nn.Module, rule: Rule | None = None) -> list[str]:
    """Names of the parameters of `model` (one process's, meta is enough) whose values scheme 2 draws otherwise
    than scheme 1: those of more than one chunk (a stack of experts, a parameter over CHUNK_NUMEL elements), but
    with `rule` (as `init_parameters` takes it) none filled with constants (zeros, ones). Chunk 0 keeps the
    parameter's seed, so a parameter of one chunk draws what it drew before."""
    names: list[str] = []
    seen: set[int] = set()  # (a shared parameter once, under its first name, as init_parameters fills it)
    for mod_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            shape = tuple(module.full_shape(pname)) if hasattr(module, "full_shape") else tuple(p.shape)
            if id(p) in seen or not shape or chunk_rows(module, pname, shape) >= shape[0]:
                continue
            seen.add(id(p))
            fill = (module.init_rule(pname) if hasattr(module, "init_rule") else None) or (
                rule(mod_name, module, pname) if rule is not None else None)
            if fill not in (zeros, ones):
                names.append(parameter_name(mod_name, pname))
    return names


def chunk_seed(seed: int, name: str, chunk: int) -> int:
    """The seed of chunk `chunk` of parameter `name` (chunk 0: the parameter's own, `param_seed(seed, name)`)."""
    return param_seed(seed, name if chunk == 0 else f"{name}[{chunk}]")


def chunk_rows(module: nn.Module, pname: str, shape: tuple[int, ...]) -> int:
    """Dim-0 rows of the whole parameter that one generator draws: the module's `init_rows`, else as many as fit
    in CHUNK_NUMEL elements (at least one). Depends on the whole shape only, never on the layout."""
    if hasattr(module, "init_rows"):
        return int(module.init_rows(pname))
    return max(1, CHUNK_NUMEL // max(1, math.prod(shape[1:])))


def part_box(module: nn.Module, pname: str, p: torch.Tensor,
             shape: tuple[int, ...]) -> tuple[list[int], list[int]] | None:
    """(offsets, sizes) per dim of this rank's part of the whole parameter: `local_part` and the FSDP2 shard applied
    to a meta tensor of the whole shape, read off the view they return. None where the part is not one box of
    the whole (rows picked by an index: no view) or the parameter is 0-dim."""
    probe = torch.empty(shape, device="meta")
    part = local_shard(module.local_part(pname, probe) if hasattr(module, "local_part") else probe, p)
    if not shape or (part is not probe and (part._base is not probe or part.stride() != probe.stride())):
        return None
    offsets, rest = [], part.storage_offset()
    for stride in probe.stride():  # (a contiguous whole: the storage offset in mixed radix)
        offsets.append(rest // stride)
        rest %= stride
    return offsets, list(part.shape)


@torch.no_grad()
def fill_parameter(module: nn.Module, pname: str, name: str, fill: Fill, seed: int) -> None:
    """Draw this rank's part of `module.<pname>` (called `name` in the whole model): the chunks of the whole
    parameter that overlap it, one at a time (see the module docstring)."""
    p = getattr(module, pname)
    local = p.to_local() if hasattr(p, "to_local") else p
    if local.is_meta:  # built on the meta device and not materialised yet: nothing to fill
        return
    shape = tuple(module.full_shape(pname)) if hasattr(module, "full_shape") else tuple(p.shape)
    # Drawn on the host, in fp32 whatever the parameter's dtype: CPU and CUDA generators give different numbers
    # for one seed, and the base of a random-start LoRA run is rebuilt on the CPU (export, sampling), so the
    # values must not depend on the device the run trained on. Only this rank's part is copied over.
    box = part_box(module, pname, p, shape)
    if box is None or list(local.shape) != box[1]:
        full = torch.empty(shape, dtype=torch.float32)
        _draw(full, 0, name, seed, fill, chunk_rows(module, pname, shape))
        part = module.local_part(pname, full) if hasattr(module, "local_part") else full
        local.copy_(local_shard(part, p))
        return
    offsets, sizes = box
    if local.numel() == 0:
        return
    rows = chunk_rows(module, pname, shape)
    first, end = offsets[0], offsets[0] + sizes[0]
    # (drawing into the parameter itself gives the numbers a new tensor would get, without the copy)
    in_place = local.device.type == "cpu" and local.dtype == torch.float32 and local.is_contiguous() and all(
        o == 0 and n == whole for o, n, whole in zip(offsets[1:], sizes[1:], shape[1:]))
    for c in range(first // rows, -(-end // rows)):
        lo, hi = c * rows, min((c + 1) * rows, shape[0])
        a, b = max(lo, first), min(hi, end)  # the rows of chunk c this rank holds
        target = local.narrow(0, a - first, b - a)
        if in_place and (a, b) == (lo, hi):
            _draw(target, lo, name, seed, fill, rows)
            continue
        chunk = torch.empty((hi - lo, *shape[1:]), dtype=torch.float32)
        _draw(chunk, lo, name, seed, fill, rows)
        piece = chunk.narrow(0, a - lo, b - a)
        for dim in range(1, len(shape)):
            piece = piece.narrow(dim, offsets[dim], sizes[dim])
        target.copy_(piece)
        del chunk, piece  # (before the next chunk is allocated: one at a time)


def _draw(t: torch.Tensor, first: int, name: str, seed: int, fill: Fill, rows: int) -> None:
    """Fill `t`, rows [first, first + len(t)) of the whole parameter starting at a chunk boundary, chunk by chunk."""
    if t.dim() == 0:
        fill(t, torch.Generator(device="cpu").manual_seed(chunk_seed(seed, name, 0)))
        return
    for lo in range(0, t.shape[0], rows):
        gen = torch.Generator(device="cpu").manual_seed(chunk_seed(seed, name, (first + lo) // rows))
        fill(t.narrow(0, lo, min(rows, t.shape[0] - lo)), gen)


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
