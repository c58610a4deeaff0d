"""Conversation turns' KV state shared between hosts through Redis (SHARED_KV_TTL_SECONDS): a turn that
lands on another host fetches its conversation's KV state and answers with the same bytes."""

import pytest
import redis
import requests

from harness import ready_facts
from tests.support import wait_until

NO_CACHE = {"Cache-Control": "no-cache"}
QUESTION = "Please keep count of the words I say: " + "apple banana cherry " * 30


def chat(server, messages: list[dict], **body) -> dict:
    """Send a chat request and return its JSON reply."""
    response = requests.post(f"{server.url}/v1/chat/completions", headers=NO_CACHE, timeout=120,
                             json={"messages": messages, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def the_token_id(server) -> int:
    """Return the id of " the", a token whose repetitions decode and encode back to themselves."""
    response = requests.post(f"{server.url}/tokenize", json={"content": " the"}, timeout=30)
    [token] = response.json()["tokens"]
    return token


@pytest.fixture(scope="module")
def redis_server(module_redis):
    """Run a throwaway Redis for the shared KV state."""
    return module_redis()


@pytest.fixture(scope="module")
def replies_redis(module_redis):
    """Run a throwaway Redis for the cached replies."""
    return module_redis()


@pytest.fixture(scope="module")
def hosts(redis_server, replies_redis, gunicorn):
    """Run two 'hosts': Gunicorn servers with folders of their own, sharing one Redis for replies and another
    for KV state, as the shipped deployment does."""
    settings = {"workers": 1, "redis_url": replies_redis.url, "shared_kv_redis_url": redis_server.url,
                "shared_kv_ttl_seconds": 600, "max_model_len": 2048}
    with (gunicorn(**settings) as first,
          gunicorn(**settings) as second):
        yield first, second


def test_the_next_turn_on_another_host_fetches_the_conversation_and_answers_the_same(hosts, redis_server):
    first, second = hosts
    # A reply whose tokens re-tokenise to themselves, so the next turn's prompt holds them exactly.
    bias = {str(the_token_id(first)): 100}
    kv = redis.Redis(port=redis_server.port)
    shared_before = len(kv.keys("corechat:kv:*"))
    turn = chat(first, [{"role": "user", "content": QUESTION}], max_tokens=12, logit_bias=bias)
    # A finished turn is sent to Redis by a background thread, after its reply may already have ended: a
    # next turn that overtakes it is computed where it lands (the same bytes, only slower).
    assert wait_until(lambda: len(kv.keys("corechat:kv:*")) > shared_before, 30)
    reply = turn["choices"][0]["message"]["content"]
    assert turn["choices"][0]["finish_reason"] == "length"
    conversation = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": reply},
                    {"role": "user", "content": "And now?"}]

    elsewhere = chat(second, conversation, max_tokens=16)
    # The whole first turn, prompt and reply (but the last reply token, never fed), came from Redis.
    assert elsewhere["usage"]["prompt_tokens_details"]["cached_tokens"] == turn["usage"]["total_tokens"] - 1
    facts = next(iter(ready_facts(second).values()))
    assert facts["shared_prefix_hits"] == 1
    at_home = chat(first, conversation, max_tokens=16)
    assert at_home["usage"]["prompt_tokens_details"]["cached_tokens"] == turn["usage"]["total_tokens"] - 1
    assert elsewhere["choices"][0]["message"]["content"] == at_home["choices"][0]["message"]["content"]


def test_kv_state_goes_to_its_own_redis_and_never_beside_the_cached_replies(hosts, redis_server, replies_redis):
    """Entries of megabytes would push replies out of their Redis's memory: each kind has its own."""
    first, _ = hosts
    question = [{"role": "user", "content": "Where does my state go? " + QUESTION}]
    response = requests.post(f"{first.url}/v1/chat/completions", timeout=120,
                             json={"messages": question, "temperature": 0, "max_tokens": 4})
    assert response.status_code == 200 and response.headers["X-Cache"] == "miss"
    kv, replies = redis.Redis(port=redis_server.port), redis.Redis(port=replies_redis.port)
    assert wait_until(lambda: kv.keys("corechat:kv:*"), 30)
    assert replies.keys("corechat:*") and not replies.keys("corechat:kv:*")
    assert not set(kv.keys("*")) - set(kv.keys("corechat:kv:*"))


def test_a_host_without_redis_computes_the_prompt_and_answers(hosts, redis_server):
    """Redis gone: the shared store fails open, the turn is computed where it lands."""
    first, second = hosts
    bias = {str(the_token_id(first)): 100}
    question = [{"role": "user", "content": "Another conversation: " + QUESTION}]
    reply = chat(first, question, max_tokens=8, logit_bias=bias)["choices"][0]["message"]["content"]
    redis_server.stop()
    try:
        conversation = [*question, {"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}]
        elsewhere = chat(second, conversation, max_tokens=8)
        assert elsewhere["choices"][0]["finish_reason"] == "length"
        assert "shared KV state in Redis failed" in second.log()
    finally:
        redis_server.start()
