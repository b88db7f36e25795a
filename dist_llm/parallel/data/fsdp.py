"""ZeRO stage 3: PyTorch FSDP2 (`fully_shard` on each block, then the root).

Its all-gathers and reduce-scatters are routed through comm.py (`set_custom_all_gather` /
`set_custom_reduce_scatter`), which counts their bytes and, on gloo, replaces the emulated reduce-scatter
(a full all-reduce, twice the bytes) by all-to-all plus a local sum.

Units shard over the dp ranks, or under context parallelism over dp x cp flattened (cp ranks hold the same
parameters, and the gradients of their different tokens are averaged over both, as DDP and ZeRO-1/2 do).

Under a pipeline (pp > 1) each stage shards its own part (its blocks, and the embedding / head it holds in the
root unit) over its dp group, as torchtitan composes them. The schedule runs the stage's forwards and backwards
in its own order, so the step is driven here rather than by one forward and one backward:
  - each part runs through the root's call (StageModel.through_call), so the root unit's hooks gather the
    embedding / head and hook the end of every backward;
  - a stage's parameters are gathered at its first forward and, by default (`parallel.reshard_after_forward`
    unset), stay gathered until its last backward of the step: one all-gather per unit per step instead of two
    per micro-batch, for the memory of the stage's whole part in the compute dtype;
  - gradients accumulate unsharded (fp32, the stage's whole part) over the micro-batches and are
    reduce-scattered once per step, in the stage's last backward (known from the schedule: `micro_step(last)`);
    `finish_grads` then reduces whatever that backward did not reach (zb1's weight-gradient pass W runs no
    FSDP2 hook) and reshards, as torch.distributed.pipelining's REDUCE_GRAD does. Under zb1 each W's 16-bit
    gradient is folded into the fp32 accumulator right after it, as the post-backward hook does after a whole
    backward (`_fold_unsharded_grads`);
  - or, with `parallel.pp_reduce_grads=micro_batch`, reduce-scattered after every backward, each result added
    into the fp32 shard as without a pipeline: m times the bytes, and no whole gradient held between backwards
    (the memory a 70B stage needs: its fp32 gradient alone is 4 bytes a parameter of the stage).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, alloc_storage
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from dist_llm.config import Config, reshard_after_forward
from dist_llm.parallel import comm
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.data.base import DataParallel
from dist_llm.parallel.expert.fsdp import shard_moe_units
from dist_llm.optim import build_optimizer
from dist_llm.precision import DTYPES
from dist_llm.parallel.marks import marks_of, set_marks


class _Alloc:
    def allocate(self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class CountedAllGather(_Alloc, AllGather):
    def __init__(self, stats: comm.CommStats) -> None:
        self.stats = stats

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        return comm.all_gather(output_tensor, input_tensor, group, self.stats, async_op=async_op)


class CountedReduceScatter(_Alloc, ReduceScatter):
    def __init__(self, stats: comm.CommStats) -> None:
        self.stats = stats

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object, async_op: bool = False) -> object | None:
        return comm.reduce_scatter(output_tensor, input_tensor, group, self.stats, op=op, async_op=async_op)


class GatherIntoParameter(CountedAllGather):
    """The all-gather of a unit holding one parameter sharded on dim 0 (the untied embedding, the head), on the
    CPU. FSDP2 gathers a unit into a flat buffer (`allocate`) and copies that out into the unsharded parameter
    (`foreach_all_gather_copy_out`): for a moment a 125 MiB table takes 250 MiB, the step's peak at ZeRO-3.
    For one parameter the flat buffer's layout is the parameter's (each rank's padded rows in rank order), so
    the buffer handed out here is the unsharded parameter's own storage: the gather lands in place, and the
    copy-out copies the data onto itself (`copy_` of a view onto the same view returns at once). The buffer is
    a tensor of its own over that storage, with its own version counter: writing it must not look, to autograd,
    like a change to the parameter that the head's matmul saved for backward (FSDP2 re-gathers into the
    same storage for backward and keeps the parameter's version for that reason). Anything else (several
    parameters, another placement, offloading, a tensor subclass with its own all-gather) gets a buffer of its
    own, as before. Not on a GPU: there FSDP2 allocates the buffer on its all-gather streams and the parameter
    on the compute stream, and handing one's memory to the other would break the caching allocator's stream
    accounting."""

    def __init__(self, stats: comm.CommStats, unit: FSDPModule) -> None:
        super().__init__(stats)
        self.unit = unit

    def allocate(self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        param = _single_dim0_param(self.unit)
        numel = math.prod(size)
        if param is not None and device.type == "cpu":
            world = param.mesh_info.shard_mesh_size
            param.init_all_gather_outputs([numel // world], [dtype], world, device)  # (a no-op after the first)
            outputs = param.all_gather_outputs
            if len(outputs) == 1 and outputs[0].numel() == numel and outputs[0].dtype == dtype:
                alloc_storage(outputs[0])  # (FSDP2 frees it at each reshard; the copy-out then finds it allocated)
                return torch.empty(0, dtype=dtype, device=device).set_(outputs[0].untyped_storage(), 0, (numel,))
        return super().allocate(size, dtype=dtype, device=device)


def _single_dim0_param(unit: FSDPModule) -> FSDPParam | None:
    """The unit's one FSDP2 parameter where it has exactly one, plain and sharded on dim 0 (else None)."""
    groups = unit._get_fsdp_state()._fsdp_param_groups
    if len(groups) != 1 or len(groups[0].fsdp_params) != 1:
        return None
    param = groups[0].fsdp_params[0]
    plain = not param.offload_to_cpu and not hasattr(param._sharded_local_tensor, "fsdp_pre_all_gather")
    return param if plain and param.fsdp_placement.dim == 0 else None


def _vocab_units(model: nn.Module) -> list[nn.Module]:
    """The untied embedding and head, each a unit of its own: left in the root unit, both were gathered whole
    (2 x vocab x width) for the whole forward and again for the whole backward, the largest thing a rank
    held (2 x 125 MiB for a 32000 x 1024 Llama against its 265 MiB quarter of the model). Apart, each is
    whole only around its own use: the embedding for its lookup (a frozen one never again in backward), the
    head for the logits and their backward. Tied (one parameter), or cut apart by the pipeline,
    they stay in the root."""
    wte, head = getattr(model, "wte", None), getattr(model, "lm_head", None)  # (None on other pipeline stages)
    if wte is None or head is None or wte.weight is head.weight:
        return []
    return [wte, head]


def release_reduce_inputs(comm_ctx: object, stream: object) -> None:
    """Drop the reduce-scatter inputs FSDP2 keeps alive in `comm_ctx` (its FSDPCommContext, `reduce_scatter_states`
    since torch 2.12), once `stream` (the compute stream) waits for each reduce-scatter's event: the caching
    allocator may then hand their memory to later kernels of that stream only."""
    states = getattr(comm_ctx, "reduce_scatter_states", None)
    if states is None:  # (a torch whose FSDP2 keeps them elsewhere: a silent no-op would keep them all step)
        raise RuntimeError(f"parallel.pp_reduce_grads=micro_batch: this torch {torch.__version__}'s FSDP2 keeps no "
                           "reduce_scatter_states; use torch>=2.13 or pp_reduce_grads=step")
    for state in states:
        if state.event is not None:
            stream.wait_event(state.event)  # type: ignore[attr-defined]
    states.clear()


class FSDPDataParallel(DataParallel):
    name = "fsdp2"

    def __init__(self, model: nn.Module, cfg: Config, ctx: ParallelContext, *,
                 materialize: Callable[[nn.Module], None] | None = None) -> None:
        p, precision = cfg.parallel, cfg.train.precision
        # fp32 sharded parameters are the master weights; forward/backward run in param_dtype, grads reduce in fp32
        mp = MixedPrecisionPolicy(param_dtype=None if precision == "fp32" else DTYPES[precision],
                                  reduce_dtype=torch.float32)
        # the dtype of the gathered parameters the forward computes with: the sharded ones stay fp32 (the masters)
        self._stream_dtype = mp.param_dtype or next(model.parameters()).dtype
        offload = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda") if p.offload == "cpu" else OffloadPolicy()
        kwargs = dict(mesh=ctx.dp_cp_mesh, mp_policy=mp, offload_policy=offload)
        reshard = reshard_after_forward(cfg)
        # fully_shard swaps every parameter for a new DTensor one: carry the tensor-parallel marks across
        marks = {name: marks_of(p) for name, p in model.named_parameters()}
        vocab = _vocab_units(model)
        held = [b for b in model.blocks if any(True for _ in b.parameters())]  # (not another stage's placeholder)
        # MoE: each router a unit gathered in fp32, at ep > 1 each layer's experts a unit over expert-dp (first:
        # the blocks' units then leave their parameters to them)
        moe_units = shard_moe_units(model, ctx, mp=mp, mesh=ctx.dp_cp_mesh, offload_policy=offload,
                                    reshard_after_forward=reshard)
        units = [*held, *vocab]
        for unit in units:
            fully_shard(unit, reshard_after_forward=reshard, **kwargs)
        fully_shard(model, reshard_after_forward=reshard, **kwargs)
        if vocab:  # an embedding's backward reads only the indices and the output's gradient, never the table:
            # without this, backward's prefetch would gather the whole table again after the first block
            vocab[0].set_unshard_in_backward(False)
            # and the head's backward does not prefetch the last block: its gather (a block's weights) would be
            # whole beside the whole head; the block gathers itself once the head is resharded. (An empty list
            # means FSDP2's default prefetch; the head itself, whole when this runs, is a prefetch that does nothing.)
            vocab[1].set_modules_to_backward_prefetch([vocab[1]])
        units = [*moe_units, *units, model]
        if ctx.device.type == "cpu":
            # In forward FSDP2 keeps each unit's gathered buffer until the next unit's copy-out (to overlap that
            # copy with the next all-gather on a GPU's side streams): two gathered buffers live at once, the head's
            # with the last block's. The CPU has no streams to overlap on: there an async unshard frees each
            # buffer right after its own copy-out, as backward always does.
            model._set_unshard_async_op(True)
        for unit in units:
            assert isinstance(unit, FSDPModule)
            unit.set_custom_all_gather(GatherIntoParameter(ctx.comm, unit) if ctx.device.type == "cpu"
                                       else CountedAllGather(ctx.comm))
            unit.set_custom_reduce_scatter(CountedReduceScatter(ctx.comm))
        self.fsdp_units = units
        # Under a pipeline, between two backwards of a step: keep the gathered parameters for the next
        # micro-batch, unless asked to reshard (zb1's W needs the gathered parameters its B left, so never there)
        self._keep_between = ctx.pp > 1 and (not reshard or p.pp_schedule == "zb1")
        self._reduce_every_backward = ctx.pp > 1 and p.pp_reduce_grads == "micro_batch"
        self._split_backward = ctx.pp > 1 and p.pp_schedule == "zb1"  # W computes the weight gradients after B
        if ctx.pp > 1:
            self._pipeline_flags(last=False)
        if materialize is not None:  # a meta model: allocate this rank's shards (to_empty) and fill them
            for name, p in model.named_parameters():  # (model.init_from places each shard by them: expert slices)
                set_marks(p, marks[name])
            materialize(model)
        for name, p in model.named_parameters():
            set_marks(p, marks[name])
        # where each rank's shard starts in the flattened parameter: fixed, so computed here once (DTensor's layout
        # arithmetic costs more than the rest of a small parameter's step, and reads the mesh back to the host)
        self._offsets = {id(p): self._shard_offset(p) for p in model.parameters()}
        super().__init__(model, cfg, ctx)

    def build_optimizer(self) -> torch.optim.Optimizer:
        # under parallel.offload=cpu the shards the optimizer steps live on the CPU: pick the kernel for them
        device = torch.device("cpu") if self.cfg.parallel.offload == "cpu" else self.ctx.device
        return build_optimizer(self.model, self.cfg.optim, device)

    hooks_on_model_call = True

    def micro_step(self, *, last: bool) -> contextlib.AbstractContextManager:
        if self.ctx.pp > 1:  # the stage's last backward reduces the step's gradients once (module docstring)
            self._pipeline_flags(last=last)
            if self._reduce_every_backward and not last:
                return self._released_reduce_inputs()
            return self._folded_weight_grads() if self._split_backward else contextlib.nullcontext()
        # Reduce-scatter on every micro-step, not only the last: FSDP2 then adds each result into the sharded
        # fp32 gradient, so between micro-steps a rank holds 4/dp bytes of gradient per parameter, as ZeRO-3
        # promises (and memory/ predicts). Skipping the sync would save accumulation-1 reduce-scatters a step
        # but keep a whole unsharded fp32 gradient (4 bytes per parameter) alive across micro-steps.
        for unit in self.fsdp_units:
            unit.set_requires_gradient_sync(True, recurse=False)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _released_reduce_inputs(self):  # type: ignore[no-untyped-def]
        """Around a backward that reduce-scatters but is not the step's last: FSDP2 keeps the last unit's
        reduce-scatter input (a whole unit's gradient) until a backward marked last, so release it at the end
        of this one, as that backward would: the compute stream waits for the reduce-scatter before reusing it."""
        yield
        root = self.fsdp_units[-1]._get_fsdp_state()  # (its comm context is every unit's)
        release_reduce_inputs(root._comm_ctx, root._device_handle.current_stream())

    @contextlib.contextmanager
    def _folded_weight_grads(self):  # type: ignore[no-untyped-def]
        """Around zb1's W: fold the weight gradients it wrote into FSDP2's fp32 accumulators once it ends."""
        yield
        self._fold_unsharded_grads()

    def _fold_unsharded_grads(self) -> None:
        """What FSDP2's post-backward does with a backward's gradient when it does not reduce: add the unsharded
        16-bit `.grad` into the fp32 `unsharded_accumulated_grad` (or start it) and drop the `.grad`. Under zb1 that
        hook fires in B (the input-gradient pass reaches each unit's inputs), before W writes the weights'
        gradients: without this a W's gradient waited in `.grad` for the next B's hook, and W's that follow one
        another with no B between (a stage's last ones) summed into that bf16 `.grad`, rounding the sum to
        bf16, where 1F1B rounds each micro-batch's gradient once and sums in fp32. A no-op in fp32 (the gradient
        is already in the reduce dtype) and for a unit not gathered (it holds no unsharded gradient)."""
        root = self.fsdp_units[-1]._get_fsdp_state()
        for state in root._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                if group.is_unsharded:
                    for param in group.fsdp_params:
                        param.accumulate_unsharded_grad_if_needed()
                        param.to_accumulated_grad_if_needed()

    def _pipeline_flags(self, *, last: bool) -> None:
        """Set how the next backward ends: the step's last reduce-scatters the accumulated gradients and reshards;
        any other accumulates them unsharded (and keeps the parameters gathered, by default), or under
        parallel.pp_reduce_grads=micro_batch reduce-scatters them too."""
        for unit in self.fsdp_units:
            unit.set_requires_gradient_sync(last or self._reduce_every_backward, recurse=False)
            unit.set_reshard_after_backward(last or not self._keep_between, recurse=False)
        self.fsdp_units[-1].set_is_last_backward(last)  # (the root: the flag is shared by every unit)

    def finish_grads(self) -> None:
        if self.ctx.pp == 1:
            return
        # Every unit's post-backward once more, as the last backward's end would run it: a no-op for a unit that
        # last backward reduced already; the reduce-scatter (and reshard) for one it did not reach (zb1's W
        # accumulates through AccumulateGrad alone). Then the root's end-of-backward: wait for the reductions.
        self._pipeline_flags(last=True)
        root = self.fsdp_units[-1]._get_fsdp_state()
        for state in root._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                group.post_backward()
        root._root_post_backward_final_callback()
        self._pipeline_flags(last=False)  # the next step's backwards accumulate until its last

    def stream_dtype(self) -> torch.dtype:
        # not the first parameter's: FSDP2 swaps it between the sharded fp32 one and the gathered param_dtype one
        return self._stream_dtype

    def tied_embedding_grad(self) -> torch.Tensor:
        # the first stage's embedding and the last stage's head shard alike over their dp groups (same dp rank)
        return self.module.wte.weight.grad.to_local()

    dp_sharded_grads = True

    def grad_shards(self) -> list[tuple[nn.Parameter, torch.Tensor, int]]:
        # DTensor gradients: this rank's local shard of dim 0 (empty where a small parameter has no rows here)
        out = []
        for p in self.module.parameters():
            if p.grad is not None:
                out.append((p, p.grad.to_local(), self._offsets[id(p)]))
        return out

    @staticmethod
    def _shard_offset(p: nn.Parameter) -> int:
        _, global_offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        row_len = math.prod(p.shape[1:])  # (from the shape: p[0] of a sharded DTensor would all-gather)
        return global_offset[0] * row_len if global_offset else 0
