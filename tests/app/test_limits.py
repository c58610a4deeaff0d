"""Input limits: body size, message count, prompt tokens, context window, generation time, odd input.

Every refusal must be a 4xx in OpenAI's error shape; the malformed-JSON and wrong-type cases that
tests/app/test_api.py already covers are not repeated here.
"""

import json

import pytest

from harness import DONE, sse_payloads
from service.app import create_app
from tests.support import started_engine

USER = [{"role": "user", "content": "Write a haiku about CPUs."}]


def post_raw(client, raw: bytes, content_type: str = "application/json"):
    """POST raw bytes to the chat endpoint."""
    return client.post("/v1/chat/completions", data=raw, content_type=content_type)


def assert_openai_error(response, status: int) -> dict:
    """Check a response is the given 4xx in OpenAI's error shape and return its error object."""
    assert response.status_code == status, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    return error


@pytest.fixture()
def limited_client(make_settings, engine):
    """Return a client of an app with small limits around the shared engine (context 256)."""
    settings = make_settings(max_model_len=256, max_request_bytes=4096, max_messages=3, max_prompt_tokens=64)
    return create_app(settings, engine=engine).test_client()


def test_body_over_the_size_limit_gets_413(limited_client):
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]}).encode()
    error = assert_openai_error(post_raw(limited_client, body), 413)
    assert "4096" in error["message"]
    assert error["code"] == "request_too_large"


def test_too_many_messages_get_400_naming_the_limit(limited_client):
    messages = [{"role": "user", "content": "hi"}] * 4
    error = assert_openai_error(limited_client.post("/v1/chat/completions", json={"messages": messages}), 400)
    assert error["param"] == "messages" and error["code"] == "too_many_messages"
    assert "4" in error["message"] and "3" in error["message"]
    at_the_limit = limited_client.post("/v1/chat/completions", json={"messages": messages[:3], "max_tokens": 1})
    assert at_the_limit.status_code == 200


def test_prompt_over_the_token_cap_gets_400_naming_the_limit(limited_client):
    response = limited_client.post("/v1/chat/completions",
                                   json={"messages": [{"role": "user", "content": "word " * 80}]})
    error = assert_openai_error(response, 400)
    assert error["code"] == "prompt_too_long" and "64" in error["message"]


def _content_with_prompt_tokens(engine, target: int) -> str:
    """Return user content whose rendered prompt is exactly `target` tokens long."""
    for words in range(target):
        content = "a" + " word" * words
        count = len(engine.template.encode(engine.template.render([{"role": "user", "content": content}])))
        if count == target:
            return content
        if count > target:
            break
    raise AssertionError(f"no content renders to exactly {target} tokens")


def test_prompt_of_context_minus_one_tokens_with_max_tokens_1_succeeds(client, engine):
    """The context window is 256 here: 255 prompt tokens leave room for exactly one token."""
    assert engine.context_length == 256
    content = _content_with_prompt_tokens(engine, 255)
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.get_json()
    usage = response.get_json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (255, 1, 256)
    error = assert_openai_error(client.post("/v1/chat/completions", json={**body, "max_tokens": 2}), 400)
    assert error["code"] == "context_length_exceeded" and "255" in error["message"] and "256" in error["message"]


def test_prompt_filling_the_whole_context_gets_400(client, engine):
    content = _content_with_prompt_tokens(engine, 256)
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
    assert assert_openai_error(response, 400)["code"] == "context_length_exceeded"


@pytest.fixture(scope="module")
def short_deadline_client(make_settings):
    """Return a client whose engine cuts every generation after 0.3 s."""
    settings = make_settings(max_model_len=32768, max_tokens_limit=30000, max_generation_seconds=0.3)
    with started_engine(settings) as engine:
        yield create_app(settings, engine=engine).test_client()


def test_generation_time_limit_ends_a_reply_with_finish_reason_length(short_deadline_client):
    body = {"messages": USER, "max_tokens": 30000, "temperature": 0}
    reply = short_deadline_client.post("/v1/chat/completions", json=body).get_json()
    assert reply["choices"][0]["finish_reason"] == "length"
    assert 0 < reply["usage"]["completion_tokens"] < 30000


def test_generation_time_limit_ends_a_stream_with_finish_reason_length(short_deadline_client):
    body = {"messages": USER, "max_tokens": 30000, "temperature": 0, "stream": True}
    text = short_deadline_client.post("/v1/chat/completions", json=body).get_data(as_text=True)
    payloads = sse_payloads(text)
    assert payloads[-1] == DONE
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "raw, param",
    [
        (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
        (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages"),
        (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}', "messages"),
        (b'{"messages": [{"role": "user", "content": "x"}], "stop": "\\ud800"}', "stop"),
    ],
)
def test_lone_surrogate_escapes_get_400_not_a_tokenizer_crash(client, raw, param):
    assert assert_openai_error(post_raw(client, raw), 400)["param"] == param


def test_control_characters_are_ordinary_text(client):
    content = "".join(chr(code) for code in range(32)) + "\u007f\u200b\ufeff"
    response = client.post("/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": content}], "max_tokens": 2})
    assert response.status_code == 200


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e400}',
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": -1e400}',
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1' + b"0" * 5000 + b"}",
        b'{"messages": [{"role": "user", "content": "x"}], "seed": -1' + b"0" * 30 + b"}",
        b'{"messages": [{"role": "user", "content": "x"}], "top_p": 1e-400}',
        b'{"messages": [{"role": "user", "content": "x"}], "stream": -Infinity}',
        b'{"messages": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b"}",
        b'{"messages": [{"role": "user", "content": "x"}], "stream_options": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"messages": [{"role": "user", "content": "x"}], "model": "a", "model": ["b"]}',
    ],
    ids=["1e400", "-1e400", "5000-digit int", "huge negative seed", "1e-400 top_p", "-Infinity", "nested objects",
         "nested arrays", "duplicate keys"],
)
def test_odd_numbers_and_nesting_get_400(client, raw):
    assert_openai_error(post_raw(client, raw), 400)


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/jsonx"],
)
def test_non_json_content_types_get_415(client, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    response = client.post("/v1/chat/completions", data=json.dumps({"messages": USER}), headers=headers)
    error = response.get_json()["error"]
    assert response.status_code == 415 and error["type"] == "invalid_request_error"


def test_json_content_type_with_charset_is_accepted(client):
    body = json.dumps({"messages": USER, "max_tokens": 1})
    response = client.post("/v1/chat/completions", data=body,
                           headers={"Content-Type": "application/json; charset=utf-8"})
    assert response.status_code == 200


def test_very_long_single_string_gets_a_clean_400(make_settings, engine):
    """A 900 KB message fits the 1 MiB body limit but not the context window: 400, not a crash."""
    client = create_app(make_settings(max_model_len=256), engine=engine).test_client()
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "ab " * 300_000}]})
    assert assert_openai_error(response, 400)["code"] == "context_length_exceeded"
