"""Mixture-of-Experts terms of the memory calculator (this package): expert parameters under expert parallelism,
what an MoE block saves for backward, and the all-to-all buffers.

Parameters. Expert weights are stacked along dim 0 (`blocks.i.moe.experts.w_*`, (E, ...)); with
`parallel.ep` a rank holds E/ep of them. ep is carved out of dp: the dense parts (attention, router, shared
experts, embeddings) stay data-parallel over all dp ranks, the experts over the dp/ep ranks that hold the same
experts (the expert-data-parallel group), so ZeRO shards the former over dp and the latter over dp/ep.

Activations (what model/moe.py saves for backward, per MoE block; counted against the saved-tensor meter by
tests/test_memory_moe.py). N tokens of the micro-batch, k = moe_top_k, M = N*k (token, slot) assignments, E
experts, C = n_embd, H = the expert hidden size, s = the compute dtype's bytes:
    per token      router input 4C (fp32), logits 4E and probabilities 4E (fp32), the expert ids (int64, 8k),
                   the top-k softmax 4k (Mixtral's order), the z-loss's log-sum-exp 4; shared experts: their
                   hidden values as the dense MLP's (4 per width with SwiGLU, 2 with GELU) and, in mixed
                   precision, their 16-bit input 2C; with model.moe_shared_gate the gate's product keeps the
                   shared output sC and the sigmoid's s (and its matmul another 16-bit copy of the input, 2C,
                   where autocast casts fp32 weights: activations.py)
    per assignment the sort order (int64, 8); with a capacity factor its keep mask (1)
    per kept row   the token index (int64, 8; and the expert index with biases), the gate s and the combined
                   expert output sC: on the rank that owns the tokens (model/moe.py's _Combine keeps no gated
                   product: autograd's index_add_ kept one for its shape alone)
    per received   the experts' input sC and hidden values s*(4H SwiGLU: gate, silu, up, product; 2H GELU):
    row            on the rank that owns the experts; at ep=1 the received rows are the kept rows; at ep>1 also
                   the dispatch's regrouping of the arrivals by local expert and its inverse (int64, 8 + 8)
    per layer      in mixed precision with fp32 parameters the 16-bit copies of the rank's expert weights
                   (autocast's casts are saved by the grouped matmul); with 16-bit parameters the router's
                   fp32 weight copy; the aux loss's per-expert fractions and the groups' offsets
    PEFT           the frozen router keeps no input; a linear keeps its input only where its weight or LoRA
                   trains (the shared expert's under mlp_up, the routed experts' under experts_up), the down
                   projection likewise (mlp_down, experts_down); each LoRA adds its rank-r A x per row

Routed load. A rank routes M assignments. At the balanced load every expert gets M*ep/E (the tokens of its
ep group's ranks), so a rank receives M rows whatever ep; at the worst case every ep rank sends all its rows
to one rank, which receives ep*M (a capacity factor bounds that by E*capacity). The peak assumes the balanced
load; the worst case is printed beside it. At ep>1 dispatch and combine are all-to-alls whose send and
receive buffers (the permuted tokens, C values in the compute dtype) live together for a moment: a temporary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dist_llm.config import Config, ConfigError


def ep_degree(cfg: Config) -> int:
    return cfg.parallel.ep


def check_ep(cfg: Config, dp: int) -> int:
    """The ep degree, checked against dp (ep is carved out of the data-parallel ranks)."""
    ep = ep_degree(cfg)
    if ep > 1 and not cfg.model.n_experts:
        raise ConfigError("parallel.ep: expert parallelism needs an MoE model (model.n_experts > 0)")
    if ep < 1 or dp % ep or (cfg.model.n_experts and cfg.model.n_experts % ep):
        raise ConfigError(f"parallel.ep: must divide dp={dp} and model.n_experts={cfg.model.n_experts}, got {ep}")
    return ep


def is_expert(name: str) -> bool:
    """A routed expert's stacked parameter (dim 0 = the expert)."""
    return ".moe.experts." in name


def local_expert_shape(shape: tuple[int, ...], ep: int) -> tuple[int, ...]:
    """The slice of a stacked expert parameter an ep rank holds: E/ep experts."""
    return (shape[0] // ep, *shape[1:])


@dataclass(frozen=True)
class RoutedRows:
    """Rows per micro-batch of one MoE layer on one rank."""

    tokens: int
    assignments: int  # N*k, routed by this rank
    kept: int  # assignments surviving the capacity (all when dropless)
    received_balanced: int  # rows this rank's experts compute at the balanced load
    received_worst: int  # ... when every ep rank routes all its rows here


def routed_rows(cfg: Config, tokens: int, ep: int) -> RoutedRows:
    m = cfg.model
    assignments = tokens * m.moe_top_k
    kept, worst = assignments, ep * assignments
    if m.moe_capacity_factor > 0:  # each expert keeps at most `capacity` of a forward's assignments
        capacity = math.ceil(m.moe_capacity_factor * assignments / m.n_experts)
        kept = min(assignments, m.n_experts * capacity)
        # a rank's E/ep experts take at most `capacity` rows from each of the ep ranks that route to them
        worst = min(ep * kept, m.n_experts * capacity)
    return RoutedRows(tokens, assignments, kept, kept, worst)


def _compute_size(cfg: Config) -> int:
    return 4 if cfg.train.precision == "fp32" else 2


def _hidden_per_row(cfg: Config, hidden: int) -> int:
    """Hidden values an MLP of this width saves per row: SwiGLU gate, silu, up and their product; GELU its input
    and output."""
    return (4 if cfg.model.mlp == "swiglu" else 2) * hidden


def _trained(cfg: Config) -> set[str] | None:
    """The peft.targets whose weights a PEFT run adapts (LoRA); None when every weight trains (no PEFT)."""
    f = cfg.peft
    if f.method == "none":
        return None
    return set(f.targets) if f.method in ("lora", "qlora") else set()


def _mlp_values(cfg: Config, hidden: int, up: str, down: str) -> int:
    """Values per row of an MLP `hidden` wide that PEFT trains through targets `up`/`down` (all when None): the
    activation's (SwiGLU: gate, silu, up; GELU: its input), the down projection's input when its weight or
    LoRA trains, each LoRA's rank-r A x (the input of B)."""
    trained, f = _trained(cfg), cfg.peft
    gated = cfg.model.mlp == "swiglu"
    if trained is None:
        return _hidden_per_row(cfg, hidden)
    lora = (2 if gated else 1) * f.rank * (up in trained) + f.rank * (down in trained)
    return (3 if gated else 1) * hidden + hidden * (down in trained) + lora


def token_side_bytes(cfg: Config) -> float:
    """Bytes per token of an MoE block's router and shared experts (the attention and norms are the dense
    block's): see the module docstring."""
    m = cfg.model
    s = _compute_size(cfg)
    k, E = m.moe_top_k, m.n_experts
    trained = _trained(cfg)
    out = 8 * E + 8 * k + 4 + (4 * k if m.moe_router_order == "topk_softmax" else 0)
    if trained is None:
        out += 4 * m.n_embd  # the router's fp32 input (a frozen router, under PEFT, keeps none)
        out += 0 if s == 4 or not m.n_shared_experts else 2 * m.n_embd  # autocast's 16-bit copy for the shared
        # experts (or the 16-bit input itself)
    elif m.n_shared_experts and "mlp_up" in trained:
        out += s * m.n_embd  # the shared expert's LoRA input, in the compute dtype
    if m.n_shared_experts:
        out += s * _mlp_values(cfg, m.moe_shared_expert_hidden, "mlp_up", "mlp_down")
        if m.moe_shared_gate:  # sigmoid(x w_g) * shared: the product keeps both factors (the sigmoid's output
            out += s * (m.n_embd + 1)  # is the tensor the sigmoid keeps too)
    return out


def kept_row_bytes(cfg: Config) -> int:
    """Bytes per kept assignment on the tokens' rank: token index, gate, combined output."""
    s = _compute_size(cfg)
    return 8 + (8 if cfg.model.bias else 0) + s + s * cfg.model.n_embd


def received_row_bytes(cfg: Config, ep: int) -> int:
    """Bytes per row the rank's experts compute: their input (kept when w_up or its LoRA trains) and hidden
    values (with PEFT: as `_mlp_values`), and at ep>1 the two int64 permutations parallel/expert/dispatch.py saves.

    With LoRA on experts_up and experts_down (fp32, GELU, r = 4, C = 32, H = 48), what autograd keeps per received
    row, read with saved_tensors_hooks: the rows x (C; w_up's grouped matmul and lora_up's A share them: dropout 0
    hands x itself on), up's output (H, GELU's input), GELU's output (H, w_down's and lora_down's A input), each
    A's output (r, its B's input); at ep>1 also the regrouping index (8) and its inverse (8), int64. That is
    4 * (32 + 48 + 48 + 4 + 4) + 16 = 560 bytes, the same at ep=1 (less the 16) and ep=2 (258 rows: 144,480)."""
    trained = _trained(cfg)
    inputs = cfg.model.n_embd if trained is None or "experts_up" in trained else 0
    regroup = 16 if ep > 1 else 0
    return (_compute_size(cfg) * (inputs + _mlp_values(cfg, cfg.model.moe_expert_hidden, "experts_up", "experts_down"))
            + regroup)


def layer_constant_bytes(cfg: Config, ep: int, *, params16: bool, casts: bool | None = None) -> int:
    """Per MoE layer, whatever the tokens: 16-bit expert weight copies (mixed precision, fp32 parameters), the
    router's fp32 copy (16-bit parameters), the aux loss's fractions and the grouped matmul's offsets."""
    casts = not params16 if casts is None else casts  # (FSDP2: fp32 shards, 16-bit gathered weights: neither)
    m, r = cfg.model, cfg.peft.rank
    local = m.n_experts // ep
    projections = 3 if m.mlp == "swiglu" else 2
    trained = _trained(cfg) or set()
    adapted = (projections - 1) * ("experts_up" in trained) + ("experts_down" in trained)  # expert LoRA pairs
    out = 4 * m.n_experts + 4 * local * (projections + 2 * adapted)  # (each LoRA: two more grouped matmuls)
    if cfg.train.precision != "fp32":
        if params16:
            out += 4 * m.n_experts * m.n_embd
        elif casts:  # (and of each expert LoRA's A and B)
            out += 2 * local * (projections * m.n_embd * m.moe_expert_hidden
                                + adapted * r * (m.n_embd + m.moe_expert_hidden))
    return out


def moe_block_bytes(cfg: Config, tokens: int, ep: int, *, params16: bool, worst: bool = False,
                    casts: bool | None = None) -> int:
    """What an MoE block's MoE part (router to combine, shared experts) saves for one micro-batch of `tokens`."""
    rows = routed_rows(cfg, tokens, ep)
    received = rows.received_worst if worst else rows.received_balanced
    order = 8 * rows.assignments + (rows.assignments if cfg.model.moe_capacity_factor > 0 else 0)
    return round(token_side_bytes(cfg) * tokens + order + kept_row_bytes(cfg) * rows.kept
                 + received_row_bytes(cfg, ep) * received + layer_constant_bytes(cfg, ep, params16=params16, casts=casts))


def a2a_buffer_bytes(cfg: Config, tokens: int, ep: int, *, worst: bool = False) -> int:
    """At ep>1: the dispatch all-to-all's send buffer (the rank's permuted rows) and its receive buffer, alive
    together (combine and the backward passes move the same rows back); 0 at ep=1 (no all-to-all)."""
    if ep == 1:
        return 0
    rows = routed_rows(cfg, tokens, ep)
    received = rows.received_worst if worst else rows.received_balanced
    return _compute_size(cfg) * cfg.model.n_embd * (rows.kept + received)


def summary_lines(cfg: Config, tokens: int, ep: int, n_moe_layers: int, in_flight: int) -> list[str]:
    """What `dist-llm memory` prints for an MoE model: the load it assumes and the routed figures."""
    m = cfg.model
    rows = routed_rows(cfg, tokens, ep)
    per_layer = received_row_bytes(cfg, ep)
    balanced = per_layer * rows.received_balanced * n_moe_layers * in_flight
    worst = per_layer * rows.received_worst * n_moe_layers * in_flight
    mib = 2**20
    lines = [f"MoE: {m.n_experts} experts, top-{m.moe_top_k}, ep={ep} ({m.n_experts // ep} experts a rank), "
             f"{n_moe_layers} MoE layers on this rank; {rows.assignments} routed rows a layer per micro-batch",
             f"routed-token activations (expert inputs and hidden values): balanced load "
             f"({rows.assignments * ep // m.n_experts} rows per expert) {balanced / mib:.2f} MiB, worst case "
             f"(all routed rows to one ep rank: {rows.received_worst} received) {worst / mib:.2f} MiB",
             "the activations and peak above assume the balanced load"]
    if ep > 1:
        lines.append(f"all-to-all buffers (send + receive of the permuted tokens, one layer): balanced "
                     f"{a2a_buffer_bytes(cfg, tokens, ep) / mib:.2f} MiB, worst "
                     f"{a2a_buffer_bytes(cfg, tokens, ep, worst=True) / mib:.2f} MiB")
    return lines
