"""Text generation from a checkpoint (`dist-llm sample`)."""

from __future__ import annotations

from pathlib import Path

import torch

from dist_llm.config import Config, ConfigError
from dist_llm.data import load_tokenizer
from dist_llm.model import GPT
from dist_llm.parallel.context import pick_device
from dist_llm.peft.base_identity import check_base
from dist_llm.train import checkpoint as ckpt


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory, a run directory or its checkpoints/ folder (then the newest complete one)."""
    if ckpt.is_complete(path):
        return path
    for root in (path / "checkpoints", path):
        latest = ckpt.latest_checkpoint(root)
        if latest is not None:
            return latest
    raise ConfigError(f"--checkpoint: no complete checkpoint at {path}")


def checked_checkpoint(path: Path, what: str) -> tuple[Path, Config]:
    """The checkpoint `path` names (`resolve_checkpoint`) and its config, once its files match its manifest:
    a damaged one is refused in one line naming the file, as resume refuses it (`what`: the flag that named it)."""
    path = resolve_checkpoint(path)
    ckpt.refuse_damaged(path, what)
    return path, ckpt.saved_config(path, what)


def load_model(path: Path, device: torch.device, *, init_from: str | None = None) -> tuple[GPT, Path]:
    """The checkpoint's model in eval mode; `init_from` replaces the base model a PEFT checkpoint names."""
    path, cfg = checked_checkpoint(path, "--checkpoint")
    if init_from is not None:
        cfg.model.init_from = init_from
    if cfg.peft.method == "none":
        model = GPT(cfg.model).to(device)
        ckpt.load_model_weights(path, model)
        return model.eval(), path
    # A PEFT checkpoint holds the trained tensors only: rebuild its base as training did (from
    # model.init_from, or the seeded random init), add the PEFT modules, then load those tensors.
    _check_base(cfg.model.init_from, path, overridden=init_from is not None)
    check_base(path, ckpt.read_json(path / ckpt.MANIFEST).get("peft_base"), cfg.model.init_from, "sample")
    if not cfg.model.init_from:  # (the base drawn from train.seed, as this version draws it)
        ckpt.check_seeded_base(path, cfg, what="sample")
    from dist_llm.parallel.context import ParallelContext
    from dist_llm.train.trainer import build_model

    cfg.train.compile = False
    ctx = ParallelContext(rank=0, world_size=1, local_rank=0, dp=1, tp=1, pp=1, device=device)
    model = build_model(cfg, ctx)
    ckpt.load_model_weights(path, model, trainable_only=True)
    return model.eval(), path


def _check_base(init_from: str, path: Path, *, overridden: bool) -> None:
    """A PEFT checkpoint holds its adapters only: the base it adapts must still be where training read it."""
    kind, _, where = init_from.partition(":")
    if kind not in ("hf", "ckpt") or Path(where).is_dir():
        return
    source = "--init-from" if overridden else f"model.init_from in {path / 'config.yaml'}"
    raise ConfigError(f"{source}: the base model directory {where} is not found; give where it is now with "
                      f"--init-from {kind}:DIR")


def sample_text(path: Path, prompt: str, *, max_new_tokens: int, temperature: float, top_k: int | None,
                seed: int, device: str = "auto", init_from: str | None = None) -> str:
    dev = pick_device(device, 0)
    model, path = load_model(path, dev, init_from=init_from)
    tok_file = path / "tokenizer.json"
    tokenizer = load_tokenizer(str(tok_file) if tok_file.is_file() else "byte")
    ids = tokenizer.encode(prompt) or [0]
    gen = torch.Generator(device=dev).manual_seed(seed)
    out = model.generate(torch.tensor([ids], device=dev), max_new_tokens, temperature=temperature,
                         top_k=top_k, generator=gen)
    return tokenizer.decode(out[0].tolist())
