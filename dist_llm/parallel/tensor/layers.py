"""Megatron-style tensor-parallel layers, written here.

Each layer holds only its rank's slice of the weight and says which part of the full weight that is
(`full_shape`, `local_part`): initialisation gives the slice the values the unsharded layer gets, drawing
only the row chunks of the full weight that it overlaps (model/init.py), so a model built at tp=N holds the
slices of the tp=1 model.
Sharded parameters carry a partition dim; parameters that are replicated across tp ranks but see only a
slice of the sequence (sequence parallelism) carry the sequence-parallel mark, so their gradients are
all-reduced over tp (the marks: parallel/marks.py).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from dist_llm.compiling import keep_out_of_graphs
from dist_llm.model.casting import cast_once
from dist_llm.model.factory import Reduction
from dist_llm.parallel import comm
from dist_llm.parallel.marks import mark_partition, mark_replicated_rows, mark_sequence_parallel
from dist_llm.parallel.tensor import mappings as tpc
from dist_llm.parallel.tensor import overlap

Init = Callable[[torch.Tensor], torch.Tensor]

RANK_SEED_RANGE = 2**62  # seeds drawn from the shared stream lie in [0, 2^62): adding a tp rank stays in 64 bits


@contextlib.contextmanager
def rank_local_rng(rank: int, device: torch.device) -> Iterator[None]:
    """Random draws inside come from a stream of this tp rank's own (Megatron's model-parallel RNG): the
    generator of `device` is seeded with s + rank, where s is one draw from the shared (default CPU) stream.

    Every tp rank draws that one s, so the shared stream stays in step across ranks; and activation
    checkpointing, which restores the shared stream before it recomputes a region, draws the same s again, so
    the recomputed masks are the forward's. The generator's own state is restored on exit."""
    seed = int(torch.randint(0, RANK_SEED_RANGE, (1,)).item())  # a CPU tensor: no device sync
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
        if cuda:
            torch.cuda.manual_seed(seed + rank)  # the current device only (torch.manual_seed would seed every GPU)
        else:
            torch.default_generator.manual_seed(seed + rank)
        yield


class RankLocalDropout(nn.Dropout):
    """Dropout whose mask comes from this tp rank's own stream (`rank_local_rng`).

    For activations of which each tp rank holds a different part: a slice of the sequence under sequence
    parallelism. From the shared stream every rank would draw the same mask, repeating one pattern on every
    slice instead of drawing each position's independently as one process does."""

    def __init__(self, p: float, *, rank: int) -> None:
        super().__init__(p)
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x  # (nothing drawn: the shared stream advances as it would with a plain dropout)
        with rank_local_rng(self.rank, x.device):
            return super().forward(x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp_rank={self.rank}"


def _mark(param: nn.Parameter, *, dim: int | None = None, sequence_parallel: bool = False) -> nn.Parameter:
    if dim is not None:
        mark_partition(param, dim)
    if sequence_parallel:
        mark_sequence_parallel(param)
    return param


class _SumReplicatedRows(Function):
    """fwd: identity / bwd: sum the gradient of rows [first, end) over the tp ranks that hold the same rows.

    For KV heads shared by several ranks (n_kv_head < tp): each rank's gradient of its KV rows covers only
    its own query heads. The rows of every group are stacked in a (groups, ...) buffer, each rank filling
    its group's slot, and one all-reduce over tp sums each group's partial gradients."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, first: int, end: int, index: int, groups: int,  # type: ignore[no-untyped-def]
                group: dist.ProcessGroup | None, stats: comm.CommStats | None) -> torch.Tensor:
        ctx.args = (first, end, index, groups, group, stats)
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[no-untyped-def]
        first, end, index, groups, group, stats = ctx.args
        grad = grad.clone()
        stacked = torch.zeros((groups, *grad[first:end].shape), dtype=grad.dtype, device=grad.device)
        stacked[index] = grad[first:end]
        comm.all_reduce(stacked, group, stats)
        grad[first:end] = stacked[index]
        return grad, None, None, None, None, None, None


@keep_out_of_graphs  # the all-reduce stays out of train.compile's graphs (see tensor/mappings.py `_wrap`)
def _sum_replicated_rows(w: torch.Tensor, first: int, end: int, index: int, groups: int,
                         group: dist.ProcessGroup | None, stats: comm.CommStats | None) -> torch.Tensor:
    return _SumReplicatedRows.apply(w, first, end, index, groups, group, stats)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows: this rank holds rows `rows` of the full weight.

    `rows` defaults to the rank's contiguous 1/tp; the fused QKV projection passes its own (whole heads per
    rank). `replicated=(first, end, index, groups)` says that local rows [first, end) are the same rows on
    every rank of group `index` of `groups` (KV heads fewer than tp): their gradients are summed over those
    ranks in backward. The input is copied into the tp region (its gradient all-reduced), or with sequence
    parallelism all-gathered along the sequence."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, group: dist.ProcessGroup | None,
                 stats: comm.CommStats | None = None, rows: torch.Tensor | None = None, gather_output: bool = False,
                 sequence_parallel: bool = False, replicated: tuple[int, int, int, int] | None = None) -> None:
        super().__init__()
        tp, rank = comm.group_size(group), tpc._rank(group)
        if rows is None:
            if out_features % tp:
                raise ValueError(f"{out_features} output features do not split over {tp} tensor-parallel ranks")
            rows = torch.arange(rank * out_features // tp, (rank + 1) * out_features // tp, device="cpu")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.stats = group, stats
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.rows_host = rows.cpu().clone()  # kept off the module's buffers: what reset_buffers restores
        # contiguous rows (all but the fused QKV's: the rank's q, k and v heads): local_part takes a view, so
        # initialisation draws only the row chunks this rank holds (model/init.py)
        first = int(self.rows_host[0]) if len(self.rows_host) else 0
        span = torch.equal(self.rows_host, torch.arange(first, first + len(self.rows_host), device="cpu"))
        self.row_span = slice(first, first + len(self.rows_host)) if span else None
        self.register_buffer("rows", rows, persistent=False)
        self.weight = _mark(nn.Parameter(torch.empty(len(rows), in_features)), dim=0)
        self.bias = _mark(nn.Parameter(torch.zeros(len(rows))), dim=0) if bias else None
        self.replicated = replicated
        if replicated is not None:
            first, end, _, groups = replicated
            for p in (self.weight, self.bias):
                if p is not None:  # counted once in the global gradient norm
                    mark_replicated_rows(p, (first, end, tp // groups))

    @torch.no_grad()
    def init_from_full(self, init: Init) -> None:
        full = torch.empty(self.out_features, self.in_features, device=self.weight.device)
        init(full)
        self.weight.copy_(self.local_part("weight", full))
        if self.bias is not None:
            self.bias.zero_()

    def full_shape(self, pname: str) -> tuple[int, ...]:
        return (self.out_features, self.in_features) if pname == "weight" else (self.out_features,)

    def local_part(self, pname: str, full: torch.Tensor) -> torch.Tensor:
        return full[self.row_span] if self.row_span is not None else full[self.rows.to(full.device)]

    def reset_buffers(self) -> None:
        self.rows.copy_(self.rows_host)

    def _synced(self, p: torch.Tensor | None) -> torch.Tensor | None:
        if p is None or self.replicated is None:
            return p
        return _sum_replicated_rows(p, *self.replicated, self.group, self.stats)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (y,) = column_parallel_linears(x, self)  # (B, T, out/tp)
        return tpc.gather_from_tp(y, self.group, self.stats) if self.gather_output else y


def column_parallel_linears(x: torch.Tensor, *layers: ColumnParallelLinear) -> tuple[torch.Tensor, ...]:
    """The outputs (B, T, out_i/tp) of column-parallel layers that read the same input x, with ONE input
    collective for all of them (SwiGLU's gate and up: Megatron fuses them into one layer for the same reason):
    without sequence parallelism x enters the tp region once (the layers' input gradients are summed locally,
    then all-reduced once); with it, x (B, T/tp, C) is all-gathered once and the summed input gradient
    reduce-scattered once. Each layer keeps its own parameters (and names); its `gather_output` is not applied."""
    first = layers[0]
    if any(m.group is not first.group or m.sequence_parallel != first.sequence_parallel for m in layers):
        raise ValueError("column_parallel_linears: the layers must share their tp group and sequence parallelism")
    params = [(m._synced(m.weight), m._synced(m.bias)) for m in layers]
    if first.sequence_parallel and comm.group_size(first.group) > 1:
        return _sequence_parallel_linears(x, first.group, first.stats, *(t for wb in params for t in wb))
    x = tpc.copy_to_tp(x, first.group, first.stats)  # (the summed input gradient all-reduced in x's dtype)
    return tuple(F.linear(xi, w, b) for xi, (w, b) in zip(cast_once(x, len(params)), params))


def _all_gather_seq(x: torch.Tensor, group: dist.ProcessGroup | None,
                    stats: comm.CommStats | None) -> tuple[torch.Tensor, dist.Work | None]:
    """Start the all-gather of x (B, T/tp, C) along the sequence: (T, B, C) buffer, pending work."""
    n = comm.group_size(group)
    moved = x.transpose(0, 1).contiguous()  # ranks' chunks are contiguous along dim 0
    out = torch.empty((n * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
    return out, comm.all_gather(out, moved, group, stats, async_op=True)


class _SequenceParallelLinears(Function):
    """fwd: all-gather x along the sequence, y_i = x W_i^T + b_i / bwd: all-gather x again, reduce-scatter the
    summed input gradient along the sequence.

    The forward gathers x piece by piece around the tp ring, each piece multiplied while the next is passed on
    (parallel/tensor/overlap.py), so no (B, T, C) input is ever whole on a rank.
    Only this rank's slice of x (1/tp of the tokens) is saved for backward, as Megatron-Core does. In backward the re-gather runs while the input gradient is
    computed, and the reduce-scatter of that gradient while the weight gradients are. Under autocast x is cast
    to the compute dtype before the gather (what the matmuls read; the cast commutes with the gather), so the
    gather moves and the slice keeps 16-bit values; the input gradient is reduced in x's own dtype, as autograd
    would. `params` are (weight, bias or None) per layer, flattened."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None,  # type: ignore[no-untyped-def]
                stats: comm.CommStats | None, *params: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.stats, ctx.x_dtype = group, stats, x.dtype
        ctx.set_materialize_grads(False)  # an output nobody used contributes nothing
        device = x.device.type
        if torch.is_autocast_enabled(device) and x.is_floating_point():
            x = x.to(torch.get_autocast_dtype(device))
        weights, biases = params[0::2], params[1::2]
        ctx.bias_dtypes = [None if b is None else b.dtype for b in biases]
        cast = [(w.to(x.dtype), None if b is None else b.to(x.dtype)) for w, b in zip(weights, biases)]
        with torch.autocast(device, enabled=False):  # (cast by hand as autocast would: same values)
            if overlap.ENABLED:  # the gather piece by piece under the matmuls (parallel/tensor/overlap.py)
                ys = overlap.ring_gather_linears(x, cast, group, stats)
            else:
                out, work = _all_gather_seq(x, group, stats)
                if work is not None:
                    work.wait()
                x_full = out.transpose(0, 1)  # (B, T, C), a view
                ys = tuple(F.linear(x_full, w, b) for w, b in cast)
        trains = any(ctx.needs_input_grad[3:])  # a frozen base (PEFT) needs no input for a weight gradient
        ctx.save_for_backward(x if trains else None, *weights)
        return ys

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):  # type: ignore[no-untyped-def]
        x, *weights = ctx.saved_tensors
        needs = ctx.needs_input_grad
        # one collective in flight at a time, each beside a matmul that does not need its result
        gathered, work = _all_gather_seq(x, ctx.group, ctx.stats) if x is not None else (None, None)
        grad_x = None
        for w, g in zip(weights, grads):
            if g is not None and needs[0]:
                part = g.matmul(w.to(g.dtype)).to(ctx.x_dtype)  # (B, T, C)
                grad_x = part if grad_x is None else grad_x + part
        if work is not None:
            work.wait()
        scattered, handle = None, None
        if grad_x is not None:
            moved = grad_x.transpose(0, 1).contiguous()  # (T, B, C)
            scattered = moved.new_empty((moved.shape[0] // comm.group_size(ctx.group), *moved.shape[1:]))
            handle = comm.reduce_scatter(scattered, moved, ctx.group, ctx.stats, async_op=True)
        param_grads: list[torch.Tensor | None] = []
        for i, (w, g) in enumerate(zip(weights, grads)):
            gw = gb = None
            if g is not None and needs[3 + 2 * i]:
                assert gathered is not None
                x_full = gathered.transpose(0, 1)  # (B, T, C)
                gw = torch.tensordot(g, x_full.to(g.dtype), dims=([0, 1], [0, 1])).to(w.dtype)  # (out, C)
            if g is not None and needs[4 + 2 * i]:
                gb = g.sum(dim=(0, 1)).to(ctx.bias_dtypes[i])
            param_grads += [gw, gb]
        grad_local = None
        if scattered is not None:
            if handle is not None:
                handle.wait()  # type: ignore[attr-defined]
            grad_local = scattered.transpose(0, 1).contiguous()  # (B, T/tp, C)
        return (grad_local, None, None, *param_grads)


@keep_out_of_graphs  # the collectives stay out of train.compile's graphs (see tensor/mappings.py `_wrap`)
def _sequence_parallel_linears(x: torch.Tensor, group: dist.ProcessGroup | None, stats: comm.CommStats | None,
                               *params: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    return _SequenceParallelLinears.apply(x, group, stats, *params)


@keep_out_of_graphs  # the ring's sends and receives stay out of train.compile's graphs, as above
def _row_sequence_parallel(x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup | None,
                           stats: comm.CommStats | None) -> torch.Tensor:
    return overlap.RowSequenceParallelLinear.apply(x, weight, group, stats)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns; the partial products are all-reduced (or, with sequence
    parallelism, reduce-scattered along the sequence, piece by piece under the next piece's matmul:
    parallel/tensor/overlap.py) and the bias, held whole, is added once after."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, group: dist.ProcessGroup | None,
                 stats: comm.CommStats | None = None, input_is_parallel: bool = True,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        tp, rank = comm.group_size(group), tpc._rank(group)
        if in_features % tp:
            raise ValueError(f"{in_features} input features do not split over {tp} tensor-parallel ranks")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.stats = group, stats
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.cols = slice(rank * in_features // tp, (rank + 1) * in_features // tp)
        self.weight = _mark(nn.Parameter(torch.empty(out_features, in_features // tp)), dim=1)
        self.bias = _mark(nn.Parameter(torch.zeros(out_features)), sequence_parallel=sequence_parallel) if bias else None

    @torch.no_grad()
    def init_from_full(self, init: Init) -> None:
        full = torch.empty(self.out_features, self.in_features, device=self.weight.device)
        init(full)
        self.weight.copy_(self.local_part("weight", full))
        if self.bias is not None:
            self.bias.zero_()

    def full_shape(self, pname: str) -> tuple[int, ...]:
        return (self.out_features, self.in_features) if pname == "weight" else (self.out_features,)

    def local_part(self, pname: str, full: torch.Tensor) -> torch.Tensor:
        return full[:, self.cols] if pname == "weight" else full  # the bias is held whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = tpc.scatter_to_tp(x, self.group, self.stats)
        if self.sequence_parallel and overlap.ENABLED and comm.group_size(self.group) > 1:
            # each piece's reduce-scatter under the next piece's matmul (parallel/tensor/overlap.py)
            y = _row_sequence_parallel(x, self.weight, self.group, self.stats)  # (B, T/tp, out)
            return y if self.bias is None else y + self.bias
        partial = F.linear(x, self.weight)  # (B, T, out), this rank's share of the sum
        if self.sequence_parallel:
            y = tpc.reduce_scatter_to_sequence(partial, self.group, self.stats)  # (B, T/tp, out)
        else:
            y = tpc.reduce_from_tp(partial, self.group, self.stats)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across tp ranks: each rank looks up the ids it holds, zeros
    the rest, and the partial embeddings are all-reduced (reduce-scattered along the sequence with
    sequence parallelism)."""

    def __init__(self, num_embeddings: int, dim: int, *, group: dist.ProcessGroup | None,
                 stats: comm.CommStats | None = None, sequence_parallel: bool = False) -> None:
        super().__init__()
        tp, rank = comm.group_size(group), tpc._rank(group)
        if num_embeddings % tp:
            raise ValueError(f"a vocabulary of {num_embeddings} does not split over {tp} tensor-parallel ranks")
        self.num_embeddings, self.dim = num_embeddings, dim
        self.group, self.stats, self.sequence_parallel = group, stats, sequence_parallel
        self.vocab_start = rank * num_embeddings // tp
        self.vocab_end = (rank + 1) * num_embeddings // tp
        self.weight = _mark(nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, dim)), dim=0)

    @torch.no_grad()
    def init_from_full(self, init: Init) -> None:
        full = torch.empty(self.num_embeddings, self.dim, device=self.weight.device)
        init(full)
        self.weight.copy_(self.local_part("weight", full))

    def full_shape(self, pname: str) -> tuple[int, ...]:
        return (self.num_embeddings, self.dim)

    def local_part(self, pname: str, full: torch.Tensor) -> torch.Tensor:
        return full[self.vocab_start : self.vocab_end]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.vocab_start) | (idx >= self.vocab_end)
        local = (idx - self.vocab_start).masked_fill(outside, 0)
        x = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # (B, T, C), partial
        if self.sequence_parallel:
            return tpc.reduce_scatter_to_sequence(x, self.group, self.stats)
        return tpc.reduce_from_tp(x, self.group, self.stats)


IGNORE_INDEX = -100  # a target that takes no part in the loss (as in torch's cross_entropy)


class _VocabParallelCrossEntropy(Function):
    """Cross-entropy over logits split along the vocabulary, without gathering them: the max, the softmax
    denominator and the target's logit are each all-reduced as (B*T,) vectors. The mean over the unmasked
    targets, or with `mean=False` their sum."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, valid: int,  # type: ignore[no-untyped-def]
                group: dist.ProcessGroup | None, stats: comm.CommStats | None, mean: bool) -> torch.Tensor:
        ctx.dtype = logits.dtype
        logits = logits.float()  # (N, V/tp)
        vocab_local = logits.shape[-1]
        # padded vocabulary entries (ids >= valid) never win: mask them before anything else
        padded = torch.arange(vocab_start, vocab_start + vocab_local, device=logits.device) >= valid
        logits = logits.masked_fill(padded, float("-inf"))
        local_max = logits.max(dim=-1).values
        comm.all_reduce(local_max, group, stats, op=dist.ReduceOp.MAX)
        shifted = logits - local_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        mine = (targets >= vocab_start) & (targets < vocab_start + vocab_local)
        local_t = (targets - vocab_start).masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        both = torch.stack([sum_exp, target_logit])  # one all-reduce for the two sums
        comm.all_reduce(both, group, stats)
        sum_exp, target_logit = both
        loss = sum_exp.log() - target_logit  # (N,)
        keep = targets != IGNORE_INDEX  # masked targets (prompt tokens in fine-tuning) count for nothing
        count = keep.sum().clamp(min=1) if mean else torch.ones((), dtype=torch.int64, device=keep.device)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_t, mine, keep, count)
        return (loss * keep).sum() / count

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[no-untyped-def]
        softmax, local_t, mine, keep, count = ctx.saved_tensors
        # d(loss)/d(logit) = softmax - onehot(target), the onehot only on the rank whose slice holds the target
        # (local_t is 0 on the others, which then subtract 0). No boolean indexing: it makes the host wait.
        g = softmax.clone().scatter_add_(-1, local_t.unsqueeze(-1), -mine.to(softmax.dtype).unsqueeze(-1))
        return (g * (keep / count * grad).unsqueeze(-1)).to(ctx.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int, valid: int,
                                 group: dist.ProcessGroup | None, stats: comm.CommStats | None = None,
                                 reduction: Reduction = "mean") -> torch.Tensor:
    """Token cross-entropy of logits (B, T, V/tp), this rank's vocabulary slice, against targets (B, T): the
    mean over the unmasked targets, or ("sum") their sum."""
    return _VocabParallelCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(), vocab_start, valid, group, stats,
                                            reduction == "mean")
