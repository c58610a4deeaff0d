"""What bounds a worker's memory: the KV token budget, and giving back what glibc keeps freed."""

import ctypes
import ctypes.util
from functools import lru_cache

import torch

MIB = 1024 * 1024


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Return the bytes of keys and values one token adds to a sequence's cache, over every layer."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def kv_token_budget(kv_cache_mb: int, bytes_per_token: int) -> int:
    """Return how many cached tokens, padding included, fit in kv_cache_mb MiB."""
    return kv_cache_mb * MIB // bytes_per_token


def most_tokens(generation) -> int:
    """Return the tokens a generation's cache holds at most: its prompt plus max_tokens."""
    return len(generation.prompt_ids) + generation.params.max_tokens


def reserved_kv_tokens(generations) -> int:
    """Return the cache tokens a set of generations may reach when decoded as one batch.

    The batch left-pads every row to its longest, so each row costs as much as the longest
    sequence will: rows times the largest prompt plus max_tokens.
    """
    return len(generations) * max((most_tokens(generation) for generation in generations), default=0)


@lru_cache(maxsize=1)
def _libc():
    """Return glibc, or None where the C library is another (musl, macOS) without malloc_trim."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def return_freed_memory() -> None:
    """Hand memory that glibc holds freed, in every arena, back to the kernel."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
