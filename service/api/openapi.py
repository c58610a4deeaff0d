"""The published contract: an OpenAPI 3.1 document of every route, served at /openapi.json.

Every schema is generated from the pydantic model that parses the request (chat_request.py,
completion_request.py, tokenize_request.py) or renders the response (responses.py, and
service/errors.py), so the contract cannot drift from the code; this file says which route takes and
answers which.
"""

from functools import lru_cache

from flask import Blueprint, jsonify
from pydantic.json_schema import models_json_schema

from .chat_request import ChatCompletionRequest
from .completion_request import CompletionRequest
from .responses import RESPONSE_MODELS
from .responses_api.objects import RESPONSES_API_MODELS
from .responses_api.request import ResponsesRequest
from .tokenize_request import DetokenizeRequest, TokenizeRequest

bp = Blueprint("openapi", __name__)

REF = "#/components/schemas/{model}"
# What the files under service/static/ are served as.
STATIC_MEDIA_TYPES = ("text/html", "text/javascript", "text/css", "image/svg+xml")


def _ref(schema_name: str) -> dict:
    """Point at a schema of the document's components."""
    return {"$ref": REF.format(model=schema_name)}


def _json(schema_name: str, description: str) -> dict:
    """Describe a JSON response by its schema's name."""
    return {"description": description, "content": {"application/json": {"schema": _ref(schema_name)}}}


def _plain(description: str, *media_types: str, schema_type: str = "string") -> dict:
    """Describe a response that no schema of ours shapes (a page, a file, the metrics)."""
    return {"description": description, "content": {media_type: {"schema": {"type": schema_type}}
                                                    for media_type in media_types}}


def _streamed(description: str, whole: str, chunk: str) -> dict:
    """Describe a generation's response: one JSON object, or with `stream: true` Server-Sent Events of chunks."""
    return {"description": description, "content": {
        "application/json": {"schema": _ref(whole)},
        "text/event-stream": {"schema": {"type": "string"}, "x-event-schema": _ref(chunk)},
    }}


ERROR = _json("ErrorResponse", "An error in OpenAI's shape (400, 404, 405, 413, 415, 503 with Retry-After, 500).")


def _get(summary: str, ok: dict) -> dict:
    """Describe a GET operation."""
    return {"get": {"summary": summary, "responses": {"200": ok, "default": ERROR}}}


def _post(summary: str, request_schema: str, ok: dict) -> dict:
    """Describe a POST operation with a JSON body."""
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request_schema)}}},
        "responses": {"200": ok, "default": ERROR},
    }}


def _paths() -> dict:
    """Describe every route."""
    return {
        "/v1/chat/completions": _post(
            "Generate a chat completion, streamed or whole.", "ChatCompletionRequest",
            _streamed("The whole reply, or with `stream: true` a Server-Sent Events stream of ChatCompletionChunk "
                      "`data:` events ending with `data: [DONE]`.", "ChatCompletion", "ChatCompletionChunk"),
        ),
        "/v1/completions": _post(
            "Continue a raw prompt (legacy text completions), streamed or whole.", "CompletionRequest",
            _streamed("The whole completion, or with `stream: true` a Server-Sent Events stream of CompletionChunk "
                      "`data:` events ending with `data: [DONE]`.", "Completion", "CompletionChunk"),
        ),
        "/v1/responses": _post(
            "Create a response (OpenAI's Responses API), streamed or whole.", "ResponsesRequest",
            _streamed("The whole response, or with `stream: true` a Server-Sent Events stream of ResponseStreamEvent "
                      "events, each an `event: <type>` line and a `data:` line, ending with `response.completed`, "
                      "`response.incomplete` or `response.failed`.", "ResponseObject", "ResponseStreamEvent"),
        ),
        "/v1/responses/{response_id}": {
            **_get("Return a response stored by the same API key; any other id is a 404.",
                   _json("ResponseObject", "The stored response.")),
            "parameters": [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}],
        },
        "/tokenize": _post(
            "Turn text (`content` or `prompt`) or a conversation (`messages`, through the chat template) into "
            "token ids.",
            "TokenizeRequest",
            _json("TokenizeResponse", "The token ids, their count and the longest sequence allowed."),
        ),
        "/detokenize": _post(
            "Turn token ids back into text.",
            "DetokenizeRequest", _json("DetokenizeResponse", "The text, under both names."),
        ),
        "/v1/models": _get("List every name the served model answers to.", _json("ModelList", "The accepted names.")),
        "/v1/models/{model_id}": {
            **_get("Describe the served model under one of its names; any other id is a 404 `model_not_found`.",
                   _json("Model", "The served model.")),
            "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
        },
        "/healthz": _get("Liveness: answers while the process is alive.", _json("Health", "Alive.")),
        "/readyz": {
            "get": {
                "summary": "Readiness: 200 once this worker's model is loaded and warmed up.",
                "responses": {
                    "200": _json("Readiness", "Ready."),
                    "503": _json("Readiness", "Still loading, or failed to load."),
                },
            }
        },
        "/metrics": _get("Prometheus metrics of every worker.",
                         _plain("Prometheus text exposition format.", "text/plain")),
        "/": _get("The chat page.", _plain("An HTML page.", "text/html")),
        "/static/{filename}": {
            **_get("A file of the chat page.",
                   _plain("The page's HTML, scripts, style and icon.", *STATIC_MEDIA_TYPES)),
            "parameters": [{"name": "filename", "in": "path", "required": True, "schema": {"type": "string"}}],
        },
        "/openapi.json": _get("This document.", _plain("OpenAPI 3.1.", "application/json", schema_type="object")),
    }


@lru_cache(maxsize=1)
def openapi_document() -> dict:
    """Build the OpenAPI document (once per process)."""
    # Responses in serialization mode: a field with a default is optional, as rendering leaves it out when unset.
    requests = (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest, ResponsesRequest)
    responses = (*RESPONSE_MODELS, *RESPONSES_API_MODELS)
    models = [*((model, "validation") for model in requests), *((model, "serialization") for model in responses)]
    _, schemas = models_json_schema(models, ref_template=REF)
    return {
        "openapi": "3.1.0",
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "info": {"title": "corechat", "version": "1", "description": "An OpenAI-compatible chat server for CPUs."},
        "paths": _paths(),
        "components": {"schemas": schemas["$defs"]},
    }


@bp.get("/openapi.json")
def get_openapi_document():
    """Serve the OpenAPI document."""
    return jsonify(openapi_document())


def init_app(app) -> None:
    """Register the route of the document."""
    app.register_blueprint(bp)
