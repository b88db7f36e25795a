"""`parallel.backend=deepspeed`: the same model and trainer, with DeepSpeed's engine doing data parallelism.

DeepSpeed is optional (`pip install dist-llm[deepspeed]`) and imported only here. The config it gets is
derived from ours (batch sizes, ZeRO stage, precision, clipping: deepspeed_config.py), so users who know DeepSpeed
switch with one key. A torch AdamW is handed in, which avoids DeepSpeed's fused_adam JIT build. On CPU DeepSpeed
would JIT-compile a shared-memory all-reduce on its first `init_distributed` (a minute of g++), which only its
inference tensor parallelism calls: the build is skipped (skip_inference_all_reduce_build).

DeepSpeed scales fp16 losses, clips and skips overflowing steps inside its own step, so the trainer's
scaler stands aside; the gradient norm and whether the step was skipped come back from the engine.

MoE models run here at ep=1 as they are: the loss the engine backpropagates carries the routers' balancing terms
(model/gpt.py), the trainer moves the expert bias after the engine's step, and the bias (a buffer, never
partitioned) is saved and resumed beside the partitions at every stage. ep>1 is refused (config.py): the engine
reduces every gradient over all of dp, where each expert's belongs to its expert-dp group alone.

At ZeRO-3 the model is built straight into DeepSpeed's partitions, one parameter at a time, whether drawn, read from
model.init_from or a LoRA/adapter tensor, QLoRA's NF4 base one layer at a time, quantised whole and then partitioned
(deepspeed_shards.build_partitioned). Checkpoints at ZeRO-1/2/3 hold each
rank's partitions as chunks of the full tensors, under the keys every layout reads (model.<fqn>: the fp32 master,
optim.state.<fqn>: the moments and step), so a DeepSpeed checkpoint resumes in any layout and any checkpoint resumes
here, each rank reading its partitions straight from the chunks (deepspeed_shards.py). What is not a tensor of the
model (the loss scaler, the engine's step counters) goes into the step folder's `deepspeed/rank_KKKKK.safetensors`,
tensors plus JSON (engine_state.py), which our manifest covers. Each rank writes and later reads its own file only,
with no collective: DeepSpeed's save_checkpoint and load_checkpoint are not used (they barrier on the training
group, rank 0 writes a 16-bit copy of the whole module that the DCP shards already hold, and they read with
torch.load(weights_only=False)). At stage 0 (no partitions) a checkpoint holds the weights only.
"""

from __future__ import annotations

import contextlib
import logging
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from dist_llm.config import Config, ConfigError
from dist_llm.model.buffers import fp32_buffers_kept, trained_buffers
from dist_llm.optim import adamw, set_lr
from dist_llm.parallel import comm
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.data import deepspeed_shards as shards
from dist_llm.parallel.data.base import DataParallel, optimizer_state_tensors, tensor_bytes
from dist_llm.parallel.data.deepspeed_config import merged_deepspeed_config
from dist_llm.parallel.data.deepspeed_shards import build_partitioned, builds_partitioned
from dist_llm.parallel.data.engine_state import (
    EngineStateError,
    read_engine_layout,
    read_engine_state,
    write_engine_state,
)
from dist_llm.parallel.tensor.checkpoint import TensorParallelState

log = logging.getLogger("dist_llm")

#: the folder of a checkpoint that holds each rank's DeepSpeed state (deepspeed/rank_KKKKK.safetensors)
ENGINE_DIR = "deepspeed"
#: the engine's own counters that its step reads (its skip count, the samples and steps it has seen)
_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """optim.param_groups (matrices decay, vectors do not), judged by each parameter's full shape: a ZeRO-3
    parameter built partitioned holds an empty tensor, its shape in `ds_shape`."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def skip_inference_all_reduce_build() -> None:
    """DeepSpeed's torch comm backend, created by the first init_distributed, JIT-compiles its shared-memory
    all-reduce (`deepspeed_shm_comm`) on a CPU machine: about a minute of g++ here on the first run (then cached
    under TORCH_EXTENSIONS_DIR), before the first step. Only `inference_all_reduce` calls it, from DeepSpeed's
    inference tensor parallelism (module_inject), which training here never uses. Marked incompatible, the op is
    not built (comm/torch.py build_shm_op returns None) and inference_all_reduce would fall back to the process
    group's. (With Intel's oneCCL bindings installed, the CPU accelerator builds its CCL comm op instead: left as
    it is.) Call before the first init_distributed; `built_inference_all_reduce()` says afterwards whether it held."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if isinstance(compatible, dict) and builder is not None:
        compatible[builder.NAME] = False


def built_inference_all_reduce() -> bool:
    """Whether DeepSpeed's comm backend holds the shared-memory op (a DeepSpeed that no longer reads the flag
    skip_inference_all_reduce_build sets would build it again, silently but for this)."""
    import deepspeed.comm.comm as ds_comm

    return getattr(getattr(ds_comm, "cdb", None), "shm_comm_op", None) is not None


class DeepSpeedDataParallel(DataParallel):
    name = "deepspeed"
    handles_loss_scaling = True

    def __init__(self, model: nn.Module, cfg: Config, ctx: ParallelContext, *,
                 materialize: Callable[[nn.Module], None] | None = None,
                 fill_each: Callable[[], AbstractContextManager[shards.Fill]] | None = None) -> None:
        try:
            import deepspeed
        except ImportError:
            raise ConfigError("parallel.backend=deepspeed: DeepSpeed is not installed "
                              "(pip install 'dist-llm[deepspeed]')") from None
        if not dist.is_initialized():  # DeepSpeed wants a process group even for one rank
            raise ConfigError("parallel.backend=deepspeed: start under torchrun (e.g. --nproc-per-node N)")
        self.cfg, self.ctx = cfg, ctx
        self.module = model
        if ctx.device.type == "cpu":
            skip_inference_all_reduce_build()
        deepspeed.init_distributed(dist_backend="nccl" if ctx.device.type == "cuda" else "gloo")
        if ctx.device.type == "cpu" and built_inference_all_reduce():
            log.warning("DeepSpeed built its shared-memory all-reduce (a minute of g++ the first time) although "
                        "dist_llm marked it unneeded: this DeepSpeed no longer reads deepspeed.ops.__compatible_ops__")
        ds_config = merged_deepspeed_config(cfg, ctx.dp)
        if materialize is not None:  # a meta-device model: ZeRO-3 partitions it as it is filled, the others whole
            if builds_partitioned(cfg):
                if fill_each is None:
                    raise ValueError("a partitioned ZeRO-3 build needs fill_each (each parameter's values)")
                with fill_each() as fill:
                    build_partitioned(model, fill, ctx.device, ds_config)
            else:
                materialize(model)
        optimizer = adamw(_param_groups(model, cfg.optim.weight_decay), cfg.optim, ctx.device)
        with fp32_buffers_kept(model):  # (data_types.buffer_dtype casts buffers through .data, the aux-free bias too)
            engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        self.engine = engine
        self.model = engine
        self.optimizer = engine.optimizer
        if cfg.parallel.zero_stage >= 1 and not self._partitioned():
            # (a ds_config path merged_deepspeed_config did not foresee): saving would drop the masters and moments
            raise ConfigError(f"parallel.deepspeed_config: DeepSpeed chose {type(self.optimizer).__name__} at "
                              f"parallel.zero_stage={cfg.parallel.zero_stage}, whose partitions dist_llm cannot "
                              f"checkpoint (e.g. data_types.grad_accum_dtype); remove such keys or use "
                              f"parallel.backend=native")
        self.tp_layout = TensorParallelState(model, ctx)  # where each tp slice sits in its full tensor
        self._skipped = 0  # whether the engine skipped the last step
        self._grad_bytes: int | None = None  # gradients held at the first step (see _held_grad_bytes)

    @contextlib.contextmanager
    def _micro(self, last: bool) -> Iterator[None]:
        self.engine.set_gradient_accumulation_boundary(last)
        yield
        if not last:
            self.engine.step()  # DeepSpeed counts micro-steps in step(); off the boundary it only accumulates

    def micro_step(self, *, last: bool) -> contextlib.AbstractContextManager:
        return self._micro(last)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)  # the trainer already divided by the global target count

    def local_grads(self) -> list[torch.Tensor]:
        return []  # DeepSpeed unscales its own gradients

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return torch.zeros((), device=self.ctx.device)  # DeepSpeed clips inside step (gradient_clipping)

    def step(self, lr: float, found_inf: torch.Tensor) -> torch.Tensor | None:
        # found_inf is always 0 here (clip_grad_norm_ above returns 0): DeepSpeed decides the skip itself, from
        # its loss scaler's overflow check (fp16) or a non-finite gradient norm (fp32), see last_step_skipped
        set_lr(self.optimizer, lr)
        if self._grad_bytes is None:
            self._grad_bytes = self._held_grad_bytes()
        before = self.engine.skipped_steps
        self.engine.step()
        self._skipped = self.engine.skipped_steps - before
        norm = self.engine.get_global_grad_norm()
        return torch.tensor(float("nan") if norm is None else float(norm))

    def last_step_skipped(self) -> torch.Tensor:
        return torch.tensor(float(self._skipped), device=self.ctx.device)

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def _zero3(self) -> bool:
        return hasattr(self.optimizer, "fp32_partitioned_groups_flat")

    def _partitioned(self) -> bool:
        """Whether the optimizer keeps flat fp32 partitions this backend saves from (ZeRO-1, 2 and 3)."""
        return self._zero3() or self._zero_optimizer()

    def checkpoint_state(self) -> dict[str, Any]:
        """This rank's partitions as chunks of the full tensors (deepspeed_shards.py): the fp32 masters under
        model.<fqn> (every name, the tied lm_head.weight too) and the moments under optim.state.<fqn>, the keys
        every layout reads. Stage 0 (no partitions) saves the module's weights only."""
        if not self._partitioned():  # (the module holds every parameter whole)
            model_sd = {k: v.detach().float().clone() for k, v in get_model_state_dict(self.module).items()}
            return {"model": model_sd, "optim": {"state": {}}}
        shards.ensure_state(self.optimizer)
        if self._zero3():
            params = [p for p in self.module.parameters()]
            pieces = shards.zero3_pieces(params, dist.get_rank(group=self.optimizer.dp_process_group))
            # (a frozen PEFT base is partitioned too, and not saved); buffers are never partitioned: an MoE layer's
            # expert_bias is state the run trains, held whole on every rank as in every other layout. The others
            # (NF4's mean and table, position tables) the build recomputes: not saved, so not asked for on resume
            # (a QLoRA checkpoint keeps the keys it had before the bias was saved)
            model_sd: dict[str, Any] = trained_buffers(self.module)
        else:
            pieces = shards.zero12_pieces(self.optimizer)
            model_sd = get_model_state_dict(self.module)  # the frozen (PEFT) parameters are held whole here
        flat = shards.flat_partitions(self.optimizer)[0]
        step = self.optimizer.optimizer.state[flat]["step"]
        return shards.state_of(self.module, pieces, step, self.tp_layout, flat.device, model_sd)

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """After DCP filled the chunks of `checkpoint_state()`'s tensors (this rank's fp32 masters and moments, in
        place): the step count, then the compute-dtype parameters from the masters."""
        if not self._partitioned():
            with torch.no_grad():
                for name, p in self.module.named_parameters():
                    p.copy_(state["model"][name].to(p.dtype))
                for name, b in trained_buffers(self.module).items():  # (checkpoint_state saved copies)
                    b.copy_(state["model"][name])
            refresh = getattr(self.optimizer, "refresh_fp32_params", None)
            if refresh is not None:  # DeepSpeed's fp32 master copies follow the loaded weights
                refresh()
            return
        shards.set_step(self.optimizer, state["optim"]["state"])
        if self._zero3():
            shards.zero3_from_masters(self.optimizer)
        else:
            self.optimizer.update_lp_params()  # this rank's partition from its masters, then all-gathered

    def _engine_file(self, path: Path) -> Path:
        # named by rank like rng/rank_KKKKK.json, so checksums.written_by gives each rank its own file to hash;
        # this backend runs data parallelism only (pp>1 is refused), so the rank is the ZeRO partition's index
        return path / ENGINE_DIR / f"rank_{self.ctx.rank:05d}.safetensors"

    def _zero_optimizer(self) -> bool:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        return isinstance(self.optimizer, DeepSpeedZeroOptimizer)

    def save_engine_state(self, path: Path) -> None:
        """What DeepSpeed keeps besides the tensors of `checkpoint_state` (ZeRO-1/2/3): its loss scaler and the
        engine's step counters, into path/deepspeed/rank_KKKKK.safetensors. Each rank writes its own small file,
        with no collective (DeepSpeed's save_checkpoint would add its barriers on the training group and a 16-bit
        copy of the whole module)."""
        if not self._partitioned():
            return  # stage 0 resumes the weights only (load_engine_state says so)
        from deepspeed.runtime.fp16.loss_scaler import LossScalerBase

        counters = {k: getattr(self.engine, k) for k in _COUNTERS}
        self._engine_file(path).parent.mkdir(exist_ok=True)
        write_engine_state(self._engine_file(path), {"loss_scaler": self.optimizer.loss_scaler, "engine": counters},
                           objects=(LossScalerBase,), layout=self._engine_layout())

    def _engine_layout(self) -> dict[str, Any]:
        """What the file's values depend on: the precision decides the loss scaler's kind (fp16's dynamic one,
        a static one otherwise). Counters and scaler mean the same at any dp size and stage."""
        return {"precision": self.cfg.train.precision}

    def load_engine_state(self, path: Path, group: Any = None) -> None:
        """The loss scaler and the engine's counters from path/deepspeed/, when they fit this engine; only this
        rank's file is read (the weights and moments came with `load_checkpoint_state`, from any layout).
        Collective over `group` (the checkpoint group): the ranks agree first on whether the files fit (the first
        rank's reason not to load holds for all), then on the outcome, so a file that fails on one rank raises
        the same one-line ConfigError on every rank."""
        file = self._engine_file(path)
        if not self._partitioned():
            log.warning("parallel.backend=deepspeed: resumed the weights only; optimizer moments start afresh "
                        "(DeepSpeed's optimizer state is saved at zero_stage 1, 2 and 3 only, this run has %d)",
                        self.cfg.parallel.zero_stage)
            return
        if not self._optimizer_state_loaded():
            # the resume warned once already (no_optimizer_state_note): the scaler and counters start afresh with
            # the moments, and an older DeepSpeed checkpoint's file is not read
            log.info("parallel.backend=deepspeed: resumed the weights only; optimizer moments, loss scaler and step "
                     "counters start afresh")
            return
        reason = comm.shared_error(self._engine_state_mismatch_or_error(path), group)
        if reason is not None:
            log.warning("parallel.backend=deepspeed: resumed the weights and optimizer moments; DeepSpeed's loss "
                        "scaler and step counters start afresh (%s)", reason)
            return
        try:
            self._load_own_engine_state(file)
            error = None
        except Exception as e:  # noqa: BLE001 - whatever a hostile or damaged file causes, one line on every rank
            words = str(e).splitlines()[0] if str(e) else type(e).__name__
            error = f"train.resume: {file}: cannot load DeepSpeed's state ({words})"
        error = comm.shared_error(error, group)
        if error is not None:
            raise ConfigError(error)
        log.info("parallel.backend=deepspeed: resumed DeepSpeed's loss scaler and step counters from %s", file)

    def _optimizer_state_loaded(self) -> bool:
        """Whether the resume put moments into the partitions (the resume clears them for a checkpoint with none)."""
        return self._partitioned() and bool(getattr(self.optimizer, "optimizer", self.optimizer).state)

    def no_optimizer_state_note(self, path: Path) -> str:
        if (path / ENGINE_DIR).is_dir():  # deepspeed/ files beside no optim.* tensors: written before they existed
            return (f" (an older DeepSpeed format: the moments it kept in {ENGINE_DIR}/rank_*.safetensors are not "
                    f"read)")
        return ""

    def _engine_state_mismatch_or_error(self, path: Path) -> str | None:
        """`_engine_state_mismatch`, or what kept it from being decided: either way, a reason not to load the
        file, never an exception that leaves the peers waiting."""
        try:
            return self._engine_state_mismatch(path)
        except Exception as e:  # noqa: BLE001 - see above
            return f"rank {self.ctx.rank}: cannot compare {path} with this run ({type(e).__name__}: {e})"

    def _load_own_engine_state(self, file: Path) -> None:
        scaler = self.optimizer.loss_scaler
        # (decoding sets the saved attributes on the live scaler, each checked against it first)
        saved = read_engine_state(file, objects={type(scaler).__name__: scaler})
        if not isinstance(saved, dict) or not isinstance(saved.get("engine"), dict):
            raise EngineStateError(f"{file}: no loss scaler and engine entries")
        counters = saved["engine"]
        values = {}
        for name in _COUNTERS:
            if not isinstance(counters.get(name), int):
                raise EngineStateError(f"{file}: the engine's {name} is not an integer")
            values[name] = counters[name]
        for name, value in values.items():
            setattr(self.engine, name, value)

    def _engine_state_mismatch(self, path: Path) -> str | None:
        """Why DeepSpeed's file in checkpoint `path` cannot go into this engine (None when it can)."""
        if not self._engine_file(path).is_file():
            return (f"{path} holds no {self._engine_file(path).relative_to(path)}: saved by another backend, "
                    f"stage 0 or with more ranks")
        saved = read_engine_layout(self._engine_file(path))
        if saved != self._engine_layout():
            return f"{self._engine_file(path)} was saved with {saved}, this run has {self._engine_layout()}"
        return None

    def _held_grad_bytes(self) -> int:
        """Gradient bytes DeepSpeed holds at the step (ZeRO-1/2): the reduced gradient partition, any per-parameter
        gradient still held (ZeRO-1 accumulates whole ones in `grad_accum`), and the fp32 copy of the partition
        that its step makes for the update (one fp32 value per element of the fp32 master partition)."""
        opt = self.optimizer
        partitions = [g for grads in (getattr(opt, "averaged_gradients", None) or {}).values() for g in (grads or [])]
        whole = [t for p in self.module.parameters() for t in (p.grad, getattr(p, "grad_accum", None))]
        fp32_copy = tensor_bytes(getattr(opt, "single_partition_of_fp32_groups", []))
        return tensor_bytes(partitions) + tensor_bytes(whole) + fp32_copy

    def model_state_bytes(self) -> dict[str, int]:
        """What DeepSpeed holds: the module's parameters (16-bit in mixed precision), the gradients of
        `_held_grad_bytes`, its fp32 master partitions (ZeRO-1/2) and the moments of the optimizer it wraps."""
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        return {"params": tensor_bytes(self.module.parameters()), "grads": self._grad_bytes or 0,
                "master": tensor_bytes(getattr(self.optimizer, "single_partition_of_fp32_groups", [])),
                "optimizer": tensor_bytes(optimizer_state_tensors(inner))}
