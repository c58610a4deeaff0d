"""The published contract: /openapi.json lists exactly the routes the app serves, and a real server's
responses (Gunicorn with every setting at its default) match the schemas it publishes."""

import json
import re
import socket

import pytest
import requests
from jsonschema import Draft202012Validator

from service.app import create_app
from tests.contract import assert_matches_contract, schema_validator

USER = [{"role": "user", "content": "Write a haiku about CPUs."}]
FORCED_CALL = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}}}],
    "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 40}
LEGACY_CALL = {"functions": [FORCED_CALL["tools"][0]["function"]], "function_call": {"name": "f"}, "max_tokens": 40}
# Werkzeug adds HEAD to every GET and the app answers no OPTIONS (service/errors.py): neither is documented.
IMPLICIT_METHODS = {"HEAD", "OPTIONS"}


@pytest.fixture(scope="module")
def document(default_server) -> dict:
    """Return the document the real server serves."""
    response = requests.get(f"{default_server.url}/openapi.json", timeout=10)
    assert response.status_code == 200
    assert response.headers["Content-Type"] == "application/json"
    return response.json()


def openapi_path(rule: str) -> str:
    """Turn a Flask rule (/v1/models/<path:model_id>) into an OpenAPI path (/v1/models/{model_id})."""
    return re.sub(r"<(?:[a-z]+:)?([a-z_]+)>", r"{\1}", rule)


def test_document_is_openapi_3_1_whose_schemas_are_valid_and_whose_references_resolve(document):
    assert document["openapi"] == "3.1.0"
    for schema in document["components"]["schemas"].values():
        Draft202012Validator.check_schema(schema)
    references = set(re.findall(r'"\$ref": "([^"]+)"', json.dumps(document)))
    assert references
    for reference in references:
        assert reference.removeprefix("#/components/schemas/") in document["components"]["schemas"], reference


def test_document_lists_exactly_the_routes_and_methods_the_app_serves(make_settings, document):
    app = create_app(make_settings())
    served, parameters = set(), {}
    for rule in app.url_map.iter_rules():
        path = openapi_path(rule.rule)
        served |= {(path, method.lower()) for method in rule.methods - IMPLICIT_METHODS}
        parameters[path] = set(rule.arguments)
    documented = {(path, method) for path, item in document["paths"].items()
                  for method in item if method != "parameters"}
    assert served == documented
    for path, item in document["paths"].items():
        assert {parameter["name"] for parameter in item.get("parameters", [])} == parameters[path], path


@pytest.mark.parametrize(
    "method, path, documented_path, body, status",
    [
        ("post", "/v1/chat/completions", None, {"messages": USER, "max_tokens": 3}, 200),
        ("post", "/v1/chat/completions", None, {"messages": USER, "max_tokens": 3, "stream": True}, 200),
        ("post", "/v1/chat/completions", None,
         {"messages": USER, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}, 200),
        ("post", "/v1/chat/completions", None, {"messages": USER, **FORCED_CALL}, 200),
        ("post", "/v1/chat/completions", None, {"messages": USER, **FORCED_CALL, "stream": True}, 200),
        ("post", "/v1/chat/completions", None,
         {"messages": USER, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}, 200),
        ("post", "/v1/chat/completions", None,
         {"messages": USER, "max_tokens": 3, "logprobs": True, "top_logprobs": 2, "stream": True}, 200),
        ("post", "/v1/chat/completions", None, {"messages": USER, **LEGACY_CALL}, 200),
        ("post", "/v1/chat/completions", None, {"messages": USER, **LEGACY_CALL, "stream": True}, 200),
        ("post", "/v1/chat/completions", None, {"messages": USER, "max_tokens": 3, "logit_bias": {"9707": 100}}, 200),
        ("post", "/v1/chat/completions", None, {"messages": USER, "max_tokens": 3, "logit_bias": {"9707": 101}}, 400),
        ("post", "/v1/chat/completions", None, {"messages": USER, "temperature": 9}, 400),
        ("post", "/v1/chat/completions", None, {"messages": USER, "model": "gpt-4o"}, 404),
        ("post", "/v1/chat/completions", None, "plain text", 415),
        ("post", "/v1/completions", None, {"prompt": "Once upon a time", "max_tokens": 3}, 200),
        ("post", "/v1/completions", None, {"prompt": [9707, 1879], "max_tokens": 3, "logprobs": 2, "echo": True}, 200),
        ("post", "/v1/completions", None, {"prompt": "Hi", "max_tokens": 0, "echo": True, "logprobs": 1}, 200),
        ("post", "/v1/completions", None,
         {"prompt": "Hi", "max_tokens": 3, "stream": True, "logprobs": 1, "stream_options": {"include_usage": True}},
         200),
        ("post", "/v1/completions", None, {"prompt": "Hi", "max_tokens": 3, "stream": True, "echo": True}, 200),
        ("post", "/v1/completions", None, {"prompt": "Hi", "logprobs": 6}, 400),
        ("post", "/v1/chat/completions", None, {"messages": USER, "max_tokens": 3, "n": 2, "seed": 1}, 200),
        ("post", "/v1/chat/completions", None, {"messages": USER, "max_tokens": 3, "n": 2, "stream": True}, 200),
        ("post", "/v1/chat/completions", None, {"messages": USER, "n": 9}, 400),
        ("post", "/v1/completions", None, {"prompt": "Hi", "max_tokens": 2, "n": 2, "echo": True, "logprobs": 1}, 200),
        ("post", "/v1/completions", None, {"prompt": "Hi", "max_tokens": 2, "n": 2, "stream": True}, 200),
        ("post", "/v1/completions", None, {"prompt": 5}, 400),
        ("post", "/tokenize", None, {"content": "Hello"}, 200),
        ("post", "/tokenize", None, {"messages": USER, "add_generation_prompt": False}, 200),
        ("post", "/tokenize", None, {"prompt": 5}, 400),
        ("post", "/detokenize", None, {"tokens": [9707, 1879]}, 200),
        ("post", "/detokenize", None, {"tokens": [True]}, 400),
        ("get", "/v1/models", None, None, 200),
        ("get", "/v1/models/tiny", "/v1/models/{model_id}", None, 200),
        ("get", "/v1/models/nope", "/v1/models/{model_id}", None, 404),
        ("get", "/healthz", None, None, 200),
        ("get", "/readyz", None, None, 200),
        ("get", "/metrics", None, None, 200),
        ("get", "/openapi.json", None, None, 200),
        ("get", "/", None, None, 200),
        ("get", "/static/chat.js", "/static/{filename}", None, 200),
        ("get", "/static/chat.css", "/static/{filename}", None, 200),
        ("get", "/static/favicon.svg", "/static/{filename}", None, 200),
    ],
)
def test_real_responses_match_the_contract(default_server, document, method, path, documented_path, body, status):
    url = f"{default_server.url}{path}"
    if isinstance(body, dict):
        # The published request schema takes what the server takes and refuses what it refuses with a 400.
        request_schema = document["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
        validator = Draft202012Validator({**request_schema, "components": document["components"]})
        assert validator.is_valid(body) == (status != 400), body
        response = requests.request(method, url, json=body, timeout=60)
    else:
        headers = {"Content-Type": "text/plain"} if body else {}
        response = requests.request(method, url, data=body, headers=headers, timeout=60)
    assert response.status_code == status, response.text
    assert_matches_contract(documented_path or path, method, status, response.headers["Content-Type"],
                            response.content, document)


def test_the_error_schema_refuses_what_is_not_an_error(document):
    validator = schema_validator("ErrorResponse", document)
    good = {"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}}
    assert validator.is_valid(good)
    for bad in ({"error": {**good["error"], "extra": 1}}, {"error": {"message": "m", "type": "invalid_request_error"}},
                {"error": {**good["error"], "type": "oops"}}, {"message": "m"}):
        assert not validator.is_valid(bad), bad


def raw_response(port: int, request: bytes) -> tuple[int, bytes]:
    """Send raw bytes, read the response to the closed connection and return its status and body."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        received = b"".join(iter(lambda: sock.recv(65536), b""))
    head, _, body = received.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


CHAT = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\n")


def test_errors_the_worker_answers_itself_match_the_error_schema(default_server, document):
    validator = schema_validator("ErrorResponse", document)
    for request, status in (
        (CHAT + b"Content-Length: 999999999\r\n\r\n", 413),
        (CHAT + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", 400),
        (b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nBad{Name}: x\r\n\r\n", 400),
    ):
        got, body = raw_response(default_server.port, request)
        assert got == status, body
        validator.validate(json.loads(body))


def test_errors_of_routing_match_the_error_schema(default_server, document):
    validator = schema_validator("ErrorResponse", document)
    for method, path, status in (("get", "/v2/nothing", 404), ("get", "/v1/chat/completions", 405),
                                 ("options", "/v1/models", 405), ("get", "/v1//models", 404)):
        response = requests.request(method, f"{default_server.url}{path}", timeout=10)
        assert response.status_code == status, response.text
        assert response.headers["Content-Type"] == "application/json"
        validator.validate(response.json())


def test_a_refused_key_matches_the_error_schema(make_settings, document):
    """Through the factory's app rather than a server of its own: a keyed Gunicorn costs a minute to start,
    and the readiness it tells a caller without a key is checked against the contract in test_privacy.py."""
    client = create_app(make_settings(api_keys="sk-the-only-key")).test_client()
    response = client.get("/v1/models", headers={"Authorization": "Bearer sk-another-key"})
    assert response.status_code == 401
    schema_validator("ErrorResponse", document).validate(response.get_json())
