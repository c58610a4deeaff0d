"""A request while it arrives in a worker's event loop: framed by h11 until it is whole, or refused.

h11 (the HTTP/1.1 state machine under httpx and uvicorn) knows where a request ends, whatever its framing (Content-Length,
chunked with extensions and trailers), and which bytes are malformed; the worker then gives Gunicorn
exactly the bytes of one request. Imported by Gunicorn's master with the worker class: no Flask or
torch at the top.
"""

import h11
from gunicorn.http import errors as gunicorn_errors

# h11 refuses a request head (request line and headers) larger than this with a 431; Gunicorn's own
# limits (a 4094-byte request line, fields of 8190 bytes) then apply to what passes.
MAX_HEAD_BYTES = 64 * 1024
# The status and code a client gets for each error Gunicorn's parser raises; any other is a 400.
GUNICORN_ERRORS = {
    gunicorn_errors.LimitRequestLine: (414, "request_line_too_long"),
    gunicorn_errors.LimitRequestHeaders: (431, "request_headers_too_large"),
    gunicorn_errors.ExpectationFailed: (417, "expectation_failed"),
    gunicorn_errors.UnsupportedTransferCoding: (501, "unsupported_transfer_coding"),
    gunicorn_errors.ForbiddenProxyRequest: (403, "forbidden"),
}
MALFORMED = (400, "malformed_request")
# h11's own refusals: a malformed request, or a head larger than MAX_HEAD_BYTES.
H11_ERRORS = {400: MALFORMED, 431: GUNICORN_ERRORS[gunicorn_errors.LimitRequestHeaders]}


class RefusedRequest(Exception):
    """A request the worker answers itself, with an HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, code: str, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers


class ArrivingRequest:
    """A request while its bytes arrive: h11 frames them, and the worker dispatches it once whole."""

    def __init__(self, conn, deadline: float, *, idle: bool, max_body_bytes: int):
        self.conn = conn
        self.deadline = deadline
        # A kept-alive connection that has sent nothing yet is idle: it is closed quietly at its
        # deadline (the keep-alive timeout), where a request begun and not finished gets a 408.
        self.idle = idle
        self.max_body_bytes = max_body_bytes
        self.framing = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.received = bytearray()
        self.method = b""
        self.body_bytes = 0
        self.continued = False

    def take(self, data: bytes) -> tuple[bytes, bytes] | None:
        """Take bytes from the client (b"" at its end of file); return (request, bytes after it) once
        the request is whole, else None. Raise RefusedRequest for a request to refuse, and
        ConnectionError when the client closed before sending a whole one."""
        self.received += data
        self.framing.receive_data(data)
        while True:
            try:
                event = self.framing.next_event()
            except h11.RemoteProtocolError as error:
                if not data:
                    raise ConnectionError("the client closed its connection in the middle of a request") from None
                status, code = H11_ERRORS.get(error.error_status_hint, MALFORMED)
                raise RefusedRequest(status, f"invalid HTTP request: {error}", code) from None
            if event is h11.NEED_DATA:
                return None
            if isinstance(event, h11.Request):
                self.method = event.method
                self._check_length(event)
            elif isinstance(event, h11.Data):
                self.body_bytes += len(event.data)
                if self.body_bytes > self.max_body_bytes:
                    raise self._too_large()
            elif isinstance(event, h11.EndOfMessage):
                unprocessed, _closed = self.framing.trailing_data
                end = len(self.received) - len(unprocessed)
                return bytes(self.received[:end]), bytes(unprocessed)
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("the client closed its connection")

    def waits_for_continue(self) -> bool:
        """Tell whether the client waits for a 100 Continue before it sends the body, not yet sent."""
        return self.framing.they_are_waiting_for_100_continue and not self.continued

    def _check_length(self, request: h11.Request) -> None:
        """Refuse at once a body announced larger than the limit, before the client sends it."""
        for name, value in request.headers:
            if name == b"content-length" and int(value) > self.max_body_bytes:
                raise self._too_large()

    def _too_large(self) -> RefusedRequest:
        """Build the 413 naming the limit."""
        return RefusedRequest(
            413, f"the request body is larger than this server's limit of {self.max_body_bytes} bytes", "request_too_large"
        )


def http_error(status: int, message: str, code: str, headers: dict | None = None) -> bytes:
    """Render an error as a whole HTTP/1.1 response in OpenAI's error shape that closes the connection."""
    # Here, not at the top: the errors module imports Flask, which Gunicorn's master does without.
    from .errors import APIError, raw_error_response

    error = APIError(message, code=code, headers=headers)
    error.status = status
    error.type = "invalid_request_error" if status < 500 else "server_error"
    return raw_error_response(error)
