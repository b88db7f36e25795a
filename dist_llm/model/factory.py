"""The seam between the model and parallelism.

The GPT asks a `LayerFactory` for every layer that a parallel form may want to replace, naming the layer's
role. The plain factory returns ordinary PyTorch modules, so the model at tp=1 is plain PyTorch; a tensor
parallel factory returns column/row/vocab-parallel layers for the same roles and reports how many heads
each rank holds.
"""

from __future__ import annotations

import contextlib
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dist_llm.model.casting import cast_once

Reduction = Literal["mean", "sum"]

LinearRole = Literal["qkv", "attn_out", "mlp_up", "mlp_gate", "mlp_down", "lm_head"]


class SequenceSplit(Protocol):
    """The sequence split over ranks (context parallelism, parallel/context_parallel/): each rank holds some
    tokens of every sequence, at global positions of its own, and attention must see the whole sequence."""

    def positions(self, t_local: int, device: torch.device) -> torch.Tensor:
        """Global positions (t_local,) of the tokens this rank holds, in the order it holds them."""
        ...

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  alibi_slopes: torch.Tensor | None) -> torch.Tensor:
        """Causal attention of this rank's queries (B, nh, T, hs) to every rank's keys/values (B, nkv, T, hs)."""
        ...


class LayerFactory:
    """Builds the model's swappable layers. This one builds plain, unsharded PyTorch layers."""

    #: how many ranks share one attention layer's heads (tensor-parallel degree)
    shards: int = 1
    #: installed by context parallelism (parallel/context_parallel/apply.py); None: each rank holds whole sequences
    sequence: SequenceSplit | None = None
    def __init__(self, vocab_size: int = 0) -> None:
        #: the real vocabulary (the model's embedding may be padded beyond it); 0 = no padding to mask
        self.vocab_size = vocab_size

    def summary(self) -> str:
        return ""

    def linear(self, in_features: int, out_features: int, *, bias: bool, role: LinearRole) -> nn.Module:
        return nn.Linear(in_features, out_features, bias=bias)

    def moe_layers(self) -> "LayerFactory":
        """The factory for the layers inside an MoE block (its shared experts). They run on the tokens the MoE
        layer holds, with whole weights: a tensor-parallel factory hands out a plain one."""
        return self

    def linears(self, x: torch.Tensor, *layers: nn.Module) -> tuple[torch.Tensor, ...]:
        """The outputs of several linear layers that read the same input x (SwiGLU's gate and up): each layer
        called in turn here, on one autocast copy of x (model/casting.py) unless a layer has forward hooks (a
        LoRA joins its base layer through one, and its dropout would then act on the 16-bit copy); a
        tensor-parallel factory gives them one input collective."""
        hooked = any(m._forward_hooks or m._forward_pre_hooks for m in layers)
        inputs = (x,) * len(layers) if hooked else cast_once(x, len(layers))
        return tuple(layer(xi) for layer, xi in zip(layers, inputs))

    def embedding(self, num_embeddings: int, dim: int) -> nn.Module:
        return nn.Embedding(num_embeddings, dim)

    def replicated(self, module: nn.Module) -> nn.Module:
        """A layer that every rank of a parallel group holds whole and that works on activations (the norms)."""
        return module

    def positions(self, t: int, device: torch.device) -> torch.Tensor | None:
        """Global positions of the t tokens a forward holds; None when they are 0..t-1 (whole sequences)."""
        return None if self.sequence is None else self.sequence.positions(t, device)

    def sequence_slice(self, x: torch.Tensor) -> torch.Tensor:
        """The part of a (B, T, C) activation this rank works on between parallel layers (all of it here)."""
        return x

    def dropout(self, p: float) -> nn.Module:
        """Dropout on the residual stream (embedding, attention and MLP outputs), between the parallel layers."""
        return nn.Dropout(p)

    def attention_rng(self) -> contextlib.AbstractContextManager:
        """The random stream attention dropout draws from."""
        return contextlib.nullcontext()

    def output_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits of the real vocabulary from the head's output (which is padded to model.pad_vocab_to)."""
        return logits[..., : self.vocab_size] if self.vocab_size else logits

    def local_heads(self, n_head: int, n_kv_head: int) -> tuple[int, int]:
        """(query heads, kv heads) held by this rank."""
        return n_head, n_kv_head

    def first_head(self, n_head: int) -> int:
        """Index of the first query head this rank holds (ALiBi slopes are per head)."""
        return 0

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor, *, reduction: Reduction = "mean") -> torch.Tensor:
        """Token cross-entropy of logits (B, T, V) against targets (B, T), its mean over the unmasked targets or
        ("sum") their sum; computed in fp32, with the vocabulary padding (ids >= vocab_size) masked out and
        targets of -100 (masked prompt tokens) ignored."""
        logits = logits.float()
        if self.vocab_size and logits.shape[-1] > self.vocab_size:
            logits = logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) >= self.vocab_size,
                                        float("-inf"))
        targets = targets.flatten()
        total = F.cross_entropy(logits.flatten(0, 1), targets, reduction="sum")  # -100 targets add nothing
        if reduction == "sum":
            return total
        return total / (targets != -100).sum().clamp(min=1)  # (a mean over no target would be nan)
