"""The identity of the frozen base a PEFT checkpoint adapts, from its bytes, not its path.

A PEFT checkpoint holds the adapters only; its base is read again from `model.init_from` by resume, `sample`
and `convert --to-hf`. Another model of the same shapes put at the same path (a re-download of another
revision, a fine-tuned copy) would be adapted without a word, and the merged export would be wrong. Reading a
70B base whole to hash it would take minutes, so the digest reads a fixed sample of each weight file: its size,
its first MiB (a safetensors header and the first tensors) and 16 windows of 64 KiB spread over the rest.
Two trainings, or two revisions, differ in nearly every weight, so they differ in the sample; an edit of a few
bytes between the windows is not seen (the files are not checksummed whole: that is what a checkpoint's
manifest does for `ckpt:` bases, whose manifest is hashed here instead).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from dist_llm.config import ConfigError

HEAD_BYTES = 1 << 20
WINDOWS = 16
WINDOW_BYTES = 64 << 10


def _sample(file: Path, digest: "hashlib._Hash") -> None:
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(f"{file.name}:{size}:".encode())
        digest.update(f.read(HEAD_BYTES))
        if size <= HEAD_BYTES:
            return
        span = size - HEAD_BYTES
        for k in range(WINDOWS):
            f.seek(HEAD_BYTES + span * k // WINDOWS)
            digest.update(f.read(WINDOW_BYTES))


def base_digest(init_from: str) -> str | None:
    """The sampled digest of the weights `init_from` (`hf:DIR` or `ckpt:DIR`) names, None for a base drawn from
    train.seed; a ConfigError naming the directory where it cannot be read."""
    kind, _, where = init_from.partition(":")
    if kind not in ("hf", "ckpt") or not where:
        return None
    folder = Path(where).expanduser()
    digest = hashlib.sha256()
    try:
        if kind == "ckpt":  # (its manifest holds every file's sha256 already)
            digest.update((folder / "manifest.json").read_bytes())
        else:
            from dist_llm.hf import weight_files

            # (not config.json: its architecture is the model fingerprint beside the digest, and its other keys,
            # a transformers version, change nothing the adapters see)
            for file in weight_files(folder):
                _sample(file, digest)
    except OSError as e:
        raise ConfigError(f"model.init_from: cannot read the base model in {folder} ({e.strerror or e})") from None
    return digest.hexdigest()[:32]


def check_base(checkpoint: Path, peft_base: object, init_from: str, what: str, *, now: str | None = None) -> None:
    """That the base `init_from` names now is the one the PEFT checkpoint (its manifest's `peft_base`) was trained
    on, by their digests (`now`: the digest of `init_from` taken already); a checkpoint written before the digest
    was kept is taken at its word."""
    saved = peft_base.get("weights") if isinstance(peft_base, dict) else None
    if saved is None:
        return
    if not isinstance(saved, str) or len(saved) != 32 or any(c not in "0123456789abcdef" for c in saved):
        raise ConfigError(f"{what}: {checkpoint / 'manifest.json'}: peft_base.weights is {saved!r:.80}, not a digest "
                          "(a damaged manifest)")
    now = now or base_digest(init_from)
    if now != saved:
        where = init_from.partition(":")[2] or "train.seed"
        to = "--init-from" if what == "sample" else "model.init_from"
        raise ConfigError(f"{what}: the base model in {where} is not the one {checkpoint} was trained on (a sample "
                          f"of its weight files differs: replaced, changed or re-sharded since); point {to} at that "
                          "model")
