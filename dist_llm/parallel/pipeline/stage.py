"""Which transformer blocks each pipeline stage holds."""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterable, Sequence
from functools import lru_cache

from torch import nn

from dist_llm.config import Config, ConfigError, ModelConfig
from dist_llm.parallel.marks import expert_slice, mark_pp_duplicate, partition_dim

log = logging.getLogger("dist_llm")


def block_params(named_shapes: Iterable[tuple[str, tuple[int, ...]]], m: ModelConfig) -> list[int]:
    """Parameters a token goes through in each block, from (name, shape) of the whole model's parameters: of an
    MoE layer's routed experts (stacked, `moe.experts.*`) only the top-k of n_experts, as GPT.num_params(active)."""
    counts = [0] * m.n_layer
    for name, shape in named_shapes:
        if not name.startswith("blocks."):
            continue
        numel = math.prod(shape)
        if ".moe.experts." in name:
            numel = numel * m.moe_top_k // m.n_experts
        counts[int(name.split(".")[1])] += numel
    return counts


def stage_costs(m: ModelConfig, active_params: Sequence[int]) -> tuple[list[float], float, float]:
    """Training FLOPs per token of each block, of the first stage's extra work and of the last stage's.

    A block costs 6N + 12*C*T (its active parameters N, attention over T positions: GPT.flops_per_token's
    count). The embedding is a lookup, ~0 FLOPs, however many parameters it holds; the last stage adds the
    LM head's matmul (6*C*V, tied or not) and the loss's log-softmax and its gradient (a few FLOPs per logit,
    counted as 6*V)."""
    blocks = [6.0 * n + 12.0 * m.n_embd * m.block_size for n in active_params]
    return blocks, 0.0, 6.0 * m.n_embd * m.padded_vocab + 6.0 * m.padded_vocab


def partition_layers(n_layer: int, stages: int, *, block_weight: float | Sequence[float] = 1.0,
                     first_extra: float = 0.0, last_extra: float = 0.0,
                     explicit: list[int] | None = None) -> list[range]:
    """Contiguous block ranges, one per stage.

    `explicit` (parallel.pp_layers) gives the block count of each stage. Otherwise the split minimises the
    heaviest stage, counting `block_weight` per block (one figure, or one per block) plus `first_extra` on the
    first stage and `last_extra` on the last; `stage_costs` gives them in FLOPs, so stages balance compute."""
    if explicit is not None:
        if len(explicit) != stages or any(c < 1 for c in explicit) or sum(explicit) != n_layer:
            raise ConfigError(f"parallel.pp_layers: {explicit} must be {stages} positive counts summing to "
                              f"model.n_layer={n_layer}")
        counts = list(explicit)
    else:
        if stages > n_layer:
            raise ConfigError(f"parallel.pp: {stages} stages need at least as many blocks, model.n_layer={n_layer}")
        weights = [float(block_weight)] * n_layer if isinstance(block_weight, (int, float)) else list(block_weight)
        counts = _balanced_counts(weights, stages, first_extra, last_extra)
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges


def _balanced_counts(blocks: list[float], stages: int, first: float, last: float) -> list[int]:
    prefix = list(itertools.accumulate(blocks, initial=0.0))
    n_layer = len(blocks)

    def weight(stage: int, start: int, count: int) -> float:
        return (prefix[start + count] - prefix[start] + (first if stage == 0 else 0.0)
                + (last if stage == stages - 1 else 0.0))

    @lru_cache(maxsize=None)
    def best(stage: int, start: int) -> tuple[float, tuple[int, ...]]:
        """(heaviest stage, counts) for stages `stage`.. holding blocks start.., each at least one."""
        remaining = n_layer - start
        if stage == stages - 1:
            return weight(stage, start, remaining), (remaining,)
        options = []
        for c in range(1, remaining - (stages - 1 - stage) + 1):
            rest, counts = best(stage + 1, start + c)
            # prefer the lighter heaviest stage, then the earlier stages holding more (a stable tie-break)
            options.append((max(weight(stage, start, c), rest), -c, (c, *counts)))
        heaviest, _, counts = min(options)
        return heaviest, counts

    return list(best(0, 0)[1])


def stage_ranges(m: ModelConfig, pp: int, named_shapes: Iterable[tuple[str, tuple[int, ...]]],
                 explicit: list[int] | None = None) -> list[range]:
    """Each pipeline stage's blocks: `explicit` (parallel.pp_layers) or balanced by training FLOPs."""
    blocks, first, last = stage_costs(m, block_params(named_shapes, m))
    return partition_layers(m.n_layer, pp, block_weight=blocks, first_extra=first, last_extra=last,
                            explicit=explicit)


def describe_stages(m: ModelConfig, ranges: list[range], named_shapes: Iterable[tuple[str, tuple[int, ...]]]) -> str:
    """'blocks 0-7 (52%), blocks 8-11 (48%)': each stage's share of the training FLOPs per token."""
    blocks, first, last = stage_costs(m, block_params(named_shapes, m))
    loads = [sum(blocks[i] for i in r) + (first if s == 0 else 0.0) + (last if s == len(ranges) - 1 else 0.0)
             for s, r in enumerate(ranges)]
    total = sum(loads)
    return ", ".join(f"blocks {r.start}-{r.stop - 1} {load / 1e6:.1f} MFLOP/token ({100 * load / total:.0f}%)"
                     for r, load in zip(ranges, loads))


def whole_shapes(model: nn.Module, tp: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of the whole model from this rank's slices: the split must not depend on
    the layout, and `dist-llm memory` splits the whole model's shapes. A sliced layer says its whole shapes itself
    (`full_shape`: tensor-parallel linears and embeddings, expert slices, LoRAs); `shape[dim] * tp` would be wrong
    for a fused QKV whose KV rows are replicated (tp > n_kv_head). Otherwise an expert slice holds E/ep of the
    stacked experts and a tensor-parallel slice 1/tp along its partition dim."""
    out, seen = [], set()
    for module_name, module in model.named_modules():
        full_shape = getattr(module, "full_shape", None)
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:  # (a tied weight once, as named_parameters lists it)
                continue
            seen.add(id(p))
            name = f"{module_name}.{pname}" if module_name else pname
            if full_shape is not None:
                out.append((name, tuple(full_shape(pname))))
                continue
            shape = list(p.shape)
            if (experts := expert_slice(p)) is not None:
                shape[0] = experts[1]
            if (dim := partition_dim(p)) is not None:
                shape[dim] *= tp
            out.append((name, tuple(shape)))
    return out


Blocks = range | tuple[range, ...]  # a stage's blocks: one run, or (interleaved) one per chunk


def rank_chunks(m: ModelConfig, pp: int, virtual: int, named_shapes: Iterable[tuple[str, tuple[int, ...]]],
                explicit: list[int] | None = None) -> list[tuple[range, ...]]:
    """Each rank's chunks under the interleaved schedule: the blocks cut into pp * virtual runs balanced by
    training FLOPs (or `explicit`, parallel.pp_layers, one count per chunk in model order); rank r holds runs
    r, r + pp, ... (virtual stages), the first of them holding the embedding and the last the head."""
    ranges = stage_ranges(m, pp * virtual, named_shapes, explicit)
    return [tuple(ranges[c * pp + r] for c in range(virtual)) for r in range(pp)]


def describe_blocks(blocks: Blocks) -> str:
    """'blocks 0-3', or for chunks 'blocks 0-1, 4-5'."""
    runs = (blocks,) if isinstance(blocks, range) else blocks
    return "blocks " + ", ".join(f"{r.start}-{r.stop - 1}" for r in runs)


def cut_to_stage(model: nn.Module, cfg: Config, pp: int, pp_rank: int) -> tuple[Blocks, bool, bool]:
    """Keep this stage's part of a built GPT in place: other stages' blocks become empty modules (so the
    parameter names, and checkpoints, stay those of the whole model), the embedding stays on the first
    stage, the final norm and head on the last. With tied embeddings the last stage keeps the embedding
    weight too (as the head), marked a pipeline duplicate (parallel/marks.py) so the gradient norm counts it once.
    Returns (blocks, first, last): blocks a range, or under the interleaved schedule a range per chunk."""
    m, virtual = cfg.model, cfg.parallel.pp_virtual
    shapes = whole_shapes(model, cfg.parallel.tp)
    ranges = stage_ranges(m, pp * virtual, shapes, cfg.parallel.pp_layers or None)
    if pp_rank == 0:
        log.info("pipeline %s by training FLOPs per token: %s", "chunks" if virtual > 1 else "stages",
                 describe_stages(m, ranges, shapes))
    mine: Blocks = ranges[pp_rank] if virtual == 1 else tuple(ranges[c * pp + pp_rank] for c in range(virtual))
    held = set(mine) if isinstance(mine, range) else {i for r in mine for i in r}
    first, last = pp_rank == 0, pp_rank == pp - 1
    for i in range(m.n_layer):
        if i not in held:
            model.blocks[i] = nn.Module()
    if not first:
        model.wpe = None
        model.drop = None
        if not (last and m.tie_embeddings):
            model.wte = None
        else:
            mark_pp_duplicate(model.wte.weight)  # type: ignore[arg-type]
    if not last:
        model.ln_f = None
        model.lm_head = None
    return mine, first, last
