"""The trainer: the only place that knows the order of a training step."""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dist_llm import memory
from dist_llm.config import Config, ConfigError, parse_steps, validate
from dist_llm.console import FILE_ONLY, sample_command, step_line
from dist_llm import perf
from dist_llm.host_malloc import map_large_allocations
from dist_llm.data import BatchPrefetcher, GlobalBatchSampler, host_batch, prepare_data, to_device, val_sampler
from dist_llm.data.sampler import IGNORE_INDEX
from dist_llm.model import GPT
from dist_llm.model.gpt import Attention
from dist_llm.model import moe
from dist_llm.parallel import comm
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.context_parallel.apply import sequence_positions
from dist_llm.parallel.parallelize import PP_SEED_STRIDE, meta_model, parallelize  # noqa: F401 - the stride, importable here as before
from dist_llm.parallel.pipeline.balancing import metric_layers
from dist_llm.parallel.runtime import ParallelRuntime
from dist_llm.parallel.tensor.checkpoint import TensorParallelState
from dist_llm.train import checkpoint as ckpt
from dist_llm.train.errors import CheckpointError, CollectiveError, TrainingError  # noqa: F401 - importable here as before
from dist_llm.train.metrics import MetricsLog, plot_losses
from dist_llm.train.preemption import Preemption
from dist_llm.train.report import summary_lines, write_report
from dist_llm.profiling import StepProfiler, span
from dist_llm.train.init_from import load_initial_weights, open_initial_tensors, resolve_architecture
from dist_llm.train.memory_phases import PhaseMeter
from dist_llm.optim import lr_at
from dist_llm.precision import DTYPES, LossScaler
from dist_llm.train.saved_tensors import SavedTensorMeter
from dist_llm.train.state import RunState, on_main, take_run_lock

log = logging.getLogger("dist_llm")


@dataclass
class StepOutput:
    """What one optimizer step produced; tensors stay on the device until a log step reads them."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    skipped: torch.Tensor  # bool, 0-dim: the gradients were not finite, so the optimizer left everything as it was


@dataclass
class _RunClock:
    """The run's time: seconds trained (carried across resumes) and the current throughput window, which
    evaluation and saving do not count."""

    prior_elapsed: float  # trained before this process (from the checkpoint resumed)
    start_step: int  # the step this process began at
    run_start: float = field(default_factory=time.perf_counter)
    window_start: float = 0.0
    window_steps: int = 0

    def __post_init__(self) -> None:
        self.window_start = self.run_start

    def elapsed(self, now: float | None = None) -> float:
        return self.prior_elapsed + (time.perf_counter() if now is None else now) - self.run_start


def build_model(cfg: Config, ctx: ParallelContext) -> GPT:
    """The GPT for `cfg` on ctx.device, whole along the pipeline (no stage cut) and not wrapped for data
    parallelism: its layers tensor-parallel when parallel.tp > 1, built on the meta device and initialised from
    `train.seed` identically at every layout (or loaded from `model.init_from`), with PEFT, checkpointing and
    compilation as configured."""
    return parallelize(meta_model(cfg, ctx), cfg, ctx, cut=False, wrap=False, load=load_initial_weights).model


class _RunStateField:
    """A Trainer attribute that reads and writes the same-named counter of its RunState (which the checkpoint
    records), so `trainer.step` and friends keep their names."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, trainer: Any, owner: type | None = None) -> Any:
        return self if trainer is None else getattr(trainer.run_state, self.name)

    def __set__(self, trainer: Any, value: Any) -> None:
        setattr(trainer.run_state, self.name, value)


class Trainer:
    def __init__(self, cfg: Config, ctx: ParallelContext) -> None:
        map_large_allocations()  # freed host tensors go back to the OS, not into malloc's heaps (host_malloc.py)
        self.phases = PhaseMeter(ctx.device)  # peak memory per phase of the run (memory_phases.py)
        cfg = resolve_architecture(cfg)
        validate(cfg)  # again: an hf: start brings its own architecture
        self.cfg, self.ctx = cfg, ctx
        t, m = cfg.train, cfg.model
        self.device = ctx.device

        # Local rank 0 prepares the token files; the others then find them in the cache. What stops it (empty
        # data, a bad tokenizer: one line; anything else) stops every rank alike.
        failure: Exception | None = None
        if ctx.local_rank == 0:
            try:
                self.data = prepare_data(cfg.data, m.vocab_size)
            except ConfigError as e:
                failure = e
            except BaseException as e:  # (a Ctrl-C too: the others must not wait for it)
                ctx.first_failure(TrainingError(f"rank {ctx.rank}: preparing data.source failed "
                                                f"({type(e).__name__}: {e})"))
                raise  # (on this rank its own error: the line or traceback it gives)
        failure = ctx.first_failure(failure)
        if failure is not None:
            raise failure
        if ctx.local_rank != 0:
            self.data = prepare_data(cfg.data, m.vocab_size)
        self.train_tokens = self.data.train_tokens()
        self.val_tokens = self.data.val_tokens()
        self.masks = {id(self.train_tokens): self.data.train_mask(), id(self.val_tokens): self.data.val_mask()}
        self.sampler = GlobalBatchSampler(len(self.train_tokens), m.block_size, t.global_batch_size, t.seed)
        self.val_sampler = val_sampler(len(self.val_tokens), m.block_size, t.global_batch_size)
        # under context parallelism every cp rank of a dp group reads the same windows and keeps its part of each
        self.cp_positions = sequence_positions(ctx.cp_rank, ctx.cp, m.block_size)

        # this rank's part of the model only: built on the meta device, cut, sharded, then materialised
        built = parallelize(meta_model(cfg, ctx), cfg, ctx, load=load_initial_weights, read=open_initial_tensors)
        self.runtime = ParallelRuntime(built, cfg, ctx)  # the stage cut, its links, the data-parallel form
        self.dp = self.runtime.dp
        with torch.device("meta"):  # the whole model's count, whatever part of it this rank holds
            whole = GPT(cfg.model)
            self.n_params, self.n_active_params = whole.num_params(), whole.num_params(active=True)
            del whole
        self.model = self.runtime.model  # what forward calls (a DDP/FSDP wrapper, or the GPT itself)
        self.module = self.runtime.module  # the GPT
        self.moe_layers = moe.moe_layers(self.module)  # (empty for a dense model; under pp this stage's)
        # what the metrics average: every MoE layer of the model, another stage's as a stand-in under pp
        self.moe_metric_layers = (metric_layers(self.module, cfg.model.n_experts, cfg.model.is_moe_block, self.device)
                                  if ctx.pp > 1 else self.moe_layers)
        self.tp_state = TensorParallelState(self.module, ctx) if ctx.tp > 1 or ctx.ep > 1 else None
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
        self.comm_bytes: dict[str, int] = {}
        self.exit_code = 0  # 130 once a Ctrl-C stopped the run (with a checkpoint)
        self.run_state = RunState(cfg, ctx, dp=self.dp, tp_state=self.tp_state, sampler=self.sampler,
                                  scaler=self.scaler, tokenizer_spec=self.data.tokenizer_spec, n_params=self.n_params)
        self.out_dir, self.ckpt_root = self.run_state.out_dir, self.run_state.ckpt_root
        self.phases.end("startup")
        self.run_state.take_run_lock()
        try:
            self.resumed_from = self.run_state.resume()
            self.phases.end("resume", keep=self.resumed_from is not None)
            fresh = self.resumed_from is None
            if fresh:
                self.run_state.set_aside_previous()
            self.metrics = MetricsLog(self.out_dir / "metrics.jsonl", enabled=ctx.is_main, fresh=fresh,
                                      tensorboard_dir=self.out_dir / "tensorboard" if t.tensorboard else None,
                                      wandb_mode=t.wandb, run_name=cfg.name, config=cfg.to_dict())
        except BaseException:  # a refused resume leaves the out_dir free for the next try
            self.run_state.release_run_lock()
            raise

    # -- the run's state on disk (train/state.py); these names stay for the tests and scripts -----------------
    step = _RunStateField("step")
    tokens_seen = _RunStateField("tokens_seen")
    elapsed_s = _RunStateField("elapsed_s")

    @property
    def pending_save(self) -> ckpt.PendingSave | None:
        return self.run_state.pending_save

    @property
    def ckpt_group(self) -> Any:
        return self.run_state.ckpt_group

    def save_checkpoint(self) -> Path:
        """Save at this step: complete on return, or with `train.async_checkpoint` once `wait_for_save` returns."""
        return self.run_state.save_checkpoint()

    def wait_for_save(self) -> None:
        """Until the checkpoint being written in the background (if any) is complete."""
        self.run_state.wait_for_save()

    def _saved_part(self, state: dict[str, Any]) -> dict[str, Any]:
        return self.run_state._saved_part(state)

    def _chunked(self, state: dict[str, Any]) -> dict[str, Any]:
        return self.run_state._chunked(state)

    def _on_main(self, fn: Any) -> Any:
        return on_main(self.ctx, self.ckpt_root, fn)

    def _take_run_lock(self) -> None:
        take_run_lock(self.ctx, self.out_dir)

    # -- one optimizer step -------------------------------------------------------------------------------
    def _micro_batches(self, sampler: GlobalBatchSampler, step: int, tokens: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of `step` on the device, built in this thread (validation)."""
        return [to_device(x, y, self.device) for x, y in self._host_micro_batches(sampler, step, tokens)]

    def _host_micro_batches(self, sampler: GlobalBatchSampler, step: int, tokens: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of `step` on the host (pinned for a GPU): what the prefetch thread builds."""
        starts = sampler.micro_batch_starts(step, dp_rank=self.ctx.dp_rank, dp_size=self.ctx.dp,
                                            micro_batch_size=self.cfg.train.micro_batch_size)
        mask, pin = self.masks[id(tokens)], self.device.type == "cuda"
        return [host_batch(tokens, s, self.cfg.model.block_size, mask, pin=pin, positions=self.cp_positions)
                for s in starts]

    def _rank_share_of_targets(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                               mask: Any) -> torch.Tensor | float:
        """The global batch's unmasked targets over dp x cp: what each micro-batch's token-loss sum is divided by.

        The loss is the mean over the global batch's unmasked targets, whatever the layout. Each rank's
        gradients are averaged over dp x cp (context-parallel ranks hold disjoint tokens of the same sequences,
        the same number each), so a rank divides its token sums by 1/(dp cp) of the global count. Without a loss
        mask every target counts and the count is known; with one, this rank's micro-batches are counted and one
        all-reduce over dp x cp sums the counts (tp ranks and pp stages hold the same targets)."""
        if mask is None:
            return float(self.cfg.train.global_batch_size * self.cfg.model.block_size // self.ctx.dp_cp)
        count = torch.stack([(y != IGNORE_INDEX).sum() for _, y in micro_batches]).sum()
        comm.all_reduce(count, self.ctx.dp_cp_group, self.ctx.comm)
        return count.clamp(min=1) / self.ctx.dp_cp  # (no target at all: zero loss and gradients, not nan)

    def train_step(self) -> StepOutput:
        t = self.cfg.train
        self.model.train()
        self.ctx.comm.reset()
        micro_batches = [to_device(x, y, self.device) for x, y in self.loader.get(self.step)]
        share = self._rank_share_of_targets(micro_batches, self.masks[id(self.train_tokens)])
        loss_sum = self.runtime.forward_backward(micro_batches,
                                                 loss_fn=lambda loss: self.scaler.scale_loss(loss / share))
        self.runtime.finish_grads()
        self.scaler.unscale_(self.dp.local_grads())
        with span("clip"):
            grad_norm = self.dp.clip_grad_norm_(self.cfg.optim.grad_clip or math.inf)
        self.runtime.mark_step_end()  # (the norm's all-reduce over the stages: their common end)
        # Whether to skip the step (fp16 overflow, or the non-finite guard in bf16/fp32) stays on the device: the
        # optimizer reads it there, so the host never waits for this step's gradients and queues the next step's
        # work at once. The norm is global, so every rank takes the same decision.
        found_inf = (~torch.isfinite(grad_norm)).float()
        lr = lr_at(self.step, self.cfg.optim, t.max_steps)
        self.run_state.wait_staged()  # a background save may still be copying what the step changes
        with span("optimizer"):
            engine_norm = self.dp.step(lr, found_inf)
        if engine_norm is not None:
            grad_norm = engine_norm
        if self.moe_layers:  # aux-loss-free balancing: the bias follows the step's load over the whole batch
            moe.update_expert_bias(self.moe_layers, self.cfg.model.moe_bias_update_rate, all_reduce=self._dp_sum)
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
            # (the diverged state is not saved: say what a resume would start from, where there is anything)
            kept = ckpt.latest_checkpoint(self.ckpt_root)
            where = f"the last complete checkpoint ({kept}) is kept" if kept else "and no checkpoint has been saved"
            raise TrainingError(f"{worst} step{'s' * (worst != 1)} in a row had non-finite gradients "
                                f"(train.max_bad_steps={limit}); stopping at step {self.step}, {where}")

    def pipeline_times(self) -> dict[str, list[float]]:
        """Every stage's busy and idle seconds in the last training step (a collective over the pp group)."""
        return self.runtime.pipeline_times()

    def _from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        return self.runtime.from_last_stage(t)

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
            self.runtime.add_eval_losses(batches, total)
        self.model.train()
        sums = torch.stack([total, count])
        comm.all_reduce(sums, self.ctx.dp_cp_group, None)  # (metrics, not training traffic; cp ranks' tokens differ)
        return self._from_last_stage(sums[0] / sums[1].clamp(min=1)).item()

    def _dp_sum(self, t: torch.Tensor) -> None:
        """Sum a tensor over the dp group in place (router loads: bookkeeping, not counted as training traffic)."""
        comm.all_reduce(t, self.ctx.dp_group, None)

    def _moe_sum(self, t: torch.Tensor) -> None:
        """Sum MoE metric rows over dp, and under pp over the stages (each holds its own layers' rows)."""
        self._dp_sum(t)
        if self.ctx.pp > 1:
            comm.all_reduce(t, self.ctx.pp_group, None)

    def _dp_mean(self, t: torch.Tensor) -> torch.Tensor:
        """The mean of a per-rank scalar over the dp x cp group (for metrics: not counted as training traffic)."""
        t = t.detach().clone()
        comm.all_reduce(t, self.ctx.dp_cp_group, None)
        return t / self.ctx.dp_cp

    def _agree_to_stop(self, requested: int, flags: torch.Tensor, clock: _RunClock | None) -> tuple[int, bool]:
        """Every rank must stop at the same step: a SIGTERM (1) or Ctrl-C (2, Preemption.code) seen by any rank
        stops them all, and all take the largest code; with `clock` (train.max_time_s set and this step not
        already the last), any rank whose budget is spent makes this step the last for all. Both flags travel in
        one MAX all-reduce: every rank calls this at every step boundary (the same collective in the same
        order). One process needs no collective (and no host sync). Returns (code, time is up)."""
        up = clock is not None and clock.elapsed() >= self.cfg.train.max_time_s
        if self.ctx.world_size > 1:
            flags[0], flags[1] = float(requested), float(up)  # a host tensor over the gloo group: no GPU wait
            comm.all_reduce(flags, self.ctx.cpu_group, None, op=torch.distributed.ReduceOp.MAX)
            requested, up = int(flags[0].item()), bool(flags[1].item())
        if up and self.ctx.is_main:
            assert clock is not None
            log.info("train.max_time_s=%g reached: step %d is the last (%.1f s trained)", self.cfg.train.max_time_s,
                     self.step, clock.elapsed())
        return requested, up

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
    def _layout(self) -> dict[str, int]:
        """The context's degrees; an MoE model's always with its ep (1 too: where its experts are is part of it)."""
        return self.ctx.layout() | ({"ep": self.ctx.ep} if self.cfg.model.n_experts else {})

    def header(self) -> dict[str, Any]:
        return {"event": "start", "step": self.step, "n_params": self.n_params, "n_active_params": self.n_active_params,
                "layout": self._layout(), "device": str(self.device), "precision": self.cfg.train.precision,
                **({"moe_blocks": [i for i in range(self.cfg.model.n_layer) if self.cfg.model.is_moe_block(i)]}
                   if self.cfg.model.n_experts else {}),  # (which block each moe_layer_imbalance entry is)
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
        if self.ctx.cp > 1:  # (no SDPA: the ring computes each block in fp32 tiles, parallel/context_parallel/ring.py)
            log.info("attention: ring over cp=%d (fp32 tiles, %d heads of %d)", self.ctx.cp, attention.n_head, m.head_dim)
            return "ring"
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

    # -- the run -----------------------------------------------------------------------------------------
    def _announce(self) -> None:
        """config.yaml, the metrics' header and the log's summary of the run, before its first step."""
        t = self.cfg.train
        if self.ctx.is_main:
            (self.out_dir).mkdir(parents=True, exist_ok=True)
            (self.out_dir / "config.yaml").write_text(self.cfg.to_yaml())
        self.metrics.write(self.header())
        active = f" ({self.n_active_params / 1e6:.2f}M active)" if self.n_active_params != self.n_params else ""
        log.info("dist_llm | %.2fM parameters%s | world %d (dp %d, tp %d, pp %d%s) | data-parallel form %s | backend "
                 "%s | %s | %s | global batch %d x %d tokens in %d micro-step(s) | out %s", self.n_params / 1e6, active,
                 self.ctx.world_size, self.ctx.dp, self.ctx.tp, self.ctx.pp,
                 self._ep_layout() + (f", cp {self.ctx.cp}" if self.ctx.cp > 1 else ""),
                 self.dp.name, self.ctx.backend, self.device, t.precision,
                 t.global_batch_size, self.cfg.model.block_size, self.accum_steps, self.out_dir)
        for line in self.ctx.placement():
            log.info(line)

    def _ep_layout(self) -> str:
        """', ep 2: 4 of 8 experts a rank' for an MoE model, whatever its ep; nothing for a dense one."""
        m = self.cfg.model
        if not m.n_experts:
            return ""
        return f", ep {self.ctx.ep}: {m.n_experts // self.ctx.ep} of {m.n_experts} experts a rank"

    def _measured_step(self, start_step: int) -> StepOutput:
        """train_step; the run's first one also measures the activations saved for backward."""
        if self.step == start_step and not self.cfg.train.compile:  # compiled graphs do not run saved-tensor hooks
            with SavedTensorMeter([*self.module.parameters(), *self.module.buffers()],
                                  module=self.module if self.dp.name == "fsdp2" else None) as meter:
                out = self.train_step()
            self.activation_bytes = meter.peak_bytes
            return out
        return self.train_step()

    def _first_step_accounting(self) -> None:
        self._log_accounting()
        self.phases.end("step1")

    def _log_step(self, out: StepOutput, clock: _RunClock, bar: tqdm, *, peak_flops: float,
                  flops_per_token: float) -> dict[str, Any]:
        """The metrics record of a log step (its host reads happen here only), written and shown; a new
        throughput window starts."""
        self.check_bad_steps()
        now = time.perf_counter()
        self.elapsed_s = clock.elapsed(now)
        last = {"step": self.step, "loss": self._from_last_stage(self._dp_mean(out.loss)).item(),
                "lr": out.lr,
                "grad_norm": out.grad_norm.item(),
                "tokens_per_s": clock.window_steps * self.tokens_per_step / (now - clock.window_start),
                "elapsed_s": round(self.elapsed_s, 3), "comm_bytes": self.comm_bytes,
                "model_state_bytes": self.state_bytes, "peak_memory_bytes": self._peak_memory()}
        if peak_flops:
            last["mfu"] = round(perf.mfu(last["tokens_per_s"], flops_per_token, peak_flops * self.ctx.world_size), 5)
        if self.activation_bytes is not None:
            last["activation_bytes"] = self.activation_bytes
        if self.runtime.stage_clock is not None:
            last.update(self.pipeline_times())
        if self.cfg.train.precision == "fp16":
            last["loss_scale"] = self.scaler.scale
        if self.scaler.skipped_steps:
            last["skipped_steps"] = self.scaler.skipped_steps
        if self.moe_metric_layers:  # means over the steps since the last log step, layers and dp ranks
            last.update(moe.take_metrics(self.moe_metric_layers, all_reduce=self._moe_sum))  # type: ignore[arg-type]
        self.metrics.write(last)
        log.info(step_line(last), extra=FILE_ONLY)  # every rank's log file (the bar shows the loss)
        bar.set_postfix(loss=f"{last['loss']:.4f}", tok_s=f"{last['tokens_per_s']:.0f}")
        clock.window_start, clock.window_steps = time.perf_counter(), 0
        return last

    def _evaluate_into(self, last: dict[str, Any]) -> None:
        last["val_loss"] = self.evaluate()
        self.metrics.write({"step": self.step, "val_loss": last["val_loss"]})
        log.info("step %d: val_loss %.4f", self.step, last["val_loss"])  # (the console: rank 0's, above its bar)

    def _save_at_step(self, clock: _RunClock) -> None:
        self.elapsed_s = clock.elapsed()
        self.phases.end("train", keep=self.step > clock.start_step + 1)
        self.save_checkpoint()
        self.phases.end("save")

    def _end_of_run(self) -> None:
        self.wait_for_save()
        self.phases.end("save")  # (with train.async_checkpoint: the wait for the last write)
        self.metrics.write(self.phases.event(self.ctx, self.step))

    def _collective_error(self, e: RuntimeError) -> CollectiveError | None:
        """A failed collective as one line naming the rank and the cause; None for any other error."""
        message = comm.describe_failure(e, rank=self.ctx.rank, timeout_s=self.cfg.parallel.timeout_s,
                                        log_dir=str(self.out_dir / "logs")) if self.ctx.world_size > 1 else None
        return None if message is None else CollectiveError(message)

    def _close_run(self, profiler: StepProfiler, bar: tqdm) -> None:
        """Whatever way the run ends: the profile, threads, files and the run lock (the signal handlers: `fit`)."""
        if profiler.finish():  # the run ended inside the profiled range
            log.info("profile of steps %s written to %s", self.cfg.train.profile_steps, profiler.path)
        self.loader.close()
        self.run_state.close()
        bar.close()
        self.metrics.close()
        self.run_state.release_run_lock()

    def _say_stopped(self, code: int) -> None:
        """The one line a stop on a signal ends with: where the checkpoint is and how to go on; after Ctrl-C
        (code 2) the process then exits 130 (`exit_code`)."""
        where = ckpt.step_dir(self.ckpt_root, self.step)
        if code == 2:
            self.exit_code = 130
            if self.ctx.is_main:
                again = ("run the same command again" if self.cfg.train.resume == "auto" else
                         "run the command again with train.resume=auto")
                log.warning("interrupted (Ctrl-C) after step %d: saved %s; %s to resume from it", self.step, where,
                            again)
        elif self.ctx.is_main:
            log.warning("SIGTERM: stopped after step %d with a checkpoint (%s); train.resume=auto goes on from it",
                        self.step, where)

    def _already_complete(self, stop: int) -> bool:
        """A run resumed at (or past) its last step has nothing to do: say so and how to go on, or start over."""
        if self.step < stop:
            return False
        t = self.cfg.train
        if t.stop_after_step and t.stop_after_step < t.max_steps:
            where, go_on = f"train.stop_after_step={stop}", f"raise or drop train.stop_after_step (max_steps={t.max_steps})"
        else:
            where, go_on = f"train.max_steps={stop}", f"raise train.max_steps (e.g. train.max_steps={2 * stop})"
        log.warning("nothing to train: %s is complete at step %d (%s); to train on, %s; to start over, "
                    "train.resume=never (the earlier run is moved aside, not deleted)", self.out_dir, self.step, where,
                    go_on)
        self.metrics.close()
        self.run_state.close()
        self.run_state.release_run_lock()
        return True

    def fit(self) -> dict[str, Any]:
        """Train to `train.max_steps` (or `train.stop_after_step`); returns the last metrics."""
        t = self.cfg.train
        stop = planned = t.stop_after_step or t.max_steps  # (train.max_time_s may bring `stop` forward)
        if self._already_complete(stop):
            return {}
        self._announce()
        last: dict[str, Any] = {}
        bar = tqdm(total=stop, initial=self.step, desc="train", unit="step", disable=not self.ctx.is_main,
                   mininterval=1.0, dynamic_ncols=True)
        clock = _RunClock(prior_elapsed=self.elapsed_s, start_step=self.step)
        preemption = Preemption().install()
        profiler = StepProfiler(parse_steps(t.profile_steps), self.out_dir, self.ctx.rank, self.device)
        stop_flags = torch.zeros(2)  # on the host (see _agree_to_stop)
        peak_flops = self._peak_flops()
        flops_per_token = self._flops_per_token() if peak_flops else 0.0  # (builds a meta model: once, here)
        self.phases.end("startup")  # fit's preparation too; from here the peak of training, not of preparing
        self.phases.training_began()
        try:
            while self.step < stop:
                with profiler.around(self.step + 1):
                    out = self._measured_step(clock.start_step)
                clock.window_steps += 1
                bar.update(1)
                if clock.window_steps == 1 and self.step == clock.start_step + 1:
                    self._first_step_accounting()
                logged = self.step % t.log_interval == 0 or self.step == stop
                if logged:
                    last = self._log_step(out, clock, bar, peak_flops=peak_flops, flops_per_token=flops_per_token)
                paused = time.perf_counter()
                evaluated = bool(t.eval_interval) and (self.step % t.eval_interval == 0 or self.step == stop)
                if evaluated:
                    self._evaluate_into(last)
                budget = clock if t.max_time_s and self.step < stop else None
                preempted, time_up = self._agree_to_stop(preemption.code, stop_flags, budget)
                if time_up:  # this step is the last: logged, evaluated, saved and reported as one
                    stop = self.step
                    clock.window_start += time.perf_counter() - paused  # (eval is not training throughput)
                    paused = time.perf_counter()
                    if not logged:
                        val = {"val_loss": last["val_loss"]} if evaluated else {}
                        last = {**self._log_step(out, clock, bar, peak_flops=peak_flops,
                                                 flops_per_token=flops_per_token), **val}
                    if t.eval_interval and not evaluated:
                        self._evaluate_into(last)
                if (t.ckpt_interval and self.step % t.ckpt_interval == 0) or self.step == stop or preempted:
                    self._save_at_step(clock)
                self._heartbeat()
                clock.window_start += time.perf_counter() - paused  # eval and saving are not training throughput
                if preempted:
                    self._say_stopped(preempted)
                    break
            self._end_of_run()
        except BaseException as e:
            preemption.restore()
            failure = self._collective_error(e) if isinstance(e, RuntimeError) else None
            if failure is None:
                raise
            raise failure from None
        finally:
            self._close_run(profiler, bar)
        try:  # (the handler stays through the report: a SIGTERM after the last save is recorded as one in training
            # is, not raised as a Terminated saying nothing was saved; the run is complete and exits 0)
            if self.ctx.is_main:
                if self.cfg.train.plot:
                    plot_losses(self.out_dir / "metrics.jsonl", self.out_dir / "loss.png")
                write_report(self.out_dir)
                newest = ckpt.latest_checkpoint(self.ckpt_root)
                for line in summary_lines(self.out_dir, step=self.step, stop=planned, newest=newest,
                                          command=sample_command(self.out_dir)):
                    log.info(line)
        finally:
            preemption.restore()
        return last
