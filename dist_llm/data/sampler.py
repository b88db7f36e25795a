"""Which token windows each step trains on, independent of how the batch is spread over ranks.

A step's global batch is drawn from a generator seeded by (seed, stream, step) alone, then each
data-parallel rank takes a contiguous slice of it (and under context parallelism each cp rank of a dp
group its part of every window: `host_batch(positions=...)`). So changing dp or micro_batch_size changes who
computes what, never what is computed: runs with different layouts see the same data, and resuming
only needs the step number.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dist_llm.config import ConfigError

TRAIN_STREAM = 0
VAL_STREAM = 1


class GlobalBatchSampler:
    def __init__(self, n_tokens: int, block_size: int, global_batch_size: int, seed: int, *, stream: int = 0) -> None:
        # A window is block_size inputs plus one more token for the last target.
        if n_tokens < block_size + 2:
            split = "validation" if stream == VAL_STREAM else "training"
            raise ConfigError(f"model.block_size: {block_size} needs at least {block_size + 2} tokens, but the {split} "
                              f"split of data.source has {n_tokens}; use a larger corpus or a smaller block")
        if global_batch_size <= 0:
            raise ConfigError(f"train.global_batch_size: must be positive, got {global_batch_size}")
        self.n_tokens = n_tokens
        self.block_size = block_size
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.stream = stream
        self.step = 0
        """The next step to draw; the trainer advances it."""

    def starts(self, step: int) -> np.ndarray:
        """Start offsets of the global batch of `step`, int64, shape (global_batch_size,)."""
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, self.stream, step]))
        # Highest start is n_tokens - block_size - 1, so the target window still fits.
        return rng.integers(0, self.n_tokens - self.block_size, size=self.global_batch_size, dtype=np.int64)

    def micro_batch_starts(self, step: int, *, dp_rank: int, dp_size: int, micro_batch_size: int) -> list[np.ndarray]:
        """This rank's share of step `step`: a contiguous slice of the global batch, cut into micro-batches."""
        b = self.global_batch_size
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
        if b % dp_size or (b // dp_size) % micro_batch_size:
            raise ValueError(
                f"global batch {b} does not split into dp_size={dp_size} ranks of micro-batches of {micro_batch_size}")
        per_rank = b // dp_size
        mine = self.starts(step)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        return [mine[i:i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)]

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "seed": self.seed, "global_batch_size": self.global_batch_size,
                "stream": self.stream}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at the saved step. A different seed or batch size would silently change the data, so it is refused."""
        for key, config_key in (("seed", "train.seed"), ("global_batch_size", "train.global_batch_size")):
            if state[key] != getattr(self, key):
                raise ConfigError(f"{config_key}: the checkpoint's data order used {state[key]}, "
                                  f"the config says {getattr(self, key)}")
        if state["stream"] != self.stream:
            raise ValueError(f"sampler state is for stream {state['stream']}, this sampler draws stream {self.stream}")
        self.step = int(state["step"])


def val_sampler(n_tokens: int, block_size: int, global_batch_size: int) -> GlobalBatchSampler:
    """Validation windows: a fixed seed, so the val set is the same whatever the training seed."""
    return GlobalBatchSampler(n_tokens, block_size, global_batch_size, seed=0, stream=VAL_STREAM)


IGNORE_INDEX = -100  # a target the loss skips


def host_batch(tokens: np.ndarray, starts: np.ndarray, block_size: int, mask: np.ndarray | None = None, *,
               pin: bool = False, positions: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets on the host, int64 tensors of shape (B, T); y[:, i] == x[:, i + 1], or -100
    where `mask` (fine-tuning records) is 0 at that target: a prompt token, not to be learned. `pin` puts them
    in page-locked memory, from which a copy to the GPU runs asynchronously. `positions` takes only those
    positions of each window (a context-parallel rank's part of the sequence): (B, len(positions)) then."""
    if positions is not None:
        return _positions_batch(tokens, starts, mask, pin=pin, positions=positions)
    # One gather of T+1 tokens per window, (B, T+1); reading only these pages keeps memmaps cheap.
    index = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(block_size + 1)
    windows = tokens[index].astype(np.int64)
    # Contiguous copies so callers may .view() them (e.g. flattening targets for the loss).
    x = torch.from_numpy(np.ascontiguousarray(windows[:, :-1]))
    targets = windows[:, 1:].copy()  # a copy even when the slice is contiguous: x shares `windows`
    if mask is not None:
        targets[mask[index][:, 1:] == 0] = IGNORE_INDEX
    y = torch.from_numpy(targets)
    return (x.pin_memory(), y.pin_memory()) if pin else (x, y)


def _positions_batch(tokens: np.ndarray, starts: np.ndarray, mask: np.ndarray | None, *, pin: bool,
                     positions: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`host_batch` at the given positions of each window only: inputs at p, targets at p + 1."""
    index = np.asarray(starts, dtype=np.int64)[:, None] + np.asarray(positions, dtype=np.int64)  # (B, T_local)
    x = torch.from_numpy(tokens[index].astype(np.int64))
    targets = tokens[index + 1].astype(np.int64)
    if mask is not None:
        targets[mask[index + 1] == 0] = IGNORE_INDEX
    y = torch.from_numpy(targets)
    return (x.pin_memory(), y.pin_memory()) if pin else (x, y)


def to_device(x: torch.Tensor, y: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A host batch on `device`; from pinned memory the copy is queued without waiting (non_blocking)."""
    return x.to(device, non_blocking=x.is_pinned()), y.to(device, non_blocking=y.is_pinned())


def get_batch(tokens: np.ndarray, starts: np.ndarray, block_size: int,
              device: torch.device | str = "cpu", mask: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`host_batch` on `device` (through pinned memory to a GPU)."""
    device = torch.device(device)
    return to_device(*host_batch(tokens, starts, block_size, mask, pin=device.type == "cuda"), device)
