"""The published contract: /openapi.json documents every route, and real responses match it."""

import re

import pytest
from jsonschema import Draft202012Validator

from contract import assert_matches_contract
from service.openapi import openapi_document

USER = [{"role": "user", "content": "Write a haiku about CPUs."}]
FORCED_CALL = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}}}],
    "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 40}


def test_served_document_is_the_published_one(client):
    response = client.get("/openapi.json")
    assert response.status_code == 200
    assert response.get_json() == openapi_document()
    assert response.get_json()["openapi"].startswith("3.1")


def test_every_component_is_a_valid_json_schema():
    for name, schema in openapi_document()["components"]["schemas"].items():
        Draft202012Validator.check_schema(schema)


def test_every_route_of_the_app_is_documented(app):
    documented = set(openapi_document()["paths"])
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path = re.sub(r"<(?:[a-z]+:)?([a-z_]+)>", r"{\1}", rule.rule)
        assert path in documented, path
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            assert method.lower() in openapi_document()["paths"][path], (method, path)


def test_request_schema_is_generated_from_the_parser():
    schema = openapi_document()["components"]["schemas"]["ChatCompletionRequest"]
    assert schema["required"] == ["messages"]
    assert schema["properties"]["temperature"]["anyOf"][0]["maximum"] == 2.0
    assert "ChatMessage" in openapi_document()["components"]["schemas"]


@pytest.mark.parametrize(
    "method, path, documented_path, body, status",
    [
        ("post", "/v1/chat/completions", None, {"messages": USER, "max_tokens": 3}, 200),
        ("post", "/v1/chat/completions", None, {"messages": USER, "max_tokens": 3, "stream": True}, 200),
        ("post", "/v1/chat/completions", None,
         {"messages": USER, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}, 200),
        ("post", "/v1/chat/completions", None, {"messages": USER, **FORCED_CALL}, 200),
        ("post", "/v1/chat/completions", None, {"messages": USER, **FORCED_CALL, "stream": True}, 200),
        ("post", "/v1/chat/completions", None, {"messages": USER, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}, 200),
        ("post", "/v1/chat/completions", None,
         {"messages": USER, "max_tokens": 3, "logprobs": True, "top_logprobs": 2, "stream": True}, 200),
        ("post", "/v1/chat/completions", None, {"messages": USER, "temperature": 9}, 400),
        ("post", "/v1/chat/completions", None, {"messages": USER, "model": "gpt-4o"}, 404),
        ("post", "/v1/chat/completions", None, b"x" * (2 * 1024 * 1024), 413),
        ("post", "/v1/chat/completions", None, "plain text", 415),
        ("get", "/v1/models", None, None, 200),
        ("get", "/v1/models/tiny", "/v1/models/{model_id}", None, 200),
        ("get", "/v1/models/nope", "/v1/models/{model_id}", None, 404),
        ("get", "/healthz", None, None, 200),
        ("get", "/readyz", None, None, 200),
        ("get", "/openapi.json", None, None, 200),
    ],
)
def test_real_responses_match_the_contract(client, method, path, documented_path, body, status):
    if isinstance(body, dict):
        response = client.open(path, method=method, json=body)
    elif isinstance(body, bytes):
        response = client.open(path, method=method, data=body, content_type="application/json")
    else:
        response = client.open(path, method=method, data=body, content_type="text/plain" if body else None)
    assert response.status_code == status, response.get_data(as_text=True)
    assert_matches_contract(documented_path or path, method, status, response.content_type, response.get_data())


def test_unknown_route_and_method_errors_match_the_error_schema(client):
    for response in (client.get("/v2/nothing"), client.get("/v1/chat/completions")):
        assert_matches_contract("/v1/chat/completions", "post", response.status_code, response.content_type, response.get_data())
