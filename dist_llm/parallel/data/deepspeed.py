"""`parallel.backend=deepspeed`: the same model and trainer, with DeepSpeed's engine doing data parallelism.

DeepSpeed is optional (`pip install dist-llm[deepspeed]`) and imported only here. The config it gets is
derived from ours (batch sizes, ZeRO stage, precision, clipping), so users who know DeepSpeed switch with
one key. A torch AdamW is handed in, which avoids DeepSpeed's fused_adam JIT build. On CPU DeepSpeed
JIT-compiles a shared-memory comm op on its first `init_distributed` (tens of seconds, then cached under
TORCH_EXTENSIONS_DIR).

DeepSpeed scales fp16 losses, clips and skips overflowing steps inside its own step, so the trainer's
scaler stands aside; the gradient norm and whether the step was skipped come back from the engine.

Checkpoints hold the model weights in our format (so they load into any native layout) and, at ZeRO-1/2, each
rank's own optimizer partition (fp32 master, Adam moments, loss scaler, the engine's step counters) in the step
folder's `deepspeed/rank_KKKKK.safetensors`, tensors plus JSON (engine_state.py), which our manifest covers.
Each rank writes and later reads its own file only, with no collective: DeepSpeed's save_checkpoint and
load_checkpoint are not used (they barrier on the training group, rank 0 writes a 16-bit copy of the whole
module that the DCP shards already hold, and they read with torch.load(weights_only=False)). Resuming with this
backend at the same dp size, ZeRO stage and precision puts the partition back through the optimizer's
load_state_dict, so training goes on as if never stopped; otherwise (or from a checkpoint of another backend)
it loads the weights and restarts the optimizer moments, and says so.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from dist_llm.config import Config, ConfigError
from dist_llm.parallel import comm
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.data.base import DataParallel, optimizer_state_tensors, tensor_bytes
from dist_llm.parallel.data.engine_state import (
    EngineStateError,
    read_engine_layout,
    read_engine_state,
    write_engine_state,
)
from dist_llm.optim import build_optimizer, set_lr

log = logging.getLogger("dist_llm")

#: the folder of a checkpoint that holds each rank's DeepSpeed state (deepspeed/rank_KKKKK.safetensors)
ENGINE_DIR = "deepspeed"
#: the engine's own counters that its step reads (its skip count, the samples and steps it has seen)
_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")


def deepspeed_config(cfg: Config, dp: int) -> dict[str, Any]:
    t, p = cfg.train, cfg.parallel
    accum = t.global_batch_size // (t.micro_batch_size * dp)
    return {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": {"stage": p.zero_stage, "reduce_bucket_size": int(p.bucket_mb * 2**20 / 4),
                              "allgather_bucket_size": int(p.bucket_mb * 2**20 / 4)},
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": t.precision == "fp16", "initial_scale_power": int(math.log2(t.loss_scale_init)),
                 "loss_scale_window": 2000},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


#: ds_config keys that our config also decides: (path in the JSON, our key, our value from the derived config)
_AGREE = [("train_batch_size", "train.global_batch_size"), ("train_micro_batch_size_per_gpu", "train.micro_batch_size"),
          ("gradient_accumulation_steps", "train.global_batch_size / (train.micro_batch_size * dp)"),
          ("gradient_clipping", "optim.grad_clip"), ("zero_optimization.stage", "parallel.zero_stage"),
          ("bf16.enabled", "train.precision"), ("fp16.enabled", "train.precision")]


def _get(tree: dict[str, Any], path: str) -> Any:
    for key in path.split("."):
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if v == "auto":  # DeepSpeed's "fill in from elsewhere": ours fills it
            continue
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def merged_deepspeed_config(cfg: Config, dp: int) -> dict[str, Any]:
    """Our derived ds_config, with `parallel.deepspeed_config` merged over it; where both set a key that our
    config decides, they must agree (a contradiction is a one-line error naming both keys)."""
    import json
    from pathlib import Path

    ours = deepspeed_config(cfg, dp)
    path = cfg.parallel.deepspeed_config
    if not path:
        return ours
    try:
        theirs = json.loads(Path(path).expanduser().read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"parallel.deepspeed_config: cannot read {path}: {e}") from None
    if not isinstance(theirs, dict):
        raise ConfigError(f"parallel.deepspeed_config: {path} must hold a JSON object")
    for ds_key, our_key in _AGREE:
        given, derived = _get(theirs, ds_key), _get(ours, ds_key)
        if given is not None and given != "auto" and given != derived:
            raise ConfigError(f"parallel.deepspeed_config: {path} sets {ds_key}={given!r} but {our_key} gives "
                              f"{derived!r}; change one of them")
    return _merge(ours, theirs)


class DeepSpeedDataParallel(DataParallel):
    name = "deepspeed"
    handles_loss_scaling = True

    def __init__(self, model: nn.Module, cfg: Config, ctx: ParallelContext) -> None:
        try:
            import deepspeed
        except ImportError:
            raise ConfigError("parallel.backend=deepspeed: DeepSpeed is not installed "
                              "(pip install 'dist-llm[deepspeed]')") from None
        if not dist.is_initialized():  # DeepSpeed wants a process group even for one rank
            raise ConfigError("parallel.backend=deepspeed: start under torchrun (e.g. --nproc-per-node N)")
        self.cfg, self.ctx = cfg, ctx
        self.module = model
        deepspeed.init_distributed(dist_backend="nccl" if ctx.device.type == "cuda" else "gloo")
        optimizer = build_optimizer(model, cfg.optim, ctx.device)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                               config=merged_deepspeed_config(cfg, ctx.dp))
        self.engine = engine
        self.model = engine
        self.optimizer = engine.optimizer
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

    def _gathered(self, *, modify: bool) -> contextlib.AbstractContextManager:
        """ZeRO-3 partitions the module's parameters: gather them whole for reading or writing."""
        if self.cfg.parallel.zero_stage != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=0 if modify else None)

    def checkpoint_state(self) -> dict[str, Any]:
        # every key the native model has (the tied lm_head.weight too), in fp32
        with self._gathered(modify=False):
            model_sd = {k: v.detach().float().clone() for k, v in get_model_state_dict(self.module).items()}
        return {"model": model_sd, "optim": {"state": {}}}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        with self._gathered(modify=True), torch.no_grad():
            for name, p in self.module.named_parameters():
                p.copy_(state["model"][name].to(p.dtype))
        refresh = getattr(self.optimizer, "refresh_fp32_params", None)
        if refresh is not None:  # DeepSpeed's fp32 master partitions follow the loaded weights
            refresh()

    def _engine_file(self, path: Path) -> Path:
        # named by rank like rng/rank_KKKKK.json, so checksums.written_by gives each rank its own file to hash;
        # this backend runs data parallelism only (pp>1 is refused), so the rank is the ZeRO partition's index
        return path / ENGINE_DIR / f"rank_{self.ctx.rank:05d}.safetensors"

    def _zero_optimizer(self) -> bool:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        return isinstance(self.optimizer, DeepSpeedZeroOptimizer)

    def save_engine_state(self, path: Path) -> None:
        """This rank's ZeRO-1/2 partition (fp32 master, Adam moments, loss scaler) and the engine's step counters
        into path/deepspeed/rank_KKKKK.safetensors: each rank writes only its own share, with no collective
        (DeepSpeed's save_checkpoint would add its barriers on the training group and a 16-bit copy of the
        whole module, which the DCP shards already hold)."""
        if not self._zero_optimizer():
            return  # other stages resume the weights only (load_engine_state says so)
        from deepspeed.checkpoint.constants import PARAM_SLICE_MAPPINGS
        from deepspeed.runtime.fp16.loss_scaler import LossScalerBase

        # the slice mappings serve only DeepSpeed's universal checkpoints (and are not tensors or numbers)
        optim = {k: v for k, v in self.optimizer.state_dict().items() if k != PARAM_SLICE_MAPPINGS}
        counters = {k: getattr(self.engine, k) for k in _COUNTERS}
        self._engine_file(path).parent.mkdir(exist_ok=True)
        write_engine_state(self._engine_file(path), {"optimizer": optim, "engine": counters},
                           objects=(LossScalerBase,), layout=self._partition_layout())

    def _partition_layout(self) -> dict[str, Any]:
        """What decides where each value sits in this rank's flat ZeRO partitions: the engine's effective
        zero_optimization settings (e.g. round_robin_gradients reorders the parameters inside a partition, sizes
        unchanged), as a hash, and each parameter group's partition size and padding. Two engines whose layouts
        differ cannot exchange partitions, even at the same dp, stage and precision."""
        import hashlib

        zero = self.engine._config.zero_config.model_dump(mode="json")
        text = json.dumps(zero, sort_keys=True, default=str)
        return {"zero_optimization_sha256": hashlib.sha256(text.encode()).hexdigest(),
                "partition_sizes": [int(n) for n in self.optimizer.partition_size],
                "paddings": [int(n) for n in self.optimizer.groups_padding]}

    def load_engine_state(self, path: Path, group: Any = None) -> None:
        """This rank's partition and the engine's counters from path/deepspeed/, when they fit this engine; only
        this rank's file is read. Collective over `group` (the checkpoint group): the ranks agree first on
        whether the files fit (the first rank's reason not to load holds for all), then on the outcome, so a
        file that fails on one rank raises the same one-line ConfigError on every rank."""
        file = self._engine_file(path)
        reason = comm.shared_error(self._engine_state_mismatch_or_error(path), group)
        if reason is not None:
            log.warning("parallel.backend=deepspeed: resumed the model weights only; optimizer moments start "
                        "afresh (%s)", reason)
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
        log.info("parallel.backend=deepspeed: resumed DeepSpeed's optimizer state from %s", file)

    def _engine_state_mismatch_or_error(self, path: Path) -> str | None:
        """`_engine_state_mismatch`, or what kept it from being decided (an unreadable config.yaml): either way,
        a reason to load the weights only, never an exception that leaves the peers waiting."""
        try:
            return self._engine_state_mismatch(path)
        except Exception as e:  # noqa: BLE001 - see above
            return f"rank {self.ctx.rank}: cannot compare {path} with this run ({type(e).__name__}: {e})"

    def _load_own_engine_state(self, file: Path) -> None:
        scaler = self.optimizer.loss_scaler
        saved = read_engine_state(file, objects={type(scaler).__name__: scaler})
        if not isinstance(saved, dict) or not isinstance(saved.get("engine"), dict):
            raise EngineStateError(f"{file}: no optimizer and engine entries")
        optim, counters = saved["optimizer"], saved["engine"]
        # DeepSpeed's load takes one state per saved partition and, when the dp size is unchanged (checked
        # above), reads only this rank's entry: the others stay None rather than being read from disk
        parts: list[Any] = [None] * self.ctx.dp
        parts[self.ctx.dp_rank] = optim
        # the saved param groups carry the old run's hyperparameters; this run's config decides them (as under
        # the native backends): kept across the load (the lr is set at each step by the schedule)
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        configured = [{k: g[k] for k in ("betas", "eps", "weight_decay") if k in g} for g in inner.param_groups]
        self.optimizer.load_state_dict(parts, load_optimizer_states=True, load_from_fp32_weights=True)
        for group, values in zip(inner.param_groups, configured, strict=True):
            group.update(values)
        for name in _COUNTERS:
            setattr(self.engine, name, int(counters[name]))

    def _engine_state_mismatch(self, path: Path) -> str | None:
        """Why DeepSpeed's files in checkpoint `path` cannot go into this engine (None when they can): its
        ZeRO partitions are cut for one dp size, and named and typed for one stage and precision."""
        import yaml

        if not self._zero_optimizer():
            return (f"DeepSpeed's optimizer state is saved at zero_stage 1 and 2 only, this run has "
                    f"{self.cfg.parallel.zero_stage}")
        if not self._engine_file(path).is_file():
            return (f"{path} holds no {self._engine_file(path).relative_to(path)}: saved by another backend, "
                    f"another stage or an older dist_llm")
        saved_cfg = yaml.safe_load((path / "config.yaml").read_text())
        saved_dp = json.loads((path / "manifest.json").read_text())["layout"]["dp"]
        then = (saved_dp, saved_cfg["parallel"]["zero_stage"], saved_cfg["train"]["precision"])
        now = (self.ctx.dp, self.cfg.parallel.zero_stage, self.cfg.train.precision)
        if then != now:
            return f"{path} was saved at dp, zero_stage, precision = {then}, this run has {now}"
        saved = read_engine_layout(self._engine_file(path))
        if saved is None:
            return f"{self._engine_file(path)} holds no partition layout: saved by an older dist_llm"
        ours = self._partition_layout()
        if saved != ours:
            what = ", ".join(k for k in sorted(ours) if saved.get(k) != ours[k]) or "its keys"
            return (f"{self._engine_file(path)} was cut for another partition layout ({what} differ: a change to "
                    f"DeepSpeed's zero_optimization settings)")
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
