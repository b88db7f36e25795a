"""Hugging Face interchange: read GPT-2 and Llama-family directories into a GPT, and the mapping of a GPT's
names and layouts onto theirs (`export_plan`). A pure mapping: this module imports only dist_llm.config and
dist_llm.model; the commands that write directories (`dist-llm convert`, `save_hf`) are in dist_llm.convert.

A Hugging Face model directory is `config.json` plus the weights (`model.safetensors`, a sharded
`model.safetensors.index.json`, or the older `pytorch_model.bin` [.index.json]). Two families map onto the
GPT exactly, so logits agree to float rounding:

  gpt2                    learned positions, LayerNorm with bias, tanh GELU, fused qkv in Conv1D layers
                          (weights stored (in, out): transposed against nn.Linear), tied head
  llama, mistral, qwen2   RoPE, RMSNorm, SwiGLU, grouped-query attention, head untied unless
                          tie_word_embeddings; biases (qwen2's q/k/v, llama's attention_bias/mlp_bias)
                          become model.bias=true with the biases Hugging Face leaves out set to zero

RoPE: Hugging Face Llama rotates the two halves of each head (rotate_half), which is the layout of
`dist_llm.model.positions.RotaryEmbedding`, so q_proj and k_proj rows are copied as they are (no
interleaving permutation). The fused qkv rows are q (n_head*hd), k (kv*hd), v (kv*hd), in that order.

The embedding and head are padded to model.pad_vocab_to; imported padding rows are zero and exported
tensors have them stripped. `transformers` is not needed here: only `safetensors` and torch.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import torch

from dist_llm.config import ConfigError, ModelConfig
from dist_llm.model import GPT

#: ModelConfig keys that a Hugging Face config.json decides; the others (dropout, init_std, pad_vocab_to,
#: init_from) keep the value of the `base` config handed to `model_config_from_hf`.
ARCH_KEYS = ("n_layer", "n_head", "n_kv_head", "n_embd", "vocab_size", "block_size", "pos_emb", "rope_theta",
             "norm", "norm_eps", "mlp", "mlp_hidden", "bias", "tie_embeddings")

#: model_type -> family
FAMILIES = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "llama"}

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
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{file}: expected a JSON object")
    return config


def _family(config: dict[str, Any], file: Path) -> str:
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(f"{file}: model_type {model_type!r} is not supported "
                          f"(supported: {', '.join(FAMILIES)})")
    return FAMILIES[model_type]


def _get(config: dict[str, Any], file: Path, *keys: str, default: Any = ...) -> Any:
    """The first of `keys` present in config (aliases), else `default`, else a ConfigError naming the key."""
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    if default is ...:
        raise ConfigError(f"{file}: missing key {keys[0]!r}")
    return default


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
        return float(params["rope_theta"])
    return float(config.get("rope_theta") or 10000.0)


def model_config_from_hf(path: str | Path, base: ModelConfig | None = None) -> ModelConfig:
    """The ModelConfig of a Hugging Face directory: the ARCH_KEYS from its config.json, the other keys
    (pad_vocab_to, dropout, init_std, init_from) from `base` (default: ModelConfig's defaults)."""
    path = Path(path).expanduser()
    config = read_hf_config(path)
    file = path / CONFIG_FILE
    family = _family(config, file)
    if family == "gpt2":
        arch = _gpt2_arch(config, file)
    else:
        arch = _llama_arch(config, file)
    cfg = dataclasses.replace(base or ModelConfig(), **arch)
    _check_shapes(cfg, file)
    return cfg


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
        if bool(c.get(key, ok)) != ok:
            raise ConfigError(f"{file}: {key}={c[key]!r} is not supported (dist_llm needs {str(ok).lower()})")
    n_embd = int(_get(c, file, "n_embd", "hidden_size"))
    n_inner = c.get("n_inner")
    return {
        "n_layer": int(_get(c, file, "n_layer", "num_hidden_layers")),
        "n_head": int(_get(c, file, "n_head", "num_attention_heads")),
        "n_kv_head": 0,
        "n_embd": n_embd,
        "vocab_size": int(_get(c, file, "vocab_size")),
        "block_size": int(_get(c, file, "n_positions", "n_ctx", "max_position_embeddings")),
        "pos_emb": "learned",
        "rope_theta": ModelConfig.rope_theta,
        "norm": "layernorm",
        "norm_eps": float(c.get("layer_norm_epsilon", 1e-5)),
        "mlp": "gelu",
        "mlp_hidden": 0 if n_inner in (None, 4 * n_embd) else int(n_inner),
        "bias": True,
        "tie_embeddings": bool(c.get("tie_word_embeddings", True)),
    }


def _llama_arch(c: dict[str, Any], file: Path) -> dict[str, Any]:
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{file}: hidden_act {act!r} is not supported (dist_llm's SwiGLU uses silu)")
    n_embd = int(_get(c, file, "hidden_size"))
    n_head = int(_get(c, file, "num_attention_heads"))
    n_kv = int(c.get("num_key_value_heads") or n_head)
    head_dim = c.get("head_dim")
    if head_dim is not None and n_head * int(head_dim) != n_embd:
        raise ConfigError(f"{file}: head_dim {head_dim} is not hidden_size/num_attention_heads = {n_embd}/{n_head} "
                          f"(dist_llm derives the head size from the width)")
    hidden = int(_get(c, file, "intermediate_size"))
    block_size = int(_get(c, file, "max_position_embeddings"))
    # A sliding window never applies to sequences no longer than it, so capping the context keeps it exact.
    window = c.get("sliding_window")
    sliding = c.get("use_sliding_window", True) if c.get("model_type") == "qwen2" else True
    if window and sliding:
        block_size = min(block_size, int(window))
    model_type = c.get("model_type")
    has_attn_bias = bool(c.get("attention_bias", model_type == "qwen2"))
    has_mlp_bias = bool(c.get("mlp_bias", False))
    return {
        "n_layer": int(_get(c, file, "num_hidden_layers")),
        "n_head": n_head,
        "n_kv_head": 0 if n_kv == n_head else n_kv,
        "n_embd": n_embd,
        "vocab_size": int(_get(c, file, "vocab_size")),
        "block_size": block_size,
        "pos_emb": "rope",
        "rope_theta": _rope_theta(c, file),
        "norm": "rmsnorm",
        "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
        "mlp": "swiglu",
        # 0 where it is what model.mlp_hidden=0 means (the Llama rule), as a config written by hand would say
        "mlp_hidden": 0 if hidden == ModelConfig(n_embd=n_embd, mlp="swiglu").ffn_hidden else hidden,
        "bias": has_attn_bias or has_mlp_bias,
        "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
    }


def _load_file(file: Path) -> dict[str, torch.Tensor]:
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(file), device="cpu")
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any reader failure is a bad file to the user
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        # torch.load's weights_only refusal opens with a paragraph on its defaults; the line naming the global says why
        reason = next((line for line in lines if "unsupported" in line.lower()), lines[0])
        raise ConfigError(f"{file}: cannot read weights ({reason})") from None


def read_hf_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face directory by their Hugging Face names (safetensors preferred, shards joined)."""
    path = Path(path).expanduser()
    if (path / SAFETENSORS_FILE).is_file():
        return _load_file(path / SAFETENSORS_FILE)
    for index_name in (SAFETENSORS_INDEX, TORCH_INDEX):
        index = path / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f"{index}: not a weight index (no weight_map)") from None
            tensors: dict[str, torch.Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                if not (path / shard).is_file():
                    raise ConfigError(f"{path / shard}: not found (listed in {index_name})")
                tensors.update(_load_file(path / shard))
            return tensors
    if (path / TORCH_FILE).is_file():
        return _load_file(path / TORCH_FILE)
    raise ConfigError(f"{path}: no weights found (expected {SAFETENSORS_FILE}, {SAFETENSORS_INDEX} or {TORCH_FILE})")


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    out = t.new_zeros((rows, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


class _Source:
    """The Hugging Face tensors, handed out once each by name, so leftovers can be reported."""

    def __init__(self, tensors: dict[str, torch.Tensor], path: Path, prefixes: tuple[str, ...]) -> None:
        self.path = path
        self.tensors: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if _IGNORED.search(name):
                continue
            for prefix in prefixes:  # e.g. "transformer." / "model.": base-model checkpoints lack it
                if name.startswith(prefix):
                    name = name[len(prefix):]
                    break
            self.tensors[name] = t
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ConfigError(f"{self.path}: missing tensor {name!r}")
        self.used.add(name)
        return self.tensors[name].float()

    def finish(self) -> None:
        left = sorted(set(self.tensors) - self.used)
        if left:
            more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
            raise ConfigError(f"{self.path}: unexpected tensor {left[0]!r}{more}: not a weight of this architecture")


def load_hf_state_dict(path: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The Hugging Face weights of `path` under the GPT's parameter names, full (unsharded) fp32 tensors with
    the vocabulary padded to cfg.padded_vocab by zero rows; `cfg` as `model_config_from_hf` returns it."""
    path = Path(path).expanduser()
    family = _family(read_hf_config(path), path / CONFIG_FILE)
    tensors = read_hf_tensors(path)
    if family == "gpt2":
        src = _Source(tensors, path, ("transformer.",))
        sd = _gpt2_to_ours(src, cfg)
    else:
        src = _Source(tensors, path, ("model.",))
        sd = _llama_to_ours(src, cfg)
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = sd["wte.weight"]
        if src.has("lm_head.weight"):
            src.take("lm_head.weight")  # some tied checkpoints store the head too
    else:
        sd["lm_head.weight"] = _pad_rows(src.take("lm_head.weight"), cfg.padded_vocab)
    src.finish()
    return sd


def _gpt2_to_ours(src: _Source, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    sd = {"wte.weight": _pad_rows(src.take("wte.weight"), cfg.padded_vocab), "wpe.weight": src.take("wpe.weight")}
    pairs = [("ln_1", "ln_1", False), ("attn.c_attn", "attn.qkv", True), ("attn.c_proj", "attn.proj", True),
             ("ln_2", "ln_2", False), ("mlp.c_fc", "mlp.up", True), ("mlp.c_proj", "mlp.down", True)]
    for i in range(cfg.n_layer):
        for theirs, ours, conv1d in pairs:
            w = src.take(f"h.{i}.{theirs}.weight")
            sd[f"blocks.{i}.{ours}.weight"] = w.t().contiguous() if conv1d else w  # Conv1D stores (in, out)
            sd[f"blocks.{i}.{ours}.bias"] = src.take(f"h.{i}.{theirs}.bias")
    sd["ln_f.weight"], sd["ln_f.bias"] = src.take("ln_f.weight"), src.take("ln_f.bias")
    return sd


_LLAMA_LINEARS = [("self_attn.o_proj", "attn.proj"), ("mlp.gate_proj", "mlp.gate"), ("mlp.up_proj", "mlp.up"),
                  ("mlp.down_proj", "mlp.down")]


def _llama_to_ours(src: _Source, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    def bias(name: str, rows: int) -> torch.Tensor:
        # Hugging Face leaves out the biases a family does not have; in a model.bias=true GPT they are zero
        return src.take(name) if src.has(name) else torch.zeros(rows)

    sd = {"wte.weight": _pad_rows(src.take("embed_tokens.weight"), cfg.padded_vocab)}
    for i in range(cfg.n_layer):
        h, o = f"layers.{i}", f"blocks.{i}"
        sd[f"{o}.ln_1.weight"] = src.take(f"{h}.input_layernorm.weight")
        sd[f"{o}.ln_2.weight"] = src.take(f"{h}.post_attention_layernorm.weight")
        qkv = [src.take(f"{h}.self_attn.{p}_proj.weight") for p in "qkv"]
        sd[f"{o}.attn.qkv.weight"] = torch.cat(qkv)  # rotate_half layout on both sides: rows as they are
        if cfg.bias:
            sd[f"{o}.attn.qkv.bias"] = torch.cat([bias(f"{h}.self_attn.{p}_proj.bias", w.shape[0])
                                                  for p, w in zip("qkv", qkv)])
        for theirs, ours in _LLAMA_LINEARS:
            w = src.take(f"{h}.{theirs}.weight")
            sd[f"{o}.{ours}.weight"] = w
            if cfg.bias:
                sd[f"{o}.{ours}.bias"] = bias(f"{h}.{theirs}.bias", w.shape[0])
    sd["ln_f.weight"] = src.take("norm.weight")
    return sd


def load_hf(path: str | Path, base: ModelConfig | None = None) -> GPT:
    """A GPT (fp32, on the CPU, in eval mode) holding the weights of a Hugging Face GPT-2 or Llama-family
    directory. `base` supplies the keys config.json does not decide (see `model_config_from_hf`)."""
    cfg = model_config_from_hf(path, base)
    state = load_hf_state_dict(path, cfg)
    with torch.device("meta"):  # no random init of weights that are overwritten next
        model = GPT(cfg)
    model.to_empty(device="cpu")
    if cfg.tie_embeddings:  # to_empty makes a new tensor per module, which unties them
        model.lm_head.weight = model.wte.weight
    if model.rope is not None:
        model.rope.reset_parameters()  # its tables are buffers, not weights
    _load_exact(model, state, Path(path))
    return model.eval()


def _load_exact(model: GPT, state: dict[str, torch.Tensor], where: Path) -> None:
    expected = model.state_dict()
    for name, t in expected.items():
        if name not in state:
            raise ConfigError(f"{where}: no weight for {name}")  # pragma: no cover - a mapping bug
        if tuple(state[name].shape) != tuple(t.shape):
            raise ConfigError(f"{where}: weight for {name} has shape {tuple(state[name].shape)}, "
                              f"the config.json implies {tuple(t.shape)}")
    model.load_state_dict(state, strict=True)


# -- writing: the name and layout mapping (the files are written by dist_llm.convert) ------------------------
def export_family(cfg: ModelConfig) -> str:
    """'gpt2' or 'llama': the Hugging Face family a model of `cfg` is written as (ConfigError naming the key
    that makes it unexportable)."""
    if cfg.pos_emb == "learned":
        if cfg.norm != "layernorm":
            raise ConfigError(f"model.norm={cfg.norm}: a model with learned positions exports as GPT-2, which needs "
                              f"layernorm")
        if cfg.mlp != "gelu":
            raise ConfigError(f"model.mlp={cfg.mlp}: a model with learned positions exports as GPT-2, which needs gelu")
        if cfg.kv_heads != cfg.n_head:
            raise ConfigError(f"model.n_kv_head={cfg.n_kv_head}: GPT-2 has no grouped-query attention")
        return "gpt2"
    if cfg.pos_emb == "rope":
        if cfg.norm != "rmsnorm":
            raise ConfigError(f"model.norm={cfg.norm}: a RoPE model exports as Llama, which needs rmsnorm")
        if cfg.mlp != "swiglu":
            raise ConfigError(f"model.mlp={cfg.mlp}: a RoPE model exports as Llama, which needs swiglu")
        return "llama"
    raise ConfigError(f"model.pos_emb={cfg.pos_emb}: no Hugging Face GPT-2 or Llama equivalent (use learned or rope)")


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
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
            "hidden_size": cfg.n_embd, "intermediate_size": cfg.ffn_hidden, "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps,
            # transformers 4.x reads rope_theta, 5.x rope_parameters
            "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "rope_scaling": None, "attention_bias": cfg.bias, "mlp_bias": cfg.bias,
            "attention_dropout": cfg.dropout, "pretraining_tp": 1}


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The plain (tp=1) GPT's state dict: name -> full shape, in the module order (built on meta: no memory)."""
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in GPT(cfg).state_dict().items()}


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One tensor of a Hugging Face export: rows [rows[0], rows[1]) of our tensor `source` (all rows when
    `rows` is None), transposed when `transpose` (GPT-2's Conv1D stores (in, out)); `source` None: zeros (a
    bias GPT-2 always has and a bias-free GPT lacks)."""

    name: str
    shape: tuple[int, ...]
    source: str | None
    rows: tuple[int, int] | None = None
    transpose: bool = False


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
        q_rows, kv_rows = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        qkv_rows = {"q": (0, q_rows), "k": (q_rows, q_rows + kv_rows), "v": (q_rows + kv_rows, q_rows + 2 * kv_rows)}
        for i in range(cfg.n_layer):
            h, o = f"model.layers.{i}", f"blocks.{i}"
            add(f"{h}.input_layernorm.weight", f"{o}.ln_1.weight")
            for kind in ("weight", "bias") if cfg.bias else ("weight",):
                for p in "qkv":  # rotate_half layout on both sides: q and k rows as they are
                    add(f"{h}.self_attn.{p}_proj.{kind}", f"{o}.attn.qkv.{kind}", qkv_rows[p])
            for kind in ("weight", "bias") if cfg.bias else ("weight",):
                add(f"{h}.self_attn.o_proj.{kind}", f"{o}.attn.proj.{kind}")
            add(f"{h}.post_attention_layernorm.weight", f"{o}.ln_2.weight")
            for theirs, mine in _LLAMA_LINEARS[1:]:
                for kind in ("weight", "bias") if cfg.bias else ("weight",):
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
    t = source if entry.rows is None else source[entry.rows[0]:entry.rows[1]]
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


__all__ = ["ARCH_KEYS", "FAMILIES", "HFTensor", "export_family", "export_plan", "hf_config", "hf_state_dict",
           "hf_tensor", "load_hf", "load_hf_state_dict", "model_config_from_hf", "plain_state", "read_hf_config",
           "read_hf_tensors", "weight_shapes"]
