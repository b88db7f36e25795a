"""The seam between the model and parallelism.

The GPT asks a `LayerFactory` for every layer that a parallel form may want to replace, naming the layer's
role. The plain factory returns ordinary PyTorch modules, so the model at tp=1 is plain PyTorch; a tensor
parallel factory returns column/row/vocab-parallel layers for the same roles and reports how many heads
each rank holds.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

LinearRole = Literal["qkv", "attn_out", "mlp_up", "mlp_gate", "mlp_down", "lm_head"]


class LayerFactory:
    """Builds the model's swappable layers. This one builds plain, unsharded PyTorch layers."""

    #: how many ranks share one attention layer's heads (tensor-parallel degree)
    shards: int = 1

    def linear(self, in_features: int, out_features: int, *, bias: bool, role: LinearRole) -> nn.Module:
        return nn.Linear(in_features, out_features, bias=bias)

    def embedding(self, num_embeddings: int, dim: int) -> nn.Module:
        return nn.Embedding(num_embeddings, dim)

    def local_heads(self, n_head: int, n_kv_head: int) -> tuple[int, int]:
        """(query heads, kv heads) held by this rank."""
        return n_head, n_kv_head

    def first_head(self, n_head: int) -> int:
        """Index of the first query head this rank holds (ALiBi slopes are per head)."""
        return 0

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy of logits (B, T, V) against targets (B, T); computed in fp32."""
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
