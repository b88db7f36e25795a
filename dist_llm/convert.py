"""`dist-llm convert`: dist_llm checkpoints <-> Hugging Face directories, and a checkpoint as full safetensors.

`--to-hf` and `--to-full` stream: the checkpoint's DCP index (read by `safe_metadata.load_index`, no pickle
runs) gives every tensor's full shape, so the output files and their headers are planned before anything is
read; then one model tensor at a time is read from the chunks whatever tp/pp/dp layout saved it wrote
(`convert_io.ChunkReader`: a tensor stored whole is the deserialised chunk itself, not DCP's copy of it), cut
into its Hugging Face tensors as views (Llama's q/k/v are row ranges of our fused qkv, the vocabulary padding
is dropped, GPT-2's Conv1D weights transposed), and appended to the current safetensors file
(`dist_llm.safetensors_shards`, which makes a view contiguous block of rows by block). The peak is the
largest model tensor, once. Past `--max-shard-size` (default 5GB) the output is sharded with an index, as
transformers writes it.

`--from-hf` streams the other way: DCP saves placeholders and each of our tensors is read from the Hugging
Face files (block of rows by block of rows), converted to fp32 and written, then freed before the next
(`convert_io.StreamingSavePlanner`); no optimizer state is written. Peak: the largest tensor in fp32.

A PEFT (LoRA/QLoRA) checkpoint holds only the adapters and the buffers the run trained (an MoE layer's expert
bias, written as the checkpoint holds it); its base is what `model.init_from` names. Each base
tensor is read alone (a Hugging Face directory's by lazy slices, a checkpoint's from its chunks), a
QLoRA base weight goes through NF4 and back as training saw it, and its LoRA update `alpha/r * B A` is added:
the merged model, tensor by tensor. (A PEFT run on a random base, `model.init_from` empty, rebuilds that base
whole from train.seed: a test and demo case, never a real model.)
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dist_llm.config import Config, ConfigError, ModelConfig
from dist_llm.convert_io import ChunkReader, StreamingSavePlanner, placeholders, streaming_writer
from dist_llm.fileio import atomic_folder, atomic_path, atomic_write_text
from dist_llm.hf import (
    HFCheckpoint,
    HFTensor,
    export_family,
    export_plan,
    hf_config,
    hf_tensor,
    model_config_from_hf,
    plain_state,
    weight_shapes,
)
from dist_llm.hf_tokenizer import write_hf_tokenizer
from dist_llm.host_malloc import map_large_allocations
from dist_llm.model import GPT
from dist_llm.peft.base_identity import check_base
from dist_llm.peft.expert_lora import LORA_OF
from dist_llm.safetensors_shards import (
    DEFAULT_MAX_SHARD_SIZE,
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX,
    Entry,
    parse_shard_size,
    plan_shards,
    write_file,
    write_shards,
)
from dist_llm.train import checkpoint as ckpt

EXPORT_DTYPE = torch.float32  # what the checkpoints' weights are, and what `convert` always wrote
FULL_CONFIG_KEY = "dist_llm_model_config"  # the model config, as JSON, in a --to-full file's metadata
CONFIG_FILE = "config.json"


class Weights(Protocol):
    """A model's full (tp=1) fp32 tensors by our parameter names, made one at a time."""

    def get(self, name: str) -> torch.Tensor: ...


# -- sources of tensors -------------------------------------------------------------------------------------
class CheckpointWeights:
    """The `model.*` tensors of a dist_llm checkpoint, each read alone in its full shape from the chunks any
    layout wrote of it (`convert_io.ChunkReader`: a tensor stored whole costs its own size, no second copy)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.chunks = ChunkReader(path)
        self.index = self.chunks.index  # safe_metadata.load_index: no pickle runs

    def has(self, name: str) -> bool:
        return isinstance(self.index.get(f"model.{name}"), TensorStorageMetadata)

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Every tensor of `shapes` is in the checkpoint with that full shape (before anything is written)."""
        for name, shape in shapes.items():
            if not self.has(name):
                raise ConfigError(f"{self.path}: holds no tensor model.{name} (its config.yaml describes one)")
            saved = tuple(self.index[f"model.{name}"].size)
            if saved != shape:
                raise ConfigError(f"{self.path}: model.{name} has shape {saved}, its config.yaml implies {shape}")

    def get(self, name: str) -> torch.Tensor:
        return self.chunks.read_whole(f"model.{name}").to(EXPORT_DTYPE)  # (a no-op for fp32 weights)


class HFWeights:
    """A Hugging Face directory's weights under our names, each read alone (`hf.HFCheckpoint`: headers checked
    on opening; q/k/v stacked, Conv1D transposed, padding rows and the biases Hugging Face leaves out zero),
    block of rows by block of rows: the inverse of `export_plan`."""

    def __init__(self, path: Path, cfg: ModelConfig) -> None:
        self.src = HFCheckpoint(path, cfg)
        self.shapes = weight_shapes(cfg)

    def get(self, name: str) -> torch.Tensor:
        return _read_converted(self.src, name, self.shapes[name])


class _RandomBase:
    """The seeded random base of a PEFT run without model.init_from, rebuilt whole as training built it."""

    def __init__(self, cfg: Config) -> None:
        from dist_llm.config import PeftConfig
        from dist_llm.parallel.context import ParallelContext
        from dist_llm.train.trainer import build_model

        plain = dataclasses.replace(cfg, peft=PeftConfig(), train=dataclasses.replace(
            cfg.train, compile=False, activation_checkpointing="none"))
        one = ParallelContext(rank=0, world_size=1, local_rank=0, dp=1, tp=1, pp=1, device=torch.device("cpu"))
        self.state = plain_state(build_model(plain, one))

    def get(self, name: str) -> torch.Tensor:
        return self.state[name].to(EXPORT_DTYPE)


_BLOCK_LINEAR = re.compile(r"^blocks\.\d+\.(attn\.qkv|attn\.proj|mlp\.up|mlp\.gate|mlp\.down)\.weight$")


class MergedPeft:
    """A LoRA/QLoRA checkpoint's merged weights: each base tensor (NF4 and back for QLoRA's block linears, as
    training saw it) plus its LoRA update (a stacked expert weight: each expert's own), as
    `dist_llm.peft.merge_into_base` folds them. A model tensor the checkpoint holds itself (a buffer the run
    trained: an MoE layer's expert bias) is the checkpoint's, as `sample.load_model` loads it: the base's
    would route otherwise than training did."""

    def __init__(self, adapters: CheckpointWeights, cfg: Config) -> None:
        if cfg.peft.method not in ("lora", "qlora"):
            raise ConfigError("peft.method: adapter layers cannot be folded into the base model; "
                              "export needs LoRA or QLoRA (or no PEFT)")
        self.adapters, self.cfg = adapters, cfg
        kind, _, where = cfg.model.init_from.partition(":")
        base_dir = Path(where).expanduser()
        if kind == "hf":
            self.base: Weights = HFWeights(base_dir, cfg.model)
        elif kind == "ckpt":
            if not ckpt.is_complete(base_dir):
                raise ConfigError(f"model.init_from: {base_dir} is not a complete checkpoint "
                                  f"(the base of {adapters.path})")
            ckpt.refuse_damaged(base_dir, "model.init_from")
            base = CheckpointWeights(base_dir)
            base.check(weight_shapes(cfg.model))
            self.base = base
        else:
            ckpt.check_seeded_base(adapters.path, cfg, what="convert --to-hf")
            self.base = _RandomBase(cfg)
        check_base(adapters.path, ckpt.read_json(adapters.path / ckpt.MANIFEST).get("peft_base"), cfg.model.init_from,
                   "convert --to-hf")
        # the model's own tensors among the checkpoint's (its adapter tensors have names no base weight has)
        self.trained = {name: shape for name, shape in weight_shapes(cfg.model).items() if adapters.has(name)}
        adapters.check(self.trained)

    @torch.no_grad()
    def get(self, name: str) -> torch.Tensor:
        if name in self.trained:
            return self.adapters.get(name)
        w = self.base.get(name)
        if self.cfg.peft.method == "qlora" and _BLOCK_LINEAR.match(name):
            from dist_llm.peft.nf4 import NF4Weight

            w = NF4Weight.quantize(w).dequantize(EXPORT_DTYPE)  # NF4Linear's defaults, as apply_peft quantised
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and self.adapters.has(f"{module}.lora.A"):
            a, b = self.adapters.get(f"{module}.lora.A"), self.adapters.get(f"{module}.lora.B")
            w = w + ((b @ a) * (self.cfg.peft.alpha / self.cfg.peft.rank)).to(w.dtype)  # LoRA.delta()
        owner, _, pname = name.rpartition(".")
        child = f"{owner}.{LORA_OF[pname]}" if owner.endswith(".moe.experts") and pname in LORA_OF else None
        if child is not None and self.adapters.has(f"{child}.A"):  # per expert: W_e + scale A_e B_e
            a, b = self.adapters.get(f"{child}.A"), self.adapters.get(f"{child}.B")  # (E, in, r), (E, r, out)
            w = torch.baddbmm(w, a.to(w.dtype), b.to(w.dtype), alpha=self.cfg.peft.alpha / self.cfg.peft.rank)
        return w


# -- checkpoints --------------------------------------------------------------------------------------------
def _checkpoint(path: str | Path, flag: str) -> tuple[Path, Config]:
    """The checkpoint directory `path` names (a run directory: its newest) and its config; a damaged one refused."""
    from dist_llm.sample import checked_checkpoint

    path = Path(path).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{flag}: checkpoint directory not found: {path}")
    return checked_checkpoint(path, flag)


def checkpoint_weights(path: Path, cfg: Config) -> Weights:
    """The model of the checkpoint at `path` (a PEFT one merged into its base), tensor by tensor."""
    saved = CheckpointWeights(path)
    if cfg.peft.method != "none":
        return MergedPeft(saved, cfg)
    saved.check(weight_shapes(cfg.model))
    return saved


def _hf_view(entry: HFTensor, source: torch.Tensor | None) -> torch.Tensor:
    """The tensor `entry` describes as a view of our full tensor `source` (a row range, GPT-2's Conv1D
    transpose; zeros for a zeros entry): the writer makes it contiguous block by block, never whole."""
    if entry.source is None:
        return hf_tensor(entry, None, EXPORT_DTYPE)
    assert source is not None
    t = source if entry.expert is None else source[entry.expert]
    t = t if entry.rows is None else t[entry.rows[0]:entry.rows[1]]
    return t.t() if entry.transpose else t


def _hf_stream(plan: list[HFTensor], weights: Weights) -> Iterator[tuple[str, torch.Tensor]]:
    """The export's tensors in plan order, each source loaded once (the entries of one source are adjacent)."""
    name, loaded = None, None
    for entry in plan:
        if entry.source is not None and entry.source != name:
            loaded = None  # dropped before the next is loaded
            name, loaded = entry.source, weights.get(entry.source)
        yield entry.name, _hf_view(entry, loaded)


def _check_dropped(cfg: ModelConfig, get: Callable[[str], torch.Tensor]) -> None:
    """An MoE export leaves out the tensors its family has no place for (`hf_moe.moe_dropped`): exact only while
    they are zero, so a non-zero one stops the export, named, before anything is written."""
    if not cfg.n_experts:
        return
    from dist_llm.hf_moe import LABEL, moe_dropped

    label = LABEL[export_family(cfg)]
    for name in moe_dropped(cfg, export_family(cfg)):
        if get(name).any():
            why = ("the aux-loss-free routing bias of model.moe_bias_update_rate" if name.endswith("expert_bias")
                   else "it has biases on q, k and v only: train with model.bias=false model.qkv_bias=true")
            raise ConfigError(f"cannot export as {label}: {name} is not zero and {label} has no place for it ({why})")


def _empty_out(out: Path) -> Path:
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out: {out} already exists and is not an empty directory")
    return out


def convert_checkpoint_to_hf(checkpoint: str | Path, out: str | Path, *,
                             max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """A dist_llm checkpoint of any layout -> a Hugging Face directory (config.json, model.safetensors or
    shards with their index, and the checkpoint's tokenizer.json when it has one), streamed tensor by tensor,
    built in a temporary folder beside `out` and renamed to it at the end."""
    limit = parse_shard_size(max_shard_size)
    out = _empty_out(Path(out))
    map_large_allocations()  # (host_malloc.py: ~200 MiB of freed tensors kept in the heap at 124M otherwise)
    path, cfg = _checkpoint(checkpoint, "--to-hf")
    plan = export_plan(cfg.model)  # fails (unexportable architecture) before anything is read or created
    weights = checkpoint_weights(path, cfg)
    _check_dropped(cfg.model, weights.get)
    entries = [Entry(e.name, e.shape, EXPORT_DTYPE) for e in plan]
    tok = path / "tokenizer.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    # built beside `out` and renamed into place: `out` is a complete export or absent (or left empty)
    with atomic_folder(out) as building:
        write_shards(building, entries, _hf_stream(plan, weights), max_shard_bytes=limit)
        (building / CONFIG_FILE).write_text(json.dumps(hf_config(cfg.model, EXPORT_DTYPE), indent=2) + "\n")
        write_hf_tokenizer(building, tok if tok.is_file() else None, model_max_length=cfg.model.block_size)
    return out


def save_full(checkpoint: str | Path, out: str | Path, *, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """`--to-full`: a checkpoint of any layout as full fp32 tensors under our parameter names (LoRA folded in),
    the model config in the files' metadata, streamed tensor by tensor. `out` ending in .safetensors: one file
    (refused if the model is over `max_shard_size`); otherwise a directory of model.safetensors or shards
    with their index, as transformers names them."""
    limit = parse_shard_size(max_shard_size)
    out = Path(out).expanduser()
    if out.exists():
        raise ConfigError(f"--out: {out} already exists")
    map_large_allocations()  # (host_malloc.py: ~200 MiB of freed tensors kept in the heap at 124M otherwise)
    path, cfg = _checkpoint(checkpoint, "--to-full")
    weights = checkpoint_weights(path, cfg)
    shapes = weight_shapes(cfg.model)
    entries = [Entry(name, shape, EXPORT_DTYPE) for name, shape in shapes.items()]
    meta = {FULL_CONFIG_KEY: json.dumps(dataclasses.asdict(cfg.model))}
    stream = ((name, weights.get(name)) for name in shapes)  # a tied head is loaded (and written) twice
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        if len(plan_shards(entries, limit)) > 1:
            raise ConfigError(f"--out: {out}: the model's {sum(e.nbytes for e in entries)} bytes are over "
                              f"--max-shard-size ({limit}); give a directory as --out for sharded files")
        with atomic_path(out) as tmp:
            write_file(tmp, entries, stream, meta)
    else:
        with atomic_folder(out) as building:
            write_shards(building, entries, stream, max_shard_bytes=limit, metadata=meta)
    return out


def load_full(path: str | Path) -> GPT:
    """The GPT that `save_full` wrote (one file, or a directory of one file or shards with an index)."""
    from safetensors import safe_open

    path = Path(path).expanduser()
    files = [path]
    if path.is_dir():
        index = path / SAFETENSORS_INDEX
        files = ([path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
                 if index.is_file() else [path / SAFETENSORS_FILE])
    with safe_open(str(files[0]), framework="pt") as f:
        meta = f.metadata() or {}
    if FULL_CONFIG_KEY not in meta:
        raise ConfigError(f"{files[0]}: not a dist_llm consolidated model (no model config in its metadata)")
    model = GPT(ModelConfig(**json.loads(meta[FULL_CONFIG_KEY])))
    state = model.state_dict()
    seen: set[str] = set()
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name not in state:
                        raise ConfigError(f"{file}: unexpected tensor {name!r}")
                    state[name].copy_(f.get_tensor(name))  # one tensor read at a time
                    seen.add(name)
    if set(state) - seen:
        raise ConfigError(f"{path}: missing tensor {sorted(set(state) - seen)[0]!r}")
    return model.eval()


# -- in-memory models and the other direction -----------------------------------------------------------------
def save_hf(model: GPT, path: str | Path, *, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Write `config.json` and the weights (model.safetensors, or shards and their index) that transformers'
    AutoModelForCausalLM loads: GPT-2 for learned positions + layernorm + gelu, Llama for rope + rmsnorm +
    swiglu, Mixtral or Qwen2-MoE for such a model with experts (`hf_moe`; ConfigError otherwise). Each file is
    whole or absent, the weights before config.json."""
    limit = parse_shard_size(max_shard_size)
    plan = export_plan(model.cfg)  # raises before anything is written
    sd = plain_state(model)
    _check_dropped(model.cfg, sd.__getitem__)
    dtype = sd["wte.weight"].dtype
    path = Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    entries = [Entry(e.name, e.shape, dtype) for e in plan]
    stream = ((e.name, hf_tensor(e, None if e.source is None else sd[e.source], dtype)) for e in plan)
    written = write_shards(path, entries, stream, max_shard_bytes=limit, atomic=True)
    for stale in [*path.glob("model-*-of-*.safetensors"), path / SAFETENSORS_FILE, path / SAFETENSORS_INDEX]:
        if stale.name not in written:  # an earlier export's weights in the other form: transformers would mix them
            stale.unlink(missing_ok=True)
    atomic_write_text(path / CONFIG_FILE, json.dumps(hf_config(model.cfg, dtype), indent=2) + "\n")
    return path


def load_checkpoint_model(path: str | Path) -> GPT:
    """The whole GPT of a dist_llm checkpoint (a checkpoint directory or a run directory: its newest one), on
    the CPU, PEFT modules included: for a model that fits one process (sampling, tests)."""
    from dist_llm.sample import load_model

    path = Path(path).expanduser()
    if not path.is_dir():
        raise ConfigError(f"--to-hf: checkpoint directory not found: {path}")
    model, _ = load_model(path, torch.device("cpu"))
    return model


# Rows of one of our tensors read from the Hugging Face files at a time (HFCheckpoint reads each region in
# blocks of at most safetensors_read.BLOCK_BYTES of the file's bytes).
READ_BLOCK_BYTES = 16 * 2**20


def _reading_failure(e: BaseException) -> BaseException | None:
    """The failure behind a DCP save that failed while reading its source tensors: DCP wraps what the planner's
    reads raised (an I/O error, a damaged shard, a Ctrl-C) as this rank's save failure."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException) and len(e.failures) == 1:
        (inner, _), = e.failures.values()
        if isinstance(inner, (OSError, ConfigError, KeyboardInterrupt)):
            return inner
    return None


def _read_converted(src: HFCheckpoint, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Our full tensor `name` in fp32 (q/k/v stacked, Conv1D transposed, vocabulary padding zero), read from the
    Hugging Face files block of rows by block of rows."""
    out = torch.empty(shape, dtype=EXPORT_DTYPE)
    if out.numel() == 0:
        return out
    if out.dim() == 0:
        return src.read_into(name, out)
    step = max(1, READ_BLOCK_BYTES // max(1, out[0].nbytes))
    for a in range(0, shape[0], step):
        b = min(shape[0], a + step)
        src.read_into(name, out[a:b], rows=[(a, b)])  # (explicit reads: no pages of the files stay mapped)
    return out


def convert_hf_to_checkpoint(hf_dir: str | Path, out: str | Path, *, pad_vocab_to: int = 128) -> Path:
    """A Hugging Face directory -> a complete dist_llm checkpoint at `out` (step 0, the directory's
    tokenizer.json copied in when it has one), which `dist-llm sample --checkpoint` and `model.init_from=ckpt:`
    read at any layout. Streamed: DCP writes placeholders whose data is made as each is written
    (`convert_io.StreamingSavePlanner`): one of our tensors read from the files (block of rows by block of rows,
    safetensors' lazy slices), converted to fp32, written and freed before the next; the peak is the largest
    tensor in fp32, never the model. No optimizer state is written: a model never trained has zero moments,
    and `train.resume` of this checkpoint starts a fresh optimizer (with a warning); its data-order state is
    that of the default train.seed and train.global_batch_size, which a resume then insists on: init_from is
    the way to fine-tune."""
    from dist_llm.data.sampler import TRAIN_STREAM
    from dist_llm.parallel.context import ParallelContext
    from dist_llm.precision import LossScaler

    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise ConfigError("convert runs as one process: do not start it under torchrun")
    hf_dir = Path(hf_dir).expanduser()
    out = _empty_out(Path(out))
    map_large_allocations()  # (host_malloc.py: ~200 MiB of freed tensors kept in the heap at 124M otherwise)
    model_cfg = model_config_from_hf(hf_dir, ModelConfig(pad_vocab_to=pad_vocab_to))
    tok = hf_dir / "tokenizer.json"
    cfg = Config(model=model_cfg, name=f"hf-{hf_dir.resolve().name}")
    cfg.data.tokenizer = str(tok.resolve()) if tok.is_file() else "byte"
    cfg.train.device = "cpu"
    ctx = ParallelContext.from_config(cfg)
    t = cfg.train
    train_state = {
        "step": 0, "tokens_seen": 0, "elapsed_s": 0.0,
        "sampler": {"step": 0, "seed": t.seed, "global_batch_size": t.global_batch_size, "stream": TRAIN_STREAM},
        "scaler": LossScaler(enabled=t.precision == "fp16", scale=t.loss_scale_init).state_dict(),
        "converted_from": str(hf_dir.resolve()),
    }
    shapes = weight_shapes(model_cfg)  # our state dict's names and full shapes (a tied head too, as training saves)
    there_before = set(out.iterdir()) if out.is_dir() else None  # (an empty folder the user made stays)
    with HFCheckpoint(hf_dir, model_cfg) as src:  # every header checked here, before anything is written
        planner = StreamingSavePlanner(lambda fqn: _read_converted(src, fqn.removeprefix("model."),
                                                                   shapes[fqn.removeprefix("model.")]))
        try:
            ckpt.save_checkpoint(out, state={"model": placeholders(shapes, EXPORT_DTYPE)}, train_state=train_state,
                                 cfg=cfg, ctx=ctx, extra_files={"tokenizer.json": tok} if tok.is_file() else None,
                                 planner=planner, storage_writer=streaming_writer(out))
        except BaseException as e:
            if not ckpt.is_complete(out):  # no half-written checkpoint left behind, nothing the user had removed
                if there_before is None:
                    shutil.rmtree(out, ignore_errors=True)
                else:
                    for path in set(out.iterdir()) - there_before:
                        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            inner = _reading_failure(e)
            if inner is not None:  # said as itself (one line naming the file), not as DCP's save failure
                raise inner from None
            raise
        finally:
            planner.release()
    return out


__all__ = ["CheckpointWeights", "HFWeights", "MergedPeft", "checkpoint_weights", "convert_checkpoint_to_hf",
           "convert_hf_to_checkpoint", "load_checkpoint_model", "load_full", "save_full", "save_hf"]
