"""The tensor-parallel plan: which layer of the GPT becomes which parallel layer, as a LayerFactory.

  qkv             column-parallel, whole heads per rank (and whole KV groups under GQA; with fewer KV heads
                  than ranks, each rank holds the KV head its queries read, its gradient summed over sharers)
  attn_out        row-parallel
  mlp_up, gate    column-parallel, one input collective for both (`linears`)
  mlp_down        row-parallel
  wte, lm_head    vocab-parallel (tied when tie_embeddings), and a vocab-parallel cross-entropy

With sequence parallelism the regions between those layers (norms, dropout, residual adds) hold 1/tp of
the sequence; the norms (and row-parallel biases) then carry `sequence_parallel`, so their gradients,
computed from a slice of the sequence, are all-reduced over tp; and dropout there draws its masks from a
stream of each rank's own (as attention dropout, which acts on each rank's heads, always does).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from dist_llm.config import Config, ModelConfig
from dist_llm.model.factory import LayerFactory, LinearRole, Reduction
from dist_llm.parallel import comm
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.tensor import mappings as tpc
from dist_llm.parallel.marks import is_sequence_parallel, mark_sequence_parallel
from dist_llm.parallel.tensor.layers import (
    ColumnParallelLinear,
    RankLocalDropout,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_linears,
    rank_local_rng,
    vocab_parallel_cross_entropy,
)


def qkv_rows(cfg: ModelConfig, tp: int, rank: int) -> tuple[torch.Tensor, tuple[int, int, int, int] | None]:
    """Rows of the fused [q; k; v] weight that rank `rank` holds: its n_head/tp query heads and the KV heads
    they read (query head h reads KV head h // (n_head / n_kv_head), so the groups line up). With fewer KV
    heads than ranks, each rank holds the one KV head its queries read, shared with tp/n_kv_head - 1 other
    ranks; the second value then says which local rows are shared, and by which group: (first, end,
    group index, number of groups)."""
    hd, nh, nkv = cfg.head_dim, cfg.n_head, cfg.kv_heads
    q_heads = nh // tp
    first_kv, kv_heads = (rank * nkv // tp, nkv // tp) if nkv >= tp else ((rank * q_heads) // (nh // nkv), 1)

    def head_rows(offset: int, first: int, count: int) -> torch.Tensor:
        return offset + torch.arange(first * hd, (first + count) * hd, device="cpu")  # (also under a meta build)

    rows = torch.cat([head_rows(0, rank * q_heads, q_heads),
                      head_rows(nh * hd, first_kv, kv_heads),
                      head_rows((nh + nkv) * hd, first_kv, kv_heads)])
    shared = (q_heads * hd, (q_heads + 2) * hd, first_kv, nkv) if nkv < tp else None
    return rows, shared


class TensorParallelFactory(LayerFactory):
    def __init__(self, cfg: Config, ctx: ParallelContext) -> None:
        super().__init__(vocab_size=cfg.model.vocab_size)
        self.model_cfg = cfg.model
        self.group, self.stats = ctx.tp_group, ctx.comm
        self.shards, self.rank = ctx.tp, ctx.tp_rank
        self.sequence_parallel = cfg.parallel.sequence_parallel
        self.device = ctx.device
        self.applied: dict[str, int] = {"column": 0, "row": 0, "vocab": 0}

    def linear(self, in_features: int, out_features: int, *, bias: bool, role: LinearRole) -> nn.Module:
        sp = self.sequence_parallel
        if role in ("attn_out", "mlp_down"):
            self.applied["row"] += 1
            return RowParallelLinear(in_features, out_features, bias=bias, group=self.group, stats=self.stats,
                                     sequence_parallel=sp)
        rows, shared = qkv_rows(self.model_cfg, self.shards, self.rank) if role == "qkv" else (None, None)
        self.applied["vocab" if role == "lm_head" else "column"] += 1
        return ColumnParallelLinear(in_features, out_features, bias=bias, group=self.group, stats=self.stats,
                                    rows=rows, sequence_parallel=sp, replicated=shared)

    def linears(self, x: torch.Tensor, *layers: nn.Module) -> tuple[torch.Tensor, ...]:
        """Column-parallel layers reading one input share its collective (one all-reduce of the summed input
        gradient; under SP one all-gather and one reduce-scatter). A layer with hooks (a LoRA joins its base
        layer through a forward hook) is called as a module, so that they run: each then has its own."""
        plain = all(type(m) is ColumnParallelLinear and not (m._forward_hooks or m._forward_pre_hooks)
                    for m in layers)
        if plain:
            return column_parallel_linears(x, *layers)  # type: ignore[arg-type]
        return tuple(layer(x) for layer in layers)  # (each enters the tp region itself: its input in x's dtype)

    def moe_layers(self) -> LayerFactory:
        """An MoE layer splits its tokens over tp and holds whole weights (parallel/tensor/moe.py): its shared
        experts are plain layers."""
        return LayerFactory(vocab_size=self.vocab_size)

    def embedding(self, num_embeddings: int, dim: int) -> nn.Module:
        self.applied["vocab"] += 1
        return VocabParallelEmbedding(num_embeddings, dim, group=self.group, stats=self.stats,
                                      sequence_parallel=self.sequence_parallel)

    def replicated(self, module: nn.Module) -> nn.Module:
        """A layer every tp rank holds whole (the norms): with sequence parallelism it sees a slice of the
        sequence, so its gradients are partial sums to all-reduce over tp."""
        if self.sequence_parallel:
            for p in module.parameters():
                mark_sequence_parallel(p)
        return module

    def sequence_slice(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) replicated -> this rank's slice of the sequence under sequence parallelism."""
        return tpc.scatter_to_sequence(x, self.group, self.stats) if self.sequence_parallel else x

    def local_heads(self, n_head: int, n_kv_head: int) -> tuple[int, int]:
        return n_head // self.shards, max(1, n_kv_head // self.shards)

    def first_head(self, n_head: int) -> int:
        return self.rank * (n_head // self.shards)

    def attention_rng(self) -> contextlib.AbstractContextManager:
        """Attention dropout acts on this rank's heads: its mask comes from the tp-local stream."""
        return rank_local_rng(self.rank, self.device)

    def dropout(self, p: float) -> nn.Module:
        """Under sequence parallelism each rank holds its own slice of the sequence there: a tp-local mask.
        Without it every rank holds the same whole activation, which must get the same mask: the shared stream."""
        return RankLocalDropout(p, rank=self.rank) if self.sequence_parallel else nn.Dropout(p)

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor, *, reduction: Reduction = "mean") -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, vocab_start=self.rank * logits.shape[-1],
                                            valid=self.vocab_size, group=self.group, stats=self.stats,
                                            reduction=reduction)

    def output_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Full logits for the real vocabulary (gathered from the vocab-parallel slices)."""
        return tpc.gather_from_tp(logits, self.group, self.stats)[..., : self.vocab_size]

    def summary(self) -> str:
        a = self.applied
        sp = ", sequence parallel" if self.sequence_parallel else ""
        return f"applied tensor parallel (tp={self.shards}{sp}): {a['column']} column, {a['row']} row, {a['vocab']} vocab"


def sync_sequence_parallel_grads(grad_shards: list[tuple[nn.Parameter, torch.Tensor, int]],
                                 ctx: ParallelContext, *, bucket_mb: float | None = None) -> None:
    """All-reduce over tp the gradients of replicated parameters that saw only a slice of the sequence
    (norms and row-parallel biases under sequence parallelism, MoE layers under tp), in flat all-reduces of up
    to `bucket_mb` MiB (`parallel.bucket_mb`; None: one): with MoE these are every local expert's gradients,
    and one flat copy of them all would be a second copy of the stage's experts. Every tp rank forms the same
    buckets (the same parameters in the same order), so the collectives pair up."""
    grads = [g for p, g, _ in grad_shards if is_sequence_parallel(p) and g.numel()]
    if not grads or ctx.tp == 1:
        return
    cap = None if bucket_mb is None else max(1, int(bucket_mb * 2**20))
    for bucket in _buckets(grads, cap):
        # offloaded gradients (parallel.offload=cpu) live on the host, which an NCCL group does not reduce: their
        # bucket goes to the collectives' device and back
        here = bucket[0].device.type == ctx.device.type
        if here and len(bucket) == 1 and bucket[0].is_contiguous():  # (one tensor, a large one: in place, no copy)
            comm.all_reduce(bucket[0], ctx.tp_group, ctx.comm)
            continue
        flat = torch.cat([g.reshape(-1) for g in bucket]).to(ctx.device)
        comm.all_reduce(flat, ctx.tp_group, ctx.comm)
        flat = flat.to(bucket[0].device)
        torch._foreach_copy_(bucket, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in bucket]), bucket)])


def _buckets(grads: list[torch.Tensor], cap_bytes: int | None) -> list[list[torch.Tensor]]:
    """`grads` in order, cut into runs of at most `cap_bytes` (a tensor larger than that alone)."""
    out: list[list[torch.Tensor]] = [[]]
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if out[-1] and cap_bytes is not None and size + nbytes > cap_bytes:
            out.append([])
            size = 0
        out[-1].append(g)
        size += nbytes
    return out
