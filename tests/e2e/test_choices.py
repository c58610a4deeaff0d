"""`n` > 1 choices through real Gunicorn, on chat and legacy completions: each with its own index whole and
streamed, seeded choices reproducible and batch-invariant, n running places, bounded, never cached."""

import threading
import time

import openai
import pytest
import requests

from harness import sse_payloads
from service.api.responses import ChatCompletionChunk, CompletionChunk
from tests.support import openai_client, wait_until

USER = [{"role": "user", "content": "Write a short poem about caches."}]
PROMPT = "Once upon a time, in a land of caches,"


@pytest.fixture(scope="module")
def server(gunicorn):
    """Run Gunicorn with one worker of three running places and one queue place, so places are countable."""
    with gunicorn(workers=1, max_running=3, max_queue=1, max_tokens_limit=32000) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    """Return an openai client of the server that never retries."""
    return openai_client(server)


def contents(completion) -> list[str]:
    """Return each choice's content, by index."""
    assert [choice.index for choice in completion.choices] == list(range(len(completion.choices)))
    return [choice.message.content for choice in completion.choices]


def test_seeded_choices_differ_and_the_first_is_the_reply_n_1_gets(client):
    params = {"model": "tiny", "messages": USER, "max_tokens": 8, "temperature": 1.0, "seed": 42}
    several = client.chat.completions.create(**params, n=2)
    first, second = contents(several)
    assert first != second
    assert contents(client.chat.completions.create(**params)) == [first]
    assert several.usage.completion_tokens == 16
    assert several.usage.prompt_tokens == client.chat.completions.create(**params).usage.prompt_tokens
    assert all(choice.finish_reason == "length" for choice in several.choices)


def test_seeded_choices_are_reproducible(client):
    params = {"model": "tiny", "messages": USER, "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 2}
    assert contents(client.chat.completions.create(**params)) == contents(client.chat.completions.create(**params))


def test_seeded_choices_are_the_same_beside_other_requests_in_the_batch(server, client):
    params = {"model": "tiny", "messages": USER, "max_tokens": 12, "temperature": 1.0, "seed": 11, "n": 2}
    alone = contents(client.chat.completions.create(**params))
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Other."}],
                                            max_tokens=30000, stream=True)
    replies = {}
    try:
        next(iter(stream))
        # The long stream holds one of the three running places: the two choices decode beside it.
        thread = threading.Thread(target=lambda: replies.update(got=contents(client.chat.completions.create(**params))))
        thread.start()
        thread.join(120)
        assert running(server) == 1
    finally:
        stream.close()
    assert replies["got"] == alone


def test_greedy_choices_are_all_the_same(client):
    greedy = client.chat.completions.create(model="tiny", messages=USER, max_tokens=6, temperature=0, n=2)
    first, second = contents(greedy)
    assert first == second


def test_streamed_choices_carry_their_index_and_add_up_to_the_whole_ones(server, client):
    body = {"messages": USER, "max_tokens": 8, "temperature": 1.0, "seed": 5, "n": 2,
            "stream_options": {"include_usage": True}}
    whole = contents(client.chat.completions.create(
        model="tiny", **{key: value for key, value in body.items() if key != "stream_options"}))
    response = requests.post(f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120)
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(payload) for payload in payloads[:-1]]
    texts, finishes, roles = ["", ""], [None, None], [0, 0]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        roles[choice.index] += choice.delta.role == "assistant"
        texts[choice.index] += getattr(choice.delta, "content", None) or ""
        finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == whole and finishes == ["length", "length"] and roles == [1, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    typed = list(client.chat.completions.create(model="tiny", stream=True, **body))
    by_index = ["", ""]
    for chunk in typed:
        for choice in chunk.choices:
            by_index[choice.index] += choice.delta.content or ""
    assert by_index == whole


def test_legacy_completions_take_n_whole_and_streamed_with_echo(server, client):
    params = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 3}
    several = client.completions.create(**params, n=2, echo=True)
    texts = [choice.text for choice in several.choices]
    assert [choice.index for choice in several.choices] == [0, 1] and texts[0] != texts[1]
    assert all(text.startswith(PROMPT) for text in texts)
    assert texts[0] == PROMPT + client.completions.create(**params).choices[0].text
    body = {key: value for key, value in params.items() if key != "model"}
    response = requests.post(f"{server.url}/v1/completions", json={**body, "n": 2, "echo": True, "stream": True},
                             timeout=120)
    payloads = sse_payloads(response.text)
    streamed = ["", ""]
    for payload in payloads[:-1]:
        (choice,) = CompletionChunk.model_validate(payload).choices
        streamed[choice.index] += choice.text
    assert streamed == texts


def test_echo_logprobs_of_each_choice_score_the_prompt_alike(client):
    several = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, seed=1, n=2, echo=True, logprobs=1)
    prompts = [choice.logprobs.token_logprobs[:-2] for choice in several.choices]
    assert prompts[0] == prompts[1] and prompts[0][0] is None


def running(server) -> int:
    """Return the running places the worker counts."""
    return requests.get(f"{server.url}/readyz", timeout=10).json()["running"]


def wait_idle(server) -> None:
    """Wait until the worker runs and queues nothing (a closed stream frees its places at the engine's next step)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        readiness = requests.get(f"{server.url}/readyz", timeout=10).json()
        if readiness["running"] == readiness["waiting"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError("the worker stayed busy")


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_n_choices_take_n_running_places(server, client, route):
    wait_idle(server)
    if route == "chat":
        held = client.chat.completions.create(model="tiny", messages=USER, max_tokens=30000, stream=True, n=3, seed=1)
    else:
        held = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30000, stream=True, n=3, seed=1)
    queued = None
    try:
        next(iter(held))
        # The role chunk goes out before the engine takes the request: its places count from then on.
        assert wait_until(lambda: running(server) == 3, 30)
        # The three places are the three choices': one more request waits in the one queue place, the next is refused.
        queued = client.chat.completions.create(model="tiny", messages=USER, max_tokens=30000, stream=True)
        with pytest.raises(openai.InternalServerError) as raised:
            client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
        assert raised.value.status_code == 503
    finally:
        held.close()
        if queued is not None:
            queued.close()


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": USER, "n": 4}),
    ("/v1/completions", {"prompt": PROMPT, "n": 4}),
])
def test_more_choices_than_running_places_is_a_400_naming_n(server, path, body):
    response = requests.post(f"{server.url}{path}", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "n" and "MAX_RUNNING" in error["message"]


@pytest.mark.parametrize("n", [0, 9, -1])
def test_n_outside_1_to_8_is_a_400(server, n):
    response = requests.post(f"{server.url}/v1/chat/completions", json={"messages": USER, "n": n}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"


def test_choices_are_never_cached(server):
    body = {"messages": USER, "max_tokens": 3, "temperature": 0, "n": 2}
    assert [requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).headers["X-Cache"]
            for _ in range(2)] == ["bypass", "bypass"]
