"""What bounds a worker's memory: the KV budget in pages, and giving back what glibc keeps freed."""

import ctypes
import ctypes.util
from dataclasses import dataclass
from functools import lru_cache

import torch

MIB = 1024 * 1024
# Tokens of KV state per page, the unit a sequence's room is counted (and, on the paged path,
# stored) in; kernels.h's kPageTokens, which kvpool.PagePool checks it against.
PAGE_TOKENS = 64


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Return the bytes of keys and values one token adds to a sequence's cache, over every layer."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


@dataclass(frozen=True)
class KVBudget:
    """A worker's KV memory (KV_CACHE_MB) as whole pages of PAGE_TOKENS tokens."""

    pages: int
    page_bytes: int

    @classmethod
    def of(cls, kv_cache_mb: int, bytes_per_token: int) -> "KVBudget":
        """Return the pages that fit in kv_cache_mb MiB."""
        page_bytes = PAGE_TOKENS * bytes_per_token
        return cls(pages=kv_cache_mb * MIB // page_bytes, page_bytes=page_bytes)

    @property
    def tokens(self) -> int:
        """Return the most tokens one sequence can hold: every page."""
        return self.pages * PAGE_TOKENS


def pages_for(tokens: int) -> int:
    """Return the pages that hold `tokens` tokens."""
    return -(-tokens // PAGE_TOKENS)


def most_tokens(generation) -> int:
    """Return the tokens a generation's cache holds at most: its prompt plus max_tokens."""
    return len(generation.prompt_ids) + generation.params.max_tokens


def pages_needed(generation) -> int:
    """Return the pages a generation reserves when it starts: its most tokens, for each of its choices."""
    return pages_for(most_tokens(generation)) * generation.places


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
