"""The one definition of the marks a parameter carries about how it is split across ranks.

Checkpointing, the gradient norm, the sequence-parallel sync and loading read them, so that none of them
needs a special case per layer. They are plain attributes on the Parameter (they travel with it through
`to_empty`, FSDP2's wrap and loading via `marks_of` / `set_marks`); only this module names them.

- partition dim: the parameter is this tp rank's slice of the full tensor along that dim;
- sequence parallel: replicated over tp but each rank sees only its slice of the sequence, so its gradient is
  partial and summed over tp (the norms under sequence parallelism; everything inside an MoE layer under tp,
  which routes 1/tp of the tokens on each rank: parallel/tensor/moe.py);
- replicated rows (first, end, factor): rows [first, end) of a tp slice are held by `factor` tp ranks (grouped
  KV heads when tp exceeds the KV heads): the norm counts them once;
- pipeline duplicate: the tied embedding held by the last stage as the head, also held by the first stage: the
  norm counts it once;
- expert slice (first, total): a stacked expert tensor (E_local, ...) holding experts [first, first + E_local) of
  `total`, this rank's part under expert parallelism: checkpoints place it at that offset along dim 0, its
  gradient is reduced over the expert-data-parallel group only, the norm sums it over the ep group.
"""

from __future__ import annotations

from typing import Any

import torch

_PARTITION_DIM = "tp_partition_dim"
_SEQUENCE_PARALLEL = "sequence_parallel"
_REPLICATED_ROWS = "tp_replicated_rows"
_PP_DUPLICATE = "pp_duplicate"
_EXPERT_SLICE = "ep_expert_slice"
MARKS = (_PARTITION_DIM, _SEQUENCE_PARALLEL, _REPLICATED_ROWS, _PP_DUPLICATE, _EXPERT_SLICE)


def mark_partition(p: torch.Tensor, dim: int) -> None:
    setattr(p, _PARTITION_DIM, dim)


def partition_dim(p: torch.Tensor) -> int | None:
    """The dim along which `p` is a tp slice of the full tensor; None when it is whole on every tp rank."""
    return getattr(p, _PARTITION_DIM, None)


def mark_sequence_parallel(p: torch.Tensor, on: bool = True) -> None:
    setattr(p, _SEQUENCE_PARALLEL, on)


def is_sequence_parallel(p: torch.Tensor) -> bool:
    return bool(getattr(p, _SEQUENCE_PARALLEL, False))


def mark_replicated_rows(p: torch.Tensor, rows: tuple[int, int, int]) -> None:
    """(first row, end row, factor): rows [first, end) of this slice are held by `factor` tp ranks."""
    setattr(p, _REPLICATED_ROWS, rows)


def replicated_rows(p: torch.Tensor) -> tuple[int, int, int] | None:
    return getattr(p, _REPLICATED_ROWS, None)


def mark_pp_duplicate(p: torch.Tensor) -> None:
    setattr(p, _PP_DUPLICATE, True)


def is_pp_duplicate(p: torch.Tensor) -> bool:
    return bool(getattr(p, _PP_DUPLICATE, False))


def mark_expert_slice(p: torch.Tensor, first: int, total: int) -> None:
    """`p` (E_local, ...) holds experts [first, first + E_local) of `total`."""
    setattr(p, _EXPERT_SLICE, (first, total))


def expert_slice(p: torch.Tensor) -> tuple[int, int] | None:
    """(first expert, total experts) of an expert-parallel slice; None for any other parameter."""
    return getattr(p, _EXPERT_SLICE, None)


def marks_of(p: torch.Tensor) -> dict[str, Any]:
    """Every mark `p` carries, to put on the Parameter that replaces it (`set_marks`)."""
    return {name: getattr(p, name) for name in MARKS if hasattr(p, name)}


def set_marks(p: torch.Tensor, marks: dict[str, Any]) -> None:
    for name, value in marks.items():
        setattr(p, name, value)
