"""Attention for decoding: one query per sequence, its key/value heads shared by groups of query heads.

A decode step of a batch whose rows carry `row_starts` (DecodeBatch.step passes each row's first
real column of the left-padded cache) runs torch.ops.corechat.decode_attention: each row attends
over its own keys only, in a fixed order, so its output is the same bits alone or in any batch;
padding never enters its sums (through SDPA it does: the padded width moves where its key blocks
split, and so the rounding). The kernel is for bfloat16 caches and plain causal attention; for
anything else (float32, sliding windows, soft-capping, attention sinks) decoding keeps SDPA.

The SDPA path hands each key/value head's group of query heads to torch's CPU kernel as that
head's queries, which walks the keys once per key/value head instead of once per query head: a
decode step of the 0.5B model took 62 ms at 1,000 tokens of context and 124 ms at 3,000 with
transformers' call, 35 and 42 ms this way (bench/attention_probe.py). A plain bf16 matrix product
would be as fast but builds a oneDNN primitive for every new context length, and torch caches
them, so a worker grows with every long conversation (tests/test_attention.py checks this one
does not). Prompt passes keep transformers' SDPA call.
Registered with transformers' AttentionInterface as ATTENTION, so the model calls it for SDPA.
"""

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

ATTENTION = "corechat"


# Attention variants the decode kernel does not implement: with any of these set, SDPA decodes.
UNSUPPORTED_BY_KERNEL = ("sliding_window", "softcap", "s_aux")


def grouped_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, row_starts=None,
                             **kwargs):
    """Attend with single-token queries by rows (the kernel) or as SDPA over grouped queries; prompts as SDPA.

    query is (batch, heads, 1, dim), key and value (batch, kv_heads, keys, dim); query head h reads
    key/value head h // (heads / kv_heads), as in transformers' repeat_kv, so each key/value head's
    query heads become that head's queries. The mask is SDPA's, (batch, 1, 1 or queries, keys).
    """
    if query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if (row_starts is not None and query.dtype == torch.bfloat16 and key.dtype == torch.bfloat16
            and not any(kwargs.get(name) is not None for name in UNSUPPORTED_BY_KERNEL)):
        output = torch.ops.corechat.decode_attention(query[:, :, 0], key.contiguous(), value.contiguous(), row_starts,
                                                     scaling if scaling is not None else query.shape[-1] ** -0.5)
        return output.unsqueeze(1), None
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    output = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
    return output.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, grouped_decode_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
