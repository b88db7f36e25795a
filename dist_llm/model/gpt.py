"""A decoder-only GPT, readable top to bottom.

Token embedding -> [learned positions] -> n_layer x (pre-norm attention, pre-norm MLP) -> norm -> LM head.
The model knows nothing of parallelism: every layer a parallel form may swap comes from a `LayerFactory`,
and `embed`, `blocks` and `head` are separate so a pipeline can cut the model into stages.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterable, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dist_llm.config import ModelConfig
from dist_llm.model import init as model_init
from dist_llm.model.factory import LayerFactory, Reduction
from dist_llm.model.moe import MoE, moe_layers
from dist_llm.model.positions import RotaryEmbedding, SlopeValues, alibi_slopes, shared_alibi_bias

Checkpointing = Literal["none", "full", "selective"]


def make_norm(cfg: ModelConfig, layers: LayerFactory) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return layers.replicated(nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps))
    return layers.replicated(nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias))


class Attention(nn.Module):
    """Causal self-attention with n_kv_head <= n_head (MHA, GQA, MQA) through SDPA."""

    def __init__(self, cfg: ModelConfig, layers: LayerFactory, rope: RotaryEmbedding | None) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.layers = layers
        self.n_head, self.n_kv_head = layers.local_heads(cfg.n_head, cfg.kv_heads)
        qkv_out = (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim
        self.qkv = layers.linear(cfg.n_embd, qkv_out, bias=cfg.bias or cfg.qkv_bias, role="qkv")
        self.proj = layers.linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=cfg.bias, role="attn_out")
        self.dropout = cfg.dropout
        self.resid_dropout = layers.dropout(cfg.dropout)
        self.rope = rope
        if cfg.pos_emb == "alibi":
            self.first_head = layers.first_head(cfg.n_head)  # a tensor-parallel rank holds a contiguous range of heads
            self.register_buffer("alibi_slopes", self._slopes(cfg.n_head), persistent=False)
            self._slope_values = SlopeValues()
        else:
            self.alibi_slopes = None
        self.total_heads = cfg.n_head
        self.checkpoint_core = False  # selective activation checkpointing recomputes only `core`

    def _slopes(self, n_head: int) -> torch.Tensor:
        return alibi_slopes(n_head)[self.first_head : self.first_head + self.n_head]

    def reset_buffers(self) -> None:
        """Recompute the ALiBi slopes (after a model built on the meta device is materialised)."""
        if self.alibi_slopes is not None:
            self.alibi_slopes.copy_(self._slopes(self.total_heads).to(self.alibi_slopes.device))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Scaled dot-product attention over (B, nh, T, hs) queries and (B, nkv, T, hs) keys/values."""
        if self.layers.sequence is not None:  # the sequence split over ranks: attention over all of it
            return self.layers.sequence.attention(q, k, v, alibi_slopes=self.alibi_slopes)
        dropout = self.dropout if self.training else 0.0
        gqa = self.n_kv_head != self.n_head
        bias = None
        if self.alibi_slopes is not None:  # one bias for all the blocks (CUDA's efficient kernel keeps it)
            bias = shared_alibi_bias(self.alibi_slopes, self._slope_values, q.shape[-2], q.dtype)
        with self.layers.attention_rng() if dropout else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=bias is None,
                                                  dropout_p=dropout, enable_gqa=gqa)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # under sequence parallelism x holds a slice of the sequence and qkv all of it
        B, T, _ = qkv.shape
        q, k, v = qkv.split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim], dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        if self.rope is not None:
            q, k = self.rope(q, k, self.layers.positions(T, q.device))
        if self.checkpoint_core and self.training:
            y = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            y = self.core(q, k, v)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, nh*hs)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """GELU (up, gelu, down) or SwiGLU (down(silu(gate x) * up x))."""

    def __init__(self, cfg: ModelConfig, layers: LayerFactory, hidden: int = 0) -> None:
        super().__init__()
        hidden = hidden or cfg.ffn_hidden
        self.layers = layers
        self.swiglu = cfg.mlp == "swiglu"
        self.up = layers.linear(cfg.n_embd, hidden, bias=cfg.bias, role="mlp_up")
        self.gate = layers.linear(cfg.n_embd, hidden, bias=cfg.bias, role="mlp_gate") if self.swiglu else None
        self.down = layers.linear(hidden, cfg.n_embd, bias=cfg.bias, role="mlp_down")
        self.dropout = layers.dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            gate, up = self.layers.linears(x, self.gate, self.up)  # (B, T, hidden) each
            h = F.silu(gate) * up
        else:
            h = F.gelu(self.up(x), approximate="tanh")  # GPT-2's GELU
        return self.dropout(self.down(h))


class Block(nn.Module):
    """Pre-norm attention, then a pre-norm dense MLP (`mlp`) or, in an MoE block, a mixture of experts (`moe`)."""

    def __init__(self, cfg: ModelConfig, layers: LayerFactory, rope: RotaryEmbedding | None, *,
                 moe: bool = False) -> None:
        super().__init__()
        self.ln_1 = make_norm(cfg, layers)
        self.attn = Attention(cfg, layers, rope)
        self.ln_2 = make_norm(cfg, layers)
        if moe:
            inner = layers.moe_layers()  # (plain layers under tp: the MoE layer splits its tokens instead)
            shared = MLP(cfg, inner, hidden=cfg.moe_shared_expert_hidden) if cfg.n_shared_experts else None
            if shared is not None:
                shared.dropout = nn.Identity()  # (the MoE's output gets one dropout, as the dense MLP's)
            self.moe = MoE(cfg, shared, layers.dropout(cfg.dropout))
        else:
            self.mlp = MLP(cfg, layers)

        self.recompute = False  # full activation checkpointing: keep only the input, recompute in backward

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + (self.moe if hasattr(self, "moe") else self.mlp)(self.ln_2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and self.training:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: LayerFactory | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        layers = layers or LayerFactory(vocab_size=cfg.vocab_size)
        self.layers = layers
        self.wte = layers.embedding(cfg.padded_vocab, cfg.n_embd)
        # (under sequence parallelism the slice of its output is taken by an op whose backward gathers the
        # gradient, so unlike the norms it needs no all-reduce)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.pos_emb == "learned" else None
        self.drop = layers.dropout(cfg.dropout)
        rope = RotaryEmbedding(cfg.head_dim, cfg.block_size, cfg.rope_theta) if cfg.pos_emb == "rope" else None
        self.rope = rope
        self.blocks = nn.ModuleList(Block(cfg, layers, rope, moe=cfg.is_moe_block(i)) for i in range(cfg.n_layer))
        self.ln_f = make_norm(cfg, layers)
        self.lm_head = layers.linear(cfg.n_embd, cfg.padded_vocab, bias=False, role="lm_head")
        self.tie_weights()
        if not self.wte.weight.is_meta:  # built on the meta device: parallelize() materialises and initialises
            self.reset_parameters()

    # -- initialisation ---------------------------------------------------------------------------------
    def tie_weights(self) -> None:
        """The LM head shares the token embedding (again after `to_empty`, which gives each module a new tensor)."""
        if self.cfg.tie_embeddings and self.wte is not None and self.lm_head is not None:
            self.lm_head.weight = self.wte.weight

    def _init_rule(self, mod_name: str, module: nn.Module, pname: str) -> model_init.Fill:
        """GPT-2 init: N(0, init_std) for weights, residual projections scaled by 1/sqrt(2*n_layer); zero biases;
        norms at one."""
        if pname == "bias" or pname.startswith("b_"):  # (b_up, b_down: the stacked experts' biases)
            return model_init.zeros
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            return model_init.ones
        std = self.cfg.init_std
        # (an expert's w_down (E, H, C): each expert drawn alone, the same whichever rank holds it)
        if mod_name.endswith(("attn.proj", "mlp.down", "shared.down")) or pname == "w_down":
            std = std / math.sqrt(2 * self.cfg.n_layer)
        return model_init.normal(std)

    def reset_parameters(self, seed: int | None = None, *, only: Iterable[str] | None = None) -> int:
        """Initialise every parameter (those named in `only`, if given) from its own generator, seeded by (seed,
        its name): the same values at every parallel layout (see model/init.py). Without a seed one is drawn
        from the global stream, so `torch.manual_seed(s)` before fixes the result. Buffers are recomputed too
        (without `only`). Returns how many parameters it visited (one still on the meta device is left as is)."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), device="cpu").item())
        count = model_init.init_parameters(self, seed, self._init_rule, only=only)
        if only is None:
            self.reset_buffers()
        return count

    def reset_buffers(self) -> None:
        """Recompute the non-persistent buffers (RoPE tables, ALiBi slopes, tensor-parallel row indices)."""
        model_init.reset_buffers(self)

    def set_activation_checkpointing(self, mode: Checkpointing) -> None:
        """'full' recomputes each block in backward; 'selective' only the attention core. Parameter names
        do not change, so checkpoints move between runs with and without it."""
        for block in self.blocks:
            if not isinstance(block, Block):  # a placeholder for a block another pipeline stage holds
                continue
            block.recompute = mode == "full"
            block.attn.checkpoint_core = mode == "selective"

    # -- forward, in pieces a pipeline stage can take -----------------------------------------------------
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> residual stream (B, T, C)."""
        x = self.wte(idx)  # (B, T, C), or (B, T/tp, C) under sequence parallelism
        if self.wpe is not None:
            pos = self.layers.positions(idx.shape[1], idx.device)
            pos = torch.arange(idx.shape[1], device=idx.device) if pos is None else pos
            x = x + self.layers.sequence_slice(self.wpe(pos)[None])
        return self.drop(x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Residual stream (B, T, C) -> logits (B, T, V)."""
        return self.lm_head(self.ln_f(x))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, *, reduction: Reduction = "mean") -> torch.Tensor:
        return self.layers.cross_entropy(logits, targets, reduction=reduction)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                reduction: Reduction = "mean",
                part: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Logits (B, T, vocab_size) for token ids (B, T); with targets, the cross-entropy instead: its mean over
        the targets that are not -100, or ("sum") its sum over them (the trainer divides by a count of its own).
        `part(idx)` runs instead of the whole forward: a piece of the model (a pipeline stage's embed / blocks /
        head) called through this module, so that hooks on the model's call run around it (FSDP2's root unit)."""
        if part is not None:
            return part(idx)
        if idx.shape[1] > self.cfg.block_size:
            raise ValueError(f"sequence of {idx.shape[1]} tokens is longer than model.block_size={self.cfg.block_size}")
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return self.layers.output_logits(logits)
        loss = self.loss(logits, targets, reduction=reduction)
        return loss + self._balancing_gradient(targets, reduction) if self.cfg.n_experts else loss

    def _balancing_gradient(self, targets: torch.Tensor, reduction: Reduction) -> torch.Tensor:
        """Zero in value, the MoE layers' load-balancing losses in gradient: the returned loss stays the LM loss
        (what the trainer reports) while backward also trains the routers toward balance. Under "sum" the
        micro-batch's losses count once per target, so that the trainer's division by the global target count
        weighs them as the mean over micro-batches (and data-parallel ranks) of each one's balancing loss."""
        terms = [m.last_loss for m in moe_layers(self) if m.last_loss is not None]
        if not terms or not torch.is_grad_enabled():
            return torch.zeros((), device=targets.device)
        extra = torch.stack(terms).sum()
        if reduction == "sum":
            extra = extra * (targets != -100).sum()
        return extra - extra.detach()

    # -- accounting ---------------------------------------------------------------------------------------
    def num_params(self, *, non_embedding: bool = False, active: bool = False) -> int:
        """Parameters, shared ones counted once; `non_embedding` leaves out the position embedding (and the
        token embedding when it is not also the output head); `active` counts of each MoE layer's routed experts
        only the top-k a token goes through."""
        n = sum(p.numel() for p in self.parameters())
        if active:
            for m in moe_layers(self):
                per_expert = sum(p.numel() for p in m.experts.parameters()) // m.n_experts
                n -= (m.n_experts - m.top_k) * per_expert
        if non_embedding:
            if self.wpe is not None:
                n -= self.wpe.weight.numel()
            if not self.cfg.tie_embeddings:
                n -= self.wte.weight.numel()
        return n

    def flops_per_token(self) -> float:
        """Training FLOPs per token, 6N + 12*L*C*T (Kaplan et al. 2020, as PaLM counts it for MFU), with N the
        non-embedding parameters (the LM head counted, position embeddings not) a token goes through: of an MoE
        layer's experts only the top-k (the router's own small matmul counted whole)."""
        c = self.cfg
        n = self.num_params(non_embedding=True, active=True)
        return 6.0 * n + 12.0 * c.n_layer * c.n_embd * c.block_size

    # -- sampling -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Append `max_new_tokens` sampled tokens to idx (B, T), cropping the context to block_size."""
        if self.layers.sequence is not None:
            raise ValueError("generate: the model's sequence is split over context-parallel ranks (parallel.cp>1); "
                             "sample from a model built without it (dist-llm sample does)")
        for _ in range(max_new_tokens):
            context = idx[:, -self.cfg.block_size :]
            logits = self(context)[:, -1, :].float()
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat((idx, nxt), dim=1)
        return idx
