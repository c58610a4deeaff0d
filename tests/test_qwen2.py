"""The lean Qwen2 forward runs transformers' operations: the same logits, bit for bit, faster.

Quantized models run it as fused operators whose RMSNorm sums its mean in its own order
(test_layer.py bounds the difference); at the tiny model's width of 64 the two orders agree, so
int8 is held to transformers' bits here too, fused products, rotary, SiLU and sums included."""

import pytest
import torch
from transformers import DynamicCache

from service.engine import Engine
from service.engine.batching import DecodeBatch


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_lean_forward_gives_transformers_bits_for_prompts_and_decode_steps(make_settings, dtype):
    """A prompt in two chunks, then decode steps of a padded batch: lean and transformers' logits equal."""
    engine = Engine(make_settings(dtype=dtype, max_model_len=1024, prefix_cache_mb=0))
    engine.start()
    assert engine.wait_ready(300), engine.facts
    model = engine.model
    try:
        assert engine.facts.forward == "lean"
        lean = model.__dict__["forward"]
        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(100, 5000, (length,), generator=generator).tolist() for length in (70, 9, 33)]

        def run() -> list[torch.Tensor]:
            seen, caches = [], []
            with torch.inference_mode():
                for ids in prompts:
                    cache = DynamicCache(config=model.config)
                    for chunk in (ids[:32], ids[32:]):
                        if chunk:
                            seen.append(model(input_ids=torch.tensor([chunk]), cache=cache, use_cache=True,
                                              logits_to_keep=1).logits[0, -1])
                    caches.append(cache)
                batch = DecodeBatch(model.config)
                batch.join(caches)
                for step in range(4):
                    seen.append(batch.step(model, [11 + step, 12, 13]))
            return seen

        with_lean = run()
        del model.forward
        with_transformers = run()
        model.forward = lean
        assert len(with_lean) == len(with_transformers)
        assert all(torch.equal(a, b) for a, b in zip(with_lean, with_transformers))
    finally:
        engine.stop()


def test_float32_keeps_transformers_forward(make_settings):
    """The lean forward needs the bf16 attention kernel; float32 models keep transformers' code."""
    engine = Engine(make_settings(dtype="float32", max_model_len=256))
    engine.start()
    try:
        assert engine.wait_ready(300), engine.facts
        assert engine.facts.forward == "transformers" and "forward" not in engine.model.__dict__
    finally:
        engine.stop()
