"""Hugging Face Mixtral and Qwen2-MoE: the MoE parts of `dist_llm.hf`'s mapping (config keys, where each of our
MoE tensors comes from, what an export writes). Names and shapes only; `dist_llm.hf` reads and writes.

Both families are Llama-style attention (RoPE, RMSNorm, GQA; Qwen2-MoE with q/k/v biases) around an MoE MLP:

  mixtral     every block MoE; router `block_sparse_moe.gate` (E, C); experts w1 (gate), w3 (up), w2 (down) as
              nn.Linear weights (out, in); weights = softmax over the top-k logits (= top-k of the softmax,
              renormalised): model.moe_router_order=topk_softmax
  qwen2_moe   MoE every `decoder_sparse_step`-th block, dense `mlp.{gate,up,down}_proj` the others; router
              `mlp.gate`; experts gate_proj/up_proj/down_proj; one shared expert MLP of its own width
              (`shared_expert_intermediate_size` -> model.moe_shared_hidden) scaled by sigmoid(`shared_expert_gate`
              x) (model.moe_shared_gate); norm_topk_prob false = softmax_topk, true = topk_softmax

On disk, two layouts of the routed experts are read:
  per expert  `...experts.{e}.w1.weight` (H, C) and so on: what the Hub holds, and what transformers 5's
              save_pretrained writes (it converts back from its in-memory form on saving)
  fused       `mlp.experts.gate_up_proj` (E, 2H, C: gate rows then up rows) and `mlp.experts.down_proj` (E, C, H):
              transformers 5's in-memory parameters, as a state_dict saved directly holds them
Ours are stacked (E, in, out) (`dist_llm.model.moe.Experts`), so each is the file's transposed; rows of ours are
experts, and a rank that keeps experts [a, b) reads just those (one expert tensor at a time, per expert).
Exports are written per expert (the Hub layout): transformers 5 loads it (converting on load), as 4.x does.

Qwen3-MoE is not mapped: its attention normalises q and k per head (QK-norm) and sets its head size apart from
the width, neither of which dist_llm's attention has.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dist_llm.config import ConfigError, ModelConfig
from dist_llm.hf_mapping import HFTensor, Mapping, Piece, _bool, _int, _whole

MOE_FAMILIES = ("mixtral", "qwen2_moe")
LABEL = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE"}
#: the ModelConfig keys of an MoE architecture (a dense Hugging Face model sets them to their defaults)
MOE_ARCH_KEYS = ("n_experts", "moe_top_k", "moe_every", "moe_hidden", "n_shared_experts", "moe_shared_hidden",
                 "moe_shared_gate", "moe_router_order")
DENSE_ARCH = {key: getattr(ModelConfig, key) for key in MOE_ARCH_KEYS}
# (gate, up, down) expert names per family
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj")}


def moe_arch(c: dict[str, Any], file: Path, family: str) -> dict[str, Any]:
    """The MoE keys of a Mixtral or Qwen2-MoE config.json."""
    if family == "mixtral":
        experts = _int(c, file, "num_local_experts")
        # (every block MoE: intermediate_size is the experts' width, and no dense MLP exists for mlp_hidden)
        arch = {"mlp_hidden": 0, "moe_every": 1, "moe_hidden": _int(c, file, "intermediate_size"),
                "n_shared_experts": 0, "moe_shared_hidden": 0, "moe_shared_gate": False,
                "moe_router_order": "topk_softmax"}
    else:
        experts = _int(c, file, "num_experts")
        if c.get("mlp_only_layers"):
            raise ConfigError(f"{file}: mlp_only_layers {c['mlp_only_layers']} is not supported (dist_llm places its "
                              f"dense blocks by decoder_sparse_step alone)")
        shared = _int(c, file, "shared_expert_intermediate_size")
        arch = {"moe_every": _int(c, file, "decoder_sparse_step", default=1),
                "moe_hidden": _int(c, file, "moe_intermediate_size"), "n_shared_experts": 1,
                "moe_shared_hidden": shared, "moe_shared_gate": True,
                "moe_router_order": "topk_softmax" if _bool(c, file, "norm_topk_prob", False) else "softmax_topk"}
    top_k = _int(c, file, "num_experts_per_tok")
    if not top_k <= experts:
        raise ConfigError(f"{file}: {experts} experts with num_experts_per_tok {top_k}: expected 1 <= k <= experts")
    return {"n_experts": experts, "moe_top_k": top_k, **arch}


def _experts(shape: tuple[int, int], names: list[str]) -> Mapping:
    """Our stacked (E, in, out) tensor from E per-expert (out, in) tensors: expert e is our row e."""
    pieces = tuple(Piece(e, 1, name, shape, transposed=True) for e, name in enumerate(names))
    return Mapping((len(names), shape[1], shape[0]), pieces)


def _zeros(*shape: int) -> Mapping:
    return Mapping(tuple(shape), (Piece(0, shape[0]),))


def moe_block_layout(cfg: ModelConfig, family: str, i: int, *, fused: bool) -> dict[str, Mapping]:
    """Our tensors of MoE block i -> where they come from (names without the "model." prefix); `fused`: the file
    holds transformers 5's in-memory gate_up_proj/down_proj (always under `mlp.`, Mixtral's too)."""
    C, E, H = cfg.n_embd, cfg.n_experts, cfg.moe_expert_hidden
    o = f"blocks.{i}.moe"
    m = f"layers.{i}.block_sparse_moe" if family == "mixtral" and not fused else f"layers.{i}.mlp"
    out = {f"{o}.router.weight": _whole(f"{m}.gate.weight", (E, C)), f"{o}.expert_bias": _zeros(E)}
    gate, up, down = _EXPERT_NAMES[family]
    if fused:
        gate_up, fused_down = f"{m}.experts.gate_up_proj", f"{m}.experts.down_proj"
        for ours, part in (("w_gate", (0, H)), ("w_up", (H, 2 * H))):
            out[f"{o}.experts.{ours}"] = Mapping((E, C, H), (Piece(0, E, gate_up, (E, 2 * H, C), True, part=part),))
        out[f"{o}.experts.w_down"] = Mapping((E, H, C), (Piece(0, E, fused_down, (E, C, H), True),))
    else:
        for ours, theirs, shape in (("w_gate", gate, (H, C)), ("w_up", up, (H, C)), ("w_down", down, (C, H))):
            out[f"{o}.experts.{ours}"] = _experts(shape, [f"{m}.experts.{e}.{theirs}.weight" for e in range(E)])
    if cfg.bias:  # neither family has expert biases: zero in a model.bias=true GPT (Qwen2-MoE's q/k/v bias)
        out.update({f"{o}.experts.b_up": _zeros(E, H), f"{o}.experts.b_gate": _zeros(E, H),
                    f"{o}.experts.b_down": _zeros(E, C)})
    if cfg.n_shared_experts:
        S, s = cfg.moe_shared_expert_hidden, f"{m}.shared_expert"
        for ours, theirs, shape in (("gate", "gate_proj", (S, C)), ("up", "up_proj", (S, C)),
                                    ("down", "down_proj", (C, S))):
            out[f"{o}.shared.{ours}.weight"] = _whole(f"{s}.{theirs}.weight", shape)
            if cfg.bias:
                out[f"{o}.shared.{ours}.bias"] = _whole(f"{s}.{theirs}.bias", shape[:1], optional=True)
        if cfg.moe_shared_gate:
            out[f"{o}.shared_gate.weight"] = _whole(f"{m}.shared_expert_gate.weight", (1, C))
    return out


# -- export ----------------------------------------------------------------------------------------------------
def _misses(cfg: ModelConfig, family: str) -> list[str]:
    needs: dict[str, Any] = {"pos_emb": "rope", "norm": "rmsnorm", "mlp": "swiglu"}
    if family == "mixtral":
        needs.update(bias=False, qkv_bias=False, n_shared_experts=0, moe_every=1, moe_router_order="topk_softmax")
    else:
        needs.update(moe_shared_gate=True)
    misses = [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in needs.items()
              if getattr(cfg, k) != v]
    if family == "qwen2_moe" and cfg.n_shared_experts < 1:  # (several are one MLP as wide as all of them)
        misses.insert(0, "model.n_shared_experts>=1")
    return misses


def moe_export_family(cfg: ModelConfig) -> str:
    """'mixtral' or 'qwen2_moe' for an MoE `cfg`, else a ConfigError naming in one line what each would need."""
    options = {family: _misses(cfg, family) for family in MOE_FAMILIES}
    for family, misses in options.items():
        if not misses:
            return family
    needs = "; ".join(f"{LABEL[f]} needs {' '.join(m)}" for f, m in options.items())
    raise ConfigError(f"model.n_experts={cfg.n_experts}: this MoE model exports as neither Mixtral nor Qwen2-MoE "
                      f"({needs})")


def moe_hf_config(cfg: ModelConfig, family: str, llama: dict[str, Any]) -> dict[str, Any]:
    """config.json of an MoE export, from the Llama one `dist_llm.hf.hf_config` made for the attention part."""
    base = {k: v for k, v in llama.items() if k not in ("attention_bias", "mlp_bias", "pretraining_tp")}
    moe = {"num_experts_per_tok": cfg.moe_top_k, "router_aux_loss_coef": cfg.moe_aux_loss_coef,
           "output_router_logits": False, "sliding_window": None}
    if family == "mixtral":
        return {**base, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **moe,
                "intermediate_size": cfg.moe_expert_hidden, "num_local_experts": cfg.n_experts,
                "router_jitter_noise": 0.0}
    return {**base, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", **moe,
            "intermediate_size": cfg.ffn_hidden, "moe_intermediate_size": cfg.moe_expert_hidden,
            "shared_expert_intermediate_size": cfg.moe_shared_expert_hidden, "num_experts": cfg.n_experts,
            "decoder_sparse_step": cfg.moe_every, "norm_topk_prob": cfg.moe_router_order == "topk_softmax",
            "mlp_only_layers": [], "qkv_bias": cfg.bias or cfg.qkv_bias, "use_sliding_window": False,
            "max_window_layers": cfg.n_layer}


def moe_block_plan(cfg: ModelConfig, family: str, i: int) -> list[HFTensor]:
    """The Hugging Face tensors of MoE block i's MLP, per expert (the Hub layout), by source in our module order."""
    C, E, H, S = cfg.n_embd, cfg.n_experts, cfg.moe_expert_hidden, cfg.moe_shared_expert_hidden
    o, h = f"blocks.{i}.moe", f"model.layers.{i}." + ("block_sparse_moe" if family == "mixtral" else "mlp")
    plan = [HFTensor(f"{h}.gate.weight", (E, C), f"{o}.router.weight")]
    gate, up, down = _EXPERT_NAMES[family]
    for ours, theirs, shape in (("w_up", up, (H, C)), ("w_gate", gate, (H, C)), ("w_down", down, (C, H))):
        plan += [HFTensor(f"{h}.experts.{e}.{theirs}.weight", shape, f"{o}.experts.{ours}", transpose=True, expert=e)
                 for e in range(E)]
    if cfg.n_shared_experts:
        for ours, theirs, shape in (("up", "up_proj", (S, C)), ("gate", "gate_proj", (S, C)),
                                    ("down", "down_proj", (C, S))):
            plan.append(HFTensor(f"{h}.shared_expert.{theirs}.weight", shape, f"{o}.shared.{ours}.weight"))
        plan.append(HFTensor(f"{h}.shared_expert_gate.weight", (1, C), f"{o}.shared_gate.weight"))
    return plan


def moe_dropped(cfg: ModelConfig, family: str) -> list[str]:
    """Our tensors an export of `family` has no place for: it is exact only while they are zero (the writer checks).
    The aux-loss-free routing bias (neither family routes with one); under model.bias=true (Qwen2-MoE's q/k/v
    biases) every other bias: the attention output's, the dense MLPs', the experts' and the shared expert's."""
    names = [f"blocks.{i}.moe.expert_bias" for i in range(cfg.n_layer) if cfg.is_moe_block(i)]
    if cfg.bias:
        for i in range(cfg.n_layer):
            names.append(f"blocks.{i}.attn.proj.bias")
            if cfg.is_moe_block(i):
                names += [f"blocks.{i}.moe.experts.{b}" for b in ("b_up", "b_gate", "b_down")]
                names += [f"blocks.{i}.moe.shared.{p}.bias" for p in ("up", "gate", "down") if cfg.n_shared_experts]
            else:
                names += [f"blocks.{i}.mlp.{p}.bias" for p in ("up", "gate", "down")]
    return names


__all__ = ["DENSE_ARCH", "LABEL", "MOE_ARCH_KEYS", "MOE_FAMILIES", "moe_arch", "moe_block_layout", "moe_block_plan",
           "moe_dropped", "moe_export_family", "moe_hf_config"]
