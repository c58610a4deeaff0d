"""`logit_bias` through real Gunicorn and the official client: +100 forces a token, -100 bans the one greedy
decoding picks, each row of a batch gets its own, a grammar still has the last word, the cache keys
each bias apart, and every out-of-bounds entry is a 400."""

import json
import threading

import pytest
import requests

USER = [{"role": "user", "content": "Tell me about the sea."}]
HELLO = 9707  # "Hello" in Qwen2.5's vocabulary, which the tiny dev model has
VOCAB_SIZE = 151665


def greedy(client, **params):
    """Return a greedy whole reply with each token's logprob entry."""
    return client.chat.completions.create(model="tiny", messages=USER, temperature=0, logprobs=True, **params)


def reply_bytes(completion) -> list[bytes]:
    """Return the bytes of each token of a reply."""
    return [bytes(entry.bytes) for entry in completion.choices[0].logprobs.content]


def test_plus_100_gives_that_token_at_every_step_of_a_greedy_reply_whole_and_streamed(solo_client):
    forced = greedy(solo_client, max_tokens=6, logit_bias={str(HELLO): 100})
    assert reply_bytes(forced) == [b"Hello"] * 6
    assert forced.choices[0].message.content == "Hello" * 6 and forced.choices[0].finish_reason == "length"
    chunks = solo_client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=6, stream=True,
                                                 logit_bias={str(HELLO): 100.0})
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == "Hello" * 6


def test_minus_100_bans_the_token_greedy_decoding_picks(solo_server, solo_client):
    first = reply_bytes(greedy(solo_client, max_tokens=1))[0]
    ids = requests.post(f"{solo_server.url}/tokenize", json={"content": first.decode()}, timeout=10).json()["tokens"]
    assert len(ids) == 1, ids
    assert bytes(reply_bytes(greedy(solo_client, max_tokens=12))[0]) == first
    banned = greedy(solo_client, max_tokens=12, logit_bias={str(ids[0]): -100})
    assert first not in reply_bytes(banned) and len(reply_bytes(banned)) == banned.usage.completion_tokens


def test_each_row_of_a_batch_gets_its_own_bias_and_the_others_none(solo_client):
    alone = greedy(solo_client, max_tokens=24).choices[0].message.content
    replies = {}

    def send(name, **params):
        replies[name] = greedy(solo_client, max_tokens=24, **params).choices[0].message.content

    threads = [threading.Thread(target=send, args=("plain",)),
               threading.Thread(target=send, args=("forced",), kwargs={"logit_bias": {str(HELLO): 100}}),
               threading.Thread(target=send, args=("plain again",), kwargs={"logit_bias": {str(HELLO): 0}})]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert replies == {"plain": alone, "forced": "Hello" * 24, "plain again": alone}


def test_a_grammar_still_forbids_a_token_the_bias_pushes(solo_client):
    reply = solo_client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=12,
                                                response_format={"type": "json_object"}, logit_bias={str(HELLO): 100})
    assert reply.choices[0].message.content.startswith("{")


def test_the_cache_keys_each_bias_apart(solo_server):
    body = {"messages": USER, "max_tokens": 4, "temperature": 0}

    def x_cache(**extra) -> str:
        response = requests.post(f"{solo_server.url}/v1/chat/completions", json={**body, **extra}, timeout=60)
        assert response.status_code == 200
        return response.headers["X-Cache"]

    assert [x_cache(logit_bias={"11": 5}), x_cache(logit_bias={"11": 5.0}), x_cache(logit_bias={"11": 6}),
            x_cache(logit_bias={"12": 5}), x_cache()] == ["miss", "hit", "miss", "miss", "miss"]


@pytest.mark.parametrize("bias", [{"11": 0}, {"11": -100}, {"11": 100}, {"11": 100.0}, {"0": -3.5},
                                  {str(VOCAB_SIZE - 1): 1}, {str(token): 1 for token in range(300)}, {}])
def test_biases_within_bounds_are_accepted(solo_server, bias):
    response = requests.post(f"{solo_server.url}/v1/chat/completions", timeout=60,
                             json={"messages": USER, "max_tokens": 1, "logit_bias": bias})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "bias",
    [
        {"11": 100.0001}, {"11": -100.0001}, {"11": 101}, {"11": 1e308}, {"11": "5"}, {"11": True}, {"11": None},
        {str(token): 1 for token in range(301)},
        {"abc": 1}, {"-1": 1}, {" 11": 1}, {"11.0": 1}, {"0x0b": 1}, {"011": 1}, {"": 1},
        {str(VOCAB_SIZE): 1}, {str(VOCAB_SIZE): 0}, {str(2**64): 1},
        [[11, 5]], "11:5",
    ],
)
def test_every_entry_out_of_bounds_is_a_400_naming_logit_bias(solo_server, bias):
    response = requests.post(f"{solo_server.url}/v1/chat/completions", timeout=60,
                             json={"messages": USER, "max_tokens": 1, "logit_bias": bias})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "logit_bias" and error["message"]


def test_nan_as_a_bias_is_a_400(solo_server):
    body = json.dumps({"messages": USER, "max_tokens": 1, "logit_bias": {"11": float("nan")}})
    response = requests.post(f"{solo_server.url}/v1/chat/completions", data=body,
                             headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == 400 and "NaN" in response.json()["error"]["message"]
