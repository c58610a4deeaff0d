"""The engine's attention computes what SDPA computes: by rows (the kernel) or grouped (SDPA)."""

import pytest
import torch
from transformers import DynamicCache, Qwen2Config
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

from service.engine.attention import ATTENTION, corechat_attention
from service.engine.loading import load_model
from support import anonymous_megabytes

HEADS, KV_HEADS, DIM = 14, 2, 64


@pytest.fixture
def module():
    """A real Qwen2 attention layer with the 0.5B model's head layout."""
    config = Qwen2Config(hidden_size=HEADS * DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS)
    return Qwen2Attention(config, layer_idx=0)


def padding_mask(lengths: list[int], keys: int) -> torch.Tensor:
    """Return SDPA's boolean mask for left-padded rows: True where a row's real keys are."""
    columns = torch.arange(keys)
    return torch.stack([columns >= keys - length for length in lengths])[:, None, None, :]


@pytest.mark.parametrize("mask_kind", ["none", "boolean", "additive"])
def test_single_query_attention_equals_sdpa(module, mask_kind):
    """One query per row, grouped query heads, with and without padding masks: SDPA's output."""
    generator = torch.Generator().manual_seed(0)
    batch, keys = 3, 37
    query = torch.randn(batch, HEADS, 1, DIM, generator=generator)
    key = torch.randn(batch, KV_HEADS, keys, DIM, generator=generator)
    value = torch.randn(batch, KV_HEADS, keys, DIM, generator=generator)
    mask = None
    if mask_kind != "none":
        mask = padding_mask([keys, 20, 5], keys)
        if mask_kind == "additive":
            mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=module.scaling)
    got, _ = corechat_attention(module, query, key, value, mask, scaling=module.scaling)
    assert got.shape == expected.shape == (batch, 1, HEADS, DIM)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_model_decodes_a_long_context_as_with_sdpa(tiny_model_dir):
    """Prompt pass and single-token steps give SDPA's logits (float32) with the engine's attention."""
    model = load_model(tiny_model_dir, torch.float32)
    assert model.config._attn_implementation == ATTENTION
    reference = load_model(tiny_model_dir, torch.float32)
    reference.set_attn_implementation("sdpa")
    prompt = torch.randint(0, 1000, (1, 300), generator=torch.Generator().manual_seed(1))
    caches = [DynamicCache(config=model.config), DynamicCache(config=reference.config)]
    with torch.inference_mode():
        outputs = [m(input_ids=prompt, cache=c, use_cache=True).logits for m, c in zip((model, reference), caches)]
        torch.testing.assert_close(outputs[0], outputs[1])
        for token in range(10):
            step = torch.tensor([[token + 7]])
            got, expected = (m(input_ids=step, cache=c, use_cache=True).logits
                             for m, c in zip((model, reference), caches))
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_decoding_at_ever_new_context_lengths_does_not_grow_memory(module):
    """A bf16 matrix product per step would cache a oneDNN primitive per context length, each holding
    memory, so a long chat would keep growing its worker."""
    query = torch.randn(4, HEADS, 1, DIM, dtype=torch.bfloat16)
    before = anonymous_megabytes()
    for keys in range(500, 800):
        key = torch.randn(4, KV_HEADS, keys, DIM, dtype=torch.bfloat16)
        corechat_attention(module, query, key, key, None, scaling=module.scaling)
    assert anonymous_megabytes() - before < 30
