"""Hugging Face interchange: read GPT-2, Llama-family and MoE (Mixtral, Qwen2-MoE) directories into a GPT, and
the mapping of a GPT's names and layouts onto theirs (`export_plan`). A pure mapping: this module imports only
dist_llm.config, dist_llm.model and the mapping's leaves (hf_mapping, hf_moe, safetensors_read); the commands that
write directories (`dist-llm convert`, `save_hf`) are in dist_llm.convert.

A Hugging Face model directory is `config.json` plus the weights (`model.safetensors`, a sharded
`model.safetensors.index.json`, or the older `pytorch_model.bin` [.index.json]). Two families map onto the
GPT exactly, so logits agree to float rounding:

  gpt2                    learned positions, LayerNorm with bias, tanh GELU, fused qkv in Conv1D layers
                          (weights stored (in, out): transposed against nn.Linear), tied head
  llama, mistral, qwen2   RoPE, RMSNorm, SwiGLU, grouped-query attention, head untied unless
                          tie_word_embeddings; biases (qwen2's q/k/v, llama's attention_bias/mlp_bias)
                          become model.bias=true with the biases Hugging Face leaves out set to zero
  mixtral, qwen2_moe      the Llama attention around Mixture-of-Experts blocks (`dist_llm.hf_moe`: their
                          keys, the per-expert and the fused expert layouts, what an export writes)

RoPE: Hugging Face Llama rotates the two halves of each head (rotate_half), which is the layout of
`dist_llm.model.positions.RotaryEmbedding`, so q_proj and k_proj rows are copied as they are (no
interleaving permutation). The fused qkv rows are q (n_head*hd), k (kv*hd), v (kv*hd), in that order.

The embedding and head are padded to model.pad_vocab_to; imported padding rows are zero and exported
tensors have them stripped. `transformers` is not needed here: only `safetensors` and torch.

Reading is region by region: `hf_layout` says, for each of our parameters, which rows of which Hugging Face
tensors fill it (names and shapes only), and `HFCheckpoint` reads just the rows and columns a rank keeps
(`dist_llm.safetensors_read`: explicit reads of blocks of rows), so no rank holds the whole model
(`dist_llm.train.init_from`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from dist_llm.config import ConfigError, ModelConfig
from dist_llm.hf_mapping import HFTensor, Mapping, Piece, _bool, _float, _int, _whole
from dist_llm.hf_moe import (
    DENSE_ARCH,
    MOE_FAMILIES,
    moe_arch,
    moe_block_layout,
    moe_block_plan,
    moe_export_family,
    moe_hf_config,
)
from dist_llm.model import GPT
from dist_llm.safetensors_read import NonFinite, ShardFile, Stored, check_finite, read_header

#: ModelConfig keys that a Hugging Face config.json decides; the others (dropout, init_std, pad_vocab_to,
#: init_from) keep the value of the `base` config handed to `model_config_from_hf`.
ARCH_KEYS = ("n_layer", "n_head", "n_kv_head", "n_embd", "vocab_size", "block_size", "pos_emb", "rope_theta",
             "norm", "norm_eps", "mlp", "mlp_hidden", "bias", "qkv_bias", "tie_embeddings", "n_experts", "moe_top_k", "moe_every",
             "moe_hidden", "n_shared_experts", "moe_shared_hidden", "moe_shared_gate", "moe_router_order")

#: model_type -> family
FAMILIES = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "llama", "mixtral": "mixtral",
            "qwen2_moe": "qwen2_moe"}

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"

# Buffers some checkpoints carry that are not weights (GPT-2's causal masks, old Llama's RoPE frequencies).
_IGNORED = re.compile(r"(^|\.)attn\.(bias|masked_bias)$|(^|\.)rotary_emb\.inv_freq$")
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")


# -- reading -----------------------------------------------------------------------------------------------
def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The parsed config.json of a Hugging Face model directory (ConfigError when missing or malformed)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ConfigError(f"Hugging Face model directory not found: {path}")
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ConfigError(f"{file}: not found (a Hugging Face model directory needs config.json)")
    try:
        config = json.loads(file.read_text())
    except (ValueError, RecursionError) as e:  # (a UnicodeDecodeError is a ValueError)
        raise ConfigError(f"{file}: not valid JSON ({str(e).splitlines()[0][:200]})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{file}: expected a JSON object")
    return config


def _family(config: dict[str, Any], file: Path) -> str:
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(f"{file}: model_type {model_type!r} is not supported "
                          f"(supported: {', '.join(FAMILIES)})")
    return FAMILIES[model_type]


def _rope_theta(config: dict[str, Any], file: Path) -> float:
    """rope_theta from transformers 5's `rope_parameters` or 4.x's top-level key; only unscaled RoPE maps."""
    params = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"{file}: {key} must be an object, got {value!r}")
        kind = value.get("rope_type", value.get("type", "default"))
        if kind != "default":
            raise ConfigError(f"{file}: {key}.rope_type {kind!r} is not supported (only plain RoPE, 'default')")
    if params is not None and params.get("rope_theta") is not None:
        return _float({"rope_parameters.rope_theta": params["rope_theta"]}, file, "rope_parameters.rope_theta")
    return _float(config, file, "rope_theta", default=10000.0)


def model_config_from_hf(path: str | Path, base: ModelConfig | None = None) -> ModelConfig:
    """The ModelConfig of a Hugging Face directory: the ARCH_KEYS from its config.json, the other keys
    (pad_vocab_to, dropout, init_std, init_from) from `base` (default: ModelConfig's defaults)."""
    path = Path(path).expanduser()
    config = read_hf_config(path)
    file = path / CONFIG_FILE
    family = _family(config, file)
    arch = _gpt2_arch(config, file) if family == "gpt2" else _llama_arch(config, file)
    arch.update(moe_arch(config, file, family) if family in MOE_FAMILIES else DENSE_ARCH)
    cfg = dataclasses.replace(base or ModelConfig(), **arch)
    _check_shapes(cfg, file)
    _check_layer_count(cfg, path, file)
    return cfg


#: the block index in a Hugging Face tensor name: GPT-2's `h.3.`, Llama's and the MoE families' `layers.3.`
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


def _check_layer_count(cfg: ModelConfig, path: Path, file: Path) -> None:
    """No more layers than the weight files hold, told from their tensor names only (an index's map, the
    safetensors headers, or a mapped pytorch_model.bin): a forged count (3,000,000 for 4) would otherwise build a model of that many blocks on
    the meta device (minutes, gigabytes of module objects) before any header is compared with it."""
    try:
        weights = _weight_files(path)
    except ConfigError:
        return  # (no weight files: the reader of the weights says so)
    if weights.weight_map is not None:
        names: list[str] = list(weights.weight_map)
    elif weights.kind == "safetensors":
        names = [name for shard in weights.files for name in _safetensors_header(shard)]
    else:  # a lone pytorch_model.bin names its tensors in its pickle: mapped, not read (zip-format files)
        names = [str(name) for file in weights.files for name in _torch_weights(file)]
    held = max((int(m.group(1)) + 1 for name in names if (m := _LAYER_INDEX.search(name))), default=0)
    if cfg.n_layer > held:
        raise ConfigError(f"{file}: {cfg.n_layer} layers, but the weight files of {path} hold {held}")


def _check_shapes(cfg: ModelConfig, file: Path) -> None:
    for name in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{file}: model.{name} must be positive, got {getattr(cfg, name)}")
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(f"{file}: hidden size {cfg.n_embd} is not divisible by {cfg.n_head} heads")
    if cfg.n_head % cfg.kv_heads:
        raise ConfigError(f"{file}: {cfg.n_head} attention heads are not divisible by {cfg.kv_heads} key/value heads")
    if cfg.pos_emb == "rope" and cfg.head_dim % 2:
        raise ConfigError(f"{file}: RoPE needs an even head size, got {cfg.head_dim}")
    if cfg.pad_vocab_to <= 0:
        raise ConfigError(f"model.pad_vocab_to: must be positive, got {cfg.pad_vocab_to}")


def _gpt2_arch(c: dict[str, Any], file: Path) -> dict[str, Any]:
    act = c.get("activation_function", "gelu_new")
    if act not in _GELU_TANH:
        raise ConfigError(f"{file}: activation_function {act!r} is not supported (dist_llm's GELU is the tanh "
                          f"approximation: {' or '.join(_GELU_TANH)})")
    for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                    ("add_cross_attention", False)):
        if _bool(c, file, key, ok) != ok:
            raise ConfigError(f"{file}: {key}={c[key]!r} is not supported (dist_llm needs {str(ok).lower()})")
    n_embd = _int(c, file, "n_embd", "hidden_size")
    n_inner = _int(c, file, "n_inner", default=None)
    return {
        "n_layer": _int(c, file, "n_layer", "num_hidden_layers"),
        "n_head": _int(c, file, "n_head", "num_attention_heads"),
        "n_kv_head": 0,
        "n_embd": n_embd,
        "vocab_size": _int(c, file, "vocab_size"),
        "block_size": _int(c, file, "n_positions", "n_ctx", "max_position_embeddings"),
        "pos_emb": "learned",
        "rope_theta": ModelConfig.rope_theta,
        "norm": "layernorm",
        "norm_eps": _float(c, file, "layer_norm_epsilon", default=1e-5),
        "mlp": "gelu",
        "mlp_hidden": 0 if n_inner in (None, 4 * n_embd) else n_inner,
        "bias": True,
        "qkv_bias": False,
        "tie_embeddings": _bool(c, file, "tie_word_embeddings", True),
    }


def _llama_arch(c: dict[str, Any], file: Path) -> dict[str, Any]:
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{file}: hidden_act {act!r} is not supported (dist_llm's SwiGLU uses silu)")
    n_embd = _int(c, file, "hidden_size")
    n_head = _int(c, file, "num_attention_heads")
    n_kv = _int(c, file, "num_key_value_heads", default=n_head)
    head_dim = _int(c, file, "head_dim", default=None)
    if head_dim is not None and n_head * head_dim != n_embd:
        raise ConfigError(f"{file}: head_dim {head_dim} is not hidden_size/num_attention_heads = {n_embd}/{n_head} "
                          f"(dist_llm derives the head size from the width)")
    hidden = _int(c, file, "intermediate_size")
    block_size = _int(c, file, "max_position_embeddings")
    # A sliding window never applies to sequences no longer than it, so capping the context keeps it exact.
    window = _int(c, file, "sliding_window", default=None, minimum=0)  # (0, as Mixtral's may say: no window)
    model_type = c.get("model_type")
    sliding = _bool(c, file, "use_sliding_window", True) if model_type in ("qwen2", "qwen2_moe") else True
    if window and sliding:
        block_size = min(block_size, window)
    # (qwen2_moe: q/k/v biases, `qkv_bias` in transformers 5, always there in 4.x)
    has_attn_bias = (_bool(c, file, "qkv_bias", True) if model_type == "qwen2_moe" else
                     _bool(c, file, "attention_bias", model_type == "qwen2"))
    has_mlp_bias = _bool(c, file, "mlp_bias", False)
    return {
        "n_layer": _int(c, file, "num_hidden_layers"),
        "n_head": n_head,
        "n_kv_head": 0 if n_kv == n_head else n_kv,
        "n_embd": n_embd,
        "vocab_size": _int(c, file, "vocab_size"),
        "block_size": block_size,
        "pos_emb": "rope",
        "rope_theta": _rope_theta(c, file),
        "norm": "rmsnorm",
        "norm_eps": _float(c, file, "rms_norm_eps", default=1e-6),
        "mlp": "swiglu",
        # 0 where it is what model.mlp_hidden=0 means (the Llama rule), as a config written by hand would say
        "mlp_hidden": 0 if hidden == ModelConfig(n_embd=n_embd, mlp="swiglu").ffn_hidden else hidden,
        # Qwen2-MoE's q/k/v biases alone: qkv_bias, so that its other linears stay bias-free (and exportable)
        "bias": (has_attn_bias or has_mlp_bias) and model_type != "qwen2_moe",
        "qkv_bias": has_attn_bias and model_type == "qwen2_moe",
        "tie_embeddings": _bool(c, file, "tie_word_embeddings", False),
    }


def _load_file(file: Path, *, mmap: bool = False) -> dict[str, torch.Tensor]:
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(file), device="cpu")
        try:  # mapped, not read: only the pages of the slices taken are touched (zip-format files only)
            return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
        except RuntimeError:
            if not mmap:
                raise
            return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any reader failure is a bad file to the user
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        # torch.load's weights_only refusal opens with a paragraph on its defaults; the line naming the global says why
        reason = next((line for line in lines if "unsupported" in line.lower()), lines[0])
        raise ConfigError(f"{file}: cannot read weights ({reason})") from None


def _torch_weights(file: Path) -> dict[str, torch.Tensor]:
    """A pytorch_model.bin's tensors, mapped: a dict of floating-point tensors (as a safetensors header's dtypes
    are checked), else one line naming the file; an integer tensor was imported as a weight without a word."""
    loaded: Any = _load_file(file, mmap=True)
    if not isinstance(loaded, dict):
        raise ConfigError(f"{file}: cannot read weights (it holds a {type(loaded).__name__}, not tensors by name)")
    for key, value in loaded.items():
        if _IGNORED.search(str(key)):
            continue
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            kind = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise ConfigError(f"{file}: cannot read weights (tensor {key!r} is {kind}, not a floating-point weight)")
    return loaded


def read_weight_map(index: Path) -> dict[str, Path]:
    """Tensor name -> shard file of a weight index (`model.safetensors.index.json`): each shard a plain file
    name in the index's own directory (a path elsewhere would read another file's bytes into the model)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        items = list(weight_map.items())
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise ConfigError(f"{index}: not a weight index (no weight_map)") from None
    for name, shard in items:
        if type(name) is not str or type(shard) is not str:
            raise ConfigError(f"{index}: not a weight index (weight_map maps {name!r} to {shard!r}, not a file name)")
        if Path(shard).name != shard or shard in ("", ".", ".."):
            raise ConfigError(f"{index}: names a shard {shard[:200]!r} outside its directory")
    return {name: index.parent / shard for name, shard in items}


@dataclasses.dataclass(frozen=True)
class _WeightFiles:
    kind: str  # 'safetensors' | 'torch'
    files: list[Path]
    index: Path | None = None  # the weight index of sharded files, and its map (tensor name -> shard)
    weight_map: dict[str, Path] | None = None

    def check_place(self, key: str, file: Path) -> None:
        """That the index places tensor `key` (as the file names it) in `file`, the shard that holds it: a tensor
        the index puts elsewhere is a stale copy or a damaged index (which one to read, unknown). One it does not
        list is read, as transformers reads it (a second copy of it is refused where it is met)."""
        if self.weight_map is None or self.index is None:
            return
        placed = self.weight_map.get(key)
        if placed is not None and placed != file:
            raise ConfigError(f"{file}: holds tensor {key!r}, but {self.index.name} places it in {placed.name}")


def _weight_files(path: Path) -> _WeightFiles:
    """The weight files of a directory (safetensors preferred; shards with their index's map)."""
    if (path / SAFETENSORS_FILE).is_file():
        return _WeightFiles("safetensors", [path / SAFETENSORS_FILE])
    for kind, index_name in (("safetensors", SAFETENSORS_INDEX), ("torch", TORCH_INDEX)):
        index = path / index_name
        if index.is_file():
            weight_map = read_weight_map(index)
            shards = sorted(set(weight_map.values()))
            for shard in shards:
                if not shard.is_file():
                    raise ConfigError(f"{shard}: not found (listed in {index_name})")
            return _WeightFiles(kind, shards, index, weight_map)
    if (path / TORCH_FILE).is_file():
        return _WeightFiles("torch", [path / TORCH_FILE])
    raise ConfigError(f"{path}: no weights found (expected {SAFETENSORS_FILE}, {SAFETENSORS_INDEX} or {TORCH_FILE})")


def weight_files(path: Path) -> list[Path]:
    """The files a Hugging Face directory's weights are read from: its index (where sharded) and the shards."""
    found = _weight_files(path)
    return ([found.index] if found.index is not None else []) + found.files


def read_hf_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face directory by their Hugging Face names, read whole (shards joined): for
    comparisons and small models; loading a model reads region by region (`HFCheckpoint`)."""
    files = _weight_files(Path(path).expanduser()).files
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(_load_file(file))
    return tensors


# -- where each of our tensors comes from (pure: names and shapes only) -------------------------------------
def _stacked(parts: list[tuple[str, int]], width: int | None = None, *, optional: bool = False) -> Mapping:
    """Rows of several tensors one after the other (Llama's q, k, v -> our fused qkv)."""
    pieces, start = [], 0
    for name, rows in parts:
        pieces.append(Piece(start, rows, name, (rows, width) if width else (rows,), optional=optional))
        start += rows
    return Mapping((start, width) if width else (start,), tuple(pieces))


def _vocab(name: str, cfg: ModelConfig) -> Mapping:
    """The real vocabulary's rows, then zero rows up to cfg.padded_vocab."""
    V, C = cfg.vocab_size, cfg.n_embd
    pad = (Piece(V, cfg.padded_vocab - V),) if cfg.padded_vocab > V else ()
    return Mapping((cfg.padded_vocab, C), (Piece(0, V, name, (V, C)), *pad))


PREFIXES = {"gpt2": ("transformer.",), "llama": ("model.",), "mixtral": ("model.",), "qwen2_moe": ("model.",)}


def hf_layout(cfg: ModelConfig, family: str, *, fused: bool = False) -> dict[str, Mapping]:
    """Our parameter name -> where its rows come from in a Hugging Face checkpoint of `family` ('gpt2', 'llama',
    'mixtral', 'qwen2_moe'), for the model `cfg` describes (as `model_config_from_hf` returns it). A tied head maps
    as the embedding does. MoE blocks: `hf_moe.moe_block_layout` (`fused`: transformers 5's gate_up_proj)."""
    C, H = cfg.n_embd, cfg.ffn_hidden
    out: dict[str, Mapping] = {}
    if family == "gpt2":
        out["wte.weight"], out["wpe.weight"] = _vocab("wte.weight", cfg), _whole("wpe.weight", (cfg.block_size, C))
        linears = [("attn.c_attn", "attn.qkv", 3 * C, C), ("attn.c_proj", "attn.proj", C, C),
                   ("mlp.c_fc", "mlp.up", H, C), ("mlp.c_proj", "mlp.down", C, H)]
        for i in range(cfg.n_layer):
            h, o = f"h.{i}", f"blocks.{i}"
            for norm in ("ln_1", "ln_2"):
                out[f"{o}.{norm}.weight"], out[f"{o}.{norm}.bias"] = (_whole(f"{h}.{norm}.{k}", (C,)) for k in ("weight", "bias"))
            for theirs, ours, rows, cols in linears:  # Conv1D: (in, out) in the file
                out[f"{o}.{ours}.weight"] = _whole(f"{h}.{theirs}.weight", (rows, cols), transposed=True)
                out[f"{o}.{ours}.bias"] = _whole(f"{h}.{theirs}.bias", (rows,))
        out["ln_f.weight"], out["ln_f.bias"] = _whole("ln_f.weight", (C,)), _whole("ln_f.bias", (C,))
    else:
        q, kv = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        out["wte.weight"] = _vocab("embed_tokens.weight", cfg)
        mlp = [("mlp.gate_proj", "mlp.gate", H, C), ("mlp.up_proj", "mlp.up", H, C), ("mlp.down_proj", "mlp.down", C, H)]
        for i in range(cfg.n_layer):
            linears = [("self_attn.o_proj", "attn.proj", C, q)] + ([] if cfg.is_moe_block(i) else mlp)
            if cfg.is_moe_block(i):
                out.update(moe_block_layout(cfg, family, i, fused=fused))
            h, o = f"layers.{i}", f"blocks.{i}"
            out[f"{o}.ln_1.weight"] = _whole(f"{h}.input_layernorm.weight", (C,))
            out[f"{o}.ln_2.weight"] = _whole(f"{h}.post_attention_layernorm.weight", (C,))
            qkv = [(f"{h}.self_attn.{p}_proj.weight", n) for p, n in (("q", q), ("k", kv), ("v", kv))]
            out[f"{o}.attn.qkv.weight"] = _stacked(qkv, C)  # rotate_half layout on both sides: rows as they are
            if cfg.bias or cfg.qkv_bias:  # Hugging Face leaves out the biases a family lacks: zero in our GPT
                out[f"{o}.attn.qkv.bias"] = _stacked([(n.replace(".weight", ".bias"), r) for n, r in qkv], optional=True)
            for theirs, ours, rows, cols in linears:
                out[f"{o}.{ours}.weight"] = _whole(f"{h}.{theirs}.weight", (rows, cols))
                if cfg.bias:
                    out[f"{o}.{ours}.bias"] = _whole(f"{h}.{theirs}.bias", (rows,), optional=True)
        out["ln_f.weight"] = _whole("norm.weight", (C,))
    out["lm_head.weight"] = out["wte.weight"] if cfg.tie_embeddings else _vocab("lm_head.weight", cfg)
    return out


# -- reading regions -----------------------------------------------------------------------------------------
Rows = Sequence[tuple[int, int]]  # row ranges [a, b) of one of our tensors, in the order they are wanted


@dataclasses.dataclass
class _Entry:
    file: Path
    key: str  # the name in the file (with its prefix)
    shape: tuple[int, ...]
    tensor: torch.Tensor | None = None  # pytorch_model.bin only: the (mapped) tensor


def _safetensors_header(file: Path) -> dict[str, Stored]:
    """Tensor name -> where and how it is stored, from a safetensors file's header (no tensor data read)."""
    try:
        return read_header(file)
    except (OSError, ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{file}: cannot read weights (not a safetensors file: {e})") from None


def _overlaps(mapping: Mapping, rows: Rows) -> Iterator[tuple[tuple[int, int], Any, tuple[int, int]]]:
    """Where each asked row range meets each of the mapping's pieces: (rows of the destination, which stacks the
    ranges, the piece, its own rows)."""
    at = 0
    for a, b in rows:
        for p in mapping.pieces:
            lo, hi = max(a, p.start), min(b, p.start + p.rows)
            if lo < hi:
                yield (at + lo - a, at + hi - a), p, (lo - p.start, hi - p.start)
        at += b - a


def _read_failure(e: OSError, entry: "_Entry") -> OSError:
    """An I/O error reading `entry`'s tensor, as an OSError of the same errno naming the file and the tensor."""
    return OSError(e.errno, f"cannot read tensor {entry.key!r}: {e.strerror or _first_line(e)}", str(entry.file))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class HFCheckpoint:
    """The weights of a Hugging Face directory, read region by region under our names.

    Only headers are read on opening (every file's, so every rank finds the same errors: a missing, unexpected
    or misshapen tensor, one line naming the file and key). `read_into` then reads just the rows and columns
    asked for with explicit reads (`safetensors_read`: not a memory map, whose touched pages would stay resident
    until the file is closed): straight into the destination where it has the file's dtype and whole rows are
    read, otherwise in blocks of whole rows of at most 16 MiB converted to the destination's dtype block by block; a shard is opened the first time one of its tensors is read.
    `pytorch_model.bin` (a legacy format) cannot be sliced lazily: it is mapped whole with torch.load(mmap=True)
    (read whole where the file predates the zip format), and its slices are copied from there."""

    def __init__(self, path: str | Path, cfg: ModelConfig) -> None:
        self.path = Path(path).expanduser()
        self.family = _family(read_hf_config(self.path), self.path / CONFIG_FILE)
        self.cfg = cfg
        self.entries: dict[str, _Entry] = {}
        self._headers: dict[Path, dict[str, Stored]] = {}
        self._open: dict[Path, ShardFile] = {}
        weights = _weight_files(self.path)
        for file in weights.files:
            if weights.kind == "safetensors":
                self._headers[file] = _safetensors_header(file)
                found = {k: (s.shape, None) for k, s in self._headers[file].items()}
            else:
                found = {k: (tuple(t.shape), t) for k, t in _torch_weights(file).items()}
            for key, (shape, tensor) in found.items():
                if _IGNORED.search(key):
                    continue
                weights.check_place(key, file)
                name = self._strip(key)
                if name in self.entries:  # (a second copy, in another shard or under another prefix: which is it?)
                    first = self.entries[name]
                    also = f"{first.file}" + (f" (as {first.key!r})" if first.key != key else "")
                    raise ConfigError(f"{file}: holds tensor {key!r}, which is also in {also}: a weight is read "
                                      "from one place")
                self.entries[name] = _Entry(file, key, shape, tensor)
        # MoE experts on disk: per expert (the Hub's, save_pretrained's) or fused (transformers 5 in memory)
        fused = any(name.endswith(".experts.gate_up_proj") for name in self.entries)
        self.layout = hf_layout(cfg, self.family, fused=fused)
        self._check()

    def _strip(self, key: str) -> str:
        for prefix in PREFIXES[self.family]:  # base-model checkpoints lack it
            if key.startswith(prefix):
                return key[len(prefix):]
        return key

    def _check(self) -> None:
        needed: dict[str, Piece] = {}
        for mapping in self.layout.values():
            needed.update({p.name: p for p in mapping.pieces if p.name is not None})
        for name, piece in needed.items():
            entry = self.entries.get(name)
            if entry is None:
                if piece.optional:
                    continue
                raise ConfigError(f"{self.path}: missing tensor {name!r}")
            if entry.shape != piece.hf_shape:
                raise ConfigError(f"{entry.file}: tensor {entry.key!r} has shape {entry.shape}, the config.json "
                                  f"implies {piece.hf_shape}")
        allowed = {"lm_head.weight"} if self.cfg.tie_embeddings else set()  # some tied checkpoints store the head too
        left = sorted(set(self.entries) - set(needed) - allowed)
        if left:
            more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
            raise ConfigError(f"{self.entries[left[0]].file}: unexpected tensor {left[0]!r}{more}: not a weight of "
                              f"this architecture")

    def _shard(self, entry: _Entry) -> ShardFile:
        if entry.file not in self._open:
            try:  # (checks that the file holds every byte its header describes: a truncated file fails here)
                self._open[entry.file] = ShardFile(entry.file, self._headers[entry.file])
            except ValueError as e:  # the file is bad
                raise ConfigError(f"{entry.file}: cannot read weights for tensor {entry.key!r} "
                                  f"({_first_line(e)})") from None
            except OSError as e:  # the system failed to read it (stays an OSError: not the input's fault)
                raise _read_failure(e, entry) from None
        return self._open[entry.file]

    def read_into(self, name: str, out: torch.Tensor, rows: Rows | None = None,
                  cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Fill `out` with rows `rows` (default: all) x columns [cols) (default: all) of our tensor `name`, the
        ranges stacked in order; each region read from the files alone and converted to out's dtype."""
        mapping = self.layout[name]
        rows = [(0, mapping.shape[0])] if rows is None else rows
        if len(mapping.shape) == 3:
            return self._read_experts(name, mapping, out, rows, cols)
        c0, c1 = cols if cols is not None else (0, mapping.shape[1] if len(mapping.shape) > 1 else 0)
        want = (sum(b - a for a, b in rows), *((c1 - c0,) if len(mapping.shape) > 1 else ()))
        if tuple(out.shape) != want:
            raise ValueError(f"{name}: destination of shape {tuple(out.shape)} for a region of shape {want}")
        for (d0, d1), p, (r0, r1) in _overlaps(mapping, rows):
            dst = out[d0:d1]
            entry = self.entries.get(p.name) if p.name is not None else None
            if entry is None:  # padding, or a bias the checkpoint leaves out
                dst.zero_()
                continue
            if entry.tensor is not None:  # pytorch_model.bin, mapped
                self._copy_mapped(entry, dst, (r0, r1), (c0, c1), vector=len(mapping.shape) == 1,
                                  transposed=p.transposed)
                continue
            shard = self._shard(entry)
            try:  # (a file damaged past its header is found here, by the ranks that read that region)
                if p.transposed and len(mapping.shape) > 1:  # Conv1D (in, out): our rows are its columns
                    for i, block in shard.blocks(entry.key, (c0, c1), (r0, r1)):
                        dst[:, i : i + len(block)].copy_(block.t())
                else:  # (straight into dst where it has the file's dtype and whole rows are read)
                    shard.read_rows_into(entry.key, (r0, r1), dst, (c0, c1) if len(mapping.shape) > 1 else None)
            except NonFinite as e:  # (every block is checked as it is read: a NaN weight would skip every step)
                raise ConfigError(f"{entry.file}: {e}") from None
            except ValueError as e:  # the file is bad (cut short inside the tensor)
                raise ConfigError(f"{entry.file}: cannot read tensor {entry.key!r} ({_first_line(e)})") from None
            except OSError as e:
                raise _read_failure(e, entry) from None
        return out

    def _read_experts(self, name: str, mapping: Mapping, out: torch.Tensor, rows: Rows,
                      cols: tuple[int, int] | None) -> torch.Tensor:
        """`read_into` of a stacked expert tensor (E, in, out): `rows` are experts, each whole. Per-expert files
        give expert e's (out, in) tensor, read whole; a fused (E, x, in) one the experts' rows, of x the piece's
        `part`: either way transposed into ours."""
        want = (sum(b - a for a, b in rows), *mapping.shape[1:])
        if cols is not None or tuple(out.shape) != want:
            raise ValueError(f"{name}: destination of shape {tuple(out.shape)} for experts of shape {want}")
        for (d0, d1), p, (r0, r1) in _overlaps(mapping, rows):
            dst, entry = out[d0:d1], self.entries[p.name] if p.name else None
            part = p.part or (0, p.hf_shape[1])
            try:
                if entry is None:
                    dst.zero_()
                elif entry.tensor is not None:  # pytorch_model.bin, mapped
                    src = entry.tensor[None] if len(p.hf_shape) == 2 else entry.tensor[r0:r1, part[0]:part[1]]
                    # (one expert's (out, in) checked by its rows: as one row its mask would be the whole matrix)
                    check_finite(entry.key, entry.tensor if len(p.hf_shape) == 2 else src,
                                 0 if len(p.hf_shape) == 2 else r0)
                    dst.copy_(src.transpose(1, 2))
                elif len(p.hf_shape) == 2:  # one expert's (out, in): its rows are our columns
                    for i, block in self._shard(entry).blocks(entry.key, (0, p.hf_shape[0])):
                        dst[0, :, i : i + len(block)].copy_(block.t())
                else:
                    for i, block in self._shard(entry).blocks(entry.key, (r0, r1), part):
                        dst[i : i + len(block)].copy_(block.transpose(1, 2))
            except OSError as e:  # the system failed to read (not the file's fault): as for dense tensors
                assert entry is not None
                raise _read_failure(e, entry) from None
            except NonFinite as e:
                assert entry is not None
                raise ConfigError(f"{entry.file}: {e}") from None
            except (ValueError, RuntimeError) as e:
                assert entry is not None
                raise ConfigError(f"{entry.file}: cannot read tensor {entry.key!r} ({_first_line(e)})") from None
        return out

    @staticmethod
    def _copy_mapped(entry: _Entry, dst: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int], *,
                     vector: bool, transposed: bool) -> None:
        (r0, r1), (c0, c1), src = rows, cols, entry.tensor
        assert src is not None
        try:
            if vector:
                region, first = src[r0:r1], r0
            elif transposed:  # Conv1D (in, out): our rows are its columns
                region, first = src[c0:c1, r0:r1], c0
            else:
                region, first = src[r0:r1, c0:c1], r0
            check_finite(entry.key, region, first)  # (in pieces of the mapped file, before the copy)
            dst.copy_(region.t() if transposed and not vector else region)
        except NonFinite as e:
            raise ConfigError(f"{entry.file}: {e}") from None
        except Exception as e:  # noqa: BLE001 - any reader failure is a bad file to the user
            raise ConfigError(f"{entry.file}: cannot read tensor {entry.key!r} ({_first_line(e)})") from None

    def read(self, name: str, rows: Rows | None = None, cols: tuple[int, int] | None = None,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A new tensor of `dtype` holding a region of our tensor `name` (see `read_into`)."""
        shape = self.layout[name].shape
        n = sum(b - a for a, b in rows) if rows is not None else shape[0]
        width = ((cols[1] - cols[0]) if cols is not None else shape[1],) if len(shape) > 1 else ()
        width += tuple(shape[2:])  # (stacked experts: each whole)
        return self.read_into(name, torch.empty((n, *width), dtype=dtype), rows, cols)

    def close(self) -> None:
        for shard in self._open.values():
            shard.close()
        self._open.clear()

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_hf_state_dict(path: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The Hugging Face weights of `path` under the GPT's parameter names, full (unsharded) fp32 tensors with
    the vocabulary padded to cfg.padded_vocab by zero rows; `cfg` as `model_config_from_hf` returns it.
    The whole model at once: for a conversion or a test; training loads slices (`HFCheckpoint`)."""
    with HFCheckpoint(path, cfg) as src:
        sd = {name: src.read(name) for name in src.layout if not (cfg.tie_embeddings and name == "lm_head.weight")}
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = sd["wte.weight"]
    return sd


@torch.no_grad()
def load_hf(path: str | Path, base: ModelConfig | None = None) -> GPT:
    """A GPT (fp32, on the CPU, in eval mode) holding the weights of a Hugging Face GPT-2, Llama-family, Mixtral or
    Qwen2-MoE directory. `base` supplies the keys config.json does not decide (see `model_config_from_hf`)."""
    cfg = model_config_from_hf(path, base)
    with HFCheckpoint(path, cfg) as src:
        with torch.device("meta"):  # no random init of weights that are overwritten next
            model = GPT(cfg)
        model.to_empty(device="cpu")
        if cfg.tie_embeddings:  # to_empty makes a new tensor per module, which unties them
            model.lm_head.weight = model.wte.weight
        model.reset_buffers()  # RoPE tables, the MoE routing bias (zero): buffers, not weights
        for name, p in model.named_parameters():  # (a tied head is listed once, as wte.weight)
            if tuple(p.shape) != src.layout[name].shape:  # pragma: no cover - a mapping bug
                raise ConfigError(f"{src.path}: weight for {name} has shape {src.layout[name].shape}, the model "
                                  f"wants {tuple(p.shape)}")
            src.read_into(name, p)
    return model.eval()


# (hf_state_dict's export order of the Llama linears besides q/k/v)
_LLAMA_LINEARS = [("self_attn.o_proj", "attn.proj"), ("mlp.gate_proj", "mlp.gate"), ("mlp.up_proj", "mlp.up"),
                  ("mlp.down_proj", "mlp.down")]


# -- writing: the name and layout mapping (the files are written by dist_llm.convert) ------------------------
#: the keys each Hugging Face family fixes, with the value it needs (n_kv_head: 0 means n_head, no GQA)
_FAMILY_NEEDS: dict[str, dict[str, Any]] = {"llama": {"pos_emb": "rope", "norm": "rmsnorm", "mlp": "swiglu"},
                                            "gpt2": {"pos_emb": "learned", "norm": "layernorm", "mlp": "gelu",
                                                     "n_kv_head": 0}}
_FAMILY_LABEL = {"llama": "Llama", "gpt2": "GPT-2"}


def _family_misses(cfg: ModelConfig, family: str) -> list[str]:
    """The `model.key=value` settings `cfg` would need to export as `family` (empty: it does)."""
    needs = dict(_FAMILY_NEEDS[family])
    misses = [f"model.{k}={v}" for k, v in needs.items() if k != "n_kv_head" and getattr(cfg, k) != v]
    if "n_kv_head" in needs and cfg.kv_heads != cfg.n_head:
        misses.append("model.n_kv_head=0")  # GPT-2 has no grouped-query attention
    return misses


def export_family(cfg: ModelConfig) -> str:
    """'gpt2' or 'llama' ('mixtral' or 'qwen2_moe' for an MoE model): the Hugging Face family a model of `cfg` is
    written as. Otherwise a ConfigError that names, in one line, the keys this model has and the settings of the
    nearer family to train with instead."""
    if cfg.n_experts:
        return moe_export_family(cfg)
    options = {family: _family_misses(cfg, family) for family in ("llama", "gpt2")}
    for family, misses in options.items():
        if not misses:
            return family
    near, far = sorted(options, key=lambda f: (len(options[f]), f != "llama"))  # fewer changes first
    changed = " ".join(options["llama"] + options["gpt2"])
    has = " ".join(f"model.{k}={getattr(cfg, k)}" for k in ("pos_emb", "norm", "mlp", "n_kv_head")
                   if f"model.{k}=" in changed)
    raise ConfigError(f"{has}: exports as neither GPT-2 nor Llama; to export, train with {' '.join(options[near])} "
                      f"({_FAMILY_LABEL[near]}) or {' '.join(options[far])} ({_FAMILY_LABEL[far]})")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def hf_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The config.json of the Hugging Face model equivalent to `cfg`."""
    family = export_family(cfg)
    common = {"vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
              "initializer_range": cfg.init_std, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
              "use_cache": True, "torch_dtype": _dtype_name(dtype)}
    if family == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common,
                "n_positions": cfg.block_size, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
                "n_inner": cfg.ffn_hidden, "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
                "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False}
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
            "hidden_size": cfg.n_embd, "intermediate_size": cfg.ffn_hidden, "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps,
            # transformers 4.x reads rope_theta, 5.x rope_parameters
            "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "rope_scaling": None, "attention_bias": cfg.bias or cfg.qkv_bias, "mlp_bias": cfg.bias,
            "attention_dropout": cfg.dropout, "pretraining_tp": 1}
    if family == "llama":
        return llama
    return moe_hf_config(cfg, family, llama)


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The plain (tp=1) GPT's state dict: name -> full shape, in the module order (built on meta: no memory)."""
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in GPT(cfg).state_dict().items()}


def export_plan(cfg: ModelConfig) -> list[HFTensor]:
    """Every tensor of the Hugging Face export of a `cfg` model, by its Hugging Face name, in our module order
    (the entries of one source are adjacent, so a streaming writer loads each source once). Vocabulary
    padding is stripped; a tied head is written only as the embedding."""
    family = export_family(cfg)
    ours = weight_shapes(cfg)
    V = cfg.vocab_size
    plan: list[HFTensor] = []

    def add(name: str, source: str | None, rows: tuple[int, int] | None = None, *, transpose: bool = False,
            zeros: int = 0) -> None:
        if source is None or source not in ours:
            plan.append(HFTensor(name, (zeros,), None))
            return
        shape = list(ours[source])
        if rows is not None:
            shape[0] = rows[1] - rows[0]
        plan.append(HFTensor(name, tuple(reversed(shape)) if transpose else tuple(shape), source, rows, transpose))

    if family == "gpt2":
        add("transformer.wte.weight", "wte.weight", (0, V))
        add("transformer.wpe.weight", "wpe.weight")
        pairs = [("ln_1", "ln_1", False), ("attn.c_attn", "attn.qkv", True), ("attn.c_proj", "attn.proj", True),
                 ("ln_2", "ln_2", False), ("mlp.c_fc", "mlp.up", True), ("mlp.c_proj", "mlp.down", True)]
        names = [(f"h.{i}.{theirs}", f"blocks.{i}.{mine}", conv1d) for i in range(cfg.n_layer)
                 for theirs, mine, conv1d in pairs] + [("ln_f", "ln_f", False)]
        for theirs, mine, conv1d in names:
            add(f"transformer.{theirs}.weight", f"{mine}.weight", transpose=conv1d)
            rows = ours[f"{mine}.weight"][0]
            add(f"transformer.{theirs}.bias", f"{mine}.bias", zeros=rows)  # GPT-2 always has biases
    else:
        add("model.embed_tokens.weight", "wte.weight", (0, V))
        qkv_bias = cfg.bias or cfg.qkv_bias
        # (Llama's attention_bias covers o_proj too: zeros where only q/k/v have them; Qwen2-MoE: q/k/v only)
        o_bias, mlp_bias = qkv_bias and family == "llama", cfg.bias and family == "llama"
        q_rows, kv_rows = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        qkv_rows = {"q": (0, q_rows), "k": (q_rows, q_rows + kv_rows), "v": (q_rows + kv_rows, q_rows + 2 * kv_rows)}
        for i in range(cfg.n_layer):
            h, o = f"model.layers.{i}", f"blocks.{i}"
            add(f"{h}.input_layernorm.weight", f"{o}.ln_1.weight")
            for kind in ("weight", "bias") if qkv_bias else ("weight",):
                for p in "qkv":  # rotate_half layout on both sides: q and k rows as they are
                    add(f"{h}.self_attn.{p}_proj.{kind}", f"{o}.attn.qkv.{kind}", qkv_rows[p])
            for kind in ("weight", "bias") if o_bias else ("weight",):
                add(f"{h}.self_attn.o_proj.{kind}", f"{o}.attn.proj.{kind}", zeros=cfg.n_embd)
            add(f"{h}.post_attention_layernorm.weight", f"{o}.ln_2.weight")
            if cfg.is_moe_block(i):
                plan += moe_block_plan(cfg, family, i)
                continue
            for theirs, mine in _LLAMA_LINEARS[1:]:
                for kind in ("weight", "bias") if mlp_bias else ("weight",):
                    add(f"{h}.{theirs}.{kind}", f"{o}.{mine}.{kind}")
        add("model.norm.weight", "ln_f.weight")
    if not cfg.tie_embeddings:
        add("lm_head.weight", "lm_head.weight", (0, V))
    return plan


def hf_tensor(entry: HFTensor, source: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor `entry` describes, cut from our full tensor `source` (None for a zeros entry), contiguous in
    `dtype` (a view of `source` where it can be: a row range of a contiguous tensor copies nothing)."""
    if entry.source is None:
        return torch.zeros(entry.shape, dtype=dtype)
    assert source is not None
    t = source if entry.expert is None else source[entry.expert]
    t = t if entry.rows is None else t[entry.rows[0]:entry.rows[1]]
    if entry.transpose:
        t = t.t()
    return t.to(dtype).contiguous()


def plain_state(model: GPT) -> dict[str, torch.Tensor]:
    """A GPT's weights by the plain GPT's names (compiled blocks' `_orig_mod` dropped), detached, on the CPU;
    ConfigError if it is a tensor-parallel shard or carries weights the plain GPT has not (unmerged PEFT)."""
    if not isinstance(model, GPT):
        raise ConfigError(f"cannot export a {type(model).__name__}: expected a dist_llm GPT")
    if getattr(model.layers, "shards", 1) != 1:
        raise ConfigError("cannot export a tensor-parallel model shard: load the checkpoint into one process first")
    state = {k.replace("._orig_mod", ""): v.detach().cpu() for k, v in model.state_dict().items()}
    expected = weight_shapes(model.cfg)
    extra = sorted(set(state) - set(expected))
    if extra:
        raise ConfigError(f"cannot export: {extra[0]} is not a weight of the plain GPT (merge or drop PEFT weights first)")
    for name, shape in expected.items():
        if name not in state or tuple(state[name].shape) != shape:
            raise ConfigError(f"cannot export: weight {name} is missing or not of the full shape {shape}")
    return state


def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names and layouts (vocabulary padding stripped; a tied head
    only as the embedding), each a contiguous tensor of its own (safetensors refuses shared storage)."""
    plan = export_plan(model.cfg)
    sd = plain_state(model)
    dtype = sd["wte.weight"].dtype
    return {e.name: hf_tensor(e, None if e.source is None else sd[e.source], dtype).clone() for e in plan}


__all__ = ["ARCH_KEYS", "FAMILIES", "HFCheckpoint", "HFTensor", "Mapping", "Piece", "export_family", "export_plan",
           "hf_config", "hf_layout", "hf_state_dict", "hf_tensor", "load_hf", "load_hf_state_dict",
           "model_config_from_hf", "plain_state", "read_hf_config", "read_hf_tensors", "weight_shapes"]
