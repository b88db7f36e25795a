"""`dist-llm train|sample|convert|memory|report`: parse, build, run. Bad input ends in one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

from dist_llm.config import Config, ConfigError, load_config
from dist_llm.console import setup_logging

EXIT_BAD_INPUT = 2
log = logging.getLogger("dist_llm")


def fail(message: str, code: int = EXIT_BAD_INPUT, *, every_rank: bool = False) -> int:
    """One line on stderr, from rank 0 only (under torchrun every rank meets the same bad input), or from
    every rank that meets it (a failed collective: each names its own rank). Under torchrun every rank also
    leaves it in its TORCHELASTIC_ERROR_FILE (whether it printed it, and when), where dist_llm.torchrun finds a
    line no rank printed."""
    printed = every_rank or int(os.environ.get("RANK", "0")) == 0
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file and code:
        import json
        import time

        # whole or not at all (a temporary name, then a rename): torchrun's agent fails on a file it cannot parse,
        # and a disk that is full is what this line may be saying
        tmp = f"{error_file}.{os.getpid()}.tmp"
        try:
            Path(tmp).write_text(json.dumps({"message": message, "timestamp": int(time.time()), "time": time.time(),
                                             "printed": printed}))
            os.replace(tmp, error_file)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    if printed:
        print(f"dist-llm: error: {message}", file=sys.stderr)
        record = log.makeRecord(log.name, logging.ERROR, __file__, 0, message, None, None)
        for handler in log.handlers:  # and in the rank's log file (the console has it already)
            if isinstance(handler, logging.FileHandler):
                handler.handle(record)
    return code


def guarded(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn the errors a user can cause into one line and an exit code instead of a traceback."""

    def run(args: argparse.Namespace) -> int:
        from dist_llm.train.errors import CollectiveError, TrainingError  # (light: no torch to import)
        from dist_llm.train.preemption import Terminated

        try:
            return fn(args)
        except ConfigError as e:
            return fail(str(e))
        except TrainingError as e:
            return fail(str(e), code=1, every_rank=isinstance(e, CollectiveError))
        except RecursionError as e:  # (a file nested past Python's limit that no reader above named: still bad input)
            return fail(f"an input file is nested too deeply to read ({e})")
        except (RuntimeError, MemoryError) as e:  # out of memory: the config's size, not a bug; each rank says its own
            from dist_llm.train.errors import out_of_memory

            line = out_of_memory(e, rank=os.environ.get("RANK", "0"), config=getattr(args, "config", None),
                                 overrides=getattr(args, "overrides", None))
            if line is None:
                raise
            return fail(line, code=1, every_rank=True)
        except OSError as e:  # a disk full or unwritable --out: the file and the reason, from the rank that met it
            where = f"{e.filename}: " if e.filename else ""
            rank = os.environ.get("RANK")
            return fail(f"{f'rank {rank}: ' if rank else ''}{where}{e.strerror or e}", code=1, every_rank=True)
        except (KeyboardInterrupt, Terminated) as e:
            if isinstance(e, Terminated):
                line = (f"terminated ({e}): nothing saved since the last complete checkpoint (during training, "
                        f"{e} saves one at the end of the step)")
                code = 128 + e.signum
            else:
                line = ("interrupted: nothing saved since the last complete checkpoint (during training, a single "
                        "Ctrl-C saves one at the end of the step)")
                code = 130
            # under torchrun 0, as after a stop that saved: a failed worker would make torchrun restart the group
            # or print its failure report; dist-llm's launcher, which passed the signal on, exits 130 / 128 + N
            code = fail(line, code=0 if _under_torchrun() else code)
            if args.__dict__.get("_process_entry"):
                # "at once": the interpreter's exit would join background threads (the data prefetch, a checkpoint
                # writer) that the interrupt left mid-task, and could wait on them; nothing is left to save
                logging.shutdown()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
            return code

    return run


# -- train ------------------------------------------------------------------------------------------------
def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=None, help="YAML config file (e.g. configs/tiny.yaml)")
    p.add_argument("--nproc-per-node", type=int, default=1,
                   help="start this many processes on this machine (re-launches under torchrun)")
    p.add_argument("--list-keys", action="store_true",
                   help="print every config key with its default and description, and exit")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides, e.g. model.n_layer=6 optim.lr=1e-3 (every key: dist-llm train --list-keys; "
                        "each is described in dist_llm/config.py)")


def list_keys() -> str:
    """Every config key, its default and its one-line description (the docstring under each field)."""
    from dist_llm.config import describe_keys

    rows = describe_keys()
    width = max(len(key) for key, _, _ in rows)
    return "\n".join(f"{key:<{width}}  {default!r:<14} {about}" for key, default, about in rows)


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc; none elsewhere): torchrun's workers."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def relaunch_under_torchrun(args: argparse.Namespace) -> int:
    """`--nproc-per-node N`: run this same command as N local processes through torchrun.

    torchrun runs in a session of its own, so a Ctrl-C in the terminal reaches this process only, which hands it
    to the workers directly: the first makes every rank save at the same step boundary and exit 0 (0, so that
    torchrun neither restarts the group nor prints a failure summary), and this process then exits 130; the
    second makes them stop at once, and torchrun is ended with them. A SIGTERM or SIGHUP sent to this process (a
    scheduler, a closed terminal) is passed to the workers as SIGTERM: they save at the step boundary, and this
    process exits 128 + the signal's number."""
    cmd = [sys.executable, "-m", "dist_llm.torchrun", "--standalone", f"--nproc-per-node={args.nproc_per_node}",
           "-m", "dist_llm.train"]
    if args.config is not None:
        cmd += ["--config", str(args.config)]
    cmd += list(args.overrides)
    return run_launcher(cmd)


def run_launcher(cmd: list[str]) -> int:
    """Run the launcher `cmd` (torchrun) in a session of its own, handing signals to its workers (see
    relaunch_under_torchrun); its exit code, or 130 / 128 + the signal after a signal that saved."""
    import signal
    import subprocess

    interrupts = [0]
    terminated: list[int] = []  # a SIGTERM/SIGHUP passed on (a scheduler's preemption, a closed terminal)
    started: list[subprocess.Popen] = []

    def to_workers(signum: int, *, abort: bool = False) -> None:
        proc = started[0]
        workers = _children(proc.pid)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if abort:  # torchrun starts each worker in a session of its own: killing torchrun's group would
                    os.killpg(pid, signal.SIGKILL)  # leave them running (a worker stuck in a collective), orphaned
                else:
                    os.kill(pid, signum)
        if not workers or abort:  # still starting, or aborting: torchrun goes too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL if abort else signum)

    def on_interrupt(signum: int, frame: object) -> None:
        interrupts[0] += 1
        if started:
            to_workers(signal.SIGINT, abort=interrupts[0] > 1)

    def on_terminate(signum: int, frame: object) -> None:
        # torchrun is in a session of its own, so what a scheduler or a closing terminal sends this process
        # would not reach it: pass it on to the workers, which save at the step boundary as on SIGTERM
        terminated.append(signum)
        if started:
            to_workers(signal.SIGTERM)

    handlers = {signal.SIGINT: on_interrupt, signal.SIGTERM: on_terminate, signal.SIGHUP: on_terminate}
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}  # (before the start: a
    # handler is not inherited)
    try:
        proc = subprocess.Popen(cmd, start_new_session=True)
        started.append(proc)
        if interrupts[0] or terminated:  # a signal while it was starting
            os.killpg(proc.pid, signal.SIGINT if interrupts[0] else signal.SIGTERM)
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code in (0, -signal.SIGKILL) and (interrupts[0] or terminated):
        return 130 if interrupts[0] else 128 + terminated[0]
    return code


def check_out_dir(out_dir: Path) -> None:
    """train.out_dir must be a folder this process can write: checked before any process starts, so an unwritable
    one is one line naming the key, not a traceback from every rank. Nothing in it is touched."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out_dir, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        from dist_llm.fileio import folder_error

        raise ConfigError(f"train.out_dir: cannot write {out_dir}: {folder_error(out_dir, e)}") from None


@guarded
def cmd_train(args: argparse.Namespace) -> int:
    if args.list_keys:
        print(list_keys())
        return 0
    cfg = load_config(args.config, args.overrides)  # validate before starting any process
    check_out_dir(cfg.run_dir())
    if not _under_torchrun():  # a busy out_dir before anything is built (under torchrun rank 0 takes the lock)
        from dist_llm.train.run_lock import RUN_LOCK, held_elsewhere

        busy = held_elsewhere(cfg.run_dir() / RUN_LOCK)
        if busy:
            raise ConfigError(f"train.out_dir: {busy}")
    if args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node: must be at least 1, got {args.nproc_per_node}")
    if args.nproc_per_node > 1 and not _under_torchrun():
        from dist_llm.parallel.context import layout_degrees

        try:
            layout_degrees(cfg, args.nproc_per_node)
        except ConfigError as e:
            raise ConfigError(f"--nproc-per-node {args.nproc_per_node}: {e}") from None
        return relaunch_under_torchrun(args)

    from dist_llm.parallel.context import ParallelContext
    from dist_llm.train.trainer import Trainer

    from dist_llm.train.preemption import Terminated, terminate_raises

    setup_logging(int(os.environ.get("RANK", "0")), cfg.run_dir() / "logs")
    trainer = None
    # a SIGTERM while the process group forms, the data is prepared, the model built or loaded, or a checkpoint
    # resumed: one line and 128 + 15, as a Ctrl-C then is one line and 130 (training installs its own handlers)
    with terminate_raises():
        ctx = ParallelContext.from_config(cfg)
        stopped = False
        try:
            trainer = Trainer(cfg, ctx)
            trainer.fit()
        except (KeyboardInterrupt, Terminated):
            stopped = True
            if trainer is not None:  # (stopped between the build and training: the run lock is this run's)
                trainer.run_state.release_run_lock()
            raise
        finally:
            # not after a signal in a process of its own: a collective may be in flight here or on a peer, which
            # NCCL's destroy would wait on, and the process ends next anyway (`run`: os._exit)
            if not (stopped and args.__dict__.get("_process_entry")):
                ctx.destroy()
    # 130 after a Ctrl-C that saved a checkpoint; under torchrun 0, which its launcher turns into 130 (a failed
    # worker would make torchrun restart the group, or print a failure summary)
    return 0 if _under_torchrun() else trainer.exit_code


# -- sample -----------------------------------------------------------------------------------------------
def add_sample_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", type=Path, required=True,
                   help="a checkpoint directory, or a run directory (its newest checkpoint is used)")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="softmax temperature; 0 is greedy, always the likeliest token (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=50,
                   help="sample among the k likeliest tokens only; 0 for all of them (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed: the same seed gives the same text (default: "
                                                        "%(default)s)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: a GPU when there is one (default: %(default)s)")
    p.add_argument("--init-from", default=None, metavar="hf:DIR|ckpt:DIR",
                   help="for a LoRA/QLoRA/adapter checkpoint: where its base model is now, when it moved since "
                        "training (default: the model.init_from it was trained with)")


@guarded
def cmd_sample(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens: must be at least 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise ConfigError(f"--temperature: must be >= 0 (0 is greedy), got {args.temperature:g}")
    if args.top_k < 0:
        raise ConfigError(f"--top-k: must be >= 0 (0 keeps every token), got {args.top_k}")
    if not args.checkpoint.exists():
        raise ConfigError(f"--checkpoint: {args.checkpoint} not found")
    from dist_llm.sample import sample_text  # (after the checks: they need no torch)

    print(sample_text(args.checkpoint, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      top_k=args.top_k or None, seed=args.seed, device=args.device, init_from=args.init_from))
    return 0


# -- convert ----------------------------------------------------------------------------------------------
def add_convert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from-hf", type=Path, default=None, metavar="DIR",
                   help="a Hugging Face GPT-2, Llama-family, Mixtral or Qwen2-MoE directory, written as a dist_llm checkpoint")
    p.add_argument("--to-hf", type=Path, default=None, metavar="CKPT",
                   help="a dist_llm checkpoint (or run directory), written as a Hugging Face directory")
    p.add_argument("--to-full", type=Path, default=None, metavar="CKPT",
                   help="a dist_llm checkpoint of any layout, written as full safetensors under our names (--out "
                        "FILE.safetensors: one file; a directory: sharded past --max-shard-size)")
    p.add_argument("--out", type=Path, default=None,
                   help="the directory (file with --to-full) to write; it must not exist (a directory may be empty)")
    p.add_argument("--pad-vocab-to", type=int, default=128,
                   help="with --from-hf: model.pad_vocab_to of the checkpoint (padding rows are zero)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="with --to-hf / --to-full: the largest safetensors file, e.g. 5GB, 500MB, 2GiB; a larger "
                        "model is written as numbered shards with an index, as transformers does (default 5GB)")


@guarded
def cmd_convert(args: argparse.Namespace) -> int:
    # checked here rather than by argparse, so every mistake is one line
    if sum(x is not None for x in (args.from_hf, args.to_hf, args.to_full)) != 1:
        raise ConfigError("convert: give exactly one of --from-hf DIR, --to-hf CKPT or --to-full CKPT")
    if args.out is None:
        raise ConfigError("convert: --out is required")
    from dist_llm import convert

    if args.to_full is not None:
        out = convert.save_full(args.to_full, args.out, max_shard_size=args.max_shard_size)
    elif args.from_hf is not None:
        if args.pad_vocab_to < 1:
            raise ConfigError(f"--pad-vocab-to: must be positive, got {args.pad_vocab_to}")
        out = convert.convert_hf_to_checkpoint(args.from_hf, args.out, pad_vocab_to=args.pad_vocab_to)
    else:
        out = convert.convert_checkpoint_to_hf(args.to_hf, args.out, max_shard_size=args.max_shard_size)
    print(out)
    return 0


# -- memory -----------------------------------------------------------------------------------------------
def add_memory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=None, help="YAML config file (its layout, or --world-size)")
    p.add_argument("--world-size", type=int, default=None, help="ranks (default: dp*cp*tp*pp of the config, dp>=1)")
    p.add_argument("--params", type=float, default=None,
                   help="a parameter count: alone, the ZeRO paper's shorthand; with --config or --suggest, the config's "
                        "model (or a Llama-shaped one) scaled to this size")
    p.add_argument("--dp", type=int, default=1, help="with --params: data-parallel ranks")
    # (choices shown, checked by memory.paper_model_states: argparse's own refusal would be two lines)
    p.add_argument("--zero-stage", type=int, default=0, metavar="{0,1,2,3}",
                   help="with --params: ZeRO stage (default: %(default)s)")
    p.add_argument("--precision", default="mixed", metavar="{mixed,fp32}",
                   help="with --params: mixed (fp16/bf16 + fp32 master) or fp32 (default: %(default)s)")
    p.add_argument("--gpu-memory", default=None, help="with --suggest: the memory of one device, e.g. 80GiB")
    p.add_argument("--gpus-per-node", type=int, default=8,
                   help="with --suggest: devices per node; a group within one node communicates at its faster "
                        "bandwidth (default: %(default)s)")
    p.add_argument("--suggest", action="store_true",
                   help="rank every layout of --world-size ranks that fits --gpu-memory (by estimated step time: "
                        "compute, pipeline bubble, communication)")
    p.add_argument("--top", type=int, default=10, help="with --suggest: layouts shown (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")


@guarded
def cmd_memory(args: argparse.Namespace) -> int:
    import json

    from dist_llm import memory

    extra: dict[str, str] = {}
    # (0 was read as unset, the config's layout; a negative size reached the layout checks, which blamed
    # parallel.* keys the user never set)
    if args.world_size is not None and args.world_size < 1:
        raise ConfigError(f"memory: --world-size must be at least 1, got {args.world_size}")
    if args.params is not None and args.config is None and not args.overrides and not args.suggest:
        if args.params <= 0 or args.dp < 1:
            raise ConfigError(f"memory: --params and --dp must be positive, got {args.params:g} and {args.dp}")
        est = memory.paper_model_states(args.params, args.dp, args.zero_stage, args.precision)
        title = (f"{args.params:.4g} parameters, dp={args.dp}, ZeRO stage {args.zero_stage}, {args.precision} "
                 f"(the ZeRO paper's count, K={memory.PAPER_K}; no activations)")
    else:
        cfg, world = _memory_config(args)
        if args.suggest:
            return _suggest(args, cfg, world)
        est = memory.predict(cfg, world)
        p = cfg.parallel
        cp = f", cp={p.cp}" if p.cp > 1 else ""
        ep = f", ep={p.ep}" if cfg.model.n_experts else ""  # (an MoE model's, 1 too; a dense one has none)
        title = (f"{cfg.name}: world {world} (dp={world // (p.cp * p.tp * p.pp)}{cp}, tp={p.tp}, pp={p.pp}{ep}), zero_stage "
                 f"{p.zero_stage}, {cfg.train.precision}, checkpointing {cfg.train.activation_checkpointing}, "
                 f"micro batch {cfg.train.micro_batch_size} x {cfg.model.block_size}, {memory.assumed_device(cfg)}")
        extra = {"assumed_device": memory.assumed_device(cfg)}
    print(json.dumps(est.to_json() | extra) if args.json else memory.table(est, title))
    return 0


def _memory_config(args: argparse.Namespace) -> tuple[Config, int]:
    """The config `memory` plans for, its model scaled to --params where given, and the world size."""
    import torch

    from dist_llm.memory import suggest as memory_suggest
    from dist_llm.config import ModelConfig, validate
    from dist_llm.model import GPT

    if args.params is not None and args.config is None and not args.overrides:
        # no config: a Llama-shaped model (RoPE, RMSNorm, SwiGLU, 128-wide heads, untied 32k vocabulary, 2048
        # tokens) in bf16 (or fp32), one sequence per micro-batch, 8 per rank per step
        if args.world_size is None:
            raise ConfigError("memory: --params with --suggest needs --world-size (or a --config)")
        base = ModelConfig(n_layer=32, n_head=32, n_embd=4096, vocab_size=32000, block_size=2048, pos_emb="rope",
                           norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False)
        cfg = load_config(None, [f"train.precision={'fp32' if args.precision == 'fp32' else 'bf16'}",
                                 "train.micro_batch_size=1", f"train.global_batch_size={8 * args.world_size}"])
        cfg.model, cfg.name = base, "llama-shaped"
    else:
        cfg = load_config(args.config, args.overrides)
    if args.params is not None:
        before = cfg.model
        cfg.model = memory_suggest.scale_model(cfg.model, args.params)
        with torch.device("meta"):
            n = GPT(cfg.model).num_params()
        m = cfg.model
        print(f"model: {n / 1e9:.3g}B parameters (--params {args.params:.4g}: {cfg.name}'s architecture at n_layer="
              f"{m.n_layer}, n_embd={m.n_embd}, n_head={m.n_head}; was n_layer={before.n_layer}, n_embd="
              f"{before.n_embd})", file=sys.stderr if args.json else sys.stdout)
        if not args.suggest:
            validate(cfg)
    world = args.world_size or max(1, cfg.parallel.dp) * cfg.parallel.cp * cfg.parallel.tp * cfg.parallel.pp
    return cfg, world


def _suggest(args: argparse.Namespace, cfg: Config, world: int) -> int:
    import json

    from dist_llm import memory
    from dist_llm.memory import suggest as memory_suggest

    if args.gpu_memory is None:
        raise ConfigError("memory: --suggest needs --gpu-memory, e.g. 80GiB")
    if args.top < 1:
        raise ConfigError(f"memory: --top must be at least 1, got {args.top}")
    if args.gpus_per_node < 1:
        raise ConfigError(f"memory: --gpus-per-node must be at least 1, got {args.gpus_per_node}")
    budget = memory.parse_size(args.gpu_memory)
    plan = memory_suggest.suggest(cfg, world, budget, args.gpus_per_node)
    if args.json:
        print(json.dumps(memory_suggest.to_json(plan)))
    else:
        print(memory_suggest.format_plan(plan, top=args.top, memory_text=args.gpu_memory))
    return 0


# -- report -----------------------------------------------------------------------------------------------
def add_report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, help="a run directory (train.out_dir)")


@guarded
def cmd_report(args: argparse.Namespace) -> int:
    from dist_llm.train.report import write_report

    print(write_report(args.run_dir))
    return 0


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "train": ("train a model from a YAML config", add_train_args, cmd_train),
    "sample": ("generate text from a checkpoint", add_sample_args, cmd_sample),
    "convert": ("convert between Hugging Face directories and dist_llm checkpoints", add_convert_args, cmd_convert),
    "memory": ("predict per-rank memory for a config or a parameter count", add_memory_args, cmd_memory),
    "report": ("rebuild report.md of a run directory", add_report_args, cmd_report),
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from dist_llm import __version__

    parser = argparse.ArgumentParser(prog="dist-llm", description="Train GPT models on one or many processes.")
    parser.add_argument("--version", action="version", version=f"dist-llm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    subparsers = {}
    for name, (help_text, add_args, _) in COMMANDS.items():
        subparsers[name] = sub.add_parser(name, help=help_text)
        add_args(subparsers[name])
    return parser, subparsers


def main(argv: Sequence[str] | None = None, *, process_entry: bool = False) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, subparsers = build_parser()
    if not argv or argv[0] not in subparsers:
        parser.parse_args(argv)  # prints usage and exits 2 (or prints help and exits 0)
        return EXIT_BAD_INPUT
    # intermixed, so overrides and options may come in any order
    args = subparsers[argv[0]].parse_intermixed_args(argv[1:])
    args._process_entry = process_entry
    if process_entry:
        from dist_llm.train.preemption import abort_within

        abort_within(15.0)
    return COMMANDS[argv[0]][2](args)


def entry() -> None:
    """The `dist-llm` command (and `python -m dist_llm.cli`): `main` as a process of its own."""
    sys.exit(main(process_entry=True))


if __name__ == "__main__":
    entry()
