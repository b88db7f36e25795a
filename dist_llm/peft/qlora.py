"""QLoRA's frozen base, built one block linear at a time: no two fp32 block weights exist at once.

`parallel/parallelize.py` keeps every block linear's weight on the meta device through `to_empty`
(`defer_block_linears`). Whatever fills it then (a random draw from its own generator, a DCP read of a
checkpoint, a Hugging Face region) allocates that one weight, fills it, quantises it to NF4 (`quantise`)
and drops the fp32 tensor before the next one is allocated (`materialise_quantised`). The NF4 codes are those
of quantising the whole fp32 model, since each weight holds the same values when it is quantised.

Under ZeRO-3 (FSDP2) the NF4 layers exist before anything is allocated: built on the meta device and sharded
there, each rank allocates only its shards of their codes and scales. `stand_in_linears` then puts a plain
linear with a meta weight in each one's place, so that the same fills (random draw, `ckpt:`, `hf:`) run
unchanged; `quantise` quantises that one whole weight, copies this rank's shards into the NF4 layer and puts
the layer back. No rank holds more than one block linear in fp32 or in whole NF4 at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dist_llm.model.init import parameter_name

BLOCK_LINEARS = ("attn.qkv", "attn.proj", "mlp.up", "mlp.gate", "mlp.down")

#: fills a block linear's weight (given by its name in the whole model) in place
Fill = Callable[[str, torch.Tensor], None]


def _child(block: nn.Module, path: str) -> nn.Module | None:
    parent, _, name = path.rpartition(".")
    return getattr(getattr(block, parent, None), name, None)


def block_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(module name in the whole model, layer) of every plain block linear QLoRA turns into NF4, in order
    (none of a block another pipeline stage holds)."""
    names = {id(m): parameter_name(n, "") for n, m in model.named_modules()}
    return [(names[id(layer)], layer) for block in model.blocks for path in BLOCK_LINEARS  # type: ignore[union-attr]
            if isinstance(layer := _child(block, path), nn.Linear)]


def defer_block_linears(model: nn.Module) -> list[tuple[nn.Module, nn.Parameter]]:
    """Take every block linear's (meta) weight out of its module, so that `to_empty` allocates none of them;
    returns (layer, weight) to put back with `restore`."""
    deferred = [(layer, layer.weight) for _, layer in block_linears(model) if layer.weight.is_meta]
    for layer, _ in deferred:
        layer._parameters["weight"] = None
    return deferred


def restore(deferred: list[tuple[nn.Module, nn.Parameter]]) -> None:
    for layer, weight in deferred:
        layer._parameters["weight"] = weight  # (still on the meta device)


def stand_in_linears(model: nn.Module) -> list[nn.Module]:
    """Put a plain linear with a meta weight (sharing the bias) in the place of every block NF4 layer of `model`
    (built on the meta device, its storage allocated but not filled), for `quantise` to fill it back; returns
    the NF4 layers."""
    from dist_llm.peft.nf4 import NF4Linear

    names = {id(m): parameter_name(n, "") for n, m in model.named_modules()}
    layers = [(names[id(layer)], layer) for block in model.blocks for path in BLOCK_LINEARS  # type: ignore[union-attr]
              if isinstance(layer := _child(block, path), NF4Linear)]
    for module_name, layer in layers:
        stand_in(model, module_name, layer)
    return [layer for _, layer in layers]


def stand_in(model: nn.Module, module_name: str, layer: nn.Module, device: torch.device | str = "meta") -> nn.Linear:
    """Put a plain linear (sharing the bias) in the place of NF4 layer `layer`, called `module_name` in `model`,
    its weight allocated on `device` but not filled (meta: nothing allocated); `quantise` fills the layer from it
    and puts the layer back, `put_back` puts it back unfilled."""
    linear = nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta",
                       dtype=layer.weight_dtype).requires_grad_(False)
    if str(device) != "meta":  # (allocated here, not by nn.Linear: its constructor draws from the global stream)
        linear.weight = nn.Parameter(torch.empty_like(linear.weight, device=device), requires_grad=False)
    linear.bias = layer.bias
    linear.__dict__["nf4_target"] = layer  # (not an attribute Module registers: no child, no parameters)
    parent_name, _, child = module_name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, linear)
    return linear


def put_back(model: nn.Module, module_name: str, linear: nn.Linear) -> None:
    """Undo `stand_in` without filling the NF4 layer (a rank that receives its values from another), freeing the
    stand-in's weight."""
    parent_name, _, child = module_name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, linear.__dict__["nf4_target"])
    linear._parameters["weight"] = None


def check_filled(model: nn.Module, layers: list[nn.Module]) -> None:
    """That every NF4 layer `stand_in_linears` took out is back in `model` (each got its weight)."""
    present = {id(m) for m in model.modules()}
    missing = [layer for layer in layers if id(layer) not in present]
    if missing:
        raise ValueError(f"{len(missing)} NF4 block linear(s) were never filled (a loader skipped them)")


def quantise(model: nn.Module, module_name: str, linear: nn.Linear) -> None:
    """Replace block linear `module_name` of `model` by its NF4 form and free its fp32 weight (the caller's
    reference to the old layer keeps no tensor alive after this). A stand-in (`stand_in_linears`) fills the
    NF4 layer it stands for, this rank's shards of it, and puts that layer back."""
    from dist_llm.peft.nf4 import NF4Linear, NF4Weight

    target = linear.__dict__.get("nf4_target")
    if target is None:
        layer = NF4Linear.from_linear(linear)
    else:  # (the NF4 defaults, as NF4Linear.from_linear quantises)
        target.load_quantised(NF4Weight.quantize(linear.weight, target.block_size, target.scale_block_size))
        layer = target
    parent_name, _, child = module_name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, layer)
    linear._parameters["weight"] = None


@torch.no_grad()
def materialise_quantised(model: nn.Module, device: torch.device, fill: Fill) -> int:
    """Allocate, `fill` and quantise, one at a time, every block linear whose weight is still on the meta
    device (its bias, if any, is already real). Returns how many."""
    count = 0
    for module_name, layer in block_linears(model):
        meta = layer.weight
        if not meta.is_meta:
            continue
        weight = nn.Parameter(torch.empty(meta.shape, dtype=meta.dtype, device=device), requires_grad=meta.requires_grad)
        weight.__dict__.update(meta.__dict__)  # the parallel marks (parallel/marks.py), if any
        layer.weight = weight
        del weight
        fill(f"{module_name}.weight", layer.weight)
        quantise(model, module_name, layer)
        count += 1
    return count
