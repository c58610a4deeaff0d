"""Property-based fuzzing: generated requests never get a 5xx, and every response matches the contract."""

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from contract import assert_matches_contract
from service import create_app

FUZZ = settings(max_examples=120, deadline=None, database=None, suppress_health_check=list(HealthCheck))

# Text with what breaks naive servers: control characters, lone surrogates, long runs, odd scripts.
texts = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["\ud800", "a\udfffb", "\x00\x1f\x7f", "\u202e\ufeff", "x" * 5000, "😀" * 50]),
)
numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=False), st.sampled_from([0, 1, -1, 2**63, 1e308])
)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), numbers, texts),
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(texts, children, max_size=4)),
    max_leaves=12,
)


content_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), min_size=1, max_size=3)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]), "content": st.one_of(texts, content_parts)},
    optional={"name": texts},
)
# Plausible requests, most of them valid, so generation and streaming are fuzzed too.
plausible_bodies = st.fixed_dictionaries(
    {"messages": st.lists(message, min_size=1, max_size=4)},
    optional={
        "model": st.sampled_from(["tiny", "", "gpt-4o"]),
        "max_tokens": st.integers(min_value=0, max_value=4),
        "max_completion_tokens": st.integers(min_value=0, max_value=4),
        "temperature": st.floats(min_value=-0.5, max_value=2.5),
        "top_p": st.floats(min_value=-0.1, max_value=1.1),
        "top_k": st.integers(min_value=-3, max_value=50),
        "seed": numbers,
        "stop": st.one_of(texts, st.lists(texts, max_size=5)),
        "presence_penalty": st.floats(min_value=-3, max_value=3),
        "frequency_penalty": st.floats(min_value=-3, max_value=3),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
        "n": st.integers(min_value=0, max_value=2),
    },
)
FIELDS = ["messages", "model", "max_tokens", "temperature", "top_p", "top_k", "stop", "stream", "stream_options", "n"]


def with_one_wrong_field(body: dict, draw_value) -> dict:
    """Return the body with one field, or one field of its first message, set to any JSON value."""
    field, value, in_message = draw_value
    if in_message:
        return {**body, "messages": [{**body["messages"][0], field: value}, *body["messages"][1:]]}
    return {**body, field: value}


wrong_field = st.one_of(
    st.tuples(st.sampled_from(FIELDS), json_values, st.just(False)),
    st.tuples(st.sampled_from(["role", "content", "name"]), json_values, st.just(True)),
)
request_bodies = st.one_of(
    plausible_bodies, st.builds(with_one_wrong_field, plausible_bodies, wrong_field), json_values
)


@pytest.fixture(scope="module")
def fuzz_client(make_settings, engine):
    """Return a client whose replies are at most 4 tokens, so fuzzing stays fast."""
    settings = make_settings(max_model_len=256, default_max_tokens=4, max_tokens_limit=8, max_request_bytes=64 * 1024)
    return create_app(settings, engine=engine).test_client()


def post(client, data: bytes, content_type: str = "application/json"):
    """POST raw bytes to the chat endpoint and check the response against the contract."""
    response = client.post("/v1/chat/completions", data=data, content_type=content_type)
    assert response.status_code < 500, response.get_data(as_text=True)
    assert_matches_contract("/v1/chat/completions", "post", response.status_code, response.content_type, response.get_data())
    return response


@FUZZ
@given(body=request_bodies)
def test_generated_requests_get_no_5xx_and_match_the_contract(fuzz_client, body):
    post(fuzz_client, json.dumps(body).encode())


@FUZZ
@given(raw=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(lambda text: text.encode("utf-8", "surrogatepass"))))
def test_arbitrary_bytes_get_no_5xx(fuzz_client, raw):
    post(fuzz_client, raw)


@FUZZ
@given(path=st.text(alphabet="/abcdefghijklmnopqrstuvwxyz0123456789.-_%", max_size=30), method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]))
def test_arbitrary_routes_and_methods_get_no_5xx(fuzz_client, path, method):
    # A leading "//" would make Flask's test client read a host name from the path.
    response = fuzz_client.open("/" + path.lstrip("/"), method=method)
    assert response.status_code < 500, response.get_data(as_text=True)
