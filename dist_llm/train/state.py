"""A run's state on disk: resume from a checkpoint, save one, and keep the run's folder its own.

The trainer holds one RunState and calls it at the start (lock, resume or set an earlier run aside) and at
checkpoint steps; the run's progress counters (step, tokens seen, time trained) live here, since they are
what a checkpoint saves and a resume restores.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import yaml
from torch.distributed.checkpoint.api import CheckpointException

from dist_llm.config import Config, ConfigError, resolved_init_from
from dist_llm.data import GlobalBatchSampler
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.data import DataParallel
from dist_llm.parallel.parallelize import PP_SEED_STRIDE
from dist_llm.parallel.tensor.checkpoint import TensorParallelState
from dist_llm.model.buffers import trained_buffers
from dist_llm.peft import settings_difference as peft_settings_difference, trainable_names
from dist_llm.peft.base_identity import base_digest, check_base
from dist_llm.precision import LossScaler
from dist_llm.train import checkpoint as ckpt
from dist_llm.train import run_lock
from dist_llm.train.errors import CheckpointError
from dist_llm.train.metrics import truncate_after
from dist_llm.train.preemption import interrupted
from dist_llm.train.run_lock import RUN_LOCK

log = logging.getLogger("dist_llm")


def _io_reason(e: BaseException) -> str:
    """The first OS error's words in an exception, or in DCP's per-rank failures, e.g. "No space left on device"."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    if isinstance(e, CheckpointException) and e.failures:
        rank, (inner, _) = min(e.failures.items())  # (exception, traceback) per failed rank: the first
        return f"rank {rank}: {_io_reason(inner)}"
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def on_main(ctx: ParallelContext, ckpt_root: Path, fn: Any) -> Any:
    """fn() on the main rank, its result handed to every rank (file checks done once, not per rank). If fn
    raises, the failure is what is handed on, and every rank raises it as a one-line CheckpointError: no
    peer is left waiting in the broadcast for parallel.timeout_s."""
    box: list[Any] = [None]
    if ctx.is_main:
        try:
            box = [(True, fn())]
        except Exception as e:  # noqa: BLE001 - any failure must reach the peers, not only an OSError
            where = e.filename if isinstance(e, OSError) and e.filename else ckpt_root
            box = [(False, f"checkpoints in {ckpt_root}: {where}: {_io_reason(e)}")]
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise CheckpointError(f"{value}; nothing was deleted")
    return value


def take_run_lock(ctx: ParallelContext, out_dir: Path) -> None:
    """out_dir/run.lock, created exclusively by the main rank with its pid and host: a second run in the same
    out_dir would resume, prune and move the first one's checkpoints under it. A lock left by a process that
    is gone (same host) is taken over; one held by a live process, or from another host (whose processes
    cannot be checked from here), stops this run with one line, exit 2. Every rank gets the verdict."""
    box: list[str | None] = [None]
    if ctx.is_main:
        try:  # an error here goes to every rank as the verdict, not left for them to wait on
            out_dir.mkdir(parents=True, exist_ok=True)
            box = [run_lock.take(out_dir / RUN_LOCK)]
        except OSError as e:
            box = [f"{out_dir / RUN_LOCK}: cannot take the run lock: {e.strerror or e}"]
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise ConfigError(f"train.out_dir: {box[0]}")


class RunState:
    """Checkpoints of one run: where they live, resuming from one, saving (in the background with
    `train.async_checkpoint`), and the run lock; with the progress a checkpoint records."""

    def __init__(self, cfg: Config, ctx: ParallelContext, *, dp: DataParallel, tp_state: TensorParallelState | None,
                 sampler: GlobalBatchSampler, scaler: LossScaler, tokenizer_spec: str, n_params: int) -> None:
        self.cfg, self.ctx, self.dp, self.tp_state = cfg, ctx, dp, tp_state
        self.module = dp.module
        self.sampler, self.scaler, self.tokenizer_spec = sampler, scaler, tokenizer_spec
        self.device = ctx.device
        self.out_dir = cfg.run_dir()
        self.ckpt_root = self.out_dir / "checkpoints"
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
            seconds=ckpt.coordination_timeout_s(n_params, cfg.parallel.timeout_s, **self._state_shards())))
            if ctx.world_size > 1 else None)
        self.stager: Any = None  # the host copy of background saves, made at the first one
        # the PEFT base's digest, taken as soon as it is loaded (a base replaced before the first save must not be
        # recorded), read once by the main rank and handed to all: every rank then compares the same value
        self._base_digest = self._agreed_base_digest()

    def _agreed_base_digest(self) -> str | None:
        if self.cfg.peft.method == "none" or not self.cfg.model.init_from:
            return None
        box: list[Any] = [None]
        if self.ctx.is_main:
            try:
                box = [base_digest(self.cfg.model.init_from)]
            except ConfigError as e:
                box = [e]
        if self.ckpt_group is not None:
            torch.distributed.broadcast_object_list(box, src=0, group=self.ckpt_group)
        if isinstance(box[0], ConfigError):
            raise box[0]
        return box[0]

    def _state_shards(self) -> dict[str, int]:
        """How many ways this layout splits the weights and the optimizer state (see coordination_timeout_s)."""
        model_parallel = self.ctx.tp * self.ctx.pp
        zero = self.cfg.parallel.zero_stage
        return {"weight_shards": model_parallel * (self.ctx.dp if zero >= 3 else 1),
                "state_shards": model_parallel * (self.ctx.dp_cp if zero >= 1 else 1)}  # (ZeRO shards over dp x cp)

    # -- the run's folder -----------------------------------------------------------------------------------
    def take_run_lock(self) -> None:
        take_run_lock(self.ctx, self.out_dir)

    def release_run_lock(self) -> None:
        if self.ctx.is_main:
            run_lock.release(self.out_dir / RUN_LOCK)

    def set_aside_previous(self) -> None:
        """A fresh start: an earlier run's checkpoints and metrics in out_dir are moved aside (never deleted)."""
        self._set_aside_previous_run()
        self._set_aside_previous_metrics()

    def close(self) -> None:
        """Free the host copy of background saves (after the last one completed)."""
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    # -- resume -------------------------------------------------------------------------------------------
    def resume(self) -> Path | None:
        """Load the checkpoint `train.resume` names (auto: the newest that verifies) into the live state;
        None for a fresh start."""
        choice = self.cfg.train.resume
        if choice == "never":
            log.info("starting fresh: train.resume=never (an earlier run's checkpoints and metrics in %s are moved "
                     "aside)", self.out_dir)
            return None
        path = self._pick_checkpoint() if choice == "auto" else Path(choice).expanduser()
        if path is None:
            log.info("starting fresh: no complete checkpoint in %s", self.ckpt_root)
            return None
        if not ckpt.is_complete(path):
            raise ConfigError(f"train.resume: {path} is not a complete checkpoint (no {ckpt.MANIFEST})")
        if choice != "auto":
            problem = self._verify(path)
            if problem:
                raise ConfigError(f"train.resume: {problem}")
        manifest = ckpt.read_json(path / ckpt.MANIFEST)
        if manifest.get("model_fingerprint") != self.cfg.fingerprint():
            raise ConfigError(f"train.resume: {path} holds a different model than the model.* settings describe"
                              f"{self._first_difference(path)}; start over with train.resume=never (the earlier "
                              "run is moved aside) or use another train.out_dir")
        self._check_peft_settings(path)
        if self.cfg.peft.method != "none":
            saved, here = _same_base(manifest.get("peft_base")), self.peft_base()
            if _without_weights(saved) != _without_weights(here):
                raise ConfigError(f"train.resume: {path} adapts another base model ({_without_weights(saved)}) than "
                                  f"model.init_from describes ({_without_weights(here)})")
            check_base(path, saved, self.cfg.model.init_from, "train.resume", now=self._base_digest)
        if self.cfg.peft.method != "none" and not self.cfg.model.init_from:  # (the frozen base is drawn anew)
            ckpt.check_seeded_base(path, self.cfg, what="train.resume")
        # DCP reads this rank's chunks of the full tensors straight into the live state (the tensors of
        # `everything`); a PEFT checkpoint holds the trained tensors only: the frozen base stays as built
        everything = self.dp.checkpoint_state()
        held = ckpt.model_keys(path) if self.cfg.peft.method != "none" else None
        wanted = self._chunked(self._saved_part(everything, held=held))
        state = ckpt.load_checkpoint(path, state=wanted, ctx=self.ctx, group=self.ckpt_group,
                                     stage_seed=self.cfg.train.seed + PP_SEED_STRIDE * self.ctx.pp_rank)
        self.dp.load_checkpoint_state(everything)
        if wanted["optim"]["state"] and not ckpt.holds_optimizer_state(path):
            # a model converted from Hugging Face: its weights only. What checkpoint_state() made is not a fresh
            # optimizer's state (torch's get_state_dict steps once at lr 0): AdamW makes it afresh at its first step
            log.warning("%s holds no optimizer state%s: resuming its weights with a fresh optimizer", path,
                        self.dp.no_optimizer_state_note(path))
            self.dp.optimizer.state.clear()
        self.dp.load_engine_state(path, self.ckpt_group)
        self.step = state["step"]
        self.tokens_seen = state["tokens_seen"]
        self.elapsed_s = state.get("elapsed_s", 0.0)
        try:
            self.sampler.load_state_dict(state["sampler"])
        except ConfigError:
            raise
        except ValueError as e:  # (a sampler of another stream: the file was written for another purpose)
            raise ConfigError(f"train.resume: {path / 'train_state.json'}: {e}") from None
        self.scaler.load_state_dict(state["scaler"])
        log.info("resumed from %s at step %d", path, self.step)
        if choice != "auto":
            self._set_aside_other_history(path)
        dropped = self._on_main(lambda: truncate_after(self.out_dir / "metrics.jsonl", self.step))
        if dropped:
            log.info("metrics.jsonl: dropped %d line(s) after step %d, which this run writes again", dropped, self.step)
        return path

    def _check_peft_settings(self, path: Path) -> None:
        """The checkpoint was trained with this run's peft settings: resuming LoRA weights under another alpha or
        targets would change the model silently (and a rank or method change fails deep in the load)."""
        saved = ckpt.saved_config(path, "train.resume").peft
        here = self.cfg.peft
        if saved.method != here.method:
            hint = (f"; to fine-tune its weights, start a new run from it with model.init_from=ckpt:{path}"
                    if saved.method == "none" else "")
            raise ConfigError(f"train.resume: {path} was trained with peft.method={saved.method}, this run sets "
                              f"peft.method={here.method}{hint}")
        differ = None if here.method == "none" else peft_settings_difference(dataclasses.asdict(saved), here)
        if differ is not None:
            key, was, now = differ
            raise ConfigError(f"train.resume: {path} was trained with peft.{key}={was}, this run sets peft.{key}="
                              f"{now}: set it back, or start over with train.resume=never")

    def _set_aside_other_history(self, path: Path) -> None:
        """An explicit resume from step N starts another line of history: checkpoints in checkpoints/ that are not
        of it would be taken by an automatic resume after a crash of this run (the newest wins) instead of its own
        saves. Those of later steps are moved into superseded-<time>/ (never deleted); a checkpoint from
        elsewhere (another folder, or one set aside before) leaves none of checkpoints/ in its history, so all of
        it is moved."""
        inside = path.resolve().parent == self.ckpt_root.resolve()
        other = [p for p in self._step_dirs(complete=False) if not inside or ckpt.step_of(p) > self.step]
        self._move_aside(other, "superseded")

    def _first_difference(self, path: Path) -> str:
        """': model.KEY is A there, B here' for the first model setting in which the checkpoint's config.yaml
        differs from this run's ('' if it cannot be told)."""
        try:
            saved = yaml.safe_load((path / "config.yaml").read_text()).get("model", {})
        except (OSError, yaml.YAMLError, AttributeError, RecursionError):
            return ""
        here = dataclasses.asdict(self.cfg.model)
        for key, value in here.items():
            if key != "init_from" and key in saved and saved[key] != value:
                return f": model.{key} is {saved[key]} there, {value} here"
        return ""

    def _on_main(self, fn: Any) -> Any:
        """on_main(): fn() on the main rank, its result (or its failure, raised on every rank) on every rank."""
        return on_main(self.ctx, self.ckpt_root, fn)

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
        complete = self._step_dirs(complete=True)
        for path in self._step_dirs(complete=False):
            if path not in complete:
                log.warning("ignoring checkpoint %s: it has no %s (its save did not finish)", path, ckpt.MANIFEST)
        for path in reversed(complete):
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

    # -- save -----------------------------------------------------------------------------------------------
    def train_state(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "elapsed_s": self.elapsed_s,
                "sampler": self.sampler.state_dict(), "scaler": self.scaler.state_dict()}

    def _saved_part(self, state: dict[str, Any], held: set[str] | None = None) -> dict[str, Any]:
        """What a checkpoint holds of a data-parallel state: everything, or with PEFT the trained tensors only:
        the trainable parameters and the buffers a run trains (model/buffers.py: an MoE layer's expert bias).
        `held`: the model tensors of the checkpoint being resumed; a trained buffer it lacks (a PEFT checkpoint
        written before they were saved) is not asked for: it stays as built, said in a warning."""
        if self.cfg.peft.method == "none":
            return state
        buffers = set(trained_buffers(self.module))
        if held is not None and buffers - held and self.cfg.model.moe_bias_update_rate > 0 and self.ctx.is_main:
            log.warning("the checkpoint holds no %s (written before PEFT checkpoints kept them): they start from "
                        "their initial values", ", ".join(sorted(buffers - held)))
        if held is not None:
            buffers &= held
        keep = set(trainable_names(self.module)) | buffers
        return {"model": {k: v for k, v in state["model"].items() if k in keep},
                "optim": {"state": {k: v for k, v in state["optim"]["state"].items() if k in keep}}}

    def _chunked(self, state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint state as this rank's chunks of the full tensors (views of the live state: nothing is
        gathered or copied); at tp=1 the forms' tensors are placed already (plain, DTensors, ZeRO's chunks)."""
        return self.tp_state.shard_state(state) if self.tp_state else state

    def peft_base(self) -> dict[str, str]:
        """The identity of the frozen base a PEFT checkpoint adapts: where it came from, its shapes, and a digest of
        a sample of its weights (peft/base_identity.py; computed once a run)."""
        base = {"init_from": self.cfg.model.init_from, "model_fingerprint": self.cfg.fingerprint()}
        return base | ({"weights": self._base_digest} if self._base_digest else {})

    def tokenizer_files(self) -> dict[str, Path]:
        spec = self.tokenizer_spec
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
        except KeyboardInterrupt:  # a second Ctrl-C during the save: stop at once, leave no half checkpoint
            if self.ctx.is_main and mine[0] and not ckpt.is_complete(path):
                shutil.rmtree(path, ignore_errors=True)
            raise
        except (OSError, CheckpointException) as e:
            if self.ctx.is_main and mine[0] and not ckpt.is_complete(path):
                shutil.rmtree(path, ignore_errors=True)  # (resume=auto would ignore it anyway: no manifest)
            if interrupted(e):  # a second Ctrl-C, come out as a failed write: the abort it asked for
                raise KeyboardInterrupt from None
            kept = ckpt.latest_checkpoint(self.ckpt_root)
            raise CheckpointError(f"saving checkpoint {path} failed ({_io_reason(e)}); training stopped at step "
                                  f"{self.step}, the last complete checkpoint is {kept or 'none'}") from None

    def wait_staged(self) -> None:
        """Until a background save has copied what the next optimizer step changes (a no-op without one)."""
        if self.pending_save is not None:
            self.pending_save.wait_staged()


def _without_weights(base: Any) -> Any:
    """A `peft_base` without its weights' digest (compared on its own, and absent from earlier checkpoints)."""
    return {k: v for k, v in base.items() if k != "weights"} if isinstance(base, dict) else base


def _same_base(saved: Any) -> Any:
    """A manifest's `peft_base` as this version writes it: checkpoints made before model.init_from was stored
    resolved hold the path as typed, relative to the directory the run was started from (taken to be this one)."""
    if isinstance(saved, dict) and isinstance(saved.get("init_from"), str):
        return {**saved, "init_from": resolved_init_from(saved["init_from"])}
    return saved
