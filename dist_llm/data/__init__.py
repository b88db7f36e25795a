"""Data: tokenizers, corpus preparation into cached token files (uint16, or uint32 past 65,536 tokens), and layout-independent sampling."""

from dist_llm.data.corpus import PreparedData, documents, is_val_document, prepare_data
from dist_llm.data.loader import BatchPrefetcher
from dist_llm.data.sampler import GlobalBatchSampler, get_batch, host_batch, to_device, val_sampler
from dist_llm.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "BPETokenizer",
    "BatchPrefetcher",
    "ByteTokenizer",
    "GlobalBatchSampler",
    "PreparedData",
    "Tokenizer",
    "documents",
    "get_batch",
    "host_batch",
    "is_val_document",
    "load_tokenizer",
    "prepare_data",
    "to_device",
    "val_sampler",
]
