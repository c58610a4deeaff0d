"""Grammars as request fields and context_length_exceeded through the official `openai` client, against real
Gunicorn with its response cache on a real redis-server.

The client has no parameter for vLLM's `structured_outputs` or llama.cpp's `grammar`: they go in `extra_body`,
as their users send them. The tiny model has random weights, so a reply that matches its grammar shows the
grammar was enforced.
"""

import re

import openai
import pytest

from tests.support import openai_client

ASK = [{"role": "user", "content": "Answer in the required form."}]
CONTEXT = 512


@pytest.fixture(scope="module")
def server(gunicorn, module_redis):
    """Run one worker with a 512-token context and its response cache on a real redis-server."""
    with gunicorn(workers=1, max_model_len=CONTEXT, redis_url=module_redis().url) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    """Return an openai client of the server that never retries."""
    return openai_client(server)


def test_structured_outputs_regex_holds_whole_and_streamed(client):
    pattern = r"(yes|no), [0-9]{2,4}!"
    for seed in (1, 2):
        request = dict(model="tiny", messages=ASK, max_tokens=40, seed=seed, temperature=1.0,
                       extra_body={"structured_outputs": {"regex": pattern}})
        whole = client.chat.completions.create(**request).choices[0]
        assert whole.finish_reason == "stop" and re.fullmatch(pattern, whole.message.content), whole
        chunks = list(client.chat.completions.create(**request, stream=True))
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == whole.message.content


def test_choice_and_gbnf_grammar_hold_on_legacy_completions(client):
    choice = client.completions.create(model="tiny", prompt="Pick one:", max_tokens=20, seed=3, temperature=1.0,
                                       extra_body={"structured_outputs": {"choice": ["left", "right", "up"]}})
    assert choice.choices[0].text in {"left", "right", "up"}
    gbnf = 'root ::= "v" [0-9] "." [0-9]{1,2}'
    version = client.completions.create(model="tiny", prompt="Version:", max_tokens=20, seed=3, temperature=1.0,
                                        extra_body={"grammar": gbnf})
    assert re.fullmatch(r"v[0-9]\.[0-9]{1,2}", version.choices[0].text), version


def cached(client, pattern: str) -> tuple[str, str]:
    """Send one greedy request under a regex; return its X-Cache and its text."""
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=ASK, max_tokens=30, temperature=0.0,
        extra_body={"structured_outputs": {"regex": pattern}})
    return raw.headers["X-Cache"], raw.parse().choices[0].message.content


def test_requests_differing_only_in_their_grammar_do_not_share_a_cached_reply(client):
    digits, letters = "[0-9]{4}", "[a-z]{4}"
    first_status, first = cached(client, digits)
    assert first_status == "miss" and re.fullmatch(digits, first)
    other_status, other = cached(client, letters)
    assert other_status == "miss" and re.fullmatch(letters, other), other
    assert cached(client, digits) == ("hit", first)


@pytest.mark.parametrize("extra_body, param", [
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "json": {"type": "object"}}}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["a"], "disable_fallback": True}}, "structured_outputs"),
    ({"grammar": "root ::= undefined"}, "grammar"),
], ids=["bad-regex", "bad-lark", "two-keys", "unknown-key", "bad-gbnf"])
def test_a_malformed_constraint_is_a_bad_request_naming_the_field(client, extra_body, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, extra_body=extra_body)
    assert refused.value.param == param and refused.value.code is None


def test_a_prompt_past_the_context_is_context_length_exceeded_in_openais_words(client):
    long_messages = [{"role": "user", "content": "word " * CONTEXT}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=long_messages, stream=True)
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "messages"
    assert re.fullmatch(rf"This model's maximum context length is {CONTEXT} tokens\. However, your messages resulted "
                        r"in \d+ tokens\. Please reduce the length of the messages\.", refused.value.body["message"])
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=ASK, max_completion_tokens=CONTEXT)
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "max_completion_tokens"
    assert re.search(r"However, you requested (\d+) tokens \((\d+) in the messages, 512 in the completion\)",
                     refused.value.body["message"])
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt=[1] * CONTEXT, max_tokens=1)
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "prompt"
