"""The trainer: the only place that knows the order of a training step."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import signal
import socket
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.distributed.checkpoint.api import CheckpointException
from tqdm import tqdm

from dist_llm import memory
from dist_llm.config import Config, ConfigError, parse_steps, validate
from dist_llm import perf
from dist_llm.data import BatchPrefetcher, GlobalBatchSampler, host_batch, prepare_data, to_device, val_sampler
from dist_llm.data.sampler import IGNORE_INDEX
from dist_llm.model import GPT
from dist_llm.model.gpt import Attention
from dist_llm.parallel import comm
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.pipeline.executor import PointToPoint, StageClock, StageModel, run_schedule
from dist_llm.parallel.pipeline.schedule import build_plans
from dist_llm.parallel.parallelize import PP_SEED_STRIDE, meta_model, parallelize  # noqa: F401 - the stride, importable here as before
from dist_llm.parallel.tensor import sync_sequence_parallel_grads
from dist_llm.parallel.tensor.checkpoint import TensorParallelState
from dist_llm.train import checkpoint as ckpt
from dist_llm.train import run_lock
from dist_llm.train.metrics import MetricsLog, plot_losses
from dist_llm.train.run_lock import RUN_LOCK
from dist_llm.train.report import write_report
from dist_llm.peft import trainable_names
from dist_llm.profiling import StepProfiler, span
from dist_llm.train.init_from import load_initial_weights, resolve_architecture
from dist_llm.train.memory_phases import PhaseMeter
from dist_llm.optim import lr_at
from dist_llm.precision import DTYPES, LossScaler, autocast
from dist_llm.train.saved_tensors import SavedTensorMeter

log = logging.getLogger("dist_llm")


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. too many non-finite steps in a row); the last good checkpoint is kept."""


class CheckpointError(TrainingError):
    """A checkpoint could not be written (disk full, an I/O error); the previous complete one is untouched."""


class CollectiveError(TrainingError):
    """A collective failed: a rank stuck past `parallel.timeout_s`, or a peer gone."""


class Preemption:
    """SIGTERM (a scheduler's preemption, torchrun stopping the job) asks the run to stop: the step in flight
    finishes, a checkpoint is saved, and the process exits 0, ready for `train.resume=auto`."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def install(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def _io_reason(e: BaseException) -> str:
    """The first OS error's words in an exception, or in DCP's per-rank failures, e.g. "No space left on device"."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    if isinstance(e, CheckpointException) and e.failures:
        rank, (inner, _) = min(e.failures.items())  # (exception, traceback) per failed rank: the first
        return f"rank {rank}: {_io_reason(inner)}"
    return str(e).splitlines()[0] if str(e) else type(e).__name__


@dataclass
class StepOutput:
    """What one optimizer step produced; tensors stay on the device until a log step reads them."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    skipped: torch.Tensor  # bool, 0-dim: the gradients were not finite, so the optimizer left everything as it was


def build_model(cfg: Config, ctx: ParallelContext) -> GPT:
    """The GPT for `cfg` on ctx.device, whole along the pipeline (no stage cut) and not wrapped for data
    parallelism: its layers tensor-parallel when parallel.tp > 1, built on the meta device and initialised from
    `train.seed` identically at every layout (or loaded from `model.init_from`), with PEFT, checkpointing and
    compilation as configured."""
    return parallelize(meta_model(cfg, ctx), cfg, ctx, cut=False, wrap=False, load=load_initial_weights).model


class Trainer:
    def __init__(self, cfg: Config, ctx: ParallelContext) -> None:
        self.phases = PhaseMeter(ctx.device)  # peak memory per phase of the run (memory_phases.py)
        cfg = resolve_architecture(cfg)
        validate(cfg)  # again: an hf: start brings its own architecture
        self.cfg, self.ctx = cfg, ctx
        t, m = cfg.train, cfg.model
        self.device = ctx.device
        self.out_dir = cfg.run_dir()
        self.ckpt_root = self.out_dir / "checkpoints"

        # Local rank 0 prepares the token files; the others then find them in the cache.
        if ctx.local_rank == 0:
            self.data = prepare_data(cfg.data, m.vocab_size)
        ctx.barrier()
        if ctx.local_rank != 0:
            self.data = prepare_data(cfg.data, m.vocab_size)
        self.train_tokens = self.data.train_tokens()
        self.val_tokens = self.data.val_tokens()
        self.masks = {id(self.train_tokens): self.data.train_mask(), id(self.val_tokens): self.data.val_mask()}
        self.sampler = GlobalBatchSampler(len(self.train_tokens), m.block_size, t.global_batch_size, t.seed)
        self.val_sampler = val_sampler(len(self.val_tokens), m.block_size, t.global_batch_size)

        # this rank's part of the model only: built on the meta device, cut, sharded, then materialised
        built = parallelize(meta_model(cfg, ctx), cfg, ctx, load=load_initial_weights)
        model = built.model
        self.stage: StageModel | None = None
        if built.stage is not None:  # this pipeline stage's part of the model, and its neighbours' addresses
            self.stage = StageModel(model, *built.stage)
            self.p2p = PointToPoint(*ctx.pp_neighbours(), stats=ctx.comm)
        assert built.dp is not None
        self.dp = built.dp
        with torch.device("meta"):  # the whole model's count, whatever part of it this rank holds
            self.n_params = GPT(cfg.model).num_params()
        self.model = self.dp.model  # what forward calls (a DDP/FSDP wrapper, or the GPT itself)
        self.module = self.dp.module  # the GPT
        self.tp_state = TensorParallelState(self.module, ctx) if ctx.tp > 1 else None
        self.optimizer = self.dp.optimizer
        # fp16 loss scaling is ours, unless the engine brings its own (DeepSpeed)
        self.scaler = LossScaler(enabled=t.precision == "fp16" and not self.dp.handles_loss_scaling,
                                 scale=t.loss_scale_init, device=self.device)
        self.sdpa_kernel = self._check_attention_kernel()
        self.loader = BatchPrefetcher(lambda step: self._host_micro_batches(self.sampler, step, self.train_tokens),
                                      enabled=cfg.data.prefetch)
        self.accum_steps = t.global_batch_size // (t.micro_batch_size * ctx.dp)
        self.tokens_per_step = t.global_batch_size * m.block_size
        if ctx.pp > 1 and self.accum_steps < ctx.pp:
            log.warning("parallel.pp=%d stages run only %d micro-batch(es) a step (train.global_batch_size / "
                        "(train.micro_batch_size * dp)): each stage idles about %.0f%% of the step; use at least "
                        "pp micro-batches", ctx.pp, self.accum_steps,
                        100 * (ctx.pp - 1) / (self.accum_steps + ctx.pp - 1))
        self.state_bytes: dict[str, int] | None = None
        self.activation_bytes: int | None = None  # peak bytes saved for backward, measured in the first step
        self.stage_clock: StageClock | None = None
        self.comm_bytes: dict[str, int] = {}
        self.step = 0
        self.tokens_seen = 0
        self.elapsed_s = 0.0
        self.pending_save: ckpt.PendingSave | None = None
        # Saving, loading and checking a checkpoint coordinate the ranks over a gloo group of their own. Its waits
        # scale with the checkpoint (a rank waits for the slowest one's writing or hashing): under the training
        # group's parallel.timeout_s a large enough checkpoint would time out, so this group's timeout scales
        # with the state's bytes instead (a rank that dies still fails it at once: its connections close).
        # Background saves use it from their thread, never interleaving with training's collectives.
        self.ckpt_group = (torch.distributed.new_group(backend="gloo", timeout=timedelta(
            seconds=ckpt.coordination_timeout_s(self.n_params, cfg.parallel.timeout_s, **self._state_shards())))
            if ctx.world_size > 1 else None)
        self.stager: Any = None  # the host copy of background saves, made at the first one
        self.phases.end("startup")
        self._take_run_lock()
        try:
            self.resumed_from = self._resume()
            self.phases.end("resume", keep=self.resumed_from is not None)
            fresh = self.resumed_from is None
            if fresh:
                self._set_aside_previous_run()
                self._set_aside_previous_metrics()
            self.metrics = MetricsLog(self.out_dir / "metrics.jsonl", enabled=ctx.is_main, fresh=fresh,
                                      tensorboard_dir=self.out_dir / "tensorboard" if t.tensorboard else None,
                                      wandb_mode=t.wandb, run_name=cfg.name, config=cfg.to_dict())
        except BaseException:  # a refused resume leaves the out_dir free for the next try
            if ctx.is_main:
                run_lock.release(self.out_dir / RUN_LOCK)
            raise

    def _state_shards(self) -> dict[str, int]:
        """How many ways this layout splits the weights and the optimizer state (see coordination_timeout_s)."""
        model_parallel = self.ctx.tp * self.ctx.pp
        zero = self.cfg.parallel.zero_stage
        return {"weight_shards": model_parallel * (self.ctx.dp if zero >= 3 else 1),
                "state_shards": model_parallel * (self.ctx.dp if zero >= 1 else 1)}

    # -- resume -------------------------------------------------------------------------------------------
    def _resume(self) -> Path | None:
        choice = self.cfg.train.resume
        if choice == "never":
            return None
        path = self._pick_checkpoint() if choice == "auto" else Path(choice).expanduser()
        if path is None:
            return None
        if not ckpt.is_complete(path):
            raise ConfigError(f"train.resume: {path} is not a complete checkpoint (no {ckpt.MANIFEST})")
        if choice != "auto":
            problem = self._verify(path)
            if problem:
                raise ConfigError(f"train.resume: {problem}")
        manifest = ckpt.read_json(path / ckpt.MANIFEST)
        if manifest.get("model_fingerprint") != self.cfg.fingerprint():
            raise ConfigError(f"train.resume: {path} holds a different model than the model.* settings describe")
        if self.cfg.peft.method != "none" and manifest.get("peft_base") != self.peft_base():
            raise ConfigError(f"train.resume: {path} adapts another base model ({manifest.get('peft_base')}) than "
                              f"model.init_from describes ({self.peft_base()})")
        # DCP reads this rank's chunks of the full tensors straight into the live state (the tensors of
        # `everything`); a PEFT checkpoint holds the trained tensors only: the frozen base stays as built
        everything = self.dp.checkpoint_state()
        state = ckpt.load_checkpoint(path, state=self._chunked(self._saved_part(everything)), ctx=self.ctx,
                                     group=self.ckpt_group)
        self.dp.load_checkpoint_state(everything)
        self.dp.load_engine_state(path, self.ckpt_group)
        self.step = state["step"]
        self.tokens_seen = state["tokens_seen"]
        self.elapsed_s = state.get("elapsed_s", 0.0)
        self.sampler.load_state_dict(state["sampler"])
        self.scaler.load_state_dict(state["scaler"])
        log.info("resumed from %s at step %d", path, self.step)
        return path

    def _on_main(self, fn: Any) -> Any:
        """fn() on the main rank, its result handed to every rank (file checks done once, not per rank). If fn
        raises, the failure is what is handed on, and every rank raises it as a one-line CheckpointError: no
        peer is left waiting in the broadcast for parallel.timeout_s."""
        box: list[Any] = [None]
        if self.ctx.is_main:
            try:
                box = [(True, fn())]
            except Exception as e:  # noqa: BLE001 - any failure must reach the peers, not only an OSError
                where = e.filename if isinstance(e, OSError) and e.filename else self.ckpt_root
                box = [(False, f"checkpoints in {self.ckpt_root}: {where}: {_io_reason(e)}")]
        if torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(box, src=0)
        ok, value = box[0]
        if not ok:
            raise CheckpointError(f"{value}; nothing was deleted")
        return value

    def _verify(self, path: Path) -> str | None:
        """`ckpt.verify` with every rank checking a share of the files; a file that cannot be read (an I/O error)
        stops the run with one line instead of counting the checkpoint as damaged."""
        try:
            return ckpt.verify(path, group=self.ckpt_group)
        except ckpt.UnreadableCheckpoint as e:
            raise CheckpointError(f"train.resume: cannot check {path}: {e}; nothing was moved or deleted: run again "
                                  "once the storage answers") from None

    def _step_dirs(self, *, complete: bool) -> list[Path]:
        """The checkpoint directories in checkpoints/ (complete ones only, or all), oldest first, as the main
        rank lists them: every rank then walks the same list through the same collectives."""
        listing = ckpt.list_checkpoints if complete else ckpt.step_dirs
        return [Path(p) for p in self._on_main(lambda: [str(p) for p in listing(self.ckpt_root)])]

    def _pick_checkpoint(self) -> Path | None:
        """The newest complete checkpoint whose files match its manifest. Damaged ones newer than it are moved
        aside into checkpoints/damaged-<time>/ (a re-save of their step would replace them); when none matches
        but some are damaged, the run stops with one line and touches nothing: never a silent fresh start."""
        damaged: dict[Path, str] = {}
        for path in reversed(self._step_dirs(complete=True)):
            problem = self._verify(path)
            if problem is None:
                if damaged:
                    self._move_aside(list(damaged), "damaged")
                return path
            log.warning("skipping damaged checkpoint %s: %s", path, problem)
            damaged[path] = problem
        if damaged:
            found = "; ".join(f"{p.name} ({problem})" for p, problem in reversed(damaged.items()))
            raise ConfigError(f"train.resume=auto: no checkpoint in {self.ckpt_root} matches its manifest: {found}. "
                              "Nothing was changed: repair them, resume from another copy with train.resume=PATH, "
                              f"or start over with train.resume=never (which moves them into {self.ckpt_root}/"
                              "damaged-<time>/)")
        return None

    def _set_aside_previous_run(self) -> None:
        """A fresh start owns checkpoints/: an earlier run's checkpoints would otherwise be resumed or pruned as
        ours. They are moved, never deleted: those that verify into previous-<time>/, the rest (damaged, or a
        save that never completed) into damaged-<time>/."""
        found, complete = self._step_dirs(complete=False), set(self._step_dirs(complete=True))
        intact = [p for p in found if p in complete and self._intact_for_naming(p)]
        self._move_aside(intact, "previous")
        self._move_aside([p for p in found if p not in intact], "damaged")

    def _take_run_lock(self) -> None:
        """out_dir/run.lock, created exclusively by the main rank with its pid and host: a second run in the same
        out_dir would resume, prune and move the first one's checkpoints under it. A lock left by a process that
        is gone (same host) is taken over; one held by a live process, or from another host (whose processes
        cannot be checked from here), stops this run with one line, exit 2. Every rank gets the verdict."""
        box: list[str | None] = [None]
        if self.ctx.is_main:
            try:  # an error here goes to every rank as the verdict, not left for them to wait on
                self.out_dir.mkdir(parents=True, exist_ok=True)
                box = [run_lock.take(self.out_dir / RUN_LOCK)]
            except OSError as e:
                box = [f"{self.out_dir / RUN_LOCK}: cannot take the run lock: {e.strerror or e}"]
        if torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise ConfigError(f"train.out_dir: {box[0]}")

    def _set_aside_previous_metrics(self) -> None:
        """A fresh start writes a new metrics.jsonl: the earlier run's is renamed to metrics.previous-<time>.jsonl
        (as its checkpoints are moved, not deleted)."""
        def rename() -> str | None:
            old = self.out_dir / "metrics.jsonl"
            if not old.is_file():
                return None
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
            target, n = self.out_dir / f"metrics.previous-{stamp}.jsonl", 1
            while target.exists():
                target, n = self.out_dir / f"metrics.previous-{stamp}.{n}.jsonl", n + 1
            os.replace(old, target)
            return str(target)

        moved = self._on_main(rename)
        if moved:
            log.warning("moved the earlier run's metrics.jsonl to %s", moved)

    def _intact_for_naming(self, path: Path) -> bool:
        """Whether an earlier run's checkpoint goes into previous- or damaged-: it is only moved either way, so a
        file that cannot be read (an I/O error) names it damaged instead of stopping the fresh start."""
        try:
            return ckpt.verify(path, group=self.ckpt_group) is None
        except ckpt.UnreadableCheckpoint as e:
            log.warning("cannot check %s (%s): moved aside as damaged", path, e)
            return False

    def _move_aside(self, paths: list[Path], label: str) -> None:
        if paths:
            folder = self._on_main(lambda: str(ckpt.move_aside(self.ckpt_root, paths, label)))
            log.warning("moved %s into %s", ", ".join(p.name for p in paths), folder)

    # -- one optimizer step -------------------------------------------------------------------------------
    def _micro_batches(self, sampler: GlobalBatchSampler, step: int, tokens: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of `step` on the device, built in this thread (validation)."""
        return [to_device(x, y, self.device) for x, y in self._host_micro_batches(sampler, step, tokens)]

    def _host_micro_batches(self, sampler: GlobalBatchSampler, step: int, tokens: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of `step` on the host (pinned for a GPU): what the prefetch thread builds."""
        starts = sampler.micro_batch_starts(step, dp_rank=self.ctx.dp_rank, dp_size=self.ctx.dp,
                                            micro_batch_size=self.cfg.train.micro_batch_size)
        mask, pin = self.masks[id(tokens)], self.device.type == "cuda"
        return [host_batch(tokens, s, self.cfg.model.block_size, mask, pin=pin) for s in starts]

    def _rank_share_of_targets(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                               mask: Any) -> torch.Tensor | float:
        """The global batch's unmasked targets over dp: what each micro-batch's token-loss sum is divided by.

        The loss is the mean over the global batch's unmasked targets, whatever the layout. Each rank's
        gradients are averaged over dp, so a rank divides its token sums by 1/dp of the global count. Without
        a loss mask every target counts and the count is known; with one, this rank's micro-batches are
        counted and one all-reduce over dp sums the counts (tp ranks and pp stages hold the same targets)."""
        if mask is None:
            return float(self.cfg.train.global_batch_size * self.cfg.model.block_size // self.ctx.dp)
        count = torch.stack([(y != IGNORE_INDEX).sum() for _, y in micro_batches]).sum()
        comm.all_reduce(count, self.ctx.dp_group, self.ctx.comm)
        return count.clamp(min=1) / self.ctx.dp  # (no target at all: zero loss and gradients, not nan)

    def train_step(self) -> StepOutput:
        t = self.cfg.train
        self.model.train()
        self.ctx.comm.reset()
        loss_sum = torch.zeros((), device=self.device)  # this rank's sum of token losses
        micro_batches = [to_device(x, y, self.device) for x, y in self.loader.get(self.step)]
        share = self._rank_share_of_targets(micro_batches, self.masks[id(self.train_tokens)])
        if self.stage is not None:
            loss_sum = self._pipeline(micro_batches, train=True, share=share)
        else:
            for i, (x, y) in enumerate(micro_batches):
                with self.dp.micro_step(last=i == len(micro_batches) - 1):
                    with span("forward"), autocast(t.precision, self.device):
                        loss = self.model(x, y, reduction="sum")
                    loss_sum += loss.detach()
                    with span("backward"):
                        self.dp.backward(self.scaler.scale_loss(loss / share))
        with span("grad_sync"):
            self.dp.finish_grads()
        if (self.ctx.embedding_group is not None and self.cfg.model.tie_embeddings
                and self.module.wte.weight.requires_grad):  # (frozen under PEFT)
            # the first stage's embedding and the last stage's head are one weight: sum their gradients
            comm.all_reduce(self.dp.tied_embedding_grad(), self.ctx.embedding_group, self.ctx.comm)
        if self.cfg.parallel.sequence_parallel:
            sync_sequence_parallel_grads(self.dp.grad_shards(), self.ctx)

        self.scaler.unscale_(self.dp.local_grads())
        with span("clip"):
            grad_norm = self.dp.clip_grad_norm_(self.cfg.optim.grad_clip or math.inf)
        if self.stage is not None:
            # the norm's all-reduce over the stages is the step's common end: a stage that finished its
            # schedule early waits here, and that wait is its share of the pipeline flush
            self.stage_clock.end = self.stage_clock.mark()
        # Whether to skip the step (fp16 overflow, or the non-finite guard in bf16/fp32) stays on the device: the
        # optimizer reads it there, so the host never waits for this step's gradients and queues the next step's
        # work at once. The norm is global, so every rank takes the same decision.
        found_inf = (~torch.isfinite(grad_norm)).float()
        lr = lr_at(self.step, self.cfg.optim, t.max_steps)
        if self.pending_save is not None:  # a background save may still be copying what the step changes
            self.pending_save.wait_staged()
        with span("optimizer"):
            engine_norm = self.dp.step(lr, found_inf)
        if engine_norm is not None:
            grad_norm = engine_norm
        engine_skipped = self.dp.last_step_skipped()
        if engine_skipped is not None:  # the engine decided the skip inside its step (DeepSpeed)
            found_inf = engine_skipped
        self.scaler.update(found_inf)  # (counts skipped steps for metrics and train.max_bad_steps)
        if self.state_bytes is None:  # measured once, while gradients and optimizer states all exist
            self.state_bytes = self.dp.model_state_bytes()
        self.dp.zero_grad()
        self.comm_bytes = self.ctx.comm.snapshot()
        self.step += 1
        self.sampler.step = self.step
        self.tokens_seen += self.tokens_per_step
        # (its mean over dp is the global batch's mean token loss)
        return StepOutput(loss=loss_sum / share, grad_norm=grad_norm, lr=lr, skipped=found_inf != 0)

    def check_bad_steps(self) -> None:
        """Stop when `train.max_bad_steps` steps in a row had non-finite gradients since the last check (one host
        read of the scaler's counters: the trainer calls it at log steps)."""
        worst = self.scaler.take_worst_run()
        limit = self.cfg.train.max_bad_steps
        if worst >= limit:
            raise TrainingError(f"{worst} steps in a row had non-finite gradients (train.max_bad_steps={limit}); "
                                f"stopping at step {self.step}, the last complete checkpoint is kept")

    def _pipeline(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], *, train: bool,
                  share: torch.Tensor | float = 1.0) -> torch.Tensor:
        """One step's (or one eval batch's) micro-batches through the pipeline; the sum of token losses on the
        last stage. In training each micro-batch's sum is divided by `share` (see _rank_share_of_targets)."""
        ctx, t, m = self.ctx, self.cfg.train, self.cfg.model
        # evaluation runs the forward half, batched into exchanges alike
        name = self.cfg.parallel.pp_schedule if train else "forward"
        plan = build_plans(name, ctx.pp, len(micro_batches))[ctx.pp_rank]
        seq = m.block_size // ctx.tp if self.cfg.parallel.sequence_parallel else m.block_size
        loss_sum, clock = run_schedule(
                            plan, self.stage, self.p2p, batches=micro_batches,
                            act_shape=(t.micro_batch_size, seq, m.n_embd), act_dtype=DTYPES[t.precision],
                            loss_fn=lambda loss: self.scaler.scale_loss(loss / share),
                            backward=self.dp.backward, micro_step=lambda last: self.dp.micro_step(last=last),
                            autocast=lambda: autocast(t.precision, self.device), device=self.device, train=train)
        if train:
            self.stage_clock = clock
        return loss_sum

    def pipeline_times(self) -> dict[str, list[float]]:
        """Every stage's busy and idle seconds in the last training step (a collective over the pp group)."""
        busy, idle = self.stage_clock.busy_idle()
        mine = torch.tensor([busy, idle], dtype=torch.float64, device=self.device)
        every = torch.zeros(self.ctx.pp * 2, dtype=torch.float64, device=self.device)
        comm.all_gather(every, mine, self.ctx.pp_group, None)
        busy_s, idle_s = every[0::2].tolist(), every[1::2].tolist()
        return {"pp_busy_s": [round(b, 6) for b in busy_s], "pp_idle_s": [round(i, 6) for i in idle_s],
                "pp_idle_fraction": [round(i / (b + i), 4) if b + i else 0.0 for b, i in zip(busy_s, idle_s)]}

    def _from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        """The loss lives on the last pipeline stage: hand it to every stage (rank 0 writes the metrics)."""
        if self.ctx.pp > 1:
            t = t.detach().clone()
            torch.distributed.broadcast(t, src=self.ctx.pp_last_rank, group=self.ctx.pp_group)
        return t

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss over the unmasked targets of `train.eval_steps` fixed global batches of the
        validation split (the same at every layout)."""
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)  # sum of token losses, this rank
        count = torch.zeros((), dtype=torch.float64, device=self.device)  # unmasked targets, this rank
        for i in range(self.cfg.train.eval_steps):
            batches = self._micro_batches(self.val_sampler, i, self.val_tokens)
            count += sum((y != IGNORE_INDEX).sum() for _, y in batches)
            if self.stage is not None:
                total += self._pipeline(batches, train=False)
                continue
            for x, y in batches:
                with autocast(self.cfg.train.precision, self.device):
                    total += self.model(x, y, reduction="sum").float()
        self.model.train()
        sums = torch.stack([total, count])
        comm.all_reduce(sums, self.ctx.dp_group, None)  # (metrics, not training traffic)
        return self._from_last_stage(sums[0] / sums[1].clamp(min=1)).item()

    def _dp_mean(self, t: torch.Tensor) -> torch.Tensor:
        """The mean of a per-rank scalar over the dp group (for metrics: not counted as training traffic)."""
        t = t.detach().clone()
        comm.all_reduce(t, self.ctx.dp_group, None)
        return t / self.ctx.dp

    # -- checkpoints --------------------------------------------------------------------------------------
    def train_state(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "elapsed_s": self.elapsed_s,
                "sampler": self.sampler.state_dict(), "scaler": self.scaler.state_dict()}

    def _saved_part(self, state: dict[str, Any]) -> dict[str, Any]:
        """What a checkpoint holds of a data-parallel state: everything, or with PEFT the trained tensors only."""
        if self.cfg.peft.method == "none":
            return state
        keep = set(trainable_names(self.module))
        return {"model": {k: v for k, v in state["model"].items() if k in keep},
                "optim": {"state": {k: v for k, v in state["optim"]["state"].items() if k in keep}}}

    def _chunked(self, state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint state as this rank's chunks of the full tensors (views of the live state: nothing is
        gathered or copied); at tp=1 the forms' tensors are placed already (plain, DTensors, ZeRO's chunks)."""
        return self.tp_state.shard_state(state) if self.tp_state else state

    def peft_base(self) -> dict[str, str]:
        """The identity of the frozen base a PEFT checkpoint adapts: where it came from and its shapes."""
        return {"init_from": self.cfg.model.init_from, "model_fingerprint": self.cfg.fingerprint()}

    def tokenizer_files(self) -> dict[str, Path]:
        spec = self.data.tokenizer_spec
        return {} if spec == "byte" else {"tokenizer.json": Path(spec)}

    def save_checkpoint(self) -> Path:
        """Save at this step: complete on return, or with `train.async_checkpoint` once `wait_for_save` returns."""
        self.wait_for_save()  # one save at a time
        path = ckpt.step_dir(self.ckpt_root, self.step)
        state = self._chunked(self._saved_part(self.dp.checkpoint_state()))
        args = dict(state=state, train_state=self.train_state(), cfg=self.cfg, ctx=self.ctx, group=self.ckpt_group,
                    extra_files=self.tokenizer_files(), keep=self.cfg.train.keep_checkpoints,
                    engine_files=self.dp.save_engine_state,
                    manifest_extra={"peft_base": self.peft_base()} if self.cfg.peft.method != "none" else None)
        with self._saving(path) as cleared:
            if self.cfg.train.async_checkpoint:
                if self.stager is None:
                    self.stager = ckpt.host_stager(self.device)
                self.pending_save = ckpt.save_checkpoint_async(path, stager=self.stager, on_cleared=cleared, **args)
            else:
                ckpt.save_checkpoint(path, on_cleared=cleared, **args)
        return path

    def wait_for_save(self) -> None:
        """Until the checkpoint being written in the background (if any) is complete."""
        pending, self.pending_save = self.pending_save, None
        if pending is not None:
            with self._saving(pending.path, ours=True):  # (a pending save has cleared its path)
                pending.wait()

    @contextlib.contextmanager
    def _saving(self, path: Path, *, ours: bool = False) -> Iterator[Callable[[], None]]:
        """A failed write (disk full, an I/O error) stops training with one line; no partial checkpoint stays.
        Only a directory this save made is removed: `path` becomes ours when the save calls the yielded function
        (after moving an earlier complete checkpoint out of the way); before, a failure (e.g. that move) leaves
        whatever is at `path` as it was. A complete one (its manifest written) is kept even if ours."""
        mine = [ours]
        try:
            yield lambda: mine.__setitem__(0, True)
        except (OSError, CheckpointException) as e:
            if self.ctx.is_main and mine[0] and not ckpt.is_complete(path):
                shutil.rmtree(path, ignore_errors=True)  # (resume=auto would ignore it anyway: no manifest)
            kept = ckpt.latest_checkpoint(self.ckpt_root)
            raise CheckpointError(f"saving checkpoint {path} failed ({_io_reason(e)}); training stopped at step "
                                  f"{self.step}, the last complete checkpoint is {kept or 'none'}") from None

    def _agree_to_stop(self, requested: bool, flag: torch.Tensor) -> bool:
        """Every rank must stop at the same step: a SIGTERM seen by any rank stops them all. One process
        needs no collective (and no host sync)."""
        if self.ctx.world_size == 1:
            return requested
        flag.fill_(float(requested))  # a host tensor over the gloo group: no wait for the GPU
        comm.all_reduce(flag, self.ctx.cpu_group, None, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def _heartbeat(self) -> None:
        """out_dir/heartbeat/rank_K.json: the last step this rank finished, when, and its process (to find a
        stuck or dead rank)."""
        folder = self.out_dir / "heartbeat"
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".rank_{self.ctx.rank}.tmp"
        tmp.write_text(json.dumps({"rank": self.ctx.rank, "step": self.step, "time": time.time(), "pid": os.getpid(),
                                   "host": socket.gethostname()}))
        os.replace(tmp, folder / f"rank_{self.ctx.rank}.json")

    # -- the loop -----------------------------------------------------------------------------------------
    def header(self) -> dict[str, Any]:
        return {"event": "start", "step": self.step, "n_params": self.n_params,
                "layout": self.ctx.layout(), "device": str(self.device), "precision": self.cfg.train.precision,
                "global_batch_size": self.cfg.train.global_batch_size, "micro_batch_size": self.cfg.train.micro_batch_size,
                "accum_steps": self.accum_steps, "block_size": self.cfg.model.block_size,
                "resumed_from": str(self.resumed_from) if self.resumed_from else None,
                "flops_per_token": self._flops_per_token(), "sdpa_kernel": self.sdpa_kernel,
                "peak_memory": "cuda max_memory_allocated" if self.device.type == "cuda" else "host peak RSS",
                "device_name": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"}

    def _flops_per_token(self) -> float:
        with torch.device("meta"):
            return GPT(self.cfg.model).flops_per_token()

    def _peak_flops(self) -> float:
        """One device's peak FLOP/s for `mfu`: train.peak_tflops, else measured on a GPU; 0 (no mfu) on the CPU."""
        if self.cfg.train.peak_tflops:
            return self.cfg.train.peak_tflops * 1e12
        if self.device.type != "cuda":
            return 0.0
        flops = perf.measure_peak_flops(self.device, DTYPES[self.cfg.train.precision])
        log.info("peak of %s in %s, measured with a matmul: %.1f TFLOP/s (mfu is quoted against it)",
                 torch.cuda.get_device_name(self.device), self.cfg.train.precision, flops / 1e12)
        return flops

    def _peak_memory(self) -> list[int]:
        """Every rank's peak memory since training began (see perf.peak_memory_bytes), by rank."""
        mine = torch.tensor([self.phases.training_peak()], dtype=torch.int64)
        if self.ctx.world_size == 1:
            return mine.tolist()
        every = torch.zeros(self.ctx.world_size, dtype=torch.int64)
        comm.all_gather(every, mine, self.ctx.cpu_group, None)
        return every.tolist()

    def _check_attention_kernel(self) -> str:
        """Which SDPA kernel this run's attention takes; on a GPU the unfused math fallback gets a warning."""
        attention = next((m for m in self.module.modules() if isinstance(m, Attention)), None)
        if attention is None:
            return "none"
        m, t = self.cfg.model, self.cfg.train
        kernel = perf.sdpa_kernel(attention, seq=m.block_size, dtype=DTYPES[t.precision], device=self.device)
        if self.device.type == "cuda" and kernel not in perf.FUSED_CUDA_KERNELS:
            log.warning("attention runs SDPA's %s kernel, not flash/efficient/cudnn: it materialises the %d x %d "
                        "scores (check train.precision, model.dropout, the head size %d)", kernel, m.block_size,
                        m.block_size, m.head_dim)
        else:
            log.info("attention: SDPA %s kernel (%s, %d heads of %d)", kernel, t.precision, attention.n_head,
                     m.head_dim)
        return kernel

    def _log_accounting(self) -> None:
        """Once, after the first step (when gradients exist): what this rank holds and sends per step, and
        the memory calculator's prediction beside what it measured."""
        held = self.state_bytes or {}
        log.info("data parallel: %s | model states on rank 0: %s | comm per step on rank 0: %s",
                 self.dp.name, ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in held.items()),
                 ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in self.comm_bytes.items()) or "none")
        try:
            predicted = memory.predict(self.cfg, self.ctx.world_size, pp_rank=self.ctx.pp_rank).to_json()
        except (ConfigError, ValueError) as e:  # a layout the calculator does not model: say so, train on
            log.warning("memory calculator: %s", e)
            return
        measured = {f"{k}_bytes": v for k, v in held.items()}
        measured["model_states_bytes"] = sum(held.values())
        if self.activation_bytes is not None:
            measured["activation_bytes"] = self.activation_bytes
        if self.device.type == "cuda":
            measured["peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
        self.metrics.write({"event": "memory", "step": self.step, "predicted": predicted, "measured": measured})
        log.info("memory on rank 0, predicted | measured: model states %.2f | %.2f MiB, saved activations %.2f | %s MiB%s",
                 predicted["model_states_bytes"] / 2**20, measured["model_states_bytes"] / 2**20,
                 predicted["activation_bytes"] / 2**20,
                 f"{self.activation_bytes / 2**20:.2f}" if self.activation_bytes is not None else "-",
                 f", peak {predicted['peak_bytes'] / 2**20:.1f} | {measured['peak_bytes'] / 2**20:.1f} MiB"
                 if "peak_bytes" in measured else "")

    def fit(self) -> dict[str, Any]:
        """Train to `train.max_steps` (or `train.stop_after_step`); returns the last metrics."""
        t = self.cfg.train
        stop = t.stop_after_step or t.max_steps
        if self.ctx.is_main:
            (self.out_dir).mkdir(parents=True, exist_ok=True)
            (self.out_dir / "config.yaml").write_text(self.cfg.to_yaml())
        self.metrics.write(self.header())
        log.info("dist_llm | %.2fM parameters | world %d (dp %d, tp %d, pp %d) | %s | %s | %s | %s | global batch "
                 "%d x %d tokens in %d micro-step(s) | out %s", self.n_params / 1e6, self.ctx.world_size,
                 self.ctx.dp, self.ctx.tp, self.ctx.pp, self.dp.name, self.ctx.backend, self.device, t.precision,
                 t.global_batch_size, self.cfg.model.block_size, self.accum_steps, self.out_dir)
        for line in self.ctx.placement():
            log.info(line)
        last: dict[str, Any] = {}
        bar = tqdm(total=stop, initial=self.step, desc="train", unit="step", disable=not self.ctx.is_main,
                   mininterval=1.0, dynamic_ncols=True)
        run_start, prior_elapsed, start_step = time.perf_counter(), self.elapsed_s, self.step
        window_start, window_steps = run_start, 0
        preemption = Preemption().install()
        profiler = StepProfiler(parse_steps(t.profile_steps), self.out_dir, self.ctx.rank, self.device)
        stop_flag = torch.zeros(1)  # on the host (see _agree_to_stop)
        peak_flops = self._peak_flops()
        flops_per_token = self._flops_per_token() if peak_flops else 0.0  # (builds a meta model: once, here)
        self.phases.end("startup")  # fit's preparation too; from here the peak of training, not of preparing
        self.phases.training_began()
        try:
            while self.step < stop:
                with profiler.around(self.step + 1):
                    if self.step == start_step and not t.compile:  # compiled graphs do not run saved-tensor hooks
                        with SavedTensorMeter([*self.module.parameters(), *self.module.buffers()],
                                              module=self.module if self.dp.name == "fsdp2" else None) as meter:
                            out = self.train_step()
                        self.activation_bytes = meter.peak_bytes
                    else:
                        out = self.train_step()
                window_steps += 1
                bar.update(1)
                if window_steps == 1 and self.step == start_step + 1:
                    self._log_accounting()
                    self.phases.end("step1")
                if self.step % t.log_interval == 0 or self.step == stop:
                    self.check_bad_steps()
                    now = time.perf_counter()
                    self.elapsed_s = prior_elapsed + now - run_start
                    last = {"step": self.step, "loss": self._from_last_stage(self._dp_mean(out.loss)).item(),
                            "lr": out.lr,
                            "grad_norm": out.grad_norm.item(),
                            "tokens_per_s": window_steps * self.tokens_per_step / (now - window_start),
                            "elapsed_s": round(self.elapsed_s, 3), "comm_bytes": self.comm_bytes,
                            "model_state_bytes": self.state_bytes, "peak_memory_bytes": self._peak_memory()}
                    if peak_flops:
                        last["mfu"] = round(perf.mfu(last["tokens_per_s"], flops_per_token,
                                                     peak_flops * self.ctx.world_size), 5)
                    if self.activation_bytes is not None:
                        last["activation_bytes"] = self.activation_bytes
                    if self.stage_clock is not None:
                        last.update(self.pipeline_times())
                    if t.precision == "fp16":
                        last["loss_scale"] = self.scaler.scale
                    if self.scaler.skipped_steps:
                        last["skipped_steps"] = self.scaler.skipped_steps
                    self.metrics.write(last)
                    bar.set_postfix(loss=f"{last['loss']:.4f}", tok_s=f"{last['tokens_per_s']:.0f}")
                    window_start, window_steps = time.perf_counter(), 0
                paused = time.perf_counter()
                if t.eval_interval and (self.step % t.eval_interval == 0 or self.step == stop):
                    last["val_loss"] = self.evaluate()
                    self.metrics.write({"step": self.step, "val_loss": last["val_loss"]})
                    bar.write(f"step {self.step}: val_loss {last['val_loss']:.4f}")
                preempted = self._agree_to_stop(preemption.requested, stop_flag)
                if (t.ckpt_interval and self.step % t.ckpt_interval == 0) or self.step == stop or preempted:
                    self.elapsed_s = prior_elapsed + time.perf_counter() - run_start
                    self.phases.end("train", keep=self.step > start_step + 1)
                    self.save_checkpoint()
                    self.phases.end("save")
                self._heartbeat()
                window_start += time.perf_counter() - paused  # eval and saving are not training throughput
                if preempted:
                    log.warning("SIGTERM: stopped after step %d with a checkpoint; train.resume=auto goes on from it",
                                self.step)
                    break
            self.wait_for_save()
            self.phases.end("save")  # (with train.async_checkpoint: the wait for the last write)
            self.metrics.write(self.phases.event(self.ctx, self.step))
        except RuntimeError as e:
            message = comm.describe_failure(e, rank=self.ctx.rank, timeout_s=self.cfg.parallel.timeout_s,
                                            log_dir=str(self.out_dir / "logs")) if self.ctx.world_size > 1 else None
            if message is None:
                raise
            raise CollectiveError(message) from None
        finally:
            if profiler.finish():  # the run ended inside the profiled range
                log.info("profile of steps %s written to %s", t.profile_steps, profiler.path)
            preemption.restore()
            self.loader.close()
            if self.stager is not None:
                self.stager.close()
                self.stager = None
            bar.close()
            self.metrics.close()
            if self.ctx.is_main:
                run_lock.release(self.out_dir / RUN_LOCK)
        if self.ctx.is_main:
            plot_losses(self.out_dir / "metrics.jsonl", self.out_dir / "loss.png")
            write_report(self.out_dir)
        return last
