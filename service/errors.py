"""Typed API errors and the one place that renders them in OpenAI's error shape."""

import json
import logging
from http import HTTPStatus
from typing import Literal

from flask import jsonify
from pydantic import BaseModel, ConfigDict
from werkzeug.exceptions import HTTPException

log = logging.getLogger(__name__)


class ErrorDetail(BaseModel):
    """What went wrong, with OpenAI's `type`, `param` (the request field at fault) and `code`."""

    model_config = ConfigDict(strict=True, extra="forbid")

    message: str
    type: Literal["invalid_request_error", "authentication_error", "server_error"]
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error object; every non-2xx JSON response, and an error inside a stream, has this shape."""

    model_config = ConfigDict(strict=True, extra="forbid")

    error: ErrorDetail


class APIError(Exception):
    """An error a client sees, with OpenAI's `type`, `code` and `param`."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, headers=None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.code
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        """Return the OpenAI error object."""
        return ErrorResponse(error=ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code))


class InvalidRequest(APIError):
    """The request is malformed or asks for something out of range."""


class ContextLengthExceeded(InvalidRequest):
    """The prompt and the requested completion do not fit the context window."""

    code = "context_length_exceeded"


class Unauthorized(APIError):
    """No valid API key."""

    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class NotFound(APIError):
    """No such route or model."""

    status = 404
    code = "not_found"


# What a 503 tells clients: capacity frees up within about this many seconds.
RETRY_AFTER_SECONDS = 1


class Overloaded(APIError):
    """The worker cannot take the request now; the client should retry later."""

    status = 503
    type = "server_error"
    code = "overloaded"


class InternalError(APIError):
    """A fault of ours; the message says nothing of internals."""

    status = 500
    type = "server_error"
    code = "internal_error"


def error_response(error: APIError):
    """Render an APIError as an HTTP response."""
    response = jsonify(error.body().model_dump())
    response.status_code = error.status
    response.headers.update(error.headers)
    return response


def raw_error_response(error: APIError) -> bytes:
    """Render an APIError as a whole HTTP/1.1 response that closes the connection, for the errors
    the worker answers before (or instead of) the app: a request too slow, too large, malformed, or
    beyond the worker's capacity."""
    body = json.dumps(error.body().model_dump()).encode()
    head = [
        f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        # What the app adds to its own JSON replies (service/api/auth.py).
        "X-Content-Type-Options: nosniff",
        "Cache-Control: no-store",
        *(f"{name}: {value}" for name, value in error.headers.items()),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def handle_http_exception(exc: HTTPException):
    """Render werkzeug's own errors (404, 405, 413, ...) in OpenAI's shape."""
    error = APIError(exc.description or exc.name)
    error.status = exc.code or 500
    error.type = "invalid_request_error" if error.status < 500 else "server_error"
    error.code = exc.name.lower().replace(" ", "_")
    return error_response(error)


def handle_unexpected(exc: Exception):
    """Log a bug with its traceback; tell the client only that it happened."""
    log.exception("unhandled error")
    return error_response(InternalError("internal server error"))


def init_app(app) -> None:
    """Route every error through the OpenAI error shape (before any route is registered)."""
    # Flask would answer OPTIONS on every route with an empty 200 page, and a doubled slash
    # (/v1//chat/completions) with a 308 HTML redirect: both become 405 and 404 in OpenAI's shape.
    # CORS preflights are answered before routing (service/api/auth.py).
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False
    app.url_map.merge_slashes = False
    app.register_error_handler(APIError, error_response)
    app.register_error_handler(HTTPException, handle_http_exception)
    app.register_error_handler(Exception, handle_unexpected)
