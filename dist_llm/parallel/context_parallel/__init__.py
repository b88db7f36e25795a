"""Context parallelism: the sequence split over ranks, attention by a ring of key/value blocks."""

from dist_llm.parallel.context_parallel.layout import (LAYOUTS, block_plan, local_positions, merge_sequence,
                                                       split_sequence, unmasked_entries)
from dist_llm.parallel.context_parallel.ring import ring_attention

__all__ = ["LAYOUTS", "block_plan", "local_positions", "merge_sequence", "ring_attention", "split_sequence",
           "unmasked_entries"]
