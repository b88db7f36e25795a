"""`model.init_from`: start training from Hugging Face weights (`hf:DIR`) or a dist_llm checkpoint (`ckpt:DIR`).

The weights are read whole on every rank, then each rank keeps its tensor-parallel slice, so the start is the
same at every layout. With `hf:DIR` the directory's config.json decides the architecture keys of model.*,
and its tokenizer.json is used when data.tokenizer is left at 'byte'.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
import yaml

from dist_llm.config import Config, ConfigError, config_from_dict
from dist_llm.model import GPT
from dist_llm.model.init import local_shard

log = logging.getLogger("dist_llm")


def _split(spec: str) -> tuple[str, Path]:
    kind, _, where = spec.partition(":")
    return kind, Path(where).expanduser()


def resolve_architecture(cfg: Config) -> Config:
    """`cfg` with the model.* architecture of an `hf:` start (unchanged otherwise)."""
    if not cfg.model.init_from.startswith("hf:"):
        return cfg
    from dist_llm.hf import model_config_from_hf

    _, where = _split(cfg.model.init_from)
    model = model_config_from_hf(where, base=cfg.model)
    data = cfg.data
    if data.tokenizer == "byte" and (where / "tokenizer.json").is_file():
        data = dataclasses.replace(data, tokenizer=str(where / "tokenizer.json"))
    if model.vocab_size < 256 and data.tokenizer == "byte":
        raise ConfigError(f"model.init_from: {where} has a vocabulary of {model.vocab_size}, too small for the byte "
                          "tokenizer; set data.tokenizer to its tokenizer.json")
    return dataclasses.replace(cfg, model=model, data=data)


def initial_state(cfg: Config) -> dict[str, torch.Tensor]:
    """The full (tp=1) weights to start from, by parameter name."""
    kind, where = _split(cfg.model.init_from)
    if kind == "hf":
        from dist_llm.hf import load_hf_state_dict

        return load_hf_state_dict(where, cfg.model)
    from dist_llm.train import checkpoint as ckpt

    if not ckpt.is_complete(where):
        raise ConfigError(f"model.init_from: {where} is not a complete checkpoint (no {ckpt.MANIFEST})")
    saved = config_from_dict(yaml.safe_load((where / "config.yaml").read_text()), check=False)
    if saved.fingerprint() != cfg.fingerprint():
        raise ConfigError(f"model.init_from: {where} holds a different model than the model.* settings describe")
    model = GPT(saved.model)
    ckpt.load_model_weights(where, model)
    return model.state_dict()


@torch.no_grad()
def load_initial_weights(model: GPT, cfg: Config, tp_state: object | None, tp_rank: int) -> None:
    """Overwrite `model`'s weights (this rank's slices when `tp_state`, a TensorParallelState, is given)."""
    full = initial_state(cfg)
    current = model.state_dict()
    if tp_state is not None:
        full = tp_state.to_local({"model": full, "optim": {"state": {}}},  # type: ignore[attr-defined]
                                 {"model": current, "optim": {"state": {}}}, tp_rank)["model"]
    for name, t in current.items():
        if name not in full:
            raise ConfigError(f"model.init_from: {cfg.model.init_from} has no weight for {name}")
        if full[name].shape != t.shape:
            raise ConfigError(f"model.init_from: weight {name} has shape {tuple(full[name].shape)}, this model "
                              f"wants {tuple(t.shape)}")
        if hasattr(t, "device_mesh") and not hasattr(full[name], "device_mesh"):  # an FSDP2 shard: its part only
            t.to_local().copy_(local_shard(full[name], t))
        else:
            t.copy_(full[name])
    log.info("initialised from %s", cfg.model.init_from)
