"""The response cache's rules on their own: what keys a reply, and which replies are complete enough to store."""

from dataclasses import replace

from service.cache import cache_key
from service.cache.entries import is_complete, reply_key
from service.cache.kvshare import RedisPrefixes
from service.engine import Finished, SamplingParams
from service.settings import Settings

# Keys ---------------------------------------------------------------------------------------


def test_key_is_stable_and_changes_with_every_output_changing_input():
    params = SamplingParams(max_tokens=10, temperature=0.0)
    key = cache_key("model-a", "", [1, 2, 3], params)
    assert key == cache_key("model-a", "", [1, 2, 3], SamplingParams(max_tokens=10, temperature=0.0))
    variants = [
        cache_key("model-b", "", [1, 2, 3], params),
        cache_key("model-a", "", [1, 2, 4], params),
        cache_key("model-a", "key:abc", [1, 2, 3], params),
        *(
            cache_key("model-a", "", [1, 2, 3], replace(params, **change))
            for change in (
                {"max_tokens": 11}, {"temperature": 0.5}, {"top_p": 0.9}, {"top_k": 5}, {"seed": 1},
                {"stop": ("\n",)}, {"presence_penalty": 0.5}, {"frequency_penalty": 0.5},
                {"repetition_penalty": 1.1}, {"grammar": '{"grammars": []}'}, {"top_logprobs": 2},
                {"logit_bias": ((5, 1.0),)}, {"logit_bias": ((5, -1.0),)}, {"logit_bias": ((6, 1.0),)},
            )
        ),
    ]
    assert len({key, *variants}) == len(variants) + 1
    assert reply_key(key).startswith("corechat:v2:")


def test_only_replies_that_ended_on_their_own_or_at_max_tokens_are_complete():
    params = SamplingParams(max_tokens=10, temperature=0.0)
    assert is_complete(Finished("stop", 5, 3, 0.0, 0.0), params)
    assert is_complete(Finished("length", 5, 10, 0.0, 0.0), params)
    assert not is_complete(Finished("length", 5, 4, 0.0, 0.0), params)  # cut by max_generation_seconds
    assert not is_complete(Finished("cancelled", 5, 4, 0.0, 0.0), params)


def test_shared_kv_state_in_the_replies_redis_is_warned_of_at_start(caplog):
    settings = Settings(redis_url="redis://127.0.0.1:6380/0", shared_kv_ttl_seconds=60)
    assert RedisPrefixes.from_settings(settings) is not None
    assert "give it a Redis of its own with SHARED_KV_REDIS_URL" in caplog.text
    caplog.clear()
    apart = Settings(redis_url="redis://127.0.0.1:6380/0", shared_kv_redis_url="redis://127.0.0.1:6381/0",
                     shared_kv_ttl_seconds=60)
    assert RedisPrefixes.from_settings(apart).client.connection_pool.connection_kwargs["port"] == 6381
    assert "SHARED_KV_REDIS_URL" not in caplog.text
