"""The KV cache of sequences on transformers' forward: a model gives the same logits over corechat's cache as
over transformers' DynamicCache."""

import torch
from transformers import DynamicCache

from service.engine.kvcache import new_cache
from tests.support import started_engine


def test_a_model_gives_the_same_logits_over_both_caches(make_settings):
    """On transformers' forward (float32), a chunked 500-token prompt (its room filled and grown) and
    decode steps: logits to the bit."""
    with started_engine(make_settings(dtype="float32", max_model_len=1024)) as engine:
        model = engine.model
        prompt = torch.randint(100, 5000, (500,), generator=torch.Generator().manual_seed(0)).tolist()
        seen = []
        with torch.inference_mode():
            for cache in (new_cache(model.config), DynamicCache(config=model.config)):
                logits = []
                for start in range(0, len(prompt), 200):
                    chunk = torch.tensor([prompt[start:start + 200]])
                    logits.append(model(input_ids=chunk, cache=cache, use_cache=True, logits_to_keep=1).logits)
                for _ in range(8):
                    token = logits[-1][0, -1].argmax().view(1, 1)
                    logits.append(model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1).logits)
                seen.append(logits)
        assert all(torch.equal(a, b) for a, b in zip(*seen, strict=True))
