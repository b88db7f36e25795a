"""Typed configuration: nested dataclasses, YAML loading, dotted CLI overrides, one validator.

Precedence is CLI overrides > YAML file > dataclass defaults. Every rule that relates two fields lives
in `validate()`, so a bad config fails in one place with one line naming the key (`ConfigError`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import hashlib
import itertools
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml


# parallel.timeout_s's floor: a collective timeout under a second is of no use (one step's all-reduce can take
# longer), and at 1e-6 s the process group failed to form with pages of C++ traces from every rank, not one line.
MIN_TIMEOUT_S = 1.0


class ConfigError(ValueError):
    """A bad config value. Its message is one line that names the key and the rule it broke."""


@dataclass
class ModelConfig:
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention (query) heads per block."""
    n_kv_head: int = 0
    """Key/value heads: n_head for MHA, fewer for GQA, 1 for MQA; 0 means n_head."""
    n_embd: int = 128
    """Width of the residual stream."""
    vocab_size: int = 256
    """The vocabulary: at least the tokenizer's."""
    pad_vocab_to: int = 128
    """Pad the embedding and output head to a multiple of this (masked out of the loss), so the vocabulary
    splits over tensor-parallel ranks; the padded model is the same at every tp, so checkpoints move freely."""
    block_size: int = 128
    """Context length in tokens."""
    pos_emb: Literal["learned", "rope", "alibi"] = "learned"
    """Position encoding: learned absolute embeddings, rotary (RoPE) or linear biases (ALiBi)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    """Normalisation used before attention, before the MLP and at the end."""
    norm_eps: float = 1e-5
    """Epsilon of the normalisation layers."""
    mlp: Literal["gelu", "swiglu"] = "gelu"
    """MLP kind: GELU (4x wide) or SwiGLU (gate, up, down)."""
    mlp_hidden: int = 0
    """MLP hidden width; 0 means 4*n_embd for gelu and the Llama rule (2/3 of 4*n_embd, rounded up to 64) for swiglu."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches."""
    bias: bool = True
    """Biases in linear layers and LayerNorm."""
    tie_embeddings: bool = True
    """Share the token embedding with the output head."""
    qkv_bias: bool = False
    """Biases on the attention's q/k/v projection even where model.bias is false (Qwen2-MoE has these alone)."""
    init_std: float = 0.02
    """Standard deviation of the normal init; residual projections get init_std/sqrt(2*n_layer)."""
    n_experts: int = 0
    """Mixture of Experts: routed experts per MoE block; 0 = a dense model."""
    moe_top_k: int = 2
    """Experts each token is routed to."""
    moe_every: int = 1
    """Every k-th block is MoE (blocks i with i % k == k-1), the others dense; 1 = all blocks."""
    moe_hidden: int = 0
    """Hidden width of one expert; 0 means the dense MLP's (model.mlp_hidden's rule)."""
    n_shared_experts: int = 0
    """Experts every token goes through besides its routed ones (DeepSeek/Qwen MoE), as one MLP this many wide."""
    moe_shared_hidden: int = 0
    """Hidden width of the shared-expert MLP; 0 means n_shared_experts * the expert width (Qwen2-MoE sets its own)."""
    moe_shared_gate: bool = False
    """Scale the shared experts' output by sigmoid(x w), w a learned (n_embd,) vector per layer (Qwen2-MoE)."""
    moe_router_order: Literal["topk_softmax", "softmax_topk"] = "topk_softmax"
    """topk_softmax: pick the top-k logits, weights = softmax over them (Mixtral); softmax_topk: softmax over all
    experts, weights = the top-k probabilities as they are (Qwen2-MoE, DeepSeek)."""
    moe_aux_loss_coef: float = 0.01
    """Coefficient of the Switch/GShard load-balancing loss E * sum_i f_i * P_i; 0 = off."""
    moe_z_loss_coef: float = 0.0
    """Coefficient of the router z-loss, mean of logsumexp(logits)^2 (ST-MoE used 1e-3); 0 = off."""
    moe_bias_update_rate: float = 0.0
    """Aux-loss-free balancing (DeepSeek-V3): after each step bias += rate * sign(mean load - load), the bias
    added to the router scores for selection only; 0 = off."""
    moe_capacity_factor: float = 0.0
    """Each expert takes at most ceil(factor * tokens * top_k / n_experts) assignments, earlier tokens first, the
    rest dropped (they pass through the residual); 0 = dropless."""
    init_from: str = ""
    """Start from trained weights: 'hf:DIR' (a Hugging Face GPT-2, Llama, Mixtral or Qwen2-MoE directory, whose
    config.json then sets the architecture keys) or 'ckpt:DIR' (a dist_llm checkpoint of the same model); empty:
    random init."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab_size // self.pad_vocab_to) * self.pad_vocab_to

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def ffn_hidden(self) -> int:
        if self.mlp_hidden:
            return self.mlp_hidden
        if self.mlp == "swiglu":
            return 64 * -(-(2 * 4 * self.n_embd // 3) // 64)
        return 4 * self.n_embd

    @property
    def moe_expert_hidden(self) -> int:
        return self.moe_hidden or self.ffn_hidden

    @property
    def moe_shared_expert_hidden(self) -> int:
        """Width of a block's shared-expert MLP (0: none)."""
        if not self.n_shared_experts:
            return 0
        return self.moe_shared_hidden or self.n_shared_experts * self.moe_expert_hidden

    def is_moe_block(self, i: int) -> bool:
        """Whether block i is an MoE block (every moe_every-th, counting from 1)."""
        return self.n_experts > 0 and i % self.moe_every == self.moe_every - 1


@dataclass
class DataConfig:
    source: str = "stdlib"
    """'stdlib' (the running Python's standard library .py files), a text file, a directory of text files, or a .bin of tokens (uint16 or uint32, see token_dtype)."""
    tokenizer: str = "byte"
    """'byte' (256 symbols), 'bpe' (trained on the corpus to model.vocab_size), or a path to a tokenizer.json."""
    val_fraction: float = 0.05
    """Share of the corpus held out for validation."""
    cache_dir: str = ""
    """Where prepared token files live; empty means $DIST_LLM_CACHE or ~/.cache/dist_llm."""
    token_dtype: str = "auto"
    """Token file width: 'auto' (uint16 when the tokenizer has at most 65,536 tokens, else uint32), 'uint16' or 'uint32'. For a .bin source, how its tokens are stored."""
    prefetch: bool = True
    """Build the next step's batches in a background thread (in pinned memory for a GPU) while a step computes."""


@dataclass
class OptimConfig:
    lr: float = 3e-3
    """Peak learning rate, reached after warmup."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 50
    """Linear warmup steps."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices only (not to biases, norms)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""


@dataclass
class ParallelConfig:
    dp: int = 0
    """Data-parallel degree; 0 means WORLD_SIZE / (cp * tp * pp)."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree."""
    ep: int = 1
    """Expert-parallel degree: each MoE layer's experts split over ep data-parallel ranks (ep divides dp;
    consecutive dp ranks form an ep group), tokens sent to their experts by all-to-all."""
    cp: int = 1
    """Context-parallel degree: each of cp ranks holds a zigzag part of every sequence, attention by ring."""
    zero_stage: int = 0
    """0 = DDP, 1/2 = optimizer (+gradient) sharding, 3 = FSDP2."""
    pp_schedule: Literal["gpipe", "1f1b", "zb1", "interleaved"] = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, zb1 (ZB-H1: backward split into input and weight gradients), interleaved."""
    pp_virtual: int = 1
    """Model chunks per pipeline stage (pp_schedule=interleaved, 2 or more): rank r holds chunks r, r+pp, ..."""
    pp_overlap_p2p: bool | None = None
    """Post each pipeline exchange without waiting for it; a stage waits for a receive only before the computation
    that uses it (as Megatron-LM's overlap_p2p_comm for its interleaved schedule). Interleaved then sends each
    forward's and backward's messages right after it, apart, so each transfer completes behind the next
    computation; ZB-H1 runs the W's it holds back while its exchanges wait. Unset: true for interleaved and zb1
    (GPipe and 1F1B gain nothing from it: each of their exchanges holds what the next computation needs)."""
    pp_layers: list[int] = field(default_factory=list)
    """Blocks per pipeline stage; empty balances them by training FLOPs per token (blocks 6N + 12CT, the LM head and loss on the last stage, the embedding lookup ~0)."""
    sequence_parallel: bool = False
    """Shard norm/dropout regions along the sequence across tp ranks."""
    backend: Literal["native", "deepspeed"] = "native"
    """Training engine: dist_llm's own, or DeepSpeed."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MiB (DDP buckets, ZeRO-1/2 reduce-scatter buckets)."""
    grad_accum_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """ZeRO-1/2 (native): dtype gradients accumulate in across micro-steps; bf16/fp16 (= train.precision) halve
    the gradient buffer but round every micro-step's sum. DDP, FSDP2 and one process always accumulate in fp32."""
    reshard_after_forward: bool | None = None
    """ZeRO-3 (FSDP2): free gathered parameters after forward and gather again in backward. Unset: true, and
    false with pp > 1 (a stage keeps its part gathered from its first forward to its last backward of a step)."""
    pp_reduce_grads: Literal["step", "micro_batch"] = "step"
    """ZeRO-3 (FSDP2) under a pipeline: when a stage reduce-scatters its gradients. step: once, in its last
    backward (one reduce-scatter per unit and step; the stage's gradients accumulate whole in fp32 through the
    step). micro_batch: after every micro-batch's backward (m times the reduce-scatter bytes; a rank holds only
    its fp32 gradient shard, 4/dp bytes a parameter, as ZeRO-3 without a pipeline). Not with pp_schedule=zb1."""
    offload: Literal["none", "cpu"] = "none"
    """ZeRO-3: keep sharded parameters, gradients and optimizer states in CPU memory."""
    deepspeed_config: str = ""
    """backend=deepspeed: a ds_config.json merged over the one derived from this config; keys both set
    (batch sizes, ZeRO stage, precision, clipping) must agree."""
    timeout_s: float = 600.0
    """Timeout of collectives, in seconds (at least 1)."""


@dataclass
class TrainConfig:
    micro_batch_size: int = 32
    """Sequences per forward/backward on one rank."""
    global_batch_size: int = 32
    """Sequences per optimizer step over all data-parallel ranks."""
    max_steps: int = 1000
    """Optimizer steps to train for (also the length of the LR schedule)."""
    stop_after_step: int = 0
    """Stop after this step as if interrupted (the LR schedule still follows max_steps); 0 = run to max_steps."""
    max_time_s: float = 0.0
    """A time budget: the run ends (evaluating and saving as at its last step) after the first step at which this
    many seconds of training have passed (metrics' elapsed_s, resumes included; every rank stops at the same
    step). The LR schedule still follows max_steps. 0 = no limit."""
    profile_steps: str = ""
    """Steps a:b (from 1, both included) to trace with the PyTorch profiler into out_dir/profile/rank_K.json
    (Chrome trace; open in Perfetto or chrome://tracing). Empty: no profiling."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """fp32, or autocast to bf16/fp16 over fp32 master weights (fp16 with dynamic loss scaling)."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute each block ('full') or only its attention core ('selective') in backward."""
    seed: int = 1337
    """Seed of initialisation, data order and dropout."""
    log_interval: int = 10
    """Steps between metrics lines."""
    plot: bool = True
    """Draw loss.png (and moe.png for an MoE run) from metrics.jsonl at the end of the run; false leaves them out
    (a sweep of many short runs: matplotlib's drawing takes about half a second)."""
    eval_interval: int = 100
    """Steps between validation passes (and one at the end); 0 disables."""
    eval_steps: int = 10
    """Micro-batches per validation pass."""
    ckpt_interval: int = 0
    """Steps between checkpoints (and one at the end); 0 saves only at the end."""
    keep_checkpoints: int = 2
    """Complete checkpoints to keep; older ones are deleted after a newer one is complete. 0 keeps all."""
    async_checkpoint: bool = False
    """Write checkpoints in the background: training stalls only while the tensors are copied to host memory."""
    out_dir: str = ""
    """Output directory; empty means runs/<config name>."""
    resume: str = "auto"
    """'auto' (newest complete checkpoint in out_dir, if any), 'never', or a checkpoint directory."""
    compile: bool = False
    """torch.compile each transformer block."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """'auto' picks CUDA when present (LOCAL_RANK's GPU under torchrun), else CPU."""
    loss_scale_init: float = 2.0**16
    """Initial dynamic loss scale for fp16."""
    max_bad_steps: int = 20
    """Abort after this many consecutive steps with non-finite gradients (each skipped). Checked at log steps,
    so that no step waits on the host to read whether it overflowed."""
    peak_tflops: float = 0.0
    """One device's peak TFLOP/s, against which metrics.jsonl reports `mfu`; 0 measures it at start with a large
    matmul in the training dtype on a GPU, and leaves mfu out on the CPU."""
    tensorboard: bool = False
    """Also write TensorBoard event files to out_dir/tensorboard (needs the tensorboard package)."""
    wandb: Literal["off", "offline", "online"] = "off"
    """Also log to a Weights & Biases run (offline: files under out_dir/wandb, synced later; needs wandb)."""


PeftTarget = Literal["qkv", "attn_out", "mlp_up", "mlp_down", "experts_up", "experts_down"]


@dataclass
class PeftConfig:
    method: Literal["none", "lora", "adapter", "qlora"] = "none"
    """Parameter-efficient fine-tuning: the base model frozen, only LoRA or adapter weights trained;
    qlora also stores the frozen base linear weights in 4-bit NormalFloat."""
    rank: int = 8
    """LoRA rank r, or the adapters' bottleneck width."""
    alpha: float = 16.0
    """LoRA scale numerator: the update is (alpha / rank) * B A x."""
    dropout: float = 0.0
    """Dropout on the LoRA branch's input."""
    targets: list[PeftTarget] = field(default_factory=lambda: ["qkv"])
    """Linear layers that get LoRA: any of qkv, attn_out, mlp_up, mlp_down (in an MoE block: its shared expert),
    experts_up, experts_down (an MoE block's routed experts, one pair per expert; the router is never one)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    name: str = "default"
    """Name of the run; the default out_dir is runs/<name>."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def run_dir(self) -> Path:
        """Where the run writes (train.out_dir, default runs/<name>)."""
        return Path(self.train.out_dir or f"runs/{self.name}")

    def fingerprint(self) -> str:
        """Hash of the settings that define the model's shapes, to refuse loading a mismatched checkpoint."""
        shapes = {k: v for k, v in dataclasses.asdict(self.model).items() if k != "init_from"}
        if not self.model.n_experts:  # a dense model's hash stays what it was before the MoE keys existed
            shapes = {k: v for k, v in shapes.items() if k != "n_experts" and not k.startswith(("moe_", "n_shared_"))}
        for key in ("qkv_bias", "moe_shared_hidden", "moe_shared_gate"):  # (added later: unset, the hash stays)
            if not shapes.get(key, True):
                shapes.pop(key)
        return hashlib.sha256(json.dumps(shapes, sort_keys=True).encode()).hexdigest()[:16]


SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "parallel": ParallelConfig, "train": TrainConfig,
                             "peft": PeftConfig}


def all_keys() -> list[str]:
    keys = ["name"]
    for section, cls in SECTIONS.items():
        keys += [f"{section}.{f.name}" for f in fields(cls)]
    return keys


def describe_keys() -> list[tuple[str, Any, str]]:
    """(key, default, description) for every config key; the description is the docstring under the field."""
    rows: list[tuple[str, Any, str]] = [("name", Config().name, _field_docs(Config).get("name", ""))]
    defaults = Config()
    for section, cls in SECTIONS.items():
        docs = _field_docs(cls)
        for f in fields(cls):
            rows.append((f"{section}.{f.name}", getattr(getattr(defaults, section), f.name), docs.get(f.name, "")))
    return rows


def _field_docs(cls: type) -> dict[str, str]:
    """A dataclass's field docstrings (a string statement right after the field), read from its source."""
    import ast
    import inspect

    body = ast.parse(inspect.getsource(cls)).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for field_stmt, after in itertools.pairwise(body):
        if (isinstance(field_stmt, ast.AnnAssign) and isinstance(field_stmt.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[field_stmt.target.id] = " ".join(after.value.value.split())
    return docs


def _unknown(key: str) -> ConfigError:
    """An unknown key with the closest known one; a misspelled section is matched as a section first (`modle.n_layer`
    means model.n_layer, not the key nearest as a whole string)."""
    keys = all_keys()
    section, _, name = key.partition(".")
    if name and section not in SECTIONS:
        near = difflib.get_close_matches(section, list(SECTIONS), n=1, cutoff=0.6)
        if near:
            in_section = [k for k in keys if k.startswith(f"{near[0]}.")]
            close = difflib.get_close_matches(f"{near[0]}.{name}", in_section, n=1, cutoff=0.5)
            hint = f"'{close[0]}'" if close else f"a key of section '{near[0]}'"
            return ConfigError(f"unknown config key '{key}' (did you mean {hint}?)")
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return ConfigError(f"unknown config key '{key}'{hint}")


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check `value` against a field's annotation, converting where it is lossless (int -> float)."""
    hints = annotation
    origin = get_origin(hints)
    if origin is Literal:
        choices = get_args(hints)
        if value not in choices:
            raise ConfigError(f"{key}: must be one of {'|'.join(map(str, choices))}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        for arm in get_args(hints):
            if arm is type(None) and value is None:
                return None
        arms = [a for a in get_args(hints) if a is not type(None)]
        return _coerce(key, value, arms[0])
    if origin is list:
        (item,) = get_args(hints)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(key, v, item) for v in value]
    if hints is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if hints is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):  # YAML 1.1 reads 1e3 (no dot) as a string
            with contextlib.suppress(ValueError):
                return int(value, 10)  # "9007199254740993": exact, not through a float
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, float) and value.is_integer():  # 1e3 or 1000.0: exactly an integer
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if hints is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if hints is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {hints!r}")  # pragma: no cover - a programming error


@functools.cache
def _field_types(cls: type) -> typing.Mapping[str, Any]:
    # (each config key looked up resolves the section's annotations: ~1 ms a call uncached, hundreds a load)
    return types.MappingProxyType(typing.get_type_hints(cls))  # shared between calls: read-only


def _apply(cfg: Config, key: str, value: Any) -> None:
    if key == "name":
        cfg.name = _coerce(key, value, str)
        return
    section, _, name = key.partition(".")
    if section not in SECTIONS or not name or "." in name:
        raise _unknown(key)
    types_ = _field_types(SECTIONS[section])
    if name not in types_:
        raise _unknown(key)
    setattr(getattr(cfg, section), name, _coerce(key, value, types_[name]))


def _flatten(tree: Any, where: str = "") -> list[tuple[str, Any]]:
    if not isinstance(tree, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping of keys, got {tree!r}")
    out = []
    for k, v in tree.items():
        key = f"{where}.{k}" if where else str(k)
        if isinstance(v, dict) and key in SECTIONS:
            out += _flatten(v, key)
        elif key in SECTIONS:
            raise ConfigError(f"{key}: expected a mapping of keys, got {v!r}")
        else:
            out.append((key, v))
    return out


class _YAMLLoader(yaml.SafeLoader):
    """YAML 1.1 without its base-60 numbers, which would read `train.profile_steps=2:3` as the integer 123."""


_YAMLLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_YAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"))
_YAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
               r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


def read_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_YAMLLoader)  # noqa: S506 - a SafeLoader


def parse_override(text: str) -> tuple[str, Any]:
    """`section.key=value`, the value read as YAML (so 3e-4, true, [1, 2] and strings all work)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"override '{text}': expected section.key=value")
    try:
        value = read_yaml(raw) if raw != "" else ""
    except (yaml.YAMLError, RecursionError):
        value = raw
    return key.strip(), value


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the YAML file, then the overrides; validated. Raises ConfigError on bad input."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if p.is_dir():
            found = ", ".join(sorted(q.name for q in p.glob("*.y*ml"))[:6]) or "none there"
            raise ConfigError(f"--config: {p} is a directory; give one of its YAML files ({found})")
        if not p.is_file():
            raise ConfigError(f"--config: file not found: {p}")
        try:
            tree = read_yaml(p.read_text()) or {}
        except RecursionError:
            raise ConfigError(f"--config: {p} is nested too deeply to be a config") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            why = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(f"--config: {p} is not valid YAML{at}: {why}") from None
        if "name" not in tree:
            cfg.name = p.stem
        for key, value in _flatten(tree):
            _apply(cfg, key, value)
    for text in overrides:
        _apply(cfg, *parse_override(text))
    _resolve_init_from(cfg)
    validate(cfg)
    return cfg


def _resolve_init_from(cfg: Config) -> None:
    """model.init_from as an absolute path: it is saved in config.yaml and the manifest, and read again by
    `dist-llm sample` or a resume, which may run from another directory."""
    cfg.model.init_from = resolved_init_from(cfg.model.init_from)


def resolved_init_from(spec: str) -> str:
    """`hf:DIR` / `ckpt:DIR` with DIR made absolute (relative to the working directory); anything else as is."""
    kind, sep, where = spec.partition(":")
    if sep and kind in ("hf", "ckpt") and where:
        return f"{kind}:{Path(where).expanduser().resolve()}"
    return spec


def config_from_dict(tree: dict[str, Any], *, check: bool = True) -> Config:
    """Rebuild a Config saved with `to_dict()` (e.g. from a checkpoint). `check=False` skips the checks
    that concern training (files that may since have moved) for a config used only to rebuild the model."""
    cfg = Config()
    for key, value in _flatten(tree):
        _apply(cfg, key, value)
    if check:
        validate(cfg)
    return cfg


def _positive(cfg: Config, *keys: str) -> None:
    for key in keys:
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) <= 0:
            raise ConfigError(f"{key}: must be positive, got {getattr(getattr(cfg, section), name)}")


def _non_negative(cfg: Config, *keys: str) -> None:
    for key in keys:
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) < 0:
            raise ConfigError(f"{key}: must be >= 0, got {getattr(getattr(cfg, section), name)}")


def parse_steps(text: str) -> tuple[int, int] | None:
    """"a:b" -> (a, b), steps counted from 1 as in metrics.jsonl, both included; "" -> None. ValueError else."""
    if not text:
        return None
    first, sep, last = str(text).partition(":")
    try:
        a, b = int(first), int(last if sep else first)
    except ValueError:
        a = b = 0
    if not 1 <= a <= b:
        raise ValueError(f"expected a:b with 1 <= a <= b, got {text!r}")
    return a, b


def validate(cfg: Config) -> None:
    """Every rule between fields, in one place. Rules that need the world size live in the ParallelContext."""
    m, d, o, p, t = cfg.model, cfg.data, cfg.optim, cfg.parallel, cfg.train
    for section, cls in SECTIONS.items():  # nan and inf pass every comparison below unnoticed
        for name, annotation in _field_types(cls).items():
            value = getattr(getattr(cfg, section), name)
            if annotation is float and not math.isfinite(value):
                raise ConfigError(f"{section}.{name}: must be a finite number, got {value}")
    _positive(cfg, "model.n_layer", "model.n_head", "model.pad_vocab_to", "model.n_embd", "model.vocab_size", "model.block_size",
              "model.rope_theta", "model.norm_eps", "model.init_std",
              "train.micro_batch_size", "train.global_batch_size", "train.max_steps", "train.log_interval",
              "train.eval_steps", "train.loss_scale_init", "train.max_bad_steps", "parallel.tp", "parallel.pp", "parallel.cp",
              "parallel.timeout_s", "optim.lr")
    if p.timeout_s < MIN_TIMEOUT_S:
        raise ConfigError(f"parallel.timeout_s: must be at least {MIN_TIMEOUT_S:g} second, got {p.timeout_s:g} (the "
                          f"time a collective may wait for every rank)")
    _non_negative(cfg, "model.n_kv_head", "model.mlp_hidden", "optim.min_lr", "optim.warmup_steps",
                  "optim.weight_decay", "optim.grad_clip", "optim.eps", "parallel.dp", "train.eval_interval", "train.peak_tflops",
                  "train.ckpt_interval", "train.keep_checkpoints", "train.stop_after_step", "train.seed",
                  "train.max_time_s")
    if t.seed >= 2**63:
        raise ConfigError(f"train.seed: must be below 2**63, got {t.seed}")
    if m.n_embd % m.n_head:
        raise ConfigError(f"model.n_embd: {m.n_embd} is not divisible by model.n_head={m.n_head}")
    if m.n_head % m.kv_heads:
        raise ConfigError(f"model.n_head: {m.n_head} is not divisible by model.n_kv_head={m.kv_heads}")
    if m.pos_emb == "rope" and m.head_dim % 2:
        raise ConfigError(f"model.pos_emb: rope needs an even head size, got n_embd/n_head={m.head_dim}")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout: must be in [0, 1), got {m.dropout}")
    if not 0.0 < d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction: must be in (0, 1), got {d.val_fraction}")
    if not d.source.strip():  # Path("") is ".": an empty value would train on whatever folder the run started in
        raise ConfigError("data.source: is empty; give stdlib, a text file, a folder or a .bin/.jsonl file "
                          "(. for the current folder)")
    if d.source != "stdlib" and not Path(d.source).expanduser().exists():
        raise ConfigError(f"data.source: file or directory not found: {d.source}")
    if d.tokenizer not in ("byte", "bpe") and not Path(d.tokenizer).expanduser().is_file():
        raise ConfigError(f"data.tokenizer: must be byte, bpe or a tokenizer.json file; not found: {d.tokenizer}")
    if d.token_dtype not in ("auto", "uint16", "uint32"):
        raise ConfigError(f"data.token_dtype: must be auto, uint16 or uint32, got {d.token_dtype!r}")
    if d.tokenizer == "byte" and m.vocab_size < 256:
        raise ConfigError(f"model.vocab_size: the byte tokenizer needs at least 256, got {m.vocab_size}")
    for key, beta in (("optim.beta1", o.beta1), ("optim.beta2", o.beta2)):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"{key}: must be in [0, 1), got {beta}")
    if o.min_lr > o.lr:
        raise ConfigError(f"optim.min_lr: {o.min_lr} is above optim.lr={o.lr}")
    dp = p.dp or 1
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(
            f"train.global_batch_size: {t.global_batch_size} is not divisible by "
            f"train.micro_batch_size * parallel.dp = {t.micro_batch_size} * {dp}")
    if t.resume not in ("auto", "never") and not Path(t.resume).expanduser().is_dir():
        raise ConfigError(f"train.resume: must be auto, never or a checkpoint directory; not found: {t.resume}")
    try:
        parse_steps(t.profile_steps)
    except ValueError as e:
        raise ConfigError(f"train.profile_steps: {e}") from None
    if t.stop_after_step > t.max_steps:
        raise ConfigError(f"train.stop_after_step: {t.stop_after_step} is beyond train.max_steps={t.max_steps}")
    if p.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero_stage: must be 0, 1, 2 or 3, got {p.zero_stage}")
    if p.offload != "none" and (p.zero_stage != 3 or p.backend != "native"):
        raise ConfigError(f"parallel.offload={p.offload} needs parallel.zero_stage=3 with parallel.backend=native")
    _positive(cfg, "parallel.bucket_mb")
    _check_grad_accum_dtype(cfg)
    _check_tensor_parallel(cfg)
    _check_pipeline(cfg)
    _check_finetuning(cfg)
    _check_moe(cfg)
    _check_context_parallel(cfg)
    if p.deepspeed_config and (p.backend != "deepspeed" or not Path(p.deepspeed_config).expanduser().is_file()):
        raise ConfigError(f"parallel.deepspeed_config: needs parallel.backend=deepspeed and an existing JSON file, "
                          f"got backend={p.backend}, {p.deepspeed_config}")


def _check_grad_accum_dtype(cfg: Config) -> None:
    """A 16-bit accumulator only where one exists: ZeRO-1/2's own buffers, in the run's compute dtype (every other
    form keeps fp32 parameters, so autograd accumulates their gradients in fp32)."""
    p, precision = cfg.parallel, cfg.train.precision
    if p.grad_accum_dtype == "fp32":
        return
    if p.grad_accum_dtype != precision or p.zero_stage not in (1, 2) or p.backend != "native":
        raise ConfigError(f"parallel.grad_accum_dtype={p.grad_accum_dtype} needs train.precision={p.grad_accum_dtype} "
                          f"with parallel.zero_stage 1 or 2 and parallel.backend=native (got train.precision="
                          f"{precision}, zero_stage={p.zero_stage}, backend={p.backend}); use fp32")


# Parallel forms land issue by issue; until one has, its keys accept only the value that turns it off.
def _check_tensor_parallel(cfg: Config) -> None:
    m, tp = cfg.model, cfg.parallel.tp
    if tp == 1:
        return
    if m.n_head % tp:
        raise ConfigError(f"model.n_head: {m.n_head} is not divisible by parallel.tp={tp}")
    if (m.kv_heads % tp) if m.kv_heads >= tp else (tp % m.kv_heads):
        raise ConfigError(f"model.n_kv_head: {m.kv_heads} KV heads neither split over parallel.tp={tp} nor "
                          f"divide it (for replication)")
    if m.padded_vocab % tp:
        raise ConfigError(f"model.pad_vocab_to: the vocabulary padded to {m.padded_vocab} is not divisible by "
                          f"parallel.tp={tp}; use a multiple of {tp}")
    if m.ffn_hidden % tp:
        raise ConfigError(f"model.mlp_hidden: {m.ffn_hidden} is not divisible by parallel.tp={tp}")
    if cfg.parallel.sequence_parallel and m.block_size % tp:
        raise ConfigError(f"parallel.sequence_parallel: model.block_size={m.block_size} is not divisible by "
                          f"parallel.tp={tp}")


def _check_pipeline(cfg: Config) -> None:
    p = cfg.parallel
    if p.pp > cfg.model.n_layer:
        raise ConfigError(f"parallel.pp: {p.pp} stages need at least as many blocks, model.n_layer={cfg.model.n_layer}")
    chunks = p.pp * p.pp_virtual  # (virtual) stages, each a contiguous run of blocks
    if p.pp_layers and (len(p.pp_layers) != chunks or sum(p.pp_layers) != cfg.model.n_layer or min(p.pp_layers) < 1):
        raise ConfigError(f"parallel.pp_layers: {p.pp_layers} must be {chunks} positive counts summing to "
                          f"model.n_layer={cfg.model.n_layer}")
    check_interleaved(cfg)
    # The pipeline drives its own forwards and backwards stage by stage, so it composes with the data-parallel
    # forms whose gradient reduction it can time (after the last micro-batch's backward): the flat-buffer
    # all-reduce, ZeRO-1, ZeRO-2 and FSDP2 (driven per stage, parallel/data/fsdp.py). DeepSpeed's engine expects
    # to run the whole forward.
    # zb1's B walks the graph for the gathered parameters its W fills: a unit resharded after forward (and
    # gathered again, as new tensors, for B) would leave W nothing to fill
    # (CPU offload keeps the gradients a stage accumulates unsharded over its micro-batches on the device: untested)
    if p.pp > 1 and p.offload != "none":
        raise ConfigError(f"parallel.offload={p.offload} is not supported with parallel.pp>1; use parallel.offload=none")
    if p.pp > 1 and p.zero_stage == 3 and p.pp_schedule == "zb1" and p.reshard_after_forward:
        raise ConfigError("parallel.reshard_after_forward: true with parallel.zero_stage=3 and pp_schedule=zb1 would "
                          "regather each unit between B and W; leave it unset (false under a pipeline)")
    # a pipeline's setting, like pp_virtual: without one ZeRO-3 reduce-scatters every micro-step already
    if p.pp == 1 and p.pp_reduce_grads == "micro_batch":
        raise ConfigError("parallel.pp_reduce_grads: micro_batch applies under a pipeline (parallel.pp > 1); without "
                          "one ZeRO-3 reduce-scatters every micro-step already")
    # ZeRO-1/2 and DDP reduce when their own design says (ZeRO-2 every micro-batch, the others once a step)
    if p.pp > 1 and p.pp_reduce_grads == "micro_batch" and p.zero_stage != 3:
        raise ConfigError(f"parallel.pp_reduce_grads: micro_batch applies to parallel.zero_stage=3 (FSDP2), not "
                          f"zero_stage={p.zero_stage}; leave it at step")
    # zb1's B leaves the weight gradients to W, which runs no FSDP2 hook: its micro-batch's gradients of the whole
    # stage would be computed before any reduce, so the whole stage's fp32 gradient would exist at once anyway
    if p.pp > 1 and p.pp_reduce_grads == "micro_batch" and p.pp_schedule == "zb1":
        raise ConfigError("parallel.pp_reduce_grads: micro_batch with pp_schedule=zb1: its weight-gradient pass "
                          "computes the stage's gradients together, outside FSDP2's hooks; use pp_schedule=1f1b, "
                          "interleaved or gpipe, or pp_reduce_grads=step")
    # a torch.compile'd block's backward is one compiled function run once (donated buffers): it cannot be split
    if p.pp > 1 and p.pp_schedule == "zb1" and cfg.train.compile:
        raise ConfigError("parallel.pp_schedule: zb1 splits each backward in two, which compiled blocks cannot; "
                          "set train.compile=false or use pp_schedule=1f1b")
    # a sequence-parallel layer's backward is one autograd Function that computes its input and weight gradients
    # together (re-gathering its input): zb1's W pass would run its collectives and matmuls a second time
    if p.pp > 1 and p.pp_schedule == "zb1" and p.tp > 1 and p.sequence_parallel:
        raise ConfigError("parallel.pp_schedule: zb1 with parallel.sequence_parallel would run each layer's "
                          "sequence-parallel backward twice; use pp_schedule=1f1b or sequence_parallel=false")
    # ZeRO-2 starts every bucket's reduce-scatter at the end of each micro-step's backward, and interleaving runs
    # a backward per chunk: v times the bytes
    if p.pp > 1 and p.pp_schedule == "interleaved" and p.zero_stage == 2:
        raise ConfigError("parallel.zero_stage: 2 with pp_schedule=interleaved would reduce-scatter every bucket "
                          "once per chunk; use zero_stage 1 or pp_schedule=1f1b")
    if p.pp > 1 and p.backend != "native":
        raise ConfigError(f"parallel.backend: {p.backend} is not supported with parallel.pp>1; use backend=native")
    # DeepSpeed's engine wraps the whole module as one data-parallel replica; it has no place for our tp shards
    if p.tp > 1 and p.backend != "native":
        raise ConfigError(f"parallel.backend: {p.backend} is not supported with parallel.tp>1; use backend=native")


def overlap_p2p(cfg: Config) -> bool:
    """`parallel.pp_overlap_p2p`, or where unset its default: true for the interleaved and zb1 schedules, whose
    steps it shortens (schedule.simulate; measured in docs/benchmarks.md), false for GPipe and 1F1B."""
    p = cfg.parallel
    if p.pp_overlap_p2p is None:
        return p.pp > 1 and p.pp_schedule in ("interleaved", "zb1")
    return p.pp_overlap_p2p


def zero_draws_from_meta(cfg: Config) -> bool:
    """Whether native ZeRO-1/2 (where it shards, dp x cp > 1) takes the model on the meta device and draws each
    parameter straight into its flat buffer (parallel/data/zero.py `_build_from_meta`): from a random start without PEFT. From
    model.init_from, or with a frozen base, it takes a materialised model (the loaders and PEFT fill a whole one)."""
    p = cfg.parallel
    return p.backend == "native" and p.zero_stage in (1, 2) and not cfg.model.init_from and cfg.peft.method == "none"


def reshard_after_forward(cfg: Config) -> bool:
    """`parallel.reshard_after_forward`, or where unset its default: true, false under a pipeline (torchtitan's
    choice: 1F1B runs other micro-batches' forwards before a backward, so resharding would gather every unit
    twice per micro-batch)."""
    p = cfg.parallel
    return p.pp == 1 if p.reshard_after_forward is None else p.reshard_after_forward


def check_interleaved(cfg: Config, dp: int | None = None) -> None:
    """Interleaved 1F1B's rules: 2+ chunks per stage, a block per chunk, micro-batches a multiple of pp (its
    forwards go in groups of pp, as Megatron's). `dp` where known (the runtime checks again once it is)."""
    p, t = cfg.parallel, cfg.train
    if p.pp_virtual < 1:
        raise ConfigError(f"parallel.pp_virtual: must be positive, got {p.pp_virtual}")
    if p.pp_overlap_p2p is True and p.pp == 1:
        raise ConfigError("parallel.pp_overlap_p2p: overlaps the pipeline's point-to-point exchanges, needs "
                          "parallel.pp > 1")
    if p.pp_schedule != "interleaved" or p.pp == 1:
        if p.pp_virtual > 1:
            raise ConfigError(f"parallel.pp_virtual: {p.pp_virtual} chunks per stage need parallel.pp > 1 and "
                              f"parallel.pp_schedule=interleaved")
        return
    if p.pp_virtual < 2:
        raise ConfigError("parallel.pp_virtual: pp_schedule=interleaved needs 2 or more chunks per stage, got 1")
    if p.pp * p.pp_virtual > cfg.model.n_layer:
        raise ConfigError(f"parallel.pp_virtual: {p.pp} stages x {p.pp_virtual} chunks need at least as many blocks, "
                          f"model.n_layer={cfg.model.n_layer}")
    dp = dp or p.dp
    if dp and (t.global_batch_size // (t.micro_batch_size * dp)) % p.pp:
        m = t.global_batch_size // (t.micro_batch_size * dp)
        raise ConfigError(f"parallel.pp_schedule: interleaved needs the micro-batches per step (train.global_batch_size"
                          f" / (train.micro_batch_size * dp) = {m}) to be a multiple of parallel.pp={p.pp}")


def _check_context_parallel(cfg: Config) -> None:
    """What context parallelism composes with so far (parallel/context_parallel/): dp with DDP, ZeRO-1/2 or FSDP2
    (sharded over dp x cp), tp (with or without sequence parallelism) and pp."""
    m, p = cfg.model, cfg.parallel
    if p.cp == 1:
        return
    if m.block_size % (2 * p.cp):
        raise ConfigError(f"parallel.cp: model.block_size={m.block_size} is not divisible by 2*cp = {2 * p.cp} "
                          f"(the zigzag layout gives each rank two chunks of every sequence)")
    if m.dropout > 0:
        raise ConfigError(f"parallel.cp: model.dropout={m.dropout} (attention dropout) is not supported with cp>1; "
                          f"use model.dropout=0")
    if p.sequence_parallel and m.block_size % (2 * p.cp * p.tp):
        raise ConfigError(f"parallel.sequence_parallel: model.block_size={m.block_size} is not divisible by "
                          f"2*cp*tp = {2 * p.cp * p.tp} (each cp rank's part of a sequence splits over tp)")
    # (compile: the ring runs outside the compiled graphs, ring.py ring_attention)
    for on, what in ((m.n_experts > 0, "MoE (model.n_experts>0)"), (p.backend != "native", f"parallel.backend={p.backend}")):
        if on:
            raise ConfigError(f"parallel.cp: context parallelism with {what} is not yet supported; use parallel.cp=1")


def _check_moe(cfg: Config) -> None:
    m, p = cfg.model, cfg.parallel
    if p.ep < 1:
        raise ConfigError(f"parallel.ep: must be >= 1, got {p.ep}")
    if p.ep > 1 and not m.n_experts:
        raise ConfigError(f"parallel.ep={p.ep} needs an MoE model (model.n_experts > 0); a dense model has no experts")
    _non_negative(cfg, "model.n_experts", "model.moe_hidden", "model.n_shared_experts", "model.moe_shared_hidden",
                  "model.moe_aux_loss_coef",
                  "model.moe_z_loss_coef", "model.moe_bias_update_rate", "model.moe_capacity_factor")
    if not m.n_experts:
        return
    if not 1 <= m.moe_top_k <= m.n_experts:
        raise ConfigError(f"model.moe_top_k: must be in [1, model.n_experts={m.n_experts}], got {m.moe_top_k}")
    if not 1 <= m.moe_every <= m.n_layer:
        raise ConfigError(f"model.moe_every: must be in [1, model.n_layer={m.n_layer}], got {m.moe_every}")
    for key, on in (("moe_shared_hidden", m.moe_shared_hidden > 0), ("moe_shared_gate", m.moe_shared_gate)):
        if on and not m.n_shared_experts:
            raise ConfigError(f"model.{key}: set, but there is no shared expert (model.n_shared_experts=0)")
    _check_expert_parallel(cfg)
    if p.tp > 1 and m.block_size % p.tp:  # each tp rank routes its chunk of the sequence (parallel/tensor/moe.py)
        raise ConfigError(f"model.block_size: {m.block_size} is not divisible by parallel.tp={p.tp}; an MoE layer "
                          f"splits the sequence over the tp ranks")


def _check_expert_parallel(cfg: Config) -> None:
    """parallel.ep > 1: experts split over ep of the dp ranks (dp itself is checked against WORLD_SIZE at start,
    parallel/context.py), per (pp, tp) position; native engine only (DeepSpeed runs MoE at ep=1). ZeRO-3 shards the
    experts over the expert-dp ranks (parallel/expert/fsdp.py)."""
    m, p = cfg.model, cfg.parallel
    if p.ep == 1:
        return
    if m.n_experts % p.ep:
        raise ConfigError(f"parallel.ep: model.n_experts={m.n_experts} is not divisible by parallel.ep={p.ep}")
    if p.dp and p.dp % p.ep:
        raise ConfigError(f"parallel.ep: {p.ep} does not divide parallel.dp={p.dp}")
    # (compile: the dispatch runs outside the compiled graphs, expert/dispatch.py AllToAllDispatch)
    # DeepSpeed's engine reduces every gradient over the whole data-parallel group; under ep each rank holds other
    # experts, whose gradients must be reduced over their expert-dp ranks only (parallel/expert/grads.py)
    if p.backend != "native":
        raise ConfigError(f"parallel.ep: {p.ep} with parallel.backend={p.backend} is not supported: DeepSpeed's engine "
                          f"would all-reduce the expert gradients over all of dp, mixing different experts; use "
                          f"parallel.ep=1 or parallel.backend=native")


def check_expert_targets(f: PeftConfig, m: ModelConfig) -> None:
    """peft.targets experts_* only where there are experts."""
    experts = [t for t in f.targets if t.startswith("experts_")] if f.method in ("lora", "qlora") else []
    if experts and not m.n_experts:
        raise ConfigError(f"peft.targets: {experts[0]} needs an MoE model (model.n_experts > 0); a dense model has "
                          f"no experts")


def _check_finetuning(cfg: Config) -> None:
    m, f = cfg.model, cfg.peft
    if m.init_from:
        kind, _, where = m.init_from.partition(":")
        if kind not in ("hf", "ckpt") or not where:
            raise ConfigError(f"model.init_from: expected hf:DIR or ckpt:DIR, got {m.init_from!r}")
        if not Path(where).expanduser().is_dir():
            raise ConfigError(f"model.init_from: directory not found: {where}")
    if f.method == "none":
        return
    if f.rank < 1:
        raise ConfigError(f"peft.rank: must be positive, got {f.rank}")
    if f.alpha <= 0:
        raise ConfigError(f"peft.alpha: must be positive, got {f.alpha}")
    if not 0.0 <= f.dropout < 1.0:
        raise ConfigError(f"peft.dropout: must be in [0, 1), got {f.dropout}")
    if f.method in ("lora", "qlora") and (not f.targets or len(set(f.targets)) != len(f.targets)):
        raise ConfigError(f"peft.targets: expected distinct names among qkv, attn_out, mlp_up, mlp_down, experts_up, "
                          f"experts_down, got {f.targets}")
    if not m.init_from.startswith("hf:"):  # (an hf: start's architecture is known once resolved: peft checks then)
        check_expert_targets(f, m)
    if m.n_experts and f.method == "qlora":
        raise ConfigError("peft.method: qlora has no 4-bit form for an MoE model's stacked experts "
                          "(model.n_experts > 0); use peft.method=lora")
    if f.method == "qlora" and cfg.parallel.tp > 1:
        raise ConfigError("peft.method: qlora is not supported with parallel.tp>1 (its 4-bit weights are not sharded)")
