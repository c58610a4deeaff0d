"""Input limits: body size, message count, prompt tokens, context window, generation time, odd input.

Every refusal must be a 4xx in OpenAI's error shape; the malformed-JSON and wrong-type cases that
tests/app/test_api.py already covers are not repeated here.
"""

import json
import re

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


# OpenAI's words: agents match the code, and some the numbers in the message, to compact and retry.
REQUESTED = re.compile(r"This model's maximum context length is (\d+) tokens\. However, you requested (\d+) tokens "
                       r"\((\d+) in the (messages|prompt), (\d+) in the completion\)\. Please reduce the length of the "
                       r"\4 or completion\.")
RESULTED = re.compile(r"This model's maximum context length is (\d+) tokens\. However, your (messages|prompt) "
                      r"resulted in (\d+) tokens(, which leaves no room for the completion)?\. Please reduce the "
                      r"length of the \2\.")


def assert_context_exceeded(response, param: str) -> str:
    """Check a response is OpenAI's context_length_exceeded blaming `param`; return its message."""
    error = assert_openai_error(response, 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == param, error
    return error["message"]


@pytest.mark.parametrize("length_field", ["max_tokens", "max_completion_tokens"])
def test_chat_past_the_context_with_a_length_gives_openais_numbers(client, engine, length_field):
    prompt_tokens = len(engine.template.encode(engine.template.render(USER)))
    response = client.post("/v1/chat/completions", json={"messages": USER, length_field: 250})
    match = REQUESTED.fullmatch(assert_context_exceeded(response, length_field))
    assert match and match.groups() == ("256", str(prompt_tokens + 250), str(prompt_tokens), "messages", "250")


def test_chat_prompt_alone_past_the_context_says_how_long_it_is(client):
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 300}]})
    match = RESULTED.fullmatch(assert_context_exceeded(response, "messages"))
    assert match and match.group(1) == "256" and int(match.group(3)) > 256 and match.group(4) is None


def test_chat_prompt_filling_the_context_says_no_room_is_left(client, engine):
    content = _content_with_prompt_tokens(engine, 256)
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
    match = RESULTED.fullmatch(assert_context_exceeded(response, "messages"))
    assert match and match.group(3) == "256" and match.group(4)


def test_a_streamed_request_past_the_context_is_refused_before_the_stream(client):
    response = client.post("/v1/chat/completions",
                           json={"messages": USER, "max_tokens": 300, "stream": True})
    assert response.mimetype == "application/json"
    assert_context_exceeded(response, "max_tokens")


def test_each_of_n_choices_past_the_context_is_refused(client):
    response = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 250, "n": 3})
    assert REQUESTED.fullmatch(assert_context_exceeded(response, "max_tokens"))


@pytest.mark.parametrize("body, param, pattern", [
    ({"prompt": "word " * 300}, "prompt", REQUESTED),
    ({"prompt": [1] * 256, "max_tokens": 1}, "prompt", REQUESTED),
    ({"prompt": [[1] * 300]}, "prompt", REQUESTED),
    ({"prompt": [1] * 200, "max_tokens": 57}, "max_tokens", REQUESTED),
    ({"prompt": [1] * 256, "max_tokens": 0, "echo": True}, "prompt", RESULTED),
], ids=["text", "token-ids-filling-it", "a-list-of-token-ids", "max-tokens", "echo-alone"])
def test_legacy_completions_past_the_context_name_the_prompt_or_the_length(client, body, param, pattern):
    message = assert_context_exceeded(client.post("/v1/completions", json=body), param)
    match = pattern.fullmatch(message)
    assert match and match.group(1) == "256" and "prompt" in match.groups(), message


def test_tokenize_counts_a_text_past_the_context_so_a_client_can_measure_before_it_compacts(client):
    reply = client.post("/tokenize", json={"prompt": "word " * 300}).get_json()
    assert reply["count"] > reply["max_model_len"] == 256


@pytest.fixture(scope="module")
def small_budget_client(make_settings):
    """Return a client of an engine whose 1 MiB KV budget (4096 tokens of the tiny model) is below its context."""
    settings = make_settings(max_model_len=16_384, kv_cache_mb=1)
    with started_engine(settings) as engine:
        assert engine.kv_token_budget == 4096
        yield create_app(settings, engine=engine).test_client()


def test_a_request_past_the_kv_budget_says_the_servers_limit_in_openais_words(small_budget_client):
    response = small_budget_client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4090})
    message = assert_context_exceeded(response, "max_tokens")
    assert message.startswith("This model's maximum context length is 4096 tokens on this server (the KV cache "
                              "budget of a worker, KV_CACHE_MB). However, you requested ")


def test_n_choices_sharing_the_kv_budget_past_it_blame_n(small_budget_client):
    body = {"messages": [{"role": "user", "content": "word " * 1500}], "max_tokens": 600, "n": 3}
    message = assert_context_exceeded(small_budget_client.post("/v1/chat/completions", json=body), "n")
    assert re.fullmatch(r"This server's KV cache holds 4096 tokens per worker \(KV_CACHE_MB\), which 3 choices "
                        r"share\. However, you requested \d+ tokens \(3 choices of \d+ in the messages and 600 in the "
                        r"completion\)\. Please reduce n or the length of the messages or completion\.", message)
    one = small_budget_client.post("/v1/chat/completions", json={**body, "n": 1, "max_tokens": 1})
    assert one.status_code == 200
