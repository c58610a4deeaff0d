"""The lean Qwen2 forward runs transformers' operations around corechat's attention kernel: the same
logits, bit for bit, as transformers' own forward given that kernel for its attention.

Quantized models run it as fused operators whose RMSNorm sums its mean in its own order
(test_layer.py bounds the difference); at the tiny model's width of 64 the two orders agree, so
int8 is held to transformers' bits here too, fused products, rotary, SiLU and sums included."""

import pytest
import torch
from transformers import AttentionInterface, DynamicCache

from service.engine.kvpool import PagePool
from service.engine.memory import PAGE_TOKENS, KVBudget
from tests.support import started_engine

KERNEL_ATTENTION = "corechat-paged-test"


def as_pages(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Return a layer's keys and values, [1, kv_heads, tokens, head_dim], in the pool's stored layout:
    [pages, 2, kv_heads, PAGE_TOKENS * head_dim], a page's keys as pairs of elements, pair-major, its
    values as pairs of tokens, element by element (kernels.h: PagedAttention)."""
    _, kv_heads, tokens, dim = keys.shape
    count = -(-tokens // PAGE_TOKENS)
    padded = [torch.zeros(kv_heads, count * PAGE_TOKENS, dim, dtype=keys.dtype) for _ in range(2)]
    padded[0][:, :tokens], padded[1][:, :tokens] = keys[0], values[0]
    key_pages = padded[0].view(kv_heads, count, PAGE_TOKENS, dim // 2, 2).permute(1, 0, 3, 2, 4)
    value_pages = padded[1].view(kv_heads, count, PAGE_TOKENS // 2, 2, dim).permute(1, 0, 2, 4, 3)
    return torch.stack([key_pages.reshape(count, kv_heads, -1), value_pages.reshape(count, kv_heads, -1)], dim=1)


def kernel_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers' attention call for one sequence answered by the paged kernel: the cache's keys
    and values are put in pages, then the queries (the last positions) attend as the lean forward's rows do."""
    _, heads, queries, dim = query.shape
    kv_heads, tokens = key.shape[1], key.shape[2]
    pool = PagePool(KVBudget(-(-tokens // PAGE_TOKENS), 0), (1, kv_heads, dim))
    pages = pool.reserve(tokens)
    earlier = tokens - queries
    if earlier:
        pool.write(pages, [as_pages(key[:, :, :earlier], value[:, :, :earlier])], earlier)
    rows = query[0].transpose(0, 1).contiguous()
    new_keys, new_values = (part[0, :, earlier:].transpose(0, 1).contiguous() for part in (key, value))
    out = torch.ops.corechat.paged_attention(
        rows, new_keys, new_values, pool.storage, 0, pages.table.unsqueeze(0), torch.zeros(queries, dtype=torch.long),
        torch.arange(earlier, tokens), scaling)
    return out.unsqueeze(0), None


AttentionInterface.register(KERNEL_ATTENTION, kernel_attention)


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_lean_forward_gives_transformers_bits_for_prompts_and_decode_steps(make_settings, dtype):
    """Prompts in two chunks, then decode steps of all three as one batch: the lean forward's logits equal
    transformers' forward's, each sequence alone there with its own cache."""
    with started_engine(make_settings(dtype=dtype, max_model_len=1024, prefix_cache_mb=0)) as engine:
        model, runner = engine.model, engine._scheduler.runner
        assert engine.facts.forward == "lean"
        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(100, 5000, (length,), generator=generator).tolist() for length in (70, 9, 33)]
        steps = [[11 + step, 12, 13] for step in range(4)]

        lean = []
        with torch.inference_mode():
            kvs = [runner.reserve(100) for _ in prompts]
            for kv, ids in zip(kvs, prompts):
                for chunk in (ids[:32], ids[32:]):
                    if chunk:
                        lean.append(runner.prefill(kv, chunk, 1)[-1])
            for tokens in steps:
                lean.append(runner.decode(kvs, tokens))
            for kv in kvs:
                runner.release(kv)

        model.set_attn_implementation(KERNEL_ATTENTION)
        reference = []
        with torch.inference_mode():
            caches = [DynamicCache(config=model.config) for _ in prompts]
            for cache, ids in zip(caches, prompts):
                for chunk in (ids[:32], ids[32:]):
                    if chunk:
                        reference.append(model(input_ids=torch.tensor([chunk]), cache=cache, use_cache=True,
                                               logits_to_keep=1).logits[0, -1].float())
            for tokens in steps:
                reference.append(torch.stack([
                    model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True,
                          logits_to_keep=1).logits[0, -1].float() for cache, token in zip(caches, tokens)]))
        model.set_attn_implementation("sdpa")
        assert len(lean) == len(reference)
        assert all(torch.equal(a, b) for a, b in zip(lean, reference))


def test_float32_keeps_transformers_forward(make_settings):
    """The lean forward needs the bf16 attention kernel; float32 models run transformers' forward."""
    with started_engine(make_settings(dtype="float32", max_model_len=256)) as engine:
        assert engine.facts.forward == "transformers"
        assert type(engine._scheduler.runner).__name__ == "TransformersModel"
