"""Mixture of Experts: a router picks k of n_experts MLPs for every token; one more layer kind of the GPT.

    router (fp32)      logits = x W_r                          (N, E)
    selection          top-k of (scores + expert_bias)         bias for selection only (DeepSeek-V3)
    dispatch           sort the (token, slot) pairs by expert, so each expert's tokens are one contiguous slice
    experts            one grouped matmul per projection over the slices (weights stacked (E, in, out))
    combine            out[token] += weight * expert_out       (index_add over the sorted rows)
    shared experts     a dense MLP every token goes through (DeepSeek / Qwen MoE), added to the routed output;
                       with model.moe_shared_gate scaled per token by sigmoid(x w_g) first (Qwen2-MoE)

Router order (`model.moe_router_order`):
  "softmax_topk": probs = softmax(logits); select on probs + bias; weights = the selected probs (Qwen2-MoE,
                  DeepSeek: not renormalised, so they sum to below one)
  "topk_softmax": select on logits + bias; weights = softmax over the k selected logits (Mixtral)

Load-balancing losses (both over the N tokens of one forward, in fp32):
  aux (Switch/GShard) = E * sum_i f_i * P_i, with f_i the fraction of the N*k (token, slot) assignments that went
      to expert i and P_i the mean over tokens of softmax(logits)_i; 1.0 at perfect balance
  z-loss (ST-MoE)     = mean over tokens of logsumexp(logits)^2

The model stays plain PyTorch: expert parallelism (parallel/expert/) slices the stacked expert weights along
dim 0 and sets `dispatch`, which carries the sorted rows to their experts' ranks by all-to-all and back; expert
e's weights are `w_*[e]` of the whole layer whatever the layout. Tensor parallelism (parallel/tensor/moe.py) sets
`tokens`: each tp rank then routes and runs 1/tp of the forward's tokens with whole experts, and the balancing
statistics (assignments per expert, summed probabilities, summed z) are summed over the tp ranks first, so the
losses, the load and the capacity are those of the whole micro-batch.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from dist_llm.compiling import keep_out_of_graphs
from dist_llm.config import ModelConfig
from dist_llm.model.buffers import apply_keeping_fp32

#: sums a tensor in place over the data-parallel ranks (the trainer's; None at one process)
AllReduce = Callable[[torch.Tensor], None] | None
RouterOrder = Literal["softmax_topk", "topk_softmax"]
GroupedImpl = Literal["auto", "grouped_mm", "loop", "bmm"]


def route(logits: torch.Tensor, top_k: int, order: RouterOrder,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits (N, E), fp32 -> (weights (N, k), expert ids (N, k), full softmax probs (N, E)). `bias`
    (E,) shifts the selection only; the weights come from the unbiased scores."""
    probs = logits.softmax(dim=-1)  # (N, E)
    scores = probs if order == "softmax_topk" else logits
    chosen = scores if bias is None else scores + bias
    experts = chosen.topk(top_k, dim=-1).indices  # (N, k)
    if order == "softmax_topk":
        weights = probs.gather(-1, experts)
    else:
        weights = logits.gather(-1, experts).softmax(dim=-1)
    return weights, experts, probs


def aux_loss(probs: torch.Tensor, experts: torch.Tensor, n_experts: int,
             counts: torch.Tensor | None = None) -> torch.Tensor:
    """Switch/GShard load-balancing loss E * sum_i f_i * P_i (see the module docstring); f carries no gradient.
    `counts` (E,): the assignments per expert where the caller has them already (else counted from `experts`)."""
    if counts is None:
        counts = torch.bincount(experts.flatten(), minlength=n_experts)
    f = counts.to(probs.dtype) / experts.numel()  # (E,) fraction of assignments
    p = probs.mean(dim=0)  # (E,) mean router probability
    return n_experts * (f * p).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss: mean over tokens of logsumexp(logits)^2 (keeps the logits small)."""
    return torch.logsumexp(logits, dim=-1).square().mean()


class TokenSplit(Protocol):
    """The tokens of one forward split over a group of ranks (tensor parallelism: parallel/tensor/moe.py)."""

    size: int  # ranks in the group
    rank: int  # this rank's place in it; its tokens are chunk `rank` of the sequence dim

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) as the layer receives it -> (B, T / size, C), this rank's tokens."""
        ...

    def gather(self, out: torch.Tensor) -> torch.Tensor:
        """This rank's outputs (B, T / size, C) -> what the layer returns (the inverse of `split`)."""
        ...

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the group; backward hands the gradient of the sum to each rank's `t` (every rank
        consumes the sum alike)."""
        ...

    def gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """(B, E) integer counts of every rank -> (size, B, E), in rank order."""
        ...


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: `_grouped_mm`'s CPU backward refuses expanded ones."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g.contiguous()


class _Combine(torch.autograd.Function):
    """out (N, C): each token's rows (M, C) scaled by their routing weights (M,) and summed (an index_add_ over
    `token`, the row's token). Autograd's own form (mul, then index_add_) allocates one more (M, C) gradient and
    forms the weights' gradient in two passes; here the gathered output gradient is scaled in place and the
    weights' gradient is one row-wise dot product. Same sums. It saves rows, weights and token; autograd's form
    also kept the gated (M, C) product, which index_add_ holds for its shape alone (memory/moe.py counts this)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weights: torch.Tensor, token: torch.Tensor,  # type: ignore[override]
                n_tokens: int) -> torch.Tensor:
        ctx.save_for_backward(rows, weights, token)
        return rows.new_zeros(n_tokens, rows.shape[1]).index_add_(0, token, rows * weights[:, None])

    @staticmethod
    @once_differentiable  # (the backward scales in place: no graph of it to differentiate again)
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        rows, weights, token = ctx.saved_tensors
        picked = grad.index_select(0, token)  # (M, C): each row's token's gradient
        grad_weights = torch.linalg.vecdot(picked, rows) if ctx.needs_input_grad[1] else None
        return picked.mul_(weights[:, None]), grad_weights, None, None


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, *, impl: GroupedImpl) -> torch.Tensor:
    """Rows of x (M, K) sorted by group, group g's `counts[g]` rows times w[g] (G, K, N) -> (M, N)."""
    w = w.to(x.dtype)
    if impl == "grouped_mm":
        offsets = counts.cumsum(0).to(torch.int32)  # (stays on the device: no host sync)
        return _ContiguousGrad.apply(torch._grouped_mm(x.contiguous(), w, offs=offsets))
    sizes = counts.tolist()  # (a host read: the slices' bounds)
    if impl == "loop":
        return torch.cat([part @ w[g] for g, part in enumerate(x.split(sizes))], dim=0)
    # bmm: pad every group to the largest, one batched matmul, keep the real rows
    longest = max(sizes) if sizes else 0
    padded = x.new_zeros(len(sizes), longest, x.shape[-1])
    rows = torch.cat([torch.arange(n, device=x.device) for n in sizes]) if x.shape[0] else x.new_zeros(0).long()
    group = torch.repeat_interleave(torch.arange(len(sizes), device=x.device), counts)
    padded = padded.index_put((group, rows), x)
    return torch.bmm(padded, w)[group, rows]


def grouped_rows_fit(width: int, x: torch.Tensor) -> bool:
    """Whether rows of `width` elements of x's dtype suit `torch._grouped_mm`: it wants rows of 16 bytes, on the
    CPU too (a LoRA rank r a multiple of 8 in bf16, of 4 in fp32)."""
    return width * x.element_size() % 16 == 0


def pick_impl(x: torch.Tensor) -> GroupedImpl:
    """What "auto" runs: `torch._grouped_mm` where this torch has it for x's device and dtype (on the CPU in fp32
    and bf16, forward and backward, checked on torch 2.13; CUDA's kernel is for bf16 only), else the per-expert
    loop over contiguous slices. scripts/bench_moe.py measures the three on this machine."""
    if not hasattr(torch, "_grouped_mm"):
        return "loop"
    # (under torch.compile, the fake-tensor rule of `_grouped_mm` in torch 2.13 accepts bf16 alone, on every device)
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return "loop"
    if x.device.type == "cpu" or (x.device.type == "cuda" and x.dtype == torch.bfloat16):
        return "grouped_mm"
    return "loop"


class Router(nn.Linear):
    """The router's linear map (no bias), always in fp32: autocast off, input and weight cast up. A module of its
    own (not a bare F.linear on its weight), so that whatever wraps modules sees it called: FSDP2 gathers its
    weight in fp32 as a unit of its own while the rest of the block gathers in the 16-bit compute dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float())  # (N, E)


class Experts(nn.Module):
    """n_experts MLPs of the model's kind with weights stacked along dim 0: w_up/w_gate (E, C, H), w_down (E, H, C).
    A child `lora_up` / `lora_gate` / `lora_down`, where PEFT adds one, is called as (rows, counts) -> a per-expert
    low-rank update of that projection's output (peft/expert_lora.py)."""

    def __init__(self, n_experts: int, n_embd: int, hidden: int, *, swiglu: bool, bias: bool) -> None:
        super().__init__()
        self.swiglu = swiglu
        self.w_up = nn.Parameter(torch.empty(n_experts, n_embd, hidden))
        self.w_gate = nn.Parameter(torch.empty(n_experts, n_embd, hidden)) if swiglu else None
        self.w_down = nn.Parameter(torch.empty(n_experts, hidden, n_embd))
        self.b_up = nn.Parameter(torch.empty(n_experts, hidden)) if bias else None
        self.b_gate = nn.Parameter(torch.empty(n_experts, hidden)) if bias and swiglu else None
        self.b_down = nn.Parameter(torch.empty(n_experts, n_embd)) if bias else None
        for b in (self.b_up, self.b_gate, self.b_down):
            if b is not None:
                b.no_weight_decay = True  # type: ignore[attr-defined]  # (a stack of bias vectors: optim.decays)
        self.impl: GroupedImpl = "auto"

    def init_rows(self, pname: str) -> int:
        """Each expert's weights from a generator of their own (model/init.py): a rank that holds some of the
        experts draws those alone, and expert e's values are the same whichever rank holds it."""
        return 1

    def forward(self, x: torch.Tensor, counts: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
        """x (M, C) sorted by expert, `counts` (E,) rows per expert, `expert_of_row` (M,) -> (M, C)."""
        if torch.is_autocast_enabled(x.device.type):  # (the grouped matmul is not on autocast's lists)
            x = x.to(torch.get_autocast_dtype(x.device.type))
        impl = pick_impl(x) if self.impl == "auto" else self.impl
        loras = [getattr(self, f"lora_{n}", None) for n in ("up", "gate", "down")]
        # (peft/expert_lora.py takes the loop where its rank's rows do not fit)
        grouped = impl == "grouped_mm" and all(m is None or grouped_rows_fit(m.rank, x) for m in loras)
        if not grouped and torch.compiler.is_compiling():
            # the loop and bmm read the per-expert counts on the host: traced, that breaks the graph and
            # specialises it on this routing's sizes (a recompile per new routing up to the limit, then silent
            # eager). Run eagerly instead: one graph break, no recompiles.
            return _experts_eager(self, x, counts, expert_of_row, impl)
        return _experts(self, x, counts, expert_of_row, impl)


def _experts(experts: Experts, x: torch.Tensor, counts: torch.Tensor, expert_of_row: torch.Tensor,
             impl: GroupedImpl) -> torch.Tensor:
    """Experts.forward's computation once x is in the compute dtype and the grouped-matmul kind chosen."""

    def proj(inp: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, lora: nn.Module | None) -> torch.Tensor:
        out = grouped_matmul(inp, w, counts, impl=impl)
        update = None if lora is None else lora(inp, counts, impl=impl)  # (peft/expert_lora.py: per expert)
        out = out if update is None else out + update.to(out.dtype)
        return out if b is None else out + b.to(out.dtype)[expert_of_row]

    up = proj(x, experts.w_up, experts.b_up, getattr(experts, "lora_up", None))  # (M, H)
    if experts.w_gate is not None:
        h = F.silu(proj(x, experts.w_gate, experts.b_gate, getattr(experts, "lora_gate", None))) * up
    else:
        h = F.gelu(up, approximate="tanh")  # GPT-2's GELU, as the dense MLP
    return proj(h, experts.w_down, experts.b_down, getattr(experts, "lora_down", None))


_experts_eager = keep_out_of_graphs(_experts)


class MoE(nn.Module):
    """Router + routed experts (+ shared experts). Records its load-balancing losses and load per forward."""

    # (model/buffers.py) the aux-free bias is trained state, and stays fp32: its steps of `rate` would round away
    # in bf16 next to a bias of a few hundred steps
    trained_buffers = fp32_buffers = ("expert_bias",)

    def __init__(self, cfg: ModelConfig, shared: nn.Module | None, dropout: nn.Module) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.order = cfg.n_experts, cfg.moe_top_k, cfg.moe_router_order
        self.capacity_factor = cfg.moe_capacity_factor
        self.aux_coef, self.z_coef = cfg.moe_aux_loss_coef, cfg.moe_z_loss_coef
        self.router = Router(cfg.n_embd, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.n_embd, cfg.moe_expert_hidden, swiglu=cfg.mlp == "swiglu",
                               bias=cfg.bias)
        self.shared = shared
        # Qwen2-MoE's `shared_expert_gate`: one logit per token, in the model's precision as the shared MLP
        self.shared_gate = nn.Linear(cfg.n_embd, 1, bias=False) if shared is not None and cfg.moe_shared_gate else None
        self.dropout = dropout
        #: None: this layer's own experts run the rows; else (experts, rows, counts, expert_of_row) -> outputs
        #: (expert parallelism's all-to-all, set from outside)
        self.dispatch: Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        #: None: this rank runs every token of the forward; else their split over the tp ranks (set from outside)
        self.tokens: TokenSplit | None = None
        # DeepSeek-V3's aux-loss-free balancing: added to the scores for selection only, nudged after each step
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))
        self.last_loss: torch.Tensor | None = None  # aux_coef * aux + z_coef * z of the last forward
        self.reset_stats()

    def reset_buffers(self) -> None:
        self.expert_bias.zero_()  # (a checkpoint load afterwards brings the trained bias)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> MoE:
        apply_keeping_fp32(self, fn, lambda: super(MoE, self)._apply(fn, recurse))
        return self

    def reset_stats(self) -> None:
        """Zero what the trainer reads at log steps (sums over training forwards)."""
        self.stats: dict[str, torch.Tensor] = {}
        self.step_load: torch.Tensor | None = None  # tokens per expert since the last bias update

    @torch.no_grad()
    def _record(self, name: str, value: torch.Tensor) -> None:
        # counts stay int64: a float32 sum stops counting exactly at 2**24 tokens per expert and log interval
        value = value.detach() if not value.is_floating_point() else value.detach().float()
        old = self.stats.get(name)
        self.stats[name] = value if old is None else old + value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        split = self.tokens
        if split is not None:
            x = split.split(x)  # (B, T/tp, C): this rank's tokens
        B, T, C = x.shape
        flat = x.reshape(B * T, C)  # (N, C)
        logits = self.router(flat)  # (N, E) in fp32 whatever the run's precision
        weights, experts, probs = route(logits, self.top_k, self.order, self.expert_bias)
        # dispatch: the N*k (token, slot) pairs sorted by expert (stable: earlier tokens first within an expert)
        flat_expert = experts.flatten()  # (N*k,)
        expert_sorted, order = torch.sort(flat_expert, stable=True)  # (the sorted ids come with the order)
        counts = torch.bincount(flat_expert, minlength=self.n_experts)  # (E,)
        if split is None:
            aux, z = aux_loss(probs, experts, self.n_experts, counts), z_loss(logits)
            load, assignments, offset = counts, flat_expert.numel(), None
        else:  # the micro-batch's statistics, over every rank's tokens
            aux, z, load, offset = self._split_statistics(split, logits, probs, experts, B)
            assignments = flat_expert.numel() * split.size
        self.last_loss = None
        if self.aux_coef or self.z_coef:
            self.last_loss = self.aux_coef * aux + self.z_coef * z

        # (index_select, not x[index]: on the CPU it is ~4x faster, and its backward an index_add_, not the slower
        # accumulating index_put_; the sums are the same: each token's k rows added into zeros)
        token_sorted = order // self.top_k
        weight_sorted = weights.flatten().index_select(0, order)
        kept = load
        if self.capacity_factor > 0:  # keep each expert's first `capacity` assignments, drop the rest
            capacity = math.ceil(self.capacity_factor * assignments / self.n_experts)
            starts = counts.cumsum(0) - counts
            position = torch.arange(order.numel(), device=x.device) - starts[expert_sorted]
            if offset is not None:  # this rank's place among the micro-batch's assignments to each expert
                position = position + offset[token_sorted // T, expert_sorted]
            keep = position < capacity
            expert_sorted, token_sorted, weight_sorted = expert_sorted[keep], token_sorted[keep], weight_sorted[keep]
            kept = load.clamp(max=capacity)
            counts = counts.clamp(max=capacity) if offset is None else torch.bincount(expert_sorted,
                                                                                      minlength=self.n_experts)
        if self.dispatch is None:
            rows = self.experts(flat.index_select(0, token_sorted), counts, expert_sorted)  # (M, C)
        else:
            sent = flat.index_select(0, token_sorted)
            if torch.is_autocast_enabled(x.device.type):  # the experts compute in it anyway: half the bytes to send
                sent = sent.to(torch.get_autocast_dtype(x.device.type))
            rows = self.dispatch(self.experts, sent, counts, expert_sorted)
        out = _Combine.apply(rows, weight_sorted.to(rows.dtype), token_sorted, flat.shape[0]).to(x.dtype)
        if self.training and not _in_backward():  # (not again when activation checkpointing recomputes)
            self._record("aux", aux)
            self._record("z", z)
            self._record("load", load)
            self._record("dropped", (load - kept).sum() / assignments)
            self._record("forwards", torch.ones((), device=x.device))
            self.step_load = load.detach().float() if self.step_load is None else self.step_load + load
        out = out.view(B, T, C)
        if self.shared is not None:
            shared = self.shared(x)
            out = out + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(x)) * shared)
        if split is not None:
            out = split.gather(out)
        return self.dropout(out)

    def _split_statistics(self, split: TokenSplit, logits: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor,
                          batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """With the tokens split over ranks: (aux, z, load, offset) of the whole micro-batch. aux and z are formed
        from the group's sums (their gradients reach each rank's own tokens); load (E,) counts every rank's
        assignments; offset[b, e] is the number of the micro-batch's assignments to expert e that come before this
        rank's of batch row b in one process's order (rows first, then positions: rank by rank), for the capacity."""
        E, n = self.n_experts, experts.shape[0]
        row = torch.arange(n, device=experts.device) // (n // batch)  # (N,) batch row of each local token
        per_row = torch.bincount((row[:, None] * E + experts).flatten(), minlength=batch * E).view(batch, E)
        every = split.gather_counts(per_row)  # (tp, B, E)
        load = every.sum((0, 1))  # (E,)
        tokens = n * split.size
        sums = split.sum(torch.cat([probs.sum(0), torch.logsumexp(logits, dim=-1).square().sum()[None]]))  # (E+1,)
        f = load.to(probs.dtype) / (tokens * self.top_k)  # fraction of assignments, no gradient
        aux = E * (f * sums[:E] / tokens).sum()
        z = sums[E] / tokens
        rows_all, mine = every.sum(0), every[split.rank]  # (B, E) each
        offset = (rows_all.cumsum(0) - rows_all) - (mine.cumsum(0) - mine) + every[: split.rank].sum(0)
        return aux, z, load, offset


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


@torch.no_grad()
def update_expert_bias(layers: list[MoE], rate: float, all_reduce: AllReduce = None) -> None:
    """After an optimizer step: bias += rate * sign(mean load - load), from the tokens each expert got since the
    last update (summed over the data-parallel ranks by `all_reduce`, so every replica moves its bias alike;
    every layer's loads in one collective)."""
    loads = [layer.step_load for layer in layers]
    for layer in layers:
        layer.step_load = None
    if rate == 0 or not layers or any(load is None for load in loads):
        return
    stacked = torch.stack(loads)  # (L, E)
    if all_reduce is not None:
        all_reduce(stacked)
    for layer, load in zip(layers, stacked):
        layer.expert_bias += rate * torch.sign(load.mean() - load)


def take_metrics(layers: list[MoE], all_reduce: AllReduce = None) -> dict[str, Any]:
    """The MoE fields of a log step, since the last call (and over ranks, with `all_reduce` summing over them):
    moe_aux_loss, moe_z_loss and moe_dropped_fraction (means over layers and forwards); moe_tokens_per_expert
    (per layer in block order, the (token, slot) assignments routed to each global expert id: whole numbers);
    moe_layer_imbalance (per layer, max/mean of those counts; 1 is perfect balance) and moe_imbalance (the worst
    layer's). Resets the sums. `layers` must be the same list on every rank that sums (a pipeline stage lists the
    other stages' layers as zero stand-ins): the collectives run whatever this rank recorded, and the decision to
    report nothing (no training forward anywhere) is made from the sums, so no rank skips a collective the others
    issue."""
    if not layers:
        return {}
    device = layers[0].expert_bias.device
    zero = torch.zeros((), device=device)
    scalars = torch.stack([torch.stack([m.stats.get(k, zero).float() for k in ("aux", "z", "dropped", "forwards")])
                           for m in layers]).to(device)  # (L, 4)
    loads = torch.stack([m.stats.get("load", torch.zeros_like(m.expert_bias)).to(torch.int64)
                         for m in layers]).to(device)  # (L, E) exact counts
    if all_reduce is not None:
        all_reduce(scalars)
        all_reduce(loads)
    for m in layers:
        m.stats = {}
    if not scalars[:, 3].any():
        return {}
    n = scalars[:, 3].clamp(min=1)
    per_layer = loads.max(dim=1).values / loads.double().mean(dim=1).clamp(min=1e-9)  # (L,)
    return {"moe_aux_loss": round((scalars[:, 0] / n).mean().item(), 6),
            "moe_z_loss": round((scalars[:, 1] / n).mean().item(), 6),
            "moe_imbalance": round(per_layer.max().item(), 4),
            "moe_dropped_fraction": round((scalars[:, 2] / n).mean().item(), 6),
            "moe_layer_imbalance": [round(x, 4) for x in per_layer.tolist()],
            "moe_tokens_per_expert": loads.tolist()}
