"""The published contract: an OpenAPI 3.1 document of every route, served at /openapi.json.

The request body's schema is generated from the pydantic model that parses it (service/schemas.py),
so the contract cannot drift from the parser; the responses, built by hand in service/chat.py and
service/api.py, are described here.
"""

from functools import lru_cache

from flask import Blueprint, jsonify

from .schemas import ChatCompletionRequest

bp = Blueprint("openapi", __name__)

REF = "#/components/schemas/{model}"
NULLABLE_STRING = {"type": ["string", "null"]}
USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {name: {"type": "integer", "minimum": 0} for name in ("prompt_tokens", "completion_tokens", "total_tokens")},
}
FINISH_REASON = {"enum": ["stop", "length", "tool_calls", "cancelled"]}
TOKEN_LOGPROB = {
    "token": {"type": "string"},
    "logprob": {"type": "number", "maximum": 0},
    "bytes": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0, "maximum": 255}},
}
LOGPROBS = {
    "description": "With `logprobs: true`: each token's log probability under the distribution the sampler drew "
    "from, and the `top_logprobs` most likely alternatives; otherwise null.",
    "anyOf": [
        {
            "type": "object",
            "required": ["content"],
            "properties": {
                "content": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["token", "logprob", "bytes", "top_logprobs"],
                        "properties": {
                            **TOKEN_LOGPROB,
                            "top_logprobs": {
                                "type": "array",
                                "maxItems": 20,
                                "items": {"type": "object", "required": list(TOKEN_LOGPROB), "properties": TOKEN_LOGPROB},
                            },
                        },
                    },
                }
            },
        },
        {"type": "null"},
    ],
}
TOOL_CALL = {
    "type": "object",
    "description": "A call of one of the request's tools; `arguments` is a JSON text.",
    "required": ["id", "type", "function"],
    "properties": {
        "id": {"type": "string", "pattern": "^call_"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
        },
    },
}
TOOL_CALL_DELTA = {
    "type": "object",
    "description": "A piece of a streamed tool call: the first carries its id, type and name; later ones "
    "(same `index`) add `function.arguments` text.",
    "required": ["index", "function"],
    "properties": {
        "index": {"type": "integer", "minimum": 0},
        "id": {"type": "string", "pattern": "^call_"},
        "type": {"const": "function"},
        "function": {"type": "object", "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}},
    },
}


def _completion_header(object_name: str) -> dict:
    """Describe the fields a completion and a chunk share."""
    return {
        "id": {"type": "string", "pattern": "^chatcmpl-"},
        "object": {"const": object_name},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "system_fingerprint": NULLABLE_STRING,
    }


def _one_choice(content_field: str, content_schema: dict, finish_reason: dict) -> dict:
    """Describe a `choices` array of at most one choice carrying a message or a delta."""
    return {
        "type": "array",
        "maxItems": 1,
        "items": {
            "type": "object",
            "required": ["index", content_field, "finish_reason"],
            "properties": {
                "index": {"const": 0},
                content_field: {"type": "object", **content_schema},
                "logprobs": LOGPROBS,
                "finish_reason": finish_reason,
            },
        },
    }


RESPONSE_SCHEMAS = {
    "Error": {
        "type": "object",
        "description": "OpenAI's error object; every non-2xx JSON response has this shape.",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "additionalProperties": False,
                "properties": {
                    "message": {"type": "string", "minLength": 1},
                    "type": {"enum": ["invalid_request_error", "authentication_error", "server_error"]},
                    "param": NULLABLE_STRING,
                    "code": NULLABLE_STRING,
                },
            }
        },
    },
    "Usage": USAGE,
    "ChatCompletion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            **_completion_header("chat.completion"),
            "choices": {
                "minItems": 1,
                **_one_choice(
                    "message",
                    {
                        "required": ["role", "content"],
                        "properties": {
                            "role": {"const": "assistant"},
                            "content": {"type": ["string", "null"], "description": "null when the reply is tool calls alone"},
                            "tool_calls": {"type": "array", "minItems": 1, "items": TOOL_CALL},
                        },
                    },
                    FINISH_REASON,
                ),
            },
            "usage": {"$ref": REF.format(model="Usage")},
        },
    },
    "ChatCompletionChunk": {
        "type": "object",
        "description": "One `data:` event of a stream. The stream ends with `data: [DONE]`; `: ping` comments "
        "keep it alive while waiting. An error after the first event arrives as an Error object event.",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            **_completion_header("chat.completion.chunk"),
            "choices": _one_choice(
                "delta",
                {
                    "additionalProperties": False,
                    "properties": {
                        "role": {"const": "assistant"},
                        "content": {"type": "string"},
                        "tool_calls": {"type": "array", "minItems": 1, "items": TOOL_CALL_DELTA},
                    },
                },
                {"anyOf": [FINISH_REASON, {"type": "null"}]},
            ),
            "usage": {"anyOf": [{"$ref": REF.format(model="Usage")}, {"type": "null"}]},
        },
    },
    "Model": {
        "type": "object",
        "required": ["id", "object", "created", "owned_by"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
        },
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {"$ref": REF.format(model="Model")}}},
    },
    "Health": {"type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}},
    "Readiness": {
        "type": "object",
        "description": "This worker's state and counts. With API keys on, a caller without a key gets only "
        "these and requests_finished; otherwise the model and more facts (load and warm-up seconds, threads, "
        "...) appear.",
        "required": ["status", "worker_pid", "running", "waiting"],
        "properties": {
            "status": {"type": "string"},
            "model": {"type": "string"},
            "worker_pid": {"type": "integer"},
            "running": {"type": "integer", "minimum": 0},
            "waiting": {"type": "integer", "minimum": 0},
        },
    },
}


def _json(schema_name: str, description: str) -> dict:
    """Describe a JSON response by its schema's name."""
    return {"description": description, "content": {"application/json": {"schema": {"$ref": REF.format(model=schema_name)}}}}


ERROR = _json("Error", "An error in OpenAI's shape (400, 404, 405, 413, 415, 503 with Retry-After, 500).")


def _get(summary: str, ok: dict) -> dict:
    """Describe a GET operation."""
    return {"get": {"summary": summary, "responses": {"200": ok, "default": ERROR}}}


def _paths() -> dict:
    """Describe every route."""
    chat_ok = {
        "description": "The whole reply, or with `stream: true` a Server-Sent Events stream of "
        "ChatCompletionChunk `data:` events ending with `data: [DONE]`.",
        "content": {
            "application/json": {"schema": {"$ref": REF.format(model="ChatCompletion")}},
            "text/event-stream": {"schema": {"type": "string"}, "x-event-schema": {"$ref": REF.format(model="ChatCompletionChunk")}},
        },
    }
    return {
        "/v1/chat/completions": {
            "post": {
                "summary": "Generate a chat completion, streamed or whole.",
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": REF.format(model="ChatCompletionRequest")}}},
                },
                "responses": {"200": chat_ok, "default": ERROR},
            }
        },
        "/v1/models": _get("List the served model.", _json("ModelList", "The one served model.")),
        "/v1/models/{model_id}": {
            **_get("Describe the served model; any other id is a 404.", _json("Model", "The served model.")),
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
        "/metrics": _get(
            "Prometheus metrics of every worker.",
            {"description": "Prometheus text exposition format.", "content": {"text/plain": {"schema": {"type": "string"}}}},
        ),
        "/": _get("The chat page.", {"description": "An HTML page.", "content": {"text/html": {"schema": {"type": "string"}}}}),
        "/openapi.json": _get(
            "This document.", {"description": "OpenAPI 3.1.", "content": {"application/json": {"schema": {"type": "object"}}}}
        ),
    }


@lru_cache(maxsize=1)
def openapi_document() -> dict:
    """Build the OpenAPI document (once per process)."""
    request_schema = ChatCompletionRequest.model_json_schema(ref_template=REF)
    schemas = {**request_schema.pop("$defs", {}), "ChatCompletionRequest": request_schema, **RESPONSE_SCHEMAS}
    return {
        "openapi": "3.1.0",
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "info": {"title": "corechat", "version": "1", "description": "An OpenAI-compatible chat server for CPUs."},
        "paths": _paths(),
        "components": {"schemas": schemas},
    }


@bp.get("/openapi.json")
def get_openapi_document():
    """Serve the OpenAPI document."""
    return jsonify(openapi_document())


def init_app(app) -> None:
    """Register the route of the document."""
    app.register_blueprint(bp)
