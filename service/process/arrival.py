"""A request while it arrives in a worker's event loop: framed by h11 until it is whole, or refused.

h11 (the HTTP/1.1 state machine under httpx and uvicorn) is the one parser that decides where a
request ends and what its body is, whatever its framing (Content-Length, or chunked with extensions
and trailers). What Gunicorn then parses in a request thread is rebuilt from what h11 decoded: the
request line and headers h11 accepted, without Transfer-Encoding, the decoded body and a
Content-Length for it. Gunicorn's own chunked reader never runs (it copies the rest of an in-memory
request for every chunk, quadratic in the chunk count), and nothing Gunicorn reads can be framed
differently from what the loop admitted.

Every byte a client can make a worker hold is bounded here: the head by MAX_HEAD_BYTES, the decoded
body by MAX_REQUEST_BYTES, and the chunked framing (size lines, extensions, CRLFs, trailers), which
costs parsing work without adding body, by FRAMING_BASE_BYTES plus one byte per FRAMING_BODY_SHARE
body bytes.
"""

import re
from dataclasses import dataclass

import h11
from gunicorn.http import errors as gunicorn_errors

from ..errors import APIError, raw_error_response

# h11 refuses a request head (request line and headers) larger than this with a 431; Gunicorn's own
# limits (a 4094-byte request line, fields of 8190 bytes) then apply to what passes. Empty lines
# before a request line count against it too.
MAX_HEAD_BYTES = 64 * 1024
# A chunked body may carry this much framing, plus one byte per FRAMING_BODY_SHARE bytes of body:
# chunks of 512 bytes or more fit any body, and a body of one-byte chunks is refused after a few
# hundred of them instead of costing the loop h11's work for a million.
FRAMING_BASE_BYTES = 4096
FRAMING_BODY_SHARE = 64
# h11 takes the bytes this many at a time, so the framing limit is checked before h11 has parsed
# more than this much past it.
FEED_BYTES = 4096
# The status and code a client gets for each error Gunicorn's parser raises; any other is a 400.
GUNICORN_ERRORS = {
    gunicorn_errors.LimitRequestLine: (414, "request_line_too_long"),
    gunicorn_errors.LimitRequestHeaders: (431, "request_headers_too_large"),
    gunicorn_errors.ExpectationFailed: (417, "expectation_failed"),
    gunicorn_errors.UnsupportedTransferCoding: (501, "unsupported_transfer_coding"),
    gunicorn_errors.ForbiddenProxyRequest: (403, "forbidden"),
}
MALFORMED = (400, "malformed_request")
# h11's own refusals: a malformed request, a head larger than MAX_HEAD_BYTES, a transfer coding
# other than chunked.
H11_ERRORS = {
    400: MALFORMED,
    431: GUNICORN_ERRORS[gunicorn_errors.LimitRequestHeaders],
    501: GUNICORN_ERRORS[gunicorn_errors.UnsupportedTransferCoding],
}
# h11's messages quote the offending line (`illegal header line: b'Authorization : Bearer sk-…'`):
# everything from the quoted bytes on is cut, so no header value reaches a log or a client.
QUOTED_BYTES = re.compile(r":? ?(?:bytearray\()?b['\"].*", re.DOTALL)
FRAMING_HEADERS = (b"content-length", b"transfer-encoding")
# A line of the head that starts with a space or tab continues the previous one (obs-fold). h11
# would join them; Gunicorn and nginx refuse them, and a proxy in front that does not join them
# reads different headers (a folded Transfer-Encoding, say): refused (RFC 9112 section 5.2 allows both).
OBS_FOLD = re.compile(rb"\n[ \t]")
# A request line, read from the raw head only for the access log of a head h11 refused.
REQUEST_LINE = re.compile(rb"([!-~]{1,32}) ([!-~]{1,8192}) HTTP/(\d\.\d)\r?\n")
LEADING_EMPTY_LINES = b"\r\n"


class RefusedRequest(Exception):
    """A request the worker answers itself, with an HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, code: str, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers


@dataclass(frozen=True)
class WholeRequest:
    """A request that arrived whole: its head rebuilt for Gunicorn, its decoded body, and the bytes
    the client sent after it (a pipelined request)."""

    head: bytes
    body: bytes
    leftover: bytes


def safe_message(error: h11.RemoteProtocolError) -> str:
    """Return h11's description of a protocol error without the bytes it quotes."""
    return QUOTED_BYTES.sub("", str(error)).strip() or "malformed request"


def rebuild_head(request: h11.Request, body_length: int) -> bytes:
    """Serialise the request line and headers h11 accepted, framed by a Content-Length for the
    decoded body (when the client framed a body at all), without Transfer-Encoding."""
    lines = [b"%s %s HTTP/%s" % (request.method, request.target, request.http_version)]
    framed = False
    for name, value in request.headers.raw_items():
        if name.lower() in FRAMING_HEADERS:
            framed = True
            continue
        lines.append(name + b": " + value)
    if framed:
        lines.append(b"Content-Length: %d" % body_length)
    return b"\r\n".join(lines) + b"\r\n\r\n"


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
        self.request: h11.Request | None = None
        self.body = bytearray()
        self.fed = 0
        self.head_bytes = 0
        # The raw bytes of the head while it arrives, to find obs-fold in (at most MAX_HEAD_BYTES and a piece).
        self.raw_head = bytearray()
        self.empty_line_bytes = 0
        # When its first byte arrived (the worker sets it): where the access log's request time starts.
        self.started_at: float | None = None
        self.admitted = False
        self.continued = False

    @property
    def method(self) -> bytes:
        """Return the request's method, or b"" before its head has arrived."""
        return self.request.method if self.request is not None else b""

    def take(self, data: bytes) -> WholeRequest | None:
        """Take bytes from the client (b"" at its end of file); return the request once it is whole,
        else None. Raise RefusedRequest for a request to refuse, and ConnectionError when the client
        closed before sending a whole one."""
        if not data:
            self.framing.receive_data(b"")
            return self._next_events(at_eof=True)
        if self.fed == 0:
            data = self._skip_empty_lines(data)
        for start in range(0, len(data), FEED_BYTES):
            piece = data[start : start + FEED_BYTES]
            if self.request is None:
                self.raw_head += piece
            self.framing.receive_data(piece)
            self.fed += len(piece)
            whole = self._next_events(at_eof=False)
            if whole is not None:
                rest = data[start + FEED_BYTES :]
                return WholeRequest(whole.head, whole.body, whole.leftover + rest) if rest else whole
            if self.request is not None:
                self._check_framing()
        return None

    def waits_for_continue(self) -> bool:
        """Tell whether the client waits for a 100 Continue before it sends the body, not yet sent."""
        return self.framing.they_are_waiting_for_100_continue and not self.continued

    def request_line(self) -> tuple[bytes, bytes, bytes] | None:
        """Return the method, target and HTTP version of the request, also of a head h11 refused
        (when its first line is well formed), or None."""
        if self.request is not None:
            return self.request.method, self.request.target, self.request.http_version
        match = REQUEST_LINE.match(self.raw_head)
        return match.groups() if match else None

    def header(self, name: bytes) -> bytes | None:
        """Return the value of a request header (its first occurrence), or None."""
        if self.request is not None:
            for header_name, value in self.request.headers:
                if header_name == name:
                    return value
        return None

    def _skip_empty_lines(self, data: bytes) -> bytes:
        """Drop empty lines before the request line, as RFC 9112 section 2.2 asks a server to."""
        rest = data.lstrip(LEADING_EMPTY_LINES)
        self.empty_line_bytes += len(data) - len(rest)
        if self.empty_line_bytes > MAX_HEAD_BYTES:
            raise RefusedRequest(400, "invalid HTTP request: only empty lines before the request line", MALFORMED[1])
        return rest

    def _next_events(self, *, at_eof: bool) -> WholeRequest | None:
        """Take h11's events until it needs more bytes; return the request once it ended."""
        while True:
            try:
                event = self.framing.next_event()
            except h11.RemoteProtocolError as error:
                if at_eof:
                    raise ConnectionError("the client closed its connection in the middle of a request") from None
                status, code = H11_ERRORS.get(error.error_status_hint, MALFORMED)
                raise RefusedRequest(status, f"invalid HTTP request: {safe_message(error)}", code) from None
            if event is h11.NEED_DATA:
                return None
            if isinstance(event, h11.Request):
                self.request = event
                self.head_bytes = self.fed - len(self.framing.trailing_data[0])
                self._check_head(event)
            elif isinstance(event, h11.Data):
                self.body += event.data
                if len(self.body) > self.max_body_bytes:
                    raise self._too_large()
            elif isinstance(event, h11.EndOfMessage):
                unprocessed, _closed = self.framing.trailing_data
                self._check_framing(pending=len(unprocessed))
                body = bytes(self.body)
                return WholeRequest(rebuild_head(self.request, len(body)), body, unprocessed)
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("the client closed its connection")

    def _check_head(self, request: h11.Request) -> None:
        """Refuse framing that is ambiguous, and a body announced larger than the limit (at once,
        before the client sends it)."""
        if OBS_FOLD.search(self.raw_head, 0, self.head_bytes):
            raise RefusedRequest(400, "invalid HTTP request: a header line continues onto the next (obs-fold)",
                                 MALFORMED[1])
        self.raw_head = bytearray()
        names = {name for name, _ in request.headers}
        if b"transfer-encoding" in names:
            # RFC 9112 section 6.1: with both, a proxy in front may have framed the request by the
            # other one; and an HTTP/1.0 message with Transfer-Encoding has faulty framing.
            if b"content-length" in names:
                raise RefusedRequest(400, "invalid HTTP request: both Content-Length and Transfer-Encoding",
                                     MALFORMED[1])
            if request.http_version == b"1.0":
                raise RefusedRequest(400, "invalid HTTP request: Transfer-Encoding in HTTP/1.0", MALFORMED[1])
        for name, value in request.headers:
            if name == b"content-length" and int(value) > self.max_body_bytes:
                raise self._too_large()

    def _check_framing(self, pending: int = 0) -> None:
        """Refuse a chunked body whose framing outgrows its allowance.

        h11 hands out body bytes as soon as it has them, so what it holds while it waits for more
        (`pending`, unless the request ended) is framing too: a size line or trailer still arriving.
        """
        framing_bytes = self.fed - pending - self.head_bytes - len(self.body)
        if framing_bytes > FRAMING_BASE_BYTES + len(self.body) // FRAMING_BODY_SHARE:
            raise RefusedRequest(
                413,
                f"the request's chunked framing (chunk sizes, extensions, trailers) is larger than this server's "
                f"limit of {FRAMING_BASE_BYTES} bytes plus one per {FRAMING_BODY_SHARE} bytes of body; "
                "send larger chunks, or a Content-Length",
                "request_too_large",
            )

    def _too_large(self) -> RefusedRequest:
        """Build the 413 naming the limit."""
        return RefusedRequest(
            413, f"the request body is larger than this server's limit of {self.max_body_bytes} bytes",
            "request_too_large",
        )


def http_error(status: int, message: str, code: str, headers: dict | None = None) -> bytes:
    """Render an error as a whole HTTP/1.1 response in OpenAI's error shape that closes the connection."""
    error = APIError(message, code=code, headers=headers)
    error.status = status
    error.type = "invalid_request_error" if status < 500 else "server_error"
    return raw_error_response(error)
