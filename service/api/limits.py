"""Input limits: how large a body, how many messages and how many prompt tokens one request may send."""

from flask import Flask, current_app, request
from werkzeug.exceptions import RequestEntityTooLarge

from ..errors import APIError, InvalidRequest, error_response
from ..settings import Settings


class PayloadTooLarge(APIError):
    """The request body is larger than this server accepts."""

    status = 413
    code = "request_too_large"


def check_message_count(message_count: int, settings: Settings) -> None:
    """Refuse a conversation with more messages than configured, before rendering it."""
    if message_count > settings.max_messages:
        raise InvalidRequest(
            f"the request has {message_count} messages, above this server's limit of {settings.max_messages}",
            param="messages",
            code="too_many_messages",
        )


def check_prompt_text(prompt: str, param: str = "messages") -> None:
    """Refuse text that is not Unicode, such as a lone surrogate from a JSON "\\ud800" escape.

    JSON lets a client escape half of a UTF-16 pair; Python keeps it in the string, and the
    tokenizer, which needs real UTF-8, would fail on it deep inside the engine.
    """
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(
            f"'{param}' contains a lone UTF-16 surrogate escape (\\ud800-\\udfff), which is not a character",
            param=param,
        ) from None


def check_prompt_tokens(prompt_tokens: int, settings: Settings, param: str = "messages") -> None:
    """Refuse a prompt longer than the configured cap (the context window is checked elsewhere)."""
    if settings.max_prompt_tokens and prompt_tokens > settings.max_prompt_tokens:
        raise InvalidRequest(
            f"the prompt has {prompt_tokens} tokens, above this server's limit of {settings.max_prompt_tokens}",
            param=param,
            code="prompt_too_long",
        )


def read_request_body() -> bytes:
    """Return the request body, or raise 413 if it is larger than the configured limit.

    Werkzeug refuses a too-large Content-Length at once, but a chunked body it silently cuts at the
    limit; one more byte from the server's stream tells a body of exactly the limit from a longer one.
    """
    limit = current_app.config["MAX_CONTENT_LENGTH"]
    data = request.get_data(cache=False)
    if len(data) >= limit and request.environ["wsgi.input"].read(1):
        raise _too_large(limit)
    return data


def _too_large(limit: int) -> PayloadTooLarge:
    """Build the 413 error naming the limit."""
    return PayloadTooLarge(f"the request body is larger than this server's limit of {limit} bytes")


def init_app(app: Flask, settings: Settings) -> None:
    """Cap request bodies (with or without Content-Length) and answer an oversized one with a 413."""
    limit = settings.max_request_bytes
    app.config["MAX_CONTENT_LENGTH"] = limit

    def refuse_large_body(_exc: RequestEntityTooLarge):
        """Name the limit in OpenAI's error shape."""
        return error_response(_too_large(limit))

    app.register_error_handler(RequestEntityTooLarge, refuse_large_body)
