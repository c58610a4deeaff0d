"""What bounds a worker's KV memory: the budget in pages, its arithmetic, and admission through Gunicorn."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from devtools.devmodel import make_model_config
from harness import GunicornServer
from service.engine.memory import PAGE_TOKENS, KVBudget, kv_bytes_per_token, pages_needed
from service.settings import Settings

NO_CACHE = {"Cache-Control": "no-cache"}


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


# The tiny model keeps 256 bytes per token: 1 MiB holds 64 pages of 64 tokens, so two requests of
# a 1,933-token prompt and 100 new tokens (32 pages each) fit together and a third waits.
BUDGET_TOKENS = 4096
PROMPT_WORDS = 1900
MAX_TOKENS = 100


@pytest.fixture(scope="module")
def small_budget_server(tiny_model_dir, tmp_path_factory):
    """Run one worker with a 1 MiB KV budget, a context window larger than that, and default limits otherwise."""
    with GunicornServer(
        tmp_path_factory.mktemp("kv-budget"), workers=1, kv_cache_mb=1, max_model_len=16_384, sse_ping_seconds=0.2,
    ) as server:
        yield server


def long_prompt(index: int, words: int = PROMPT_WORDS) -> list[dict]:
    """Return a distinct prompt of about `words` tokens."""
    return [{"role": "user", "content": f"Story {index}: " + " ".join(["light"] * words)}]


def stream_to_end(server, body: dict) -> dict:
    """Stream a reply; return whether it pinged before its first token, its finish_reason and [DONE]."""
    outcome = {"pinged_first": False, "finish_reason": None, "done": False}
    seen_content = False
    with requests.post(f"{server.url}/v1/chat/completions", json={**body, "stream": True}, headers=NO_CACHE,
                       stream=True, timeout=120) as response:
        assert response.status_code == 200, response.text
        for line in response.iter_lines(decode_unicode=True):
            if line.startswith(": ping") and not seen_content:
                outcome["pinged_first"] = True
            elif line == "data: [DONE]":
                outcome["done"] = True
            elif line.startswith("data: "):
                choices = json.loads(line[len("data: "):]).get("choices") or [{}]
                seen_content = seen_content or bool(choices[0].get("delta", {}).get("content"))
                outcome["finish_reason"] = choices[0].get("finish_reason") or outcome["finish_reason"]
    return outcome


def readyz(server) -> dict:
    """Return the worker's /readyz body."""
    return requests.get(f"{server.url}/readyz", headers={"Connection": "close"}, timeout=10).json()


def test_requests_beyond_the_kv_budget_wait_in_the_queue_and_all_complete(small_budget_server):
    assert readyz(small_budget_server)["kv_token_budget"] == BUDGET_TOKENS
    most_seen = {"running": 0, "waiting": 0}
    with ThreadPoolExecutor(6) as pool:
        streams = [
            pool.submit(stream_to_end, small_budget_server, {"messages": long_prompt(index), "max_tokens": MAX_TOKENS,
                                                             "temperature": 0, "stop": ["never appears"]})
            for index in range(6)
        ]
        while not all(stream.done() for stream in streams):
            facts = readyz(small_budget_server)
            most_seen = {key: max(most_seen[key], facts[key]) for key in most_seen}
            time.sleep(0.05)
        outcomes = [stream.result() for stream in streams]
    # Eight places to run, but the budget holds two such rows: the others waited, counted.
    assert most_seen["running"] == 2 and most_seen["waiting"] >= 1, most_seen
    # Greedy replies of the random-weight model draw no EOS this early: each runs to max_tokens.
    assert all(outcome["done"] and outcome["finish_reason"] == "length" for outcome in outcomes), outcomes
    assert any(outcome["pinged_first"] for outcome in outcomes)
    facts = readyz(small_budget_server)
    assert (facts["running"], facts["waiting"]) == (0, 0)


def test_a_request_that_could_never_fit_the_budget_gets_400(small_budget_server):
    url = f"{small_budget_server.url}/v1/chat/completions"
    too_long_reply = requests.post(url, json={"messages": long_prompt(0), "max_tokens": 2500}, timeout=60)
    assert too_long_reply.status_code == 400
    error = too_long_reply.json()["error"]
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
    assert "KV_CACHE_MB" in error["message"] and str(BUDGET_TOKENS) in error["message"]

    too_long_prompt = requests.post(url, json={"messages": long_prompt(0, words=5000)}, timeout=60)
    assert too_long_prompt.status_code == 400 and too_long_prompt.json()["error"]["param"] == "messages"

    # Without max_tokens, the reply gets what room the budget leaves, so a prompt that fits is served.
    fits = requests.post(url, json={"messages": long_prompt(0, words=3900), "temperature": 0}, headers=NO_CACHE,
                         timeout=120)
    assert fits.status_code == 200, fits.text
    assert fits.json()["usage"]["total_tokens"] <= BUDGET_TOKENS
