"""Parameter-efficient fine-tuning over a frozen base GPT: LoRA, bottleneck adapters, QLoRA (`peft.*`).

`apply_peft` freezes every base parameter (`requires_grad=False`: no gradient, no optimizer state) and adds
the small trainable modules; checkpoints of a PEFT run then hold only those (plus, in their manifest and
adapter.json, which base they belong to), and `load_adapter` puts them back on a base model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dist_llm.config import ConfigError, ModelConfig, PeftConfig, check_expert_targets
from dist_llm.fileio import atomic_path, atomic_write_text
from dist_llm.model.init import parameter_name
from dist_llm.peft.adapter import Adapter, add_adapter
from dist_llm.peft.expert_lora import LORA_OF, ExpertLoRA, add_expert_lora, expert_loras, merge_experts
from dist_llm.peft.lora import LoRA, add_lora, lora_modules, merge, unmerge
from dist_llm.peft.qlora import BLOCK_LINEARS

#: peft.targets name -> the linear layers of a block it means (SwiGLU's gate is an up projection too; in an MoE
#: block the mlp names mean its shared expert, a dense MLP)
TARGETS: dict[str, tuple[str, ...]] = {"qkv": ("attn.qkv",), "attn_out": ("attn.proj",),
                                       "mlp_up": ("mlp.up", "mlp.gate", "moe.shared.up", "moe.shared.gate"),
                                       "mlp_down": ("mlp.down", "moe.shared.down"),
                                       "experts_up": (), "experts_down": ()}
#: peft.targets name -> the stacked weights of an MoE block's routed experts it means (per-expert LoRA,
#: peft/expert_lora.py). The router (and Qwen2-MoE's shared-expert gate) is never a target: it stays frozen.
EXPERT_TARGETS: dict[str, tuple[str, ...]] = {"experts_up": ("w_up", "w_gate"), "experts_down": ("w_down",)}


def _get(block: nn.Module, path: str) -> nn.Module | None:
    """The layer at `path` in a block; None where it has none (SwiGLU's gate in a GELU MLP, or a block that
    another pipeline stage holds)."""
    parent, _, name = path.rpartition(".")
    try:
        return getattr(block.get_submodule(parent), name, None)
    except AttributeError:
        return None


def _set(block: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(block.get_submodule(parent), name, module)


def apply_peft(model: nn.Module, cfg: PeftConfig, *, seed: int, sequence_parallel: bool = False) -> None:
    """Freeze `model` and add the `peft.method` modules to each block it holds, each tensor's initial values
    drawn from (seed + 1, its name): the same at every parallel layout, whichever blocks this rank holds."""
    if cfg.method == "none":
        return
    check_expert_targets(cfg, model.cfg)  # (again here: validate cannot know an hf: start's architecture)
    for p in model.parameters():
        p.requires_grad_(False)
    if cfg.method == "qlora":
        from dist_llm.peft.nf4 import NF4Linear

        for block in model.blocks:
            for path in BLOCK_LINEARS:
                layer = _get(block, path)
                if isinstance(layer, nn.Linear):
                    _set(block, path, NF4Linear.from_linear(layer))
                elif layer is not None and not isinstance(layer, NF4Linear):  # (quantised as it was loaded)
                    raise ConfigError(f"peft.method: qlora needs plain linear layers, found {type(layer).__name__} "
                                      f"at {path}")
    with torch.random.fork_rng(devices=[]):  # (constructing nn.Linear draws from the global stream: not ours)
        for i, block in enumerate(model.blocks):
            if cfg.method == "adapter":
                if hasattr(block, "attn"):  # (not a block another pipeline stage holds)
                    width = model.cfg.n_embd
                    for part in ("attn", "moe" if hasattr(block, "moe") else "mlp"):  # (on an MoE's whole output)
                        add_adapter(getattr(block, part), width, cfg.rank, sequence_parallel=sequence_parallel,
                                    seed=seed + 1, name=f"blocks.{i}.{part}")
                continue
            split = getattr(getattr(block, "moe", None), "tokens", None)  # (an MoE layer's tokens split over tp)
            tp_rank = split.rank if split is not None else None
            for target in cfg.targets:
                for path in TARGETS[target]:
                    layer = _get(block, path)
                    if layer is not None:
                        add_lora(layer, cfg.rank, cfg.alpha, cfg.dropout, seed=seed + 1, name=f"blocks.{i}.{path}",
                                 tp_rank=tp_rank if path.startswith("moe.") else None)
                experts = _get(block, "moe.experts")
                for pname in EXPERT_TARGETS.get(target, ()) if experts is not None else ():
                    if getattr(experts, pname, None) is not None:  # (w_gate: SwiGLU experts only)
                        add_expert_lora(experts, pname, cfg.rank, cfg.alpha, cfg.dropout, seed=seed + 1,
                                        name=f"blocks.{i}.moe.experts", tp_rank=tp_rank)


def peft_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name in the whole model, as `model/init.parameter_name` spells it, module) of every LoRA (expert LoRAs
    included) and adapter module of `model`."""
    return [(parameter_name(name, ""), m) for name, m in model.named_modules()
            if isinstance(m, (LoRA, ExpertLoRA, Adapter))]


def peft_parameter_names(model: nn.Module) -> set[str]:
    """The names of the parameters `apply_peft` added (none of them is in a base model's weights)."""
    return {f"{name}.{p_name}" for name, m in peft_modules(model) for p_name, _ in m.named_parameters()}


def reset_peft_parameters(model: nn.Module, seed: int, *, only: str | None = None) -> None:
    """Draw every LoRA and adapter tensor (or only the one called `only` in the whole model) from (seed + 1, its
    name), as `apply_peft` does: for modules added to a model on the meta device (nothing drawn then) and
    allocated afterwards, all at once or one parameter at a time (DeepSpeed's ZeRO-3 build)."""
    for name, module in peft_modules(model):
        if only is None:
            module.reset_parameters(seed + 1, name)
        elif only.startswith(f"{name}."):
            module.reset_parameters(seed + 1, name, only=only[len(name) + 1 :])
            return
    if only is not None:
        raise ValueError(f"{only} is not a parameter of a LoRA or adapter module")


@torch.no_grad()
def merge_into_base(model: nn.Module) -> None:
    """Fold every LoRA update into its base weight and drop the LoRA modules, dequantising a QLoRA base to
    fp32 first: what is left is a plain GPT (to export or serve). Adapters have no such form: refused."""
    from dist_llm.peft.nf4 import NF4Linear

    if any(isinstance(m, Adapter) for m in model.modules()):
        raise ConfigError("peft.method: adapter layers cannot be folded into the base model; "
                          "export needs LoRA or QLoRA (or no PEFT)")
    for block in model.blocks:
        for path in dict.fromkeys([*BLOCK_LINEARS, *(p for paths in TARGETS.values() for p in paths)]):
            layer = _get(block, path)
            if layer is None:
                continue
            lora = getattr(layer, "lora", None)
            if isinstance(layer, NF4Linear):
                plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
                plain.weight.data = layer.dequantized_weight(torch.float32)
                if layer.bias is not None:
                    plain.bias.data = layer.bias.detach().float().clone()
                _set(block, path, plain)
                layer = plain
            if isinstance(lora, LoRA):
                if not lora.merged:
                    layer.weight += lora.delta().to(layer.weight.dtype)
                lora.hook.remove()
                if hasattr(layer, "lora"):
                    del layer.lora
    merge_experts(model)  # each expert's W_e += scale A_e B_e, then the expert LoRAs dropped
    for experts, pname, _ in expert_loras(model):
        delattr(experts, LORA_OF[pname])


@dataclasses.dataclass(frozen=True)
class ParameterCounts:
    trainable: int
    total: int  # every parameter the model stands for, a QLoRA base weight by its elements
    nf4_shapes: tuple[tuple[int, int], ...] = ()  # (out, in) of each base weight stored in NF4


def parameter_counts(model: nn.Module) -> ParameterCounts:
    """Trainable and total parameters of `model` (this rank's part). A QLoRA base weight is stored as NF4
    tensors: counted by the elements it stands for, not by its packed bytes (nor skipped)."""
    from dist_llm.peft.nf4 import NF4_PARAMETERS, NF4Linear

    layers = [m for m in model.modules() if isinstance(m, NF4Linear)]
    nf4 = tuple((m.out_features, m.in_features) for m in layers)
    storage = {id(getattr(m, name)) for m in layers for name in NF4_PARAMETERS}
    params = [p for p in model.parameters() if id(p) not in storage]
    return ParameterCounts(trainable=sum(p.numel() for p in params if p.requires_grad),
                           total=sum(p.numel() for p in params) + sum(o * i for o, i in nf4), nf4_shapes=nf4)


def planned_counts(model_cfg: ModelConfig, peft_cfg: PeftConfig) -> ParameterCounts:
    """`parameter_counts` of the whole model a PEFT run of these settings trains, worked out on the meta
    device from the config alone (for report.md): QLoRA counted as LoRA on the weights it would quantise."""
    from dist_llm.model import GPT

    qlora = peft_cfg.method == "qlora"
    with torch.device("meta"):
        model = GPT(model_cfg)
        apply_peft(model, dataclasses.replace(peft_cfg, method="lora") if qlora else peft_cfg, seed=0)
    counts = parameter_counts(model)
    if not qlora:
        return counts
    layers = [_get(block, path) for block in model.blocks for path in BLOCK_LINEARS]
    return dataclasses.replace(counts, nf4_shapes=tuple(tuple(layer.weight.shape) for layer in layers
                                                        if isinstance(layer, nn.Linear)))


def trainable_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trained tensors only, by name (what a PEFT checkpoint holds): the trainable parameters and the buffers
    a run trains (model/buffers.py: an MoE layer's expert bias, which decides the routing)."""
    from dist_llm.model.buffers import trained_buffers

    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad} | trained_buffers(model)


def save_adapter(model: nn.Module, path: Path, cfg: PeftConfig, base: dict[str, Any]) -> None:
    """Write `adapter.safetensors` (the trainable tensors, full shapes: call on a single-process model) and
    `adapter.json` (the peft settings and `base`, the identity of the model they adapt) into `path`."""
    path.mkdir(parents=True, exist_ok=True)
    # each file whole or not at all (a failed save keeps the previous adapter); tensors first, then their json
    with atomic_path(path / "adapter.safetensors") as tmp:
        save_file({n: t.contiguous().cpu() for n, t in adapter_state(model).items()}, str(tmp))
    meta = {"method": cfg.method, "rank": cfg.rank, "alpha": cfg.alpha, "dropout": cfg.dropout,
            "targets": list(cfg.targets), "base": base}
    atomic_write_text(path / "adapter.json", json.dumps(meta, indent=1))


#: adapter.json's keys that must equal the loading model's peft settings: the method and its rank always (a
#: bottleneck's width for adapters); alpha (the update's scale) and the targets only where LoRA has them
_SETTINGS = {"adapter": ("method", "rank"), "lora": ("method", "rank", "alpha", "targets"),
             "qlora": ("method", "rank", "alpha", "targets")}


def _same_setting(key: str, saved: Any, ours: Any) -> bool:
    if key == "targets":  # (their order changes nothing: apply_peft adds each target's layers in any order)
        return isinstance(saved, list) and sorted(map(str, saved)) == sorted(ours)
    if key == "alpha":
        return isinstance(saved, (int, float)) and not isinstance(saved, bool) and float(saved) == float(ours)
    return type(saved) is type(ours) and saved == ours


def settings_difference(saved: dict[str, Any], cfg: PeftConfig) -> tuple[str, Any, Any] | None:
    """(key, saved value or None where missing, ours) for the first peft setting of `cfg.method` that the saved
    settings do not share (a LoRA of another rank, scale or targets is another model); None when they agree."""
    for key in _SETTINGS[cfg.method]:
        ours = list(cfg.targets) if key == "targets" else getattr(cfg, key)
        if key not in saved or not _same_setting(key, saved[key], ours):
            return key, saved.get(key), ours
    return None


def _check_settings(file: Path, meta: Any, cfg: PeftConfig) -> None:
    """adapter.json (`meta`) was written for the peft settings `cfg`, else one line naming the key."""
    if not isinstance(meta, dict):
        raise ConfigError(f"{file}: not a JSON object")
    differ = settings_difference(meta, cfg)
    if differ is not None:
        key, saved, ours = differ
        if key not in meta:
            raise ConfigError(f"{file}: has no {key!r} (this model's peft.{key} is {ours})")
        raise ConfigError(f"{file}: {key} is {saved!r}, this model's peft.{key} is {ours!r}")


def load_adapter(model: nn.Module, path: Path, cfg: PeftConfig) -> dict[str, Any]:
    """Put the tensors of `save_adapter` back on a model that has the same PEFT modules, added with the peft
    settings `cfg` (those adapter.json must record); returns adapter.json. What does not fit is refused in one
    line before any tensor is copied: `copy_` would broadcast a rank-1 LoRA into a rank-8 one without a word."""
    from dist_llm.model.buffers import trained_buffers

    if cfg.method == "none":
        raise ConfigError("peft.method: none: this model has no PEFT modules to load an adapter into")
    json_file, tensors_file = path / "adapter.json", path / "adapter.safetensors"
    try:
        meta = json.loads(json_file.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"{json_file}: unreadable ({str(e).splitlines()[0][:200]})") from None
    _check_settings(json_file, meta, cfg)
    tensors = load_file(str(tensors_file))
    targets = dict(model.named_parameters()) | trained_buffers(model)
    wanted = set(trainable_names(model))
    optional = set(trained_buffers(model))  # (an adapter saved before they were kept leaves them as built)
    if not wanted <= set(tensors) or not set(tensors) <= wanted | optional:
        missing, extra = sorted(wanted - set(tensors)), sorted(set(tensors) - wanted - optional)
        raise ConfigError(f"{tensors_file}: does not fit this model (missing {missing[:3]}, "
                          f"unexpected {extra[:3]})")
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise ConfigError(f"{tensors_file}: {name} is {t.dtype}, not a floating-point tensor")
        if t.shape != targets[name].shape:
            raise ConfigError(f"{tensors_file}: {name} has shape {tuple(t.shape)}, this model's has "
                              f"{tuple(targets[name].shape)}")
    with torch.no_grad():
        for name, t in tensors.items():
            targets[name].copy_(t)
    return meta


__all__ = ["BLOCK_LINEARS", "EXPERT_TARGETS", "TARGETS", "Adapter", "ExpertLoRA", "LoRA", "ParameterCounts", "adapter_state", "add_adapter", "add_expert_lora", "add_lora",
           "apply_peft", "expert_loras", "load_adapter", "lora_modules", "merge", "merge_into_base", "parameter_counts", "peft_modules",
           "peft_parameter_names", "planned_counts",
           "reset_peft_parameters", "save_adapter", "trainable_names", "unmerge"]
