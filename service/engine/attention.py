"""Attention by rows: each query token over its own keys, in one fixed order (corechat's kernel).

A decode step passes `row_starts` (DecodeBatch.step: each row's first real column of the
left-padded batch cache), and each row attends over its own columns only, so its output is the
same bits alone or in any batch; through SDPA it is not: the padded width moves where SDPA's key
blocks split, and so the rounding. A prompt pass (one sequence) runs each of its tokens as a row
over the keys up to its own position, with the same loop a decode step runs, so a token gets the
same bits whether its prompt was processed whole, in chunks, or from a stored prefix, and the
prompt's last token the same as if it had been decoded.

The kernel is for bfloat16 caches and plain causal attention; anything else (float32, a batch of
padded prompts, sliding windows, soft-capping, attention sinks) goes to SDPA, decode steps with
each key/value head's group of query heads as that head's queries, which walks the keys once per
key/value head instead of once per query head (a 0.5B decode step at 3,000 tokens of context: 124
ms with transformers' call, 42 ms this way; bench/attention_probe.py). A bf16 matrix product would
be as fast but builds a oneDNN primitive per context length, and torch caches them, so a worker
would grow with every long conversation (tests/test_attention.py checks neither path does).
Registered with transformers' AttentionInterface as ATTENTION, so the model calls it for SDPA.
"""

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

ATTENTION = "corechat"
# Attention variants the kernel does not implement: with any of these set, SDPA runs.
UNSUPPORTED_BY_KERNEL = ("sliding_window", "softcap", "s_aux")


def kernel_applies(query, key, row_starts, kwargs) -> bool:
    """Tell whether the row kernel computes this call: bf16, plain causal, rows whose keys are known."""
    batch, _, queries, _ = query.shape
    if query.dtype != torch.bfloat16 or key.dtype != torch.bfloat16 or not hasattr(torch.ops.corechat, "attention"):
        return False
    if any(kwargs.get(name) is not None for name in UNSUPPORTED_BY_KERNEL):
        return False
    # Several single-token rows need their starts; several prompt rows could be padded.
    return batch == 1 or (queries == 1 and row_starts is not None)


def row_spans(batch: int, queries: int, width: int, row_starts=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return the kernel's cache row, first and end column of each query row, rows numbered batch
    row by query: a decode step's rows over their own spans (from row_starts), or a prompt's
    tokens each over the keys up to its own position."""
    if queries == 1:
        cache_rows = torch.arange(batch)
        starts = row_starts if row_starts is not None else torch.zeros(batch, dtype=torch.long)
        ends = torch.full((batch,), width)
    else:
        cache_rows = torch.zeros(queries, dtype=torch.long)
        starts = torch.zeros(queries, dtype=torch.long)
        ends = torch.arange(width - queries + 1, width + 1)
    return cache_rows, starts, ends


def kernel_cache(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return keys and values as the kernel reads them: each token's vector contiguous, the same
    strides for both. A cache's views of its room (kvcache.py) already are, and are not copied."""
    dim = keys.shape[-1]
    if keys.stride(-1) == 1 and keys.stride(-2) == dim and values.stride() == keys.stride():
        return keys, values
    return keys.contiguous(), values.contiguous()


def attention_by_rows(query, key, value, scaling: float, row_starts=None) -> torch.Tensor:
    """Run the kernel: (batch, heads, queries, dim) against (batch, kv_heads, keys, dim); (batch, queries, heads, dim) out."""
    batch, heads, queries, dim = query.shape
    rows = query[:, :, 0] if queries == 1 else query[0].transpose(0, 1)
    spans = row_spans(batch, queries, key.shape[2], row_starts)
    output = torch.ops.corechat.attention(rows, *kernel_cache(key, value), *spans, scaling)
    return output.view(batch, queries, heads, dim)


def corechat_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, row_starts=None,
                       **kwargs):
    """Attend by rows where the kernel applies; else single-token queries as grouped SDPA, prompts as SDPA.

    query is (batch, heads, queries, dim), key and value (batch, kv_heads, keys, dim); query head h
    reads key/value head h // (heads / kv_heads), as in transformers' repeat_kv. The mask is SDPA's,
    (batch, 1, 1 or queries, keys); the kernel needs none (row_starts and causality say it all).
    """
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if kernel_applies(query, key, row_starts, kwargs):
        return attention_by_rows(query, key, value, scaling, row_starts), None
    if query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    output = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
    return output.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, corechat_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
