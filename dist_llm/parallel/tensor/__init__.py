"""Tensor parallelism (Megatron-style, written here) and sequence parallelism."""

from dist_llm.parallel.tensor.plan import TensorParallelFactory, sync_sequence_parallel_grads

__all__ = ["TensorParallelFactory", "sync_sequence_parallel_grads"]
