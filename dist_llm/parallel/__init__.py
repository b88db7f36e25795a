"""Parallel forms, each in its own module, all driven by one explicitly passed ParallelContext."""

from dist_llm.parallel.context import ParallelContext

__all__ = ["ParallelContext"]
