"""Stored KV state is as private as cached replies: one API key never reuses, and so never learns,
what another sent; cache_salt narrows a scope; Cache-Control: no-store leaves nothing in the host's
folder or in Redis.

Real Gunicorn with two workers (the default) and two API keys, sharing KV state through a real
Redis (SHARED_KV_TTL_SECONDS); every other setting at its default.
"""

from pathlib import Path

import pytest
import redis
import requests

from tests.support import wait_until

KEYS = ("sk-corechat-carol-0123456789", "sk-corechat-dave-9876543210")
SECRET = "My account number is 4417 1234 5678 9113 and my password is tulip-harbour-1987. " * 6
GREEDY = {"max_tokens": 1, "temperature": 0}


@pytest.fixture(scope="module")
def kv_redis(module_redis):
    """Run a throwaway Redis for shared KV state."""
    return module_redis()


@pytest.fixture(scope="module")
def keyed(gunicorn, kv_redis):
    """Run two workers with two API keys that share KV state through Redis."""
    with gunicorn(api_keys=",".join(KEYS), redis_url=kv_redis.url, shared_kv_ttl_seconds=600) as server:
        yield server


def post(server, path: str, key: str, body: dict, cache_control: str = "no-cache") -> dict:
    """Send a request with an API key past the response cache, on a fresh connection; return its JSON reply."""
    response = requests.post(f"{server.url}{path}", json=body, timeout=120, headers={
        "Authorization": f"Bearer {key}", "Cache-Control": cache_control, "Connection": "close"})
    assert response.status_code == 200, response.text
    return response.json()


def cached_tokens(reply: dict) -> int:
    """Return how many prompt tokens a reply reused from stored KV state."""
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def complete(server, key: str, prompt, **body) -> dict:
    """Continue a raw prompt (text or token ids) by one greedy token, past the response cache."""
    return post(server, "/v1/completions", key, {"prompt": prompt, **GREEDY, **body})


def token_ids(server, text: str) -> list[int]:
    """Return a text's token ids."""
    response = requests.post(f"{server.url}/tokenize", json={"content": text}, timeout=30,
                             headers={"Authorization": f"Bearer {KEYS[0]}"})
    return response.json()["tokens"]


def folder_files(server) -> set[str]:
    """Return every stored sequence's file under the server's prefix folder."""
    return {str(path) for path in Path(server.env["PREFIX_CACHE_DIR"]).rglob("*.safetensors")}


def test_another_key_reuses_nothing_of_a_conversation_it_never_saw(keyed):
    carol, dave = KEYS
    message = [{"role": "user", "content": SECRET}]
    first = post(keyed, "/v1/chat/completions", carol, {"messages": message, **GREEDY})
    again = post(keyed, "/v1/chat/completions", carol, {"messages": message, **GREEDY})
    assert cached_tokens(first) == 0 and cached_tokens(again) == first["usage"]["prompt_tokens"] - 1
    other = post(keyed, "/v1/chat/completions", dave, {"messages": message, **GREEDY})
    assert cached_tokens(other) == 0


def test_a_raw_id_probe_cannot_tell_a_right_guess_from_a_wrong_one(keyed):
    """Dave guesses Carol's next token after a known start: with stored KV shared, cached_tokens would
    be one more for the right guess. Carol's own probe shows the signal is there within her scope."""
    carol, dave = KEYS
    ids = token_ids(keyed, "The launch code is 7 3 9 1 and the vault opens at dawn, said the old keeper.")
    complete(keyed, carol, ids)
    known, right = ids[:8], ids[8]
    wrong = right + 1

    def probe(key: str, guess: int) -> int:
        """Return the cached tokens of a probe that leaves nothing stored (so no probe finds another's)."""
        return cached_tokens(post(keyed, "/v1/completions", key, {"prompt": [*known, guess, 11], **GREEDY},
                                  cache_control="no-store"))

    assert {guess: probe(dave, guess) for guess in (right, wrong)} == {right: 0, wrong: 0}
    assert {guess: probe(carol, guess) for guess in (right, wrong)} == {right: 9, wrong: 8}


def test_a_cache_salt_is_a_scope_of_its_own_within_a_key(keyed):
    carol = KEYS[0]
    prompt = "A salted conversation about lighthouses and the keepers who tend them. " * 4
    complete(keyed, carol, prompt)
    salted = complete(keyed, carol, prompt, cache_salt="salt-a-0f1e2d3c4b5a69788796a5b4c3d2e1f0")
    assert cached_tokens(salted) == 0
    same_salt = complete(keyed, carol, prompt, cache_salt="salt-a-0f1e2d3c4b5a69788796a5b4c3d2e1f0")
    assert cached_tokens(same_salt) > 0
    assert cached_tokens(complete(keyed, carol, prompt, cache_salt="salt-b-ffeeddccbbaa99887766554433221100")) == 0


@pytest.mark.parametrize("salt", ["", "x" * 257, 7])
def test_a_cache_salt_that_is_empty_too_long_or_not_text_is_a_400(keyed, salt):
    response = requests.post(f"{keyed.url}/v1/completions", timeout=30,
                             json={"prompt": "hello", "max_tokens": 1, "cache_salt": salt},
                             headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "cache_salt"


def test_no_store_leaves_nothing_on_the_host_or_in_redis(keyed, kv_redis):
    carol = KEYS[0]
    store = redis.Redis(port=kv_redis.port)
    before_files, before_keys = folder_files(keyed), set(store.keys("corechat:kv:*"))
    conversation = [{"role": "user", "content": "Forget this as soon as you answer: " + SECRET}]
    # The second reuses no more than the first (the template's start, which earlier requests stored).
    first, second = (post(keyed, "/v1/chat/completions", carol, {"messages": conversation, "max_tokens": 8,
                                                                "temperature": 0}, cache_control="no-store")
                     for _ in range(2))
    assert cached_tokens(second) == cached_tokens(first) < first["usage"]["prompt_tokens"] // 2
    assert folder_files(keyed) == before_files
    assert set(store.keys("corechat:kv:*")) == before_keys
    # The same turn without no-store is kept, on the host and beyond it.
    post(keyed, "/v1/chat/completions", carol, {"messages": conversation, "max_tokens": 8, "temperature": 0})
    assert folder_files(keyed) - before_files
    assert wait_until(lambda: set(store.keys("corechat:kv:*")) - before_keys, timeout=30)
