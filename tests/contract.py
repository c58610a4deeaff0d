"""Check real responses against the published OpenAPI document (service/api/openapi.py)."""

import json

from jsonschema import Draft202012Validator

from harness import sse_payloads
from service.api.openapi import openapi_document


def schema_validator(name: str, document: dict | None = None) -> Draft202012Validator:
    """Return a validator of one component schema, resolving its references in the document (by default the one
    this process would serve)."""
    document = document or openapi_document()
    return Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": document["components"]})


def response_schema(document: dict, path: str, method: str, status: int, media_type: str) -> dict:
    """Return the documented schema of a response (falling back to the `default` response)."""
    responses = document["paths"][path][method]["responses"]
    documented = responses.get(str(status)) or responses["default"]
    assert media_type in documented["content"], (path, method, status, media_type)
    return documented["content"][media_type]


def assert_matches_contract(path: str, method: str, status: int, content_type: str, body: bytes,
                            document: dict | None = None) -> None:
    """Fail unless a response's status, media type and body are what the document says."""
    document = document or openapi_document()
    media_type = content_type.split(";")[0].strip()
    content = response_schema(document, path, method, status, media_type)
    if media_type == "text/event-stream":
        payloads = sse_payloads(body)
        assert payloads[-1] == "[DONE]"
        event_schema = content["x-event-schema"]["$ref"].removeprefix("#/components/schemas/")
        chunk, error = schema_validator(event_schema, document), schema_validator("ErrorResponse", document)
        for payload in payloads[:-1]:
            assert chunk.is_valid(payload) or error.is_valid(payload), payload
    elif media_type == "application/json":
        validator = Draft202012Validator({**content["schema"], "components": document["components"]})
        validator.validate(json.loads(body))
