"""What bounds a worker's KV memory: the budget's arithmetic against the engine's pool and stored state."""

from service.engine.memory import PAGE_TOKENS


def test_the_budget_arithmetic_matches_the_pool_and_the_stored_state(engine):
    """The pool is the budget's pages exactly, and a stored prompt's KV state takes kv_bytes_per_token per token."""
    prompt = engine.template.encode(engine.template.render([{"role": "user", "content": "Measure my cache, please."}]))
    from service.engine import SamplingParams

    pool = engine._scheduler.runner.pool
    assert pool.storage.nbytes == pool.budget.pages * pool.budget.page_bytes <= engine.settings.kv_cache_mb * 2**20
    list(engine.submit(prompt, SamplingParams(max_tokens=1, temperature=0.0)).events())
    layers, length = engine._scheduler.prefixes.lookup([*prompt, 0])
    assert length == len(prompt)
    # Stored as its pages: the prompt's tokens, rounded up to whole pages.
    assert all(tuple(layer.shape) == pool.stored_shape(length) for layer in layers)
    held = sum(layer.nbytes for layer in layers)
    assert held == -(-len(prompt) // PAGE_TOKENS) * PAGE_TOKENS * engine.facts.kv_bytes_per_token


def test_the_engines_stored_kv_state_is_named_by_its_weights_format_layout_and_code(engine):
    from service.engine.sequence_files import forward_code_version

    prefixes = engine._scheduler.prefixes
    assert prefixes.model_key == (f"{engine.fingerprint}-{engine.settings.dtype}-{engine._scheduler.runner.kv_layout}"
                                  f"-{forward_code_version()}")
