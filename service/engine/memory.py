"""What a worker's KV state may grow to: the token budget, and what running sequences reserve of it."""

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
