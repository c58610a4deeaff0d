"""Legacy text completions (`POST /v1/completions`) through real Gunicorn and the official client: text or token
ids in, `text_completion` objects out, whole and streamed; echo with the prompt's own logprobs; the cache, the
metrics, the limits and every refusal."""

import json

import openai
import pytest
import requests

from harness import sse_payloads
from service.api.responses import Completion, CompletionChunk
from tests.support import TEST_API_KEY, openai_client

PROMPT = "Once upon a time, in a land of caches,"
HELLO = 9707  # "Hello" in Qwen2.5's vocabulary, which the tiny dev model has
# Longer than one prompt chunk of a request that asks for the prompt's logprobs (scheduler.py).
LONG_PROMPT = " ".join(f"word{index}" for index in range(60))


@pytest.fixture(scope="module")
def server(gunicorn):
    """Run Gunicorn with one worker, so a repeated request finds its worker's cache."""
    with gunicorn(workers=1, max_model_len=1024, max_tokens_limit=2000) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    """Return an openai client of the server that never retries."""
    return openai_client(server)


def post(server, **body) -> requests.Response:
    """POST a completion body as plain HTTP."""
    return requests.post(f"{server.url}/v1/completions", json=body, timeout=120)


def tokenize(server, text: str) -> list[int]:
    """Return the token ids the server's tokenizer gives a text."""
    return requests.post(f"{server.url}/tokenize", json={"prompt": text}, timeout=10).json()["tokens"]


def streamed_chunks(server, **body) -> list[dict]:
    """Stream a completion; return its chunks (each valid as CompletionChunk), checking it ends with [DONE]."""
    response = post(server, stream=True, **body)
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"].startswith("text/event-stream")
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    for payload in payloads[:-1]:
        CompletionChunk.model_validate(payload)
    return payloads[:-1]


def test_a_whole_completion_is_a_typed_text_completion_with_usage(client):
    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, seed=3)
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-") and completion.model == "tiny"
    choice = completion.choices[0]
    assert choice.index == 0 and choice.text and choice.finish_reason == "length" and choice.logprobs is None
    assert completion.usage.completion_tokens == 5
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 5


def test_max_tokens_defaults_to_16_as_openai(client):
    assert client.completions.create(model="tiny", prompt=PROMPT, temperature=0).usage.completion_tokens == 16


def test_the_prompt_is_raw_text_without_the_chat_template(server, client):
    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0)
    assert completion.usage.prompt_tokens == len(tokenize(server, PROMPT))


def test_token_ids_and_their_text_get_the_same_completion(server, client):
    ids = tokenize(server, PROMPT)
    as_text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    as_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    one_listed = client.completions.create(model="tiny", prompt=[ids], max_tokens=8, temperature=0)
    assert as_text.choices[0].text == as_ids.choices[0].text == one_listed.choices[0].text


def test_the_same_seed_gives_the_same_completion_and_another_seed_another(client):
    params = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0}
    first = client.completions.create(**params, seed=7).choices[0].text
    assert client.completions.create(**params, seed=7).choices[0].text == first
    assert client.completions.create(**params, seed=8).choices[0].text != first


def test_a_stream_is_text_completion_chunks_that_add_up_to_the_whole_reply(server, client):
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, seed=21)
    chunks = streamed_chunks(server, prompt=PROMPT, max_tokens=10, seed=21, stream_options={"include_usage": True})
    assert all(chunk["object"] == "text_completion" and chunk["id"].startswith("cmpl-") for chunk in chunks)
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"]) == whole.choices[0].text
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    assert all(chunk["usage"] is None for chunk in chunks[:-1])
    typed = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, seed=21, stream=True))
    assert "".join(chunk.choices[0].text for chunk in typed) == whole.choices[0].text


def test_stop_cuts_the_text_before_it_whole_and_streamed(server, client):
    params = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 1.0, "seed": 99}
    full = client.completions.create(**params).choices[0].text
    stop = full[8:11]
    cut = client.completions.create(**params, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]
    chunks = streamed_chunks(server, prompt=PROMPT, max_tokens=24, temperature=1.0, seed=99, stop=stop)
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == full[: full.index(stop)]


def test_logit_bias_forces_a_token(client):
    forced = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                       logit_bias={str(HELLO): 100})
    assert forced.choices[0].text == "Hello" * 5


def test_logprobs_give_each_token_its_logprob_alternatives_and_offset(client):
    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:index])) for index in range(6)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob <= 0 and top[token] == logprob and 3 <= len(top) <= 4
        # Greedy: the token taken is the most likely one.
        assert logprob == max(top.values())


def test_echo_with_logprobs_scores_the_prompt_as_the_model_scored_its_own_tokens(server, client):
    """The prompt's logprobs (in chunks, as a long prompt is passed) are those the model gave the same tokens when it
    generated them: how an evaluation harness scores a text."""
    # Without the model's default repetition_penalty, which the prompt's logprobs (the model's own) never apply.
    generated = client.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=6, temperature=0, logprobs=2,
                                          extra_body={"repetition_penalty": 1.0})
    prompt_ids = tokenize(server, LONG_PROMPT)
    assert len(prompt_ids) > 64
    text = LONG_PROMPT + generated.choices[0].text
    scored = client.completions.create(model="tiny", prompt=text, max_tokens=0, echo=True, logprobs=2)
    choice = scored.choices[0]
    assert choice.text == text and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(tokenize(server, text))
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens) == text
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(value is not None and value <= 0 for value in logprobs.token_logprobs[1:])
    assert logprobs.tokens[-6:] == generated.choices[0].logprobs.tokens
    assert logprobs.token_logprobs[-6:] == pytest.approx(generated.choices[0].logprobs.token_logprobs, abs=1e-3)
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:index])) for index in range(len(logprobs.tokens))]


def test_echo_begins_the_text_with_the_prompt_whole_and_streamed(server, client):
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0).choices[0].text
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain
    chunks = streamed_chunks(server, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert chunks[0]["choices"][0]["text"] == PROMPT
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == PROMPT + plain


def test_a_streamed_echo_with_logprobs_sends_the_prompts_first_then_each_tokens(server):
    chunks = streamed_chunks(server, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1)
    first = chunks[0]["choices"][0]
    assert first["text"] == PROMPT and first["logprobs"]["token_logprobs"][0] is None
    assert "".join(first["logprobs"]["tokens"]) == PROMPT
    offsets = [offset for chunk in chunks for offset in chunk["choices"][0]["logprobs"]["text_offset"]]
    tokens = [token for chunk in chunks for token in chunk["choices"][0]["logprobs"]["tokens"]]
    assert offsets == [sum(map(len, tokens[:index])) for index in range(len(tokens))]
    assert len(tokens) == len(tokenize(server, PROMPT)) + 4


def test_max_tokens_0_with_echo_returns_the_prompt_alone(client):
    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True)
    assert completion.choices[0].text == PROMPT and completion.usage.completion_tokens == 0


def test_the_cache_answers_a_repeat_and_keys_each_field_that_changes_the_reply(server):
    body = {"prompt": "A cached prompt.", "max_tokens": 4, "temperature": 0}
    statuses = [post(server, **body).headers["X-Cache"], post(server, **body).headers["X-Cache"],
                post(server, **{**body, "max_tokens": 5}).headers["X-Cache"],
                post(server, **body, stop="zzz").headers["X-Cache"],
                post(server, **{**body, "prompt": "A cached prompt!"}).headers["X-Cache"],
                post(server, **body, logprobs=1).headers["X-Cache"]]
    assert statuses == ["miss", "hit", "miss", "miss", "miss", "bypass"]
    # Echo only changes how the same reply is shown: the stored one serves it.
    echoed = post(server, **body, echo=True)
    assert echoed.headers["X-Cache"] == "hit"
    assert echoed.json()["choices"][0]["text"] == "A cached prompt." + post(server, **body).json()["choices"][0]["text"]
    Completion.model_validate(echoed.json())


def metric(server, name: str) -> float:
    """Return the value of one sample of the server's metrics."""
    for line in requests.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_completions_are_counted_as_chat_requests_are(server):
    before = metric(server, 'corechat_requests_total{outcome="length"}')
    refused = metric(server, 'corechat_requests_total{outcome="context_length_exceeded"}')
    assert post(server, prompt=PROMPT, max_tokens=2, seed=5).status_code == 200
    assert post(server, prompt=PROMPT, max_tokens=2000).status_code == 400
    assert metric(server, 'corechat_requests_total{outcome="length"}') == before + 1
    assert metric(server, 'corechat_requests_total{outcome="context_length_exceeded"}') == refused + 1


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": ["one", "two"]}, "prompt", "one prompt per request"),
    ({"prompt": [[1, 2], [3]]}, "prompt", "one prompt per request"),
    ({"prompt": PROMPT, "suffix": "The end."}, "suffix", "fill-in-the-middle"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [151665]}, "prompt[0]", "not a token id"),
    ({"prompt": [-1]}, "prompt[0]", "invalid 'prompt[0]'"),
    ({"prompt": PROMPT, "logprobs": 6}, "logprobs", "invalid 'logprobs'"),
    ({"prompt": PROMPT, "best_of": 2}, "best_of", "best_of may only equal n"),
    ({"prompt": PROMPT, "best_of": 9}, "best_of", "invalid 'best_of'"),
    ({"prompt": PROMPT, "max_tokens": -1}, "max_tokens", "invalid 'max_tokens'"),
    ({"prompt": PROMPT, "max_tokens": 2001}, "max_tokens", "above this server's limit"),
    ({"prompt": PROMPT, "temperature": 3}, "temperature", "invalid 'temperature'"),
    ({"prompt": "\ud800"}, "prompt", "surrogate"),
    ({"max_tokens": 3}, "prompt", "required"),
])
def test_each_refused_request_is_a_400_naming_its_field(server, body, param, words):
    response = requests.post(f"{server.url}/v1/completions", data=json.dumps(body),
                             headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_prompt_too_long_for_the_context_names_the_prompt(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="tiny", prompt=[HELLO] * 2000, max_tokens=1)
    assert raised.value.param == "prompt"


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-3.5-turbo-instruct", prompt=PROMPT, max_tokens=1)


def test_completions_need_the_key_when_keys_are_on(keyed_server):
    wrong = openai_client(keyed_server, api_key="sk-wrong", timeout=60)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny", prompt=PROMPT, max_tokens=1)
    right = openai_client(keyed_server, api_key=TEST_API_KEY, timeout=60)
    assert right.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
