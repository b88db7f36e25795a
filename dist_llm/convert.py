"""`dist-llm convert`: dist_llm checkpoints <-> Hugging Face directories, and a checkpoint as full safetensors.

`--to-hf` and `--to-full` stream: the checkpoint's DCP index (read by `safe_metadata.load_index`, no pickle
runs) gives every tensor's full shape, so the output files and their headers are planned before anything is
read; then one model tensor at a time is loaded through DCP (a one-key `dcp.load` with no process group:
DCP reassembles it from whatever tp/pp/dp shards the saving layout wrote), cut into its Hugging Face
tensors (Llama's q/k/v are row ranges of our fused qkv, the vocabulary padding is dropped, GPT-2's Conv1D
weights transposed), and appended to the current safetensors file (`dist_llm.safetensors_shards`). The peak is set by
the largest model tensor, never the model: about twice it, as DCP deserialises a stored chunk and then
copies it into the tensor asked for (a 162M-parameter model, 649 MB of weights whose largest tensor is
154 MB: 360 MB above an idle process, against 1.31 GB when the export built the model). Past
`--max-shard-size` (default 5GB) the output is sharded with an index, as transformers writes it.

A PEFT (LoRA/QLoRA) checkpoint holds only the adapters; its base is what `model.init_from` names. Each base
tensor is read alone (a Hugging Face directory's tensors lazily by name, a checkpoint's through DCP), a
QLoRA base weight goes through NF4 and back as training saw it, and its LoRA update `alpha/r * B A` is added:
the merged model, tensor by tensor. (A PEFT run on a random base, `model.init_from` empty, rebuilds that base
whole from train.seed: a test and demo case, never a real model.)
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dist_llm.config import Config, ConfigError, ModelConfig, config_from_dict
from dist_llm.fileio import atomic_folder, atomic_path, atomic_write_text
from dist_llm.hf import (HFTensor, read_weight_map, export_family, export_plan, hf_config, hf_tensor, load_hf, plain_state,
                         read_hf_config, weight_shapes)
from dist_llm.hf_tokenizer import write_hf_tokenizer
from dist_llm.model import GPT
from dist_llm.safetensors_shards import (DEFAULT_MAX_SHARD_SIZE, SAFETENSORS_FILE, SAFETENSORS_INDEX, Entry, parse_shard_size,
                             plan_shards, write_file, write_shards)
from dist_llm.train import checkpoint as ckpt
from dist_llm.train.safe_metadata import load_failure

EXPORT_DTYPE = torch.float32  # what the checkpoints' weights are, and what `convert` always wrote
FULL_CONFIG_KEY = "dist_llm_model_config"  # the model config, as JSON, in a --to-full file's metadata
CONFIG_FILE = "config.json"
TORCH_FILE, TORCH_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"  # older Hugging Face weights


class Weights(Protocol):
    """A model's full (tp=1) fp32 tensors by our parameter names, made one at a time."""

    def get(self, name: str) -> torch.Tensor: ...


# -- sources of tensors -------------------------------------------------------------------------------------
class CheckpointWeights:
    """The `model.*` tensors of a dist_llm checkpoint, each loaded alone through DCP in its full shape."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reader = ckpt.SafeReader(str(path))
        self.index = self.reader.read_metadata().state_dict_metadata  # safe_metadata.load_index: no pickle runs

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
        key = f"model.{name}"
        meta = self.index[key]
        t = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        try:  # no_dist: this one process reads every rank's chunks of the tensor, whatever the process group
            dcp.load({key: t}, storage_reader=self.reader, no_dist=True)
        except CheckpointException as e:
            raise load_failure(self.path, e) from None
        return t.to(EXPORT_DTYPE)


class HFWeights:
    """A Hugging Face directory's weights under our names, each built alone from the Hugging Face tensors the
    export plan maps it to (safetensors read lazily by name; `.bin` files memory-mapped), padded rows zero,
    the biases Hugging Face leaves out zero: the inverse of `export_plan`."""

    def __init__(self, path: Path, cfg: ModelConfig) -> None:
        read_hf_config(path)  # one line if it is gone or not a model directory
        self.path, self.cfg = path, cfg
        self.prefix = "transformer." if export_family(cfg) == "gpt2" else "model."
        self.shapes = weight_shapes(cfg)
        self.plan: dict[str, list[HFTensor]] = defaultdict(list)
        for entry in export_plan(cfg):
            if entry.source is not None:
                self.plan[entry.source].append(entry)
        self.files = self._weight_files()
        self._bins: dict[Path, dict[str, torch.Tensor]] = {}

    def _weight_files(self) -> dict[str, Path]:
        from safetensors import safe_open

        if (self.path / SAFETENSORS_FILE).is_file():
            with safe_open(str(self.path / SAFETENSORS_FILE), framework="pt") as f:
                return {name: self.path / SAFETENSORS_FILE for name in f.keys()}
        for index_name in (SAFETENSORS_INDEX, TORCH_INDEX):
            index = self.path / index_name
            if index.is_file():
                return read_weight_map(index)
        if (self.path / TORCH_FILE).is_file():
            return dict.fromkeys(self._bin(self.path / TORCH_FILE), self.path / TORCH_FILE)
        raise ConfigError(f"{self.path}: no weights found (expected {SAFETENSORS_FILE}, {SAFETENSORS_INDEX} or "
                          f"{TORCH_FILE})")

    def _bin(self, file: Path) -> dict[str, torch.Tensor]:
        if file not in self._bins:  # mapped, not read: a tensor's pages are read when it is taken
            try:
                self._bins[file] = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # noqa: BLE001 - any reader failure is a bad file to the user
                reason = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
                raise ConfigError(f"{file}: cannot read weights ({reason})") from None
        return self._bins[file]

    def _read(self, name: str) -> torch.Tensor | None:
        for key in (name, name.removeprefix(self.prefix)):  # base-model directories lack the prefix
            file = self.files.get(key)
            if file is None:
                continue
            if not file.is_file():
                raise ConfigError(f"{file}: not found (listed in {self.path}'s weight index)")
            if file.suffix != ".safetensors":
                return self._bin(file)[key]
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                return f.get_tensor(key)
        return None

    def get(self, name: str) -> torch.Tensor:
        source = "wte.weight" if name == "lm_head.weight" and self.cfg.tie_embeddings else name
        out = torch.zeros(self.shapes[name], dtype=EXPORT_DTYPE)
        for entry in self.plan[source]:
            t = self._read(entry.name)
            if t is None:
                if name.endswith(".bias"):
                    continue  # Hugging Face leaves out the biases a family does not have: zero in ours
                raise ConfigError(f"{self.path}: missing tensor {entry.name!r} (model.init_from's base)")
            if tuple(t.shape) != entry.shape:
                raise ConfigError(f"{self.path}: {entry.name} has shape {tuple(t.shape)}, expected {entry.shape}")
            t = t.to(EXPORT_DTYPE)
            rows = entry.rows or (0, out.shape[0])
            out[rows[0]:rows[1]] = t.t() if entry.transpose else t
        return out


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
    training saw it) plus its LoRA update, as `dist_llm.peft.merge_into_base` folds them."""

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
            base = CheckpointWeights(base_dir)
            base.check(weight_shapes(cfg.model))
            self.base = base
        else:
            self.base = _RandomBase(cfg)

    @torch.no_grad()
    def get(self, name: str) -> torch.Tensor:
        w = self.base.get(name)
        if self.cfg.peft.method == "qlora" and _BLOCK_LINEAR.match(name):
            from dist_llm.peft.nf4 import NF4Weight

            w = NF4Weight.quantize(w).dequantize(EXPORT_DTYPE)  # NF4Linear's defaults, as apply_peft quantised
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and self.adapters.has(f"{module}.lora.A"):
            a, b = self.adapters.get(f"{module}.lora.A"), self.adapters.get(f"{module}.lora.B")
            w = w + ((b @ a) * (self.cfg.peft.alpha / self.cfg.peft.rank)).to(w.dtype)  # LoRA.delta()
        return w


# -- checkpoints --------------------------------------------------------------------------------------------
def _checkpoint(path: str | Path, flag: str) -> tuple[Path, Config]:
    """The checkpoint directory `path` names (a run directory: its newest) and its config."""
    from dist_llm.sample import resolve_checkpoint

    path = Path(path).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{flag}: checkpoint directory not found: {path}")
    path = resolve_checkpoint(path)
    return path, config_from_dict(yaml.safe_load((path / "config.yaml").read_text()), check=False)


def checkpoint_weights(path: Path, cfg: Config) -> Weights:
    """The model of the checkpoint at `path` (a PEFT one merged into its base), tensor by tensor."""
    saved = CheckpointWeights(path)
    if cfg.peft.method != "none":
        return MergedPeft(saved, cfg)
    saved.check(weight_shapes(cfg.model))
    return saved


def _hf_stream(plan: list[HFTensor], weights: Weights) -> Iterator[tuple[str, torch.Tensor]]:
    """The export's tensors in plan order, each source loaded once (the entries of one source are adjacent)."""
    name, loaded = None, None
    for entry in plan:
        if entry.source is not None and entry.source != name:
            loaded = None  # dropped before the next is loaded
            name, loaded = entry.source, weights.get(entry.source)
        yield entry.name, hf_tensor(entry, loaded, EXPORT_DTYPE)


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
    path, cfg = _checkpoint(checkpoint, "--to-hf")
    plan = export_plan(cfg.model)  # fails (unexportable architecture) before anything is read or created
    weights = checkpoint_weights(path, cfg)
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
    swiglu (ConfigError otherwise). Each file is whole or absent, the weights before config.json."""
    limit = parse_shard_size(max_shard_size)
    plan = export_plan(model.cfg)  # raises before anything is written
    sd = plain_state(model)
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


def convert_hf_to_checkpoint(hf_dir: str | Path, out: str | Path, *, pad_vocab_to: int = 128) -> Path:
    """A Hugging Face directory -> a complete dist_llm checkpoint at `out` (step 0, empty optimizer state, the
    directory's tokenizer.json copied in when it has one), which `dist-llm sample --checkpoint` and
    `model.init_from=ckpt:` read. `train.resume` reads it too, but its data-order state is that of the default
    train.seed and train.global_batch_size, which a resume then insists on: init_from is the way to fine-tune."""
    from dist_llm.data.sampler import TRAIN_STREAM
    from dist_llm.parallel.context import ParallelContext
    from dist_llm.parallel.data.base import DataParallel
    from dist_llm.precision import LossScaler

    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise ConfigError("convert runs as one process: do not start it under torchrun")
    hf_dir = Path(hf_dir).expanduser()
    out = _empty_out(Path(out))
    model = load_hf(hf_dir, ModelConfig(pad_vocab_to=pad_vocab_to))
    tok = hf_dir / "tokenizer.json"
    cfg = Config(model=model.cfg, name=f"hf-{hf_dir.resolve().name}")
    cfg.data.tokenizer = str(tok.resolve()) if tok.is_file() else "byte"
    cfg.train.device = "cpu"
    ctx = ParallelContext.from_config(cfg)
    dp = DataParallel(model, cfg, ctx)
    t = cfg.train
    train_state = {
        "step": 0, "tokens_seen": 0, "elapsed_s": 0.0,
        "sampler": {"step": 0, "seed": t.seed, "global_batch_size": t.global_batch_size, "stream": TRAIN_STREAM},
        "scaler": LossScaler(enabled=t.precision == "fp16", scale=t.loss_scale_init).state_dict(),
        "converted_from": str(hf_dir.resolve()),
    }
    ckpt.save_checkpoint(out, state=dp.checkpoint_state(), train_state=train_state, cfg=cfg, ctx=ctx,
                         extra_files={"tokenizer.json": tok} if tok.is_file() else None)
    return out


__all__ = ["CheckpointWeights", "HFWeights", "MergedPeft", "checkpoint_weights", "convert_checkpoint_to_hf",
           "convert_hf_to_checkpoint", "load_checkpoint_model", "load_full", "save_full", "save_hf"]
