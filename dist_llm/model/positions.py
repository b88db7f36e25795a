"""Position encodings: rotary (RoPE) and linear biases (ALiBi). Learned absolute ones are an nn.Embedding in gpt.py."""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the 'rotate half' layout (the one Hugging Face Llama uses).

    cos/sin tables are non-persistent buffers: they move with the module and never enter a checkpoint.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self._gathered: tuple[tuple, torch.Tensor, torch.Tensor] | None = None  # see `_at`

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        freqs = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float32), inv_freq)  # (T, hs/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, hs)
        return emb.cos(), emb.sin()

    def reset_parameters(self) -> None:
        """Recompute the tables (after a model built on the meta device is materialised)."""
        cos, sin = self._tables()
        self.cos.copy_(cos.to(self.cos.device))
        self.sin.copy_(sin.to(self.sin.device))
        self._gathered = None

    reset_buffers = reset_parameters  # (the name model/init.py looks for)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        self._gathered = None  # (moved or cast: the old pair would pin the old device's memory)
        return super()._apply(fn, recurse)

    def __getstate__(self) -> dict:
        # (the pair's key holds storages that alias the tables: torch.save refuses them and pickle cannot rebuild
        # them; a copy gathers its own)
        return {**super().__getstate__(), "_gathered": None}

    def forward(self, q: torch.Tensor, k: torch.Tensor,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q (B, nh, T, hs) and k (B, nkv, T, hs) at `positions` (T,) (default 0..T-1); computed in fp32,
        returned in the input dtype."""
        if positions is None:
            T = q.shape[-2]
            cos, sin = self.cos[:T], self.sin[:T]
        else:
            cos, sin = self._at(positions)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def _at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables gathered at `positions`. Context parallelism's positions are one tensor per length
        (parallel/context_parallel/apply.py), asked for by every block of every micro-batch, and each block's
        rotation keeps the pair for backward: gathered once and kept, one pair is alive rather than one a block
        and micro-batch (2 x 16,384 x 128 fp32 a block, 16 MiB, for a Llama-7B rank holding 16k tokens). The key
        is the tensors themselves, their version counters (an in-place write through them gathers again) and
        their storages (a `.data` swap, as model/buffers.py casts buffers, does too); the pair holds the storages,
        so no other tensor can take their memory and be mistaken for them."""
        tensors = (positions, self.cos, self.sin)
        if torch.compiler.is_compiling() or torch.is_inference_mode_enabled() or any(t.is_inference() for t in tensors):
            # (a compiled graph gathers them itself; inference tensors cannot be saved by a later training forward
            # and keep no version counter)
            return self.cos[positions], self.sin[positions]
        key = tuple(x for t in tensors for x in (t, t._version, t.untyped_storage(), t.dtype))
        hit = self._gathered
        if hit is None or any(a is not b if isinstance(a, torch.Tensor) else a != b for a, b in zip(hit[0], key)):
            hit = self._gathered = (key, self.cos[positions], self.sin[positions])
        return hit[1], hit[2]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def alibi_slopes(n_head: int) -> torch.Tensor:
    """Per-head slopes of Press et al. (2022): a geometric sequence starting at 2^(-8/n) for n a power of
    two; otherwise the slopes of the closest smaller power of two, then every other slope of the next."""

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_head).is_integer():
        slopes = power_of_two(n_head)
    else:
        closest = 2 ** math.floor(math.log2(n_head))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: n_head - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: torch.Tensor, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Causal ALiBi bias (nh, T, T): -slope * distance on and below the diagonal, -inf above."""
    pos = torch.arange(seq_len, device=slopes.device)
    distance = (pos[None, :] - pos[:, None]).float()  # j - i, <= 0 where attention is allowed
    bias = slopes.float()[:, None, None] * distance[None]
    bias = bias.masked_fill(distance[None] > 0, float("-inf"))
    return bias.to(dtype)




# One ALiBi bias for every block while any holds it: see `shared_alibi_bias`.
_ALIBI_BIASES: weakref.WeakValueDictionary[tuple, torch.Tensor] = weakref.WeakValueDictionary()
# CUDA's memory-efficient SDPA copies a bias whose rows are not aligned to this many elements into a padded
# tensor of its own at every call (aten's preprocess_mask), which it then keeps; a bias built padded and sliced
# is used as it is.
_BIAS_ROW_ALIGNMENT = 8


def shared_alibi_bias(slopes: torch.Tensor, slope_values: "SlopeValues", seq_len: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """`alibi_bias` for `slopes` (whose values `slope_values` reads), the same tensor for every caller while one of
    them holds it. Each block asks for the bias of its heads; where SDPA's kernel keeps the bias for backward
    (CUDA's memory-efficient one), a bias a block and micro-batch stayed alive, 32 x 256 MiB for an MPT-7B shape
    (32 heads, 2,048 tokens, bf16); shared, one does. Held weakly, so it is freed with the last graph that saved
    it (nothing kept between steps). Keyed on the slopes' values, dtype and device, the length and the bias
    dtype. Its rows are padded to `_BIAS_ROW_ALIGNMENT` elements (a (heads, T, T) view). Not shared under compile
    (the graph builds its own), in inference mode (an inference tensor cannot be saved by a later training
    forward) or on the meta device."""
    if (torch.compiler.is_compiling() or torch.is_inference_mode_enabled() or slopes.is_inference()
            or slopes.device.type == "meta"):
        return alibi_bias(slopes, seq_len, dtype)
    key = (slope_values(slopes), slopes.dtype, slopes.device, seq_len, dtype)
    # The padded tensor is what is cached: a view saved for backward (SDPA's broadcast of the bias) keeps its
    # base alive, not the views between.
    rows = _ALIBI_BIASES.get(key)
    if rows is None:
        padded = -(-seq_len // _BIAS_ROW_ALIGNMENT) * _BIAS_ROW_ALIGNMENT
        rows = torch.empty(slopes.shape[0], seq_len, padded, dtype=dtype, device=slopes.device)
        rows[..., :seq_len].copy_(alibi_bias(slopes, seq_len, dtype))
        _ALIBI_BIASES[key] = rows
    return rows[..., :seq_len]


class SlopeValues:
    """A slopes tensor's values as Python floats, read again only after the tensor changes through autograd's
    view of it (an in-place write, a cast or a `.data` swap: its version counter or storage differs; a write
    through `.data` goes unseen, and nothing here makes one); reading them waits for the device, so not once a
    forward. Not carried by a pickle or a copy (it holds a storage)."""

    def __init__(self) -> None:
        self._seen: tuple[int, object, tuple[float, ...]] | None = None

    def __call__(self, slopes: torch.Tensor) -> tuple[float, ...]:
        storage = slopes.untyped_storage()  # (held: no other tensor can take its memory while it is compared)
        if self._seen is None or self._seen[0] != slopes._version or self._seen[1] is not storage:
            self._seen = (slopes._version, storage, tuple(slopes.tolist()))
        return self._seen[2]

    def __getstate__(self) -> dict:
        return {"_seen": None}
