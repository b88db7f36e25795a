"""Hugging Face interchange: read GPT-2 and Llama-family directories into a GPT, write a GPT back out.

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
import shutil
from pathlib import Path
from typing import Any

import torch

from dist_llm.config import Config, ConfigError, ModelConfig
from dist_llm.fileio import atomic_folder, atomic_path, atomic_write_text
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


# -- writing -----------------------------------------------------------------------------------------------
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


def _base_state(model: GPT) -> dict[str, torch.Tensor]:
    if not isinstance(model, GPT):
        raise ConfigError(f"cannot export a {type(model).__name__}: expected a dist_llm GPT")
    if getattr(model.layers, "shards", 1) != 1:
        raise ConfigError("cannot export a tensor-parallel model shard: load the checkpoint into one process first")
    state = {k.replace("._orig_mod", ""): v.detach().cpu() for k, v in model.state_dict().items()}
    with torch.device("meta"):
        expected = GPT(model.cfg).state_dict()
    extra = sorted(set(state) - set(expected))
    if extra:
        raise ConfigError(f"cannot export: {extra[0]} is not a weight of the plain GPT (merge or drop PEFT weights first)")
    for name, t in expected.items():
        if name not in state or tuple(state[name].shape) != tuple(t.shape):
            raise ConfigError(f"cannot export: weight {name} is missing or not of the full shape {tuple(t.shape)}")
    return state


def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names and layouts (vocabulary padding stripped; a tied head
    only as the embedding), each a contiguous tensor of its own."""
    cfg = model.cfg
    family = export_family(cfg)
    sd = _base_state(model)
    V = cfg.vocab_size
    out: dict[str, torch.Tensor] = {}
    if family == "gpt2":
        def zeros_like_bias(name: str, rows: int) -> torch.Tensor:
            return sd[name] if name in sd else torch.zeros(rows, dtype=sd["wte.weight"].dtype)

        out["transformer.wte.weight"] = sd["wte.weight"][:V]
        out["transformer.wpe.weight"] = sd["wpe.weight"]
        pairs = [("ln_1", "ln_1", False), ("attn.c_attn", "attn.qkv", True), ("attn.c_proj", "attn.proj", True),
                 ("ln_2", "ln_2", False), ("mlp.c_fc", "mlp.up", True), ("mlp.c_proj", "mlp.down", True)]
        names = [(f"h.{i}.{theirs}", f"blocks.{i}.{ours}", conv1d) for i in range(cfg.n_layer)
                 for theirs, ours, conv1d in pairs] + [("ln_f", "ln_f", False)]
        for theirs, ours, conv1d in names:
            w = sd[f"{ours}.weight"]
            out[f"transformer.{theirs}.weight"] = w.t() if conv1d else w
            out[f"transformer.{theirs}.bias"] = zeros_like_bias(f"{ours}.bias", w.shape[0])  # GPT-2 always has biases
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = sd["lm_head.weight"][:V]
    else:
        out["model.embed_tokens.weight"] = sd["wte.weight"][:V]
        q_rows, kv_rows = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        for i in range(cfg.n_layer):
            h, o = f"model.layers.{i}", f"blocks.{i}"
            out[f"{h}.input_layernorm.weight"] = sd[f"{o}.ln_1.weight"]
            out[f"{h}.post_attention_layernorm.weight"] = sd[f"{o}.ln_2.weight"]
            for kind in ("weight", "bias") if cfg.bias else ("weight",):
                q, k, v = sd[f"{o}.attn.qkv.{kind}"].split([q_rows, kv_rows, kv_rows])
                out[f"{h}.self_attn.q_proj.{kind}"] = q
                out[f"{h}.self_attn.k_proj.{kind}"] = k
                out[f"{h}.self_attn.v_proj.{kind}"] = v
                for theirs, ours in _LLAMA_LINEARS:
                    out[f"{h}.{theirs}.{kind}"] = sd[f"{o}.{ours}.{kind}"]
        out["model.norm.weight"] = sd["ln_f.weight"]
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = sd["lm_head.weight"][:V]
    # safetensors refuses tensors that share storage (slices of qkv, the tied embedding): give each its own
    return {k: v.contiguous().clone() for k, v in out.items()}


def save_hf(model: GPT, path: str | Path) -> Path:
    """Write `config.json` and `model.safetensors` that transformers' AutoModelForCausalLM loads: GPT-2 for
    learned positions + layernorm + gelu, Llama for rope + rmsnorm + swiglu (ConfigError otherwise)."""
    from safetensors.torch import save_file

    tensors = hf_state_dict(model)  # raises before anything is written
    path = Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    dtype = next(iter(tensors.values())).dtype
    # each file whole or not at all; the weights first, so a config.json never describes weights not there
    with atomic_path(path / SAFETENSORS_FILE) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    atomic_write_text(path / CONFIG_FILE, json.dumps(hf_config(model.cfg, dtype), indent=2) + "\n")
    return path


# -- conversions between directories (`dist-llm convert`) ---------------------------------------------------
def _empty_out(out: Path) -> Path:
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out: {out} already exists and is not an empty directory")
    return out


def load_checkpoint_model(path: str | Path) -> GPT:
    """The GPT of a dist_llm checkpoint (a checkpoint directory or a run directory: its newest one), on the CPU."""
    from dist_llm.sample import load_model

    path = Path(path).expanduser()
    if not path.is_dir():
        raise ConfigError(f"--to-hf: checkpoint directory not found: {path}")
    model, _ = load_model(path, torch.device("cpu"))
    return model


def convert_checkpoint_to_hf(checkpoint: str | Path, out: str | Path) -> Path:
    """A dist_llm checkpoint -> a Hugging Face directory (config.json, model.safetensors, and the checkpoint's
    tokenizer.json when it has one), built in a temporary folder beside `out` and renamed to it at the end."""
    from dist_llm.sample import resolve_checkpoint

    out = _empty_out(Path(out))
    model = load_checkpoint_model(checkpoint)
    from dist_llm.peft import merge_into_base

    merge_into_base(model)  # a LoRA/QLoRA checkpoint exports as its merged model
    export_family(model.cfg)  # fail before creating anything
    tok = resolve_checkpoint(Path(checkpoint).expanduser()) / "tokenizer.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    # built beside `out` and renamed into place: `out` is a complete export or absent (or left empty)
    with atomic_folder(out) as building:
        save_hf(model, building)
        if tok.is_file():
            shutil.copyfile(tok, building / "tokenizer.json")
    return out


def convert_hf_to_checkpoint(hf_dir: str | Path, out: str | Path, *, pad_vocab_to: int = 128) -> Path:
    """A Hugging Face directory -> a complete dist_llm checkpoint at `out` (step 0, empty optimizer state, the
    directory's tokenizer.json copied in when it has one), which `dist-llm sample --checkpoint` and
    `model.init_from=ckpt:` read. `train.resume` reads it too, but its data-order state is that of the default
    train.seed and train.global_batch_size, which a resume then insists on: init_from is the way to fine-tune."""
    import os

    from dist_llm.data.sampler import TRAIN_STREAM
    from dist_llm.parallel.context import ParallelContext
    from dist_llm.parallel.data.base import DataParallel
    from dist_llm.train import checkpoint as ckpt
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


__all__ = ["ARCH_KEYS", "FAMILIES", "convert_checkpoint_to_hf", "convert_hf_to_checkpoint", "export_family",
           "hf_config", "hf_state_dict", "load_checkpoint_model", "load_hf", "load_hf_state_dict",
           "model_config_from_hf", "read_hf_config", "read_hf_tensors", "save_hf"]
