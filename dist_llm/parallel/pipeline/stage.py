"""Which transformer blocks each pipeline stage holds."""

from __future__ import annotations

from functools import lru_cache

from torch import nn

from dist_llm.config import Config, ConfigError
from dist_llm.parallel.marks import mark_pp_duplicate


def partition_layers(n_layer: int, stages: int, *, block_weight: float = 1.0, first_extra: float = 0.0,
                     last_extra: float = 0.0, explicit: list[int] | None = None) -> list[range]:
    """Contiguous block ranges, one per stage.

    `explicit` (parallel.pp_layers) gives the block count of each stage. Otherwise the split minimises the
    heaviest stage, counting `block_weight` per block plus `first_extra` on the first stage (the embedding)
    and `last_extra` on the last (final norm and LM head): stages are balanced by parameter count."""
    if explicit is not None:
        if len(explicit) != stages or any(c < 1 for c in explicit) or sum(explicit) != n_layer:
            raise ConfigError(f"parallel.pp_layers: {explicit} must be {stages} positive counts summing to "
                              f"model.n_layer={n_layer}")
        counts = list(explicit)
    else:
        if stages > n_layer:
            raise ConfigError(f"parallel.pp: {stages} stages need at least as many blocks, model.n_layer={n_layer}")
        counts = _balanced_counts(n_layer, stages, block_weight, first_extra, last_extra)
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges


def _balanced_counts(n_layer: int, stages: int, block: float, first: float, last: float) -> list[int]:
    def weight(stage: int, count: int) -> float:
        return count * block + (first if stage == 0 else 0.0) + (last if stage == stages - 1 else 0.0)

    @lru_cache(maxsize=None)
    def best(stage: int, remaining: int) -> tuple[float, tuple[int, ...]]:
        """(heaviest stage, counts) for stages `stage`.. holding `remaining` blocks, each at least one."""
        if stage == stages - 1:
            return weight(stage, remaining), (remaining,)
        options = []
        for c in range(1, remaining - (stages - 1 - stage) + 1):
            rest, counts = best(stage + 1, remaining - c)
            # prefer the lighter heaviest stage, then the earlier stages holding more (a stable tie-break)
            options.append((max(weight(stage, c), rest), -c, (c, *counts)))
        heaviest, _, counts = min(options)
        return heaviest, counts

    return list(best(0, n_layer)[1])


def cut_to_stage(model: nn.Module, cfg: Config, pp: int, pp_rank: int) -> tuple[range, bool, bool]:
    """Keep this stage's part of a built GPT in place: other stages' blocks become empty modules (so the
    parameter names, and checkpoints, stay those of the whole model), the embedding stays on the first
    stage, the final norm and head on the last. With tied embeddings the last stage keeps the embedding
    weight too (as the head), marked a pipeline duplicate (parallel/marks.py) so the gradient norm counts it once.
    Returns (block range, first, last)."""
    m = cfg.model
    block = sum(p.numel() for p in model.blocks[0].parameters())
    embed = model.wte.weight.numel()
    ranges = partition_layers(m.n_layer, pp, block_weight=block, first_extra=embed,
                              last_extra=0 if m.tie_embeddings else embed,
                              explicit=cfg.parallel.pp_layers or None)
    mine = ranges[pp_rank]
    first, last = pp_rank == 0, pp_rank == pp - 1
    for i in range(m.n_layer):
        if i not in mine:
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
