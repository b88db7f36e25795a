"""`dist-llm convert --to-full CKPT --out model.safetensors`: a checkpoint of any layout as one file.

The model's full (tp=1, unsharded) fp32 tensors under their parameter names, a PEFT checkpoint's LoRA folded
into its base, and the model config as JSON in the file's metadata, so `load_full` rebuilds the GPT from
the file alone. safetensors holds tensors only: loading it runs no code.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dist_llm.config import ConfigError, ModelConfig
from dist_llm.fileio import atomic_path
from dist_llm.model import GPT


def save_full(checkpoint: Path, out: Path) -> Path:
    from dist_llm.peft import merge_into_base
    from dist_llm.sample import load_model

    if out.exists():
        raise ConfigError(f"--out: {out} already exists")
    model, _ = load_model(Path(checkpoint).expanduser(), torch.device("cpu"))
    merge_into_base(model)
    # tied weights share storage, which safetensors refuses: each name gets its own copy
    tensors = {name: t.detach().float().contiguous().clone() for name, t in model.state_dict().items()}
    meta = {"dist_llm_model_config": json.dumps(dataclasses.asdict(model.cfg))}
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
    return out


def load_full(path: Path) -> GPT:
    """The GPT saved by `save_full`."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if "dist_llm_model_config" not in meta:
            raise ConfigError(f"{path}: not a dist_llm consolidated model (no model config in its metadata)")
        cfg = ModelConfig(**json.loads(meta["dist_llm_model_config"]))
        state = {k: f.get_tensor(k) for k in f.keys()}
    model = GPT(cfg)
    model.load_state_dict(state)
    return model.eval()
