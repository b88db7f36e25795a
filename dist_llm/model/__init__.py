"""The GPT model, free of parallelism."""

from dist_llm.model.factory import LayerFactory
from dist_llm.model.gpt import GPT, Block

__all__ = ["GPT", "Block", "LayerFactory"]
