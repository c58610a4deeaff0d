"""What a worker's event loop answers itself (503, 408, 413, 400, ...): the bytes it sends, and the
access-log entry that makes the answer visible like any other response.

Gunicorn writes the access log (and, with `statsd_host`, its request counters) from a response, a
request and a WSGI environ after each request the app served; the loop's answers never reach the
app, so they get small stand-ins with the fields the log reads.
"""

from dataclasses import dataclass, field
from datetime import timedelta
from http import HTTPStatus

from ..api.auth import cors_headers
from .arrival import ArrivingRequest, RefusedRequest, http_error

UNKNOWN = "-"


@dataclass
class LoggedResponse:
    """The parts of a Gunicorn response its access log reads."""

    status: str
    sent: int
    headers: list = field(default_factory=list)


@dataclass
class LoggedRequest:
    """The parts of a Gunicorn request its access log reads: the headers, named as Gunicorn names them."""

    headers: list


def render(refused: RefusedRequest, arriving: ArrivingRequest, cors_origins: frozenset[str]) -> bytes:
    """Render a refusal as a whole response; a page on an allowed origin may read it (and its Retry-After)."""
    origin = arriving.header(b"origin")
    headers = {**(refused.headers or {}), **cors_headers(origin.decode("latin-1") if origin else None, cors_origins)}
    return http_error(refused.status, refused.message, refused.code, headers)


def access_entry(arriving: ArrivingRequest, status: int, sent: int, seconds: float):
    """Return what Gunicorn's access log takes (response, request, environ, request time) for an answer of the loop."""
    method, target, protocol = UNKNOWN, UNKNOWN, UNKNOWN
    line = arriving.request_line()
    if line is not None:
        method, target, version = (part.decode("latin-1") for part in line)
        protocol = f"HTTP/{version}"
    headers = []
    if arriving.request is not None:
        headers = [(name.decode("latin-1").upper(), value.decode("latin-1"))
                   for name, value in arriving.request.headers.raw_items()]
    named = dict(headers)
    path, _, query = target.partition("?")
    client = arriving.conn.client
    environ = {
        "REQUEST_METHOD": method,
        "RAW_URI": target,
        "PATH_INFO": path,
        "QUERY_STRING": query,
        "SERVER_PROTOCOL": protocol,
        "REMOTE_ADDR": client[0] if isinstance(client, tuple) else str(client or UNKNOWN),
        "HTTP_USER_AGENT": named.get("USER-AGENT", UNKNOWN),
        "HTTP_REFERER": named.get("REFERER", UNKNOWN),
    }
    response = LoggedResponse(f"{status} {HTTPStatus(status).phrase}", sent)
    return response, LoggedRequest(headers), environ, timedelta(seconds=seconds)
