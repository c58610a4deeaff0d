"""What bounds a worker's KV memory: the budget in pages and what each sequence reserves of it."""

import torch

from devtools.devmodel import make_model_config
from service.engine.memory import PAGE_TOKENS, KVBudget, kv_bytes_per_token, pages_needed
from service.settings import Settings


class Queued:
    """A stand-in for a queued generation: only its prompt length and max_tokens matter here."""

    def __init__(self, prompt_tokens: int, max_tokens: int):
        self.prompt_ids = [0] * prompt_tokens
        self.params = type("Params", (), {"max_tokens": max_tokens})()
        self.places = 1


def test_the_default_budget_holds_1365_pages_of_qwen2_5_0_5b():
    """Qwen2.5-0.5B keeps 24 layers x 2 KV heads x 64 dims x keys and values x 2 bytes per token, so
    1 GiB holds 1,365 pages of 64 tokens: 87,360 tokens, above the model's 32,768-token context."""
    config = make_model_config("qwen2.5-0.5b")
    assert kv_bytes_per_token(config, torch.bfloat16) == 24 * 2 * 64 * 2 * 2 == 12_288
    assert Settings().kv_cache_mb == 1024 and PAGE_TOKENS == 64
    budget = KVBudget.of(1024, 12_288)
    assert (budget.pages, budget.tokens) == (1365, 87_360)
    assert budget.pages * budget.page_bytes <= 1024 * 1024 * 1024
    assert KVBudget.of(1024, kv_bytes_per_token(config, torch.float32)).pages == 682


def test_each_sequence_reserves_the_pages_of_its_own_prompt_and_max_tokens():
    """Nothing is padded to another sequence's length: a short request next to a long one costs its own pages."""
    assert pages_needed(Queued(100, 28)) == 2
    assert pages_needed(Queued(64, 0)) == 1 and pages_needed(Queued(64, 1)) == 2
    assert pages_needed(Queued(28_000, 512)) == 446
