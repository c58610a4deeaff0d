"""What bounds a worker's KV memory, through Gunicorn: requests beyond the KV budget wait and complete, and
one that could never fit gets a 400."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from harness import DONE, sse_payload

NO_CACHE = {"Cache-Control": "no-cache"}


# The tiny model keeps 256 bytes per token: 1 MiB holds 64 pages of 64 tokens, so two requests of
# a 1,933-token prompt and 100 new tokens (32 pages each) fit together and a third waits.
BUDGET_TOKENS = 4096
PROMPT_WORDS = 1900
MAX_TOKENS = 100


@pytest.fixture(scope="module")
def small_budget_server(gunicorn):
    """Run one worker with a 1 MiB KV budget, a context window larger than that, and default limits otherwise."""
    with gunicorn(workers=1, kv_cache_mb=1, max_model_len=16_384, sse_ping_seconds=0.2) as server:
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
            payload = sse_payload(line)
            if line.startswith(": ping") and not seen_content:
                outcome["pinged_first"] = True
            elif payload == DONE:
                outcome["done"] = True
            elif payload is not None:
                choices = payload.get("choices") or [{}]
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
