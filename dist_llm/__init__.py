"""dist_llm: distributed training of GPT-style language models on PyTorch."""

__version__ = "0.1.0"
