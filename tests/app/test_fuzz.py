"""Property-based fuzzing: generated requests never get a 5xx, and every response matches the contract."""

import json
import math
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.app import create_app
from tests.contract import assert_matches_contract

FUZZ = settings(max_examples=120, deadline=None, database=None, suppress_health_check=list(HealthCheck))

# Text with what breaks naive servers: control characters, lone surrogates, long runs, odd scripts.
texts = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["\ud800", "a\udfffb", "\x00\x1f\x7f", "\u202e\ufeff", "x" * 5000, "😀" * 50]),
)
INT64 = 2**63 - 1
# Magnitudes where float arithmetic breaks: zeros, subnormals (5e-324 is the smallest), values that
# float32 flushes to zero or that overflow it when divided into, and the largest doubles.
FLOAT_EDGES = [
    0.0, -0.0, 5e-324, -5e-324, 1e-310, sys.float_info.min, 1e-300, 1e-45, 1e-39, 1.1754943508222875e-38,
    1e-30, 1e-7, 1e308, -1e308, sys.float_info.max, -sys.float_info.max,
]
INT_EDGES = [0, 1, -1, 2, INT64, -INT64 - 1, 2**63, -(2**63) - 1, 2**64, 2**70]


def float_edges(low: float, high: float) -> list[float]:
    """Return FLOAT_EDGES plus each bound of a field's range and the doubles next to it."""
    near_bounds = [nextto for bound in (low, high)
                   for nextto in (math.nextafter(bound, -math.inf), bound, math.nextafter(bound, math.inf))]
    return FLOAT_EDGES + near_bounds


def int_edges(low: int, high: int) -> list[int]:
    """Return INT_EDGES plus each bound of a field's range and the integers next to it."""
    return INT_EDGES + [bound + step for bound in (low, high) for step in (-1, 0, 1)]


def floats_around(low: float, high: float):
    """Draw floats in and just outside a range, and every edge value of it."""
    return st.one_of(st.floats(min_value=low - 0.5, max_value=high + 0.5), st.sampled_from(float_edges(low, high)))


def integers_around(low: int, high: int):
    """Draw integers in and just outside a range, and every edge value of it."""
    return st.one_of(st.integers(min_value=low - 3, max_value=min(high + 3, low + 50)),
                     st.sampled_from(int_edges(low, high)))


# The range the schema accepts for each numeric field (service/api/chat_request.py).
NUMERIC_FIELDS = {
    "max_tokens": (1, INT64),
    "max_completion_tokens": (1, INT64),
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "top_k": (-1, INT64),
    "seed": (-(2**63), INT64),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "n": (1, 1),
}
numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.sampled_from(FLOAT_EDGES + INT_EDGES),
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
        # Small max_tokens mostly, so replies stay short; the edges reach the limits.
        "max_tokens": st.one_of(st.integers(min_value=0, max_value=4), st.sampled_from(int_edges(1, INT64))),
        "max_completion_tokens": st.one_of(st.integers(min_value=0, max_value=4), st.sampled_from(int_edges(1, INT64))),
        "temperature": floats_around(*NUMERIC_FIELDS["temperature"]),
        "top_p": floats_around(*NUMERIC_FIELDS["top_p"]),
        "top_k": integers_around(*NUMERIC_FIELDS["top_k"]),
        "seed": st.one_of(numbers, st.sampled_from(int_edges(*NUMERIC_FIELDS["seed"]))),
        "stop": st.one_of(texts, st.lists(texts, max_size=5)),
        "presence_penalty": floats_around(*NUMERIC_FIELDS["presence_penalty"]),
        "frequency_penalty": floats_around(*NUMERIC_FIELDS["frequency_penalty"]),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
        "n": integers_around(*NUMERIC_FIELDS["n"]),
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
    assert_matches_contract("/v1/chat/completions", "post", response.status_code, response.content_type,
                            response.get_data())
    return response


@FUZZ
@given(body=request_bodies)
def test_generated_requests_get_no_5xx_and_match_the_contract(fuzz_client, body):
    post(fuzz_client, json.dumps(body).encode())


EDGE_CASES = [
    (field, value)
    for field, (low, high) in NUMERIC_FIELDS.items()
    for value in sorted(set(float_edges(low, high) if isinstance(low, float) else int_edges(low, high)), key=repr)
]


@pytest.mark.parametrize("field,value", EDGE_CASES, ids=[f"{field}={value!r}" for field, value in EDGE_CASES])
def test_every_numeric_field_at_its_edges_generates_or_gets_400_naming_it(fuzz_client, field, value):
    """Each value the schema accepts generates (greedy where a temperature is too small to divide by)."""
    body = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": 2, field: value}
    if field == "max_completion_tokens":
        del body["max_tokens"]
    for stream in (False, True):
        response = post(fuzz_client, json.dumps({**body, "stream": stream}).encode())
        if response.status_code == 200:
            text = response.get_data(as_text=True)
            assert '"error"' not in text and (not stream or text.endswith("data: [DONE]\n\n")), text
        else:
            assert response.status_code == 400 and response.get_json()["error"]["param"] == field, response.get_json()


@FUZZ
@given(raw=st.one_of(st.binary(max_size=200),
                    st.text(max_size=200).map(lambda text: text.encode("utf-8", "surrogatepass"))))
def test_arbitrary_bytes_get_no_5xx(fuzz_client, raw):
    post(fuzz_client, raw)


@FUZZ
@given(path=st.text(alphabet="/abcdefghijklmnopqrstuvwxyz0123456789.-_%", max_size=30),
       method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]))
def test_arbitrary_routes_and_methods_get_no_5xx(fuzz_client, path, method):
    # A leading "//" would make Flask's test client read a host name from the path.
    response = fuzz_client.open("/" + path.lstrip("/"), method=method)
    assert response.status_code < 500, response.get_data(as_text=True)
