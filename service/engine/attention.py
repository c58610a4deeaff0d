"""Attention for decoding: one query per sequence, its key/value heads shared by groups of query heads.

transformers hands one query per head to torch's CPU SDPA kernel with `enable_gqa`; that kernel
walks the keys once per query head, and a decode step of the 0.5B model took 62 ms at 1,000 tokens
of context and 124 ms at 3,000, against 35 ms at 40 (one thread). Handing it each key/value head's
group of query heads as that head's queries walks the keys once per key/value head: the same
output, and 35 and 42 ms (bench/attention_probe.py). A plain bf16 matrix product would be as fast
but builds a oneDNN primitive for every new context length, and torch caches them, so a worker
grows with every long conversation (tests/test_attention.py checks this one does not). Prompt
passes keep transformers' SDPA call.
Registered with transformers' AttentionInterface as ATTENTION, so the model calls it for SDPA.
"""

import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

ATTENTION = "corechat"


def grouped_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attend with single-token queries as SDPA over grouped queries; hand anything else to SDPA as is.

    query is (batch, heads, 1, dim), key and value (batch, kv_heads, keys, dim); query head h reads
    key/value head h // (heads / kv_heads), as in transformers' repeat_kv, so each key/value head's
    query heads become that head's queries. The mask is SDPA's, (batch, 1, 1 or queries, keys).
    """
    if query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    output = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
    return output.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, grouped_decode_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
