"""DeepSpeed's ZeRO partitions as checkpoint chunks, and its ZeRO-3 model built one parameter at a time.

A checkpoint holds every tensor at its full shape under the keys every layout reads: `model.<fqn>` (the fp32
master) and `optim.state.<fqn>.{step, exp_avg, exp_avg_sq}`. DeepSpeed keeps each rank's share in flat fp32
partitions, with the inner torch AdamW's moments alongside, of the same length:
  ZeRO-1/2: one flat fp32 partition per parameter group (`single_partition_of_fp32_groups[i]`): rank r's
            slice of the group's flat buffer, in which each parameter sits at a known offset; the part of a
            parameter inside the slice is a 1-D range of the flattened parameter.
  ZeRO-3:   every parameter is cut into dp contiguous ranges of `partition_numel()` elements: rank r holds
            [r n, (r + 1) n) of the flattened parameter (the last range padded); DeepSpeed's local API
            (`safe_get_local_fp32_param`, `safe_get_local_optimizer_state`) gives its fp32 master and moments
            as views of the flat sub-group they live in.
Each range becomes rectangles of the full tensor (`shards.range_rectangles`) that view the live partitions:
DCP writes them as they are and, on resume, reads straight into them, resharding from whatever layout saved.
Nothing is gathered and no rank holds more than its own partition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from dist_llm.model.buffers import trained_buffers
from dist_llm.parallel import comm
from dist_llm.parallel.data.base import allocate_buffers, parameter_owners, replace_meta_parameter
from dist_llm.parallel.shards import range_rectangles
from dist_llm.parallel.tensor.checkpoint import TensorParallelState

if TYPE_CHECKING:
    from dist_llm.peft.nf4 import NF4Linear

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class Piece:
    """This rank's range of one parameter: where it starts among the flattened parameter's elements, and the
    flat fp32 views of it (the master, then each moment)."""

    start: int
    views: dict[str, torch.Tensor]


def flat_partitions(opt: Any) -> list[torch.Tensor]:
    """The flat fp32 tensors the inner optimizer steps (this rank's partitions)."""
    if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3
        return list(opt.fp32_partitioned_groups_flat)
    return list(opt.single_partition_of_fp32_groups)  # ZeRO-1/2


def ensure_state(opt: Any) -> None:
    """The inner AdamW's state for every flat partition, made now if no step made it yet (a resume loads into
    it): AdamW's own first step makes the same zeros and step 0, and keeps state it finds."""
    inner = opt.optimizer
    for flat in flat_partitions(opt):
        if inner.state.get(flat):
            continue
        fused = inner.defaults.get("fused") or inner.defaults.get("capturable")
        step_device = flat.device if fused else "cpu"
        inner.state[flat] = {"step": torch.zeros((), dtype=torch.float32, device=step_device),
                             **{k: torch.zeros_like(flat, memory_format=torch.preserve_format) for k in MOMENTS}}


def zero12_pieces(opt: Any) -> dict[int, Piece]:
    """id(parameter) -> this rank's piece of it, at ZeRO-1/2. Read from the flat buffer's own layout (the
    parameters in `round_robin_bit16_groups` order at `round_robin_bit16_offsets`, rank r owning the r-th of dp
    equal slices), not from the parameters' `_hp_mapping`: DeepSpeed 0.19.8 links those by the unreordered order,
    which is wrong once `round_robin_gradients` reorders a group that needs no alignment padding."""
    import deepspeed.comm as ds_dist

    inner, out = opt.optimizer, {}
    for i, params in enumerate(opt.round_robin_bit16_groups):
        flat = opt.single_partition_of_fp32_groups[i]
        state = inner.state[flat]
        size = opt.bit16_groups_flat[i].numel() // ds_dist.get_world_size(group=opt.real_dp_process_group[i])
        lo = ds_dist.get_rank(group=opt.real_dp_process_group[i]) * size
        for p, meta, offset in zip(params, opt.round_robin_bit16_meta[i], opt.round_robin_bit16_offsets[i]):
            a, z = max(lo, offset), min(lo + size, offset + meta.numel())
            if a >= z:  # no element of p in this rank's partition
                continue
            views = {"master": flat.narrow(0, a - lo, z - a), **{k: state[k].narrow(0, a - lo, z - a) for k in MOMENTS}}
            out[id(p)] = Piece(a - offset, views)
    return out


def zero3_pieces(params: list[nn.Parameter], dp_rank: int) -> dict[int, Piece]:
    """id(parameter) -> this rank's piece of it, at ZeRO-3 (trainable parameters: frozen ones have no master)."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

    out = {}
    for p in params:
        if not p.requires_grad:
            continue
        n = p.partition_numel()
        lo = dp_rank * n
        held = max(0, min(lo + n, p.ds_numel) - lo)  # the last rank's range is padded past the end
        views = {"master": safe_get_local_fp32_param(p).narrow(0, 0, held),
                 **{k: safe_get_local_optimizer_state(p, k).narrow(0, 0, held) for k in MOMENTS}}
        out[id(p)] = Piece(lo, views)
    return out


def chunked(tp: TensorParallelState, fqn: str, shape: torch.Size, piece: Piece | None, key: str,
            device: torch.device) -> torch.Tensor:
    """Parameter `fqn`'s full tensor (its tp-local `shape` placed by `tp`), of which this rank holds `piece`'s
    `key` view, as chunks: the 1-D range cut into rectangles (a partial first row, full rows, a partial last)."""
    views = []
    if piece is not None:
        flat, at = piece.views[key], 0
        for rect in range_rectangles(shape, piece.start, piece.start + flat.numel()):
            n = math.prod(rect[1])
            views.append((flat[at : at + n].view(rect[1]), rect))
            at += n
    return tp.chunked(fqn, views, shape, torch.float32, device)


def state_of(module: nn.Module, pieces: dict[int, Piece], step: torch.Tensor, tp: TensorParallelState,
             device: torch.device, model_sd: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint state: every name of a trained parameter (tied aliases too) gets the fp32 master's
    chunks, its first name the moments' chunks and the step count; `model_sd` gives the other entries."""
    optim: dict[str, Any] = {}
    first: set[int] = set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if not p.requires_grad:
            continue  # frozen (PEFT): a checkpoint keeps the trained tensors only
        shape = torch.Size(getattr(p, "ds_shape", p.shape))
        piece = pieces.get(id(p))
        model_sd[name] = chunked(tp, name, shape, piece, "master", device)
        if id(p) not in first:
            first.add(id(p))
            optim[name] = {"step": step.detach().to("cpu", torch.float32, copy=True),
                           **{k: chunked(tp, name, shape, piece, k, device) for k in MOMENTS}}
    return {"model": model_sd, "optim": {"state": optim}}


def set_step(opt: Any, optim_state: dict[str, Any]) -> None:
    """The step count a checkpoint gave (one for all parameters) into every flat partition's state."""
    step = next(iter(optim_state.values()))["step"] if optim_state else torch.tensor(0.0)
    for flat in flat_partitions(opt):
        opt.optimizer.state[flat]["step"].copy_(step)


@torch.no_grad()
def zero3_from_masters(opt: Any) -> None:
    """ZeRO-3, after DCP filled the fp32 masters: the compute-dtype partitions follow them (as DeepSpeed's own
    load does), and the parameters it keeps gathered (`ds_persist`, small ones) are gathered again."""
    opt.checkpoint_event_prologue()  # every parameter back to its partition, the persistent ones too
    for i, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
        flat16 = opt.fp16_partitioned_groups_flat[i]
        if fp32.numel():
            flat16.copy_(fp32)
        for part, view in zip(opt.fp16_partitioned_groups[i], opt.unflatten(flat16, opt.fp16_partitioned_groups[i])):
            part.data = view.data
    opt.checkpoint_event_epilogue()


# -- the ZeRO-3 build: one parameter at a time ------------------------------------------------------------------
class Fill(Protocol):
    """Fills parameter `name` (its name in the whole model), allocated whole on the device, in place (or a buffer a
    run trains: read from model.init_from, else left at its start value). With `source=False` the values are not
    wanted on this rank (another's are broadcast over them): a reader reads nothing and only joins what every rank
    does together (the agreement on whether the source's read failed)."""

    def __call__(self, name: str, t: torch.Tensor, *, source: bool = True) -> None: ...


@torch.no_grad()
def build_partitioned(model: nn.Module, fill: Fill, device: torch.device, ds_config: dict[str, Any],
                      group: Any = None) -> None:
    """Materialise a meta-device model straight into DeepSpeed's ZeRO-3 partitions: each parameter in turn is
    allocated whole, filled by `fill` (drawn as model/init.py draws it, from its own generator: the values of
    the one-process model; or read from model.init_from; a LoRA or adapter tensor drawn as apply_peft draws
    it), cast to the engine's dtype and handed to DeepSpeed's partitioner, which keeps this rank's range and
    frees the rest. A rank holds its partitions plus one parameter at full size, never the whole model.
    The partitioner first broadcasts the partition group's first rank's values over the others' (DeepSpeed 0.19's
    `_zero_init_param`), so only that rank fills for real: the others call `fill(..., source=False)`, reading
    nothing from model.init_from (one read of the checkpoint per group, not one per rank) and drawing nothing.
    QLoRA's NF4 layers (built on the meta device by apply_peft) are built a layer at a time (`_build_nf4`).
    Buffers (small) are allocated whole and recomputed; those a run trains (an MoE layer's expert_bias) are then
    filled like the parameters (`_fill_trained_buffers`): from model.init_from, what one process loads."""
    import deepspeed

    from dist_llm.model.init import parameter_name
    from dist_llm.peft.nf4 import NF4_PARAMETERS, NF4Linear

    # (not entered: no module class is patched; only its converter, the one deepspeed.initialize would use on a
    # whole model, is applied to each parameter)
    partitioner = deepspeed.zero.Init(config_dict_or_path=ds_config, data_parallel_group=group)
    source = partitioner.rank == 0  # (its rank in the partition group: the one the broadcast is from)
    allocate_buffers(model, device)  # (before the parameters: an NF4 layer's mean is its weight's, set as it is built)
    owners = parameter_owners(model)
    nf4 = {id(getattr(layer, pname)): (module_name, layer) for module_name, layer in model.named_modules()
           if isinstance(layer, NF4Linear) for pname in NF4_PARAMETERS}
    built: set[int] = set()  # the NF4 layers built (each at its first NF4 parameter)
    for name, meta in list(model.named_parameters()):  # (a shared parameter once, under its first name)
        if id(meta) in nf4:
            module_name, layer = nf4[id(meta)]
            if id(layer) not in built:
                built.add(id(layer))
                _build_nf4(model, module_name, layer, fill, device, partitioner, source)
            continue
        p = replace_meta_parameter(meta, torch.empty(meta.shape, dtype=meta.dtype, device=device), owners)
        fill(parameter_name(name, ""), p, source=source)  # (collective: a failed read is raised on every rank here)
        p.data = p.data.to(partitioner.dtype)
        # (broadcasts the source's values over the group, then keeps this rank's range: the others' p held garbage)
        partitioner._convert_to_zero_parameters([p])
    _fill_trained_buffers(model, fill, partitioner, source)


def _fill_trained_buffers(model: nn.Module, fill: Fill, partitioner: Any, source: bool) -> None:
    """The buffers a run trains (model/buffers.py: an MoE layer's expert_bias), whole on every rank as in every
    layout: filled as the parameters are (read from model.init_from on the source rank; from a random start `fill`
    leaves reset_buffers' start value), then broadcast from the source over its partition group."""
    from deepspeed import comm as ds_dist

    group = partitioner.ds_process_group
    for name, b in trained_buffers(model).items():
        fill(name, b, source=source)  # (collective: a failed read is raised on every rank here)
        ds_dist.broadcast(b, ds_dist.get_global_rank(group, 0), group=group)


def _build_nf4(model: nn.Module, module_name: str, layer: NF4Linear, fill: Fill, device: torch.device,
               partitioner: Any, source: bool) -> None:
    """One QLoRA NF4 layer into DeepSpeed's partitions: its frozen base weight read or drawn whole (as one process
    fills it, under its base name `<layer>.weight`, on the source rank only), quantised to NF4 there, and the NF4
    codes, block scales and group factors (uint8, int8, int32 bits: parameters, which DeepSpeed partitions
    whatever their dtype, and never casts) handed to the partitioner, which broadcasts the source's and keeps
    this rank's range. The mean (an fp32 scalar buffer, held whole) is broadcast beside them. Peak: the weight in
    fp32 and its NF4 form whole (plus the quantiser's working space), beside the partitions."""
    from deepspeed import comm as ds_dist

    from dist_llm.model.init import parameter_name
    from dist_llm.peft import qlora
    from dist_llm.peft.nf4 import NF4_PARAMETERS, NF4Weight

    linear = qlora.stand_in(model, module_name, layer, device)  # (the fills find `<layer>.weight` in the model)
    weight = linear.weight
    fill(parameter_name(module_name, "weight"), weight, source=source)
    qlora.put_back(model, module_name, linear)
    failed = None
    if source:  # (as NF4Linear.from_linear quantises: the NF4 defaults)
        try:
            layer.take(NF4Weight.quantize(weight, layer.block_size, layer.scale_block_size))
        except Exception as e:  # noqa: BLE001 - e.g. out of memory on this rank alone: said on every rank below
            failed = (f"rank {dist.get_rank()}: quantising {module_name}.weight to NF4 failed: "
                      f"{(str(e).strip().splitlines() or [type(e).__name__])[0]}")
    # only the source quantises: its peers must learn of a failure before they wait in the broadcast below (under
    # NCCL they would wait there until the timeout)
    failed = comm.shared_error(failed, partitioner.ds_process_group)
    if failed is not None:
        raise RuntimeError(failed)
    if not source:  # (garbage: the source's values are broadcast over it)
        for pname in NF4_PARAMETERS:
            setattr(layer, pname, nn.Parameter(torch.empty_like(getattr(layer, pname), device=device),
                                               requires_grad=False))
    del linear, weight  # (the fp32 weight freed before DeepSpeed partitions)
    group = partitioner.ds_process_group
    ds_dist.broadcast(layer.scale_mean, ds_dist.get_global_rank(group, 0), group=group)
    partitioner._convert_to_zero_parameters([getattr(layer, pname) for pname in NF4_PARAMETERS])


def builds_partitioned(cfg: Any) -> bool:
    """Whether the DeepSpeed backend builds the model straight into ZeRO-3 partitions (`build_partitioned`):
    at zero_stage 3, from a random start or model.init_from, with LoRA, adapters and QLoRA (its NF4 base quantised
    one layer at a time) too."""
    p = cfg.parallel
    return p.backend == "deepspeed" and p.zero_stage == 3
