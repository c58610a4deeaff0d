"""Request framing through real Gunicorn, byte for byte over raw sockets, with every setting at its
default: what the app sees is what one parser decoded, every way of framing a request that two
parsers could read differently is refused, each refusal is logged like any response, and parsing
costs CPU in proportion to the bytes.

The reference is h11 run here on the same bytes: for each request the server serves, the app (the
real app plus tests/e2e/echo_app.py's /echo route) must see exactly the body and headers h11 decodes.
"""

import hashlib
import json
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import h11
import pytest

from service.api.nesting import MAX_JSON_DEPTH
from service.process.arrival import FRAMING_BASE_BYTES, FRAMING_BODY_SHARE
from service.settings import Settings
from tests.support import wait_until

DEFAULTS = Settings.model_construct()
SECRET = "sk-framing-test-secret-0123456789"
CLOSE = b"Connection: close\r\n"
SMUGGLED = b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def server(gunicorn):
    """Gunicorn with its defaults on the echo app, sending its request counters to a statsd socket here."""
    statsd = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    # Every request of the module sends datagrams: room for them all, or a full buffer drops the
    # ones a test looks for.
    statsd.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
    statsd.bind(("127.0.0.1", 0))
    statsd.setblocking(False)
    server = gunicorn(app="tests.e2e.echo_app:app")
    server.env["GUNICORN_CMD_ARGS"] = f"--statsd-host=127.0.0.1:{statsd.getsockname()[1]}"
    server.statsd = statsd
    with server:
        yield server
    statsd.close()


def post(headers: bytes, body: bytes, *, version: bytes = b"1.1", target: bytes = b"/echo") -> bytes:
    """Build a raw POST with these framing headers and body bytes, closing the connection after it."""
    return b"POST %s HTTP/%s\r\nHost: test\r\nX-Case: framing\r\n%s%s\r\n%s" % (target, version, headers, CLOSE, body)


def chunked(*pieces: bytes, extension: bytes = b"", trailer: bytes = b"") -> bytes:
    """Frame pieces as a chunked body, each size line carrying the extension, ended by the trailer."""
    sized = b"".join(b"%x%s\r\n%s\r\n" % (len(piece), extension, piece) for piece in pieces)
    return sized + b"0\r\n" + trailer + b"\r\n"


def exchange(port: int, raw: bytes, timeout: float = 30) -> bytes:
    """Send raw bytes on a fresh connection (in a thread, so a server that stops reading does not
    stall us) and return everything the server sent until it closed the connection."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)

    def send():
        """Send everything the server will take."""
        try:
            sock.sendall(raw)
        except OSError:
            pass  # the server refused the request and closed before reading it all

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    received = bytearray()
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass  # a refused request's unread bytes reset the connection once its answer was sent
    sender.join(timeout)
    sock.close()
    return bytes(received)


@dataclass
class Reply:
    """One response the server sent."""

    status: int
    headers: dict
    body: bytes

    def json(self) -> dict:
        """Return the body as JSON."""
        return json.loads(self.body)


def parse_replies(data: bytes) -> list[Reply]:
    """Split what a server sent into its final responses (skipping 1xx), with h11 as a client."""
    replies = []
    while data:
        client = h11.Connection(h11.CLIENT)
        client.send(h11.Request(method="POST", target="/", headers=[("Host", "test"), ("Content-Length", "0")]))
        client.send(h11.EndOfMessage())
        client.receive_data(data)
        client.receive_data(b"")
        reply = None
        while True:
            event = client.next_event()
            if isinstance(event, h11.Response):
                headers = {name.decode().lower(): value.decode() for name, value in event.headers}
                reply = Reply(event.status_code, headers, b"")
            elif isinstance(event, h11.Data):
                reply.body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
        replies.append(reply)
        data = client.trailing_data[0]
    return replies


@dataclass
class Decoded:
    """A request as the reference parser decodes it."""

    method: str
    headers: list[tuple[str, str]]
    body: bytes


def reference_decode(raw: bytes) -> list[Decoded]:
    """Decode raw bytes with h11 as a server, one request after another, skipping the empty lines
    RFC 9112 section 2.2 lets a server ignore before a request line."""
    requests = []
    raw = raw.lstrip(b"\r\n")
    while raw:
        server = h11.Connection(h11.SERVER)
        server.receive_data(raw)
        request, body = None, bytearray()
        while True:
            event = server.next_event()
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
        headers = [(name.decode(), value.decode("latin-1")) for name, value in request.headers.raw_items()]
        requests.append(Decoded(request.method.decode(), headers, bytes(body)))
        raw = server.trailing_data[0].lstrip(b"\r\n")
    return requests


# Framings a client may use: the app must see exactly what h11 decodes.
ACCEPTED = {
    "content-length": post(b"Content-Length: 5\r\n", b"hello"),
    "the same content-length twice": post(b"Content-Length: 5\r\nContent-Length: 5\r\n", b"hello"),
    "chunked": post(b"Transfer-Encoding: chunked\r\n", chunked(b"hel", b"lo, ", b"world")),
    "chunked, coding name in capitals": post(b"Transfer-Encoding: Chunked\r\n", chunked(b"hello")),
    "chunk extensions": post(b"Transfer-Encoding: chunked\r\n", chunked(b"hello", b"world", extension=b';a=1;b="x;y"')),
    "trailers, which never become headers": post(
        b"Transfer-Encoding: chunked\r\n", chunked(b"hello", trailer=b"X-Trailer: t\r\nContent-Type: text/evil\r\n")
    ),
    "empty chunked body": post(b"Transfer-Encoding: chunked\r\n", chunked()),
    "bare LF line ends in the head":
        b"POST /echo HTTP/1.1\nHost: test\nX-Case: framing\nContent-Length: 5\nConnection: close\n\nhello",
    "an empty line before the request line": b"\r\n" + post(b"Content-Length: 5\r\n", b"hello"),
    "one-byte chunks within the framing allowance": post(
        b"Transfer-Encoding: chunked\r\n", chunked(*[b"%d" % (i % 10) for i in range(FRAMING_BASE_BYTES // 6)])
    ),
    "chunks of 512 bytes, a body at the size limit": post(
        b"Transfer-Encoding: chunked\r\n",
        chunked(*[bytes([65 + i % 26]) * 512 for i in range(DEFAULTS.max_request_bytes // 512)]),
    ),
    "a body of exactly the size limit":
        post(b"Content-Length: %d\r\n" % DEFAULTS.max_request_bytes, b"z" * DEFAULTS.max_request_bytes),
}


def assert_app_saw(reply: Reply, decoded: Decoded) -> None:
    """Check the echo of a request against the reference decoding of the same bytes."""
    assert reply.status == 200, (reply.status, reply.body[:300])
    seen = reply.json()
    assert seen["body_length"] == len(decoded.body)
    assert seen["body_sha256"] == hashlib.sha256(decoded.body).hexdigest()
    assert seen["content_length"] == str(len(decoded.body))
    headers = {name.lower(): value for name, value in seen["headers"].items()}
    assert "transfer-encoding" not in headers and "x-trailer" not in headers
    for name, value in decoded.headers:
        if name.lower() not in ("content-length", "transfer-encoding", "connection"):
            assert headers[name.lower()] == value, (name, headers)


@pytest.mark.parametrize("raw", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_the_app_sees_exactly_what_the_reference_parser_decodes(server, raw):
    (reply,) = parse_replies(exchange(server.port, raw))
    (decoded,) = reference_decode(raw)
    assert_app_saw(reply, decoded)


def test_pipelined_requests_after_chunked_ones_are_each_seen_as_decoded(server):
    keep = post(b"Transfer-Encoding: chunked\r\n", chunked(b"first", trailer=b"X-T: 1\r\n")).replace(CLOSE, b"")
    second = post(b"Content-Length: 6\r\n", b"second").replace(CLOSE, b"")
    raw = keep + b"\r\n" + second + post(b"Transfer-Encoding: chunked\r\n", chunked(b"third", extension=b";x"))
    replies = parse_replies(exchange(server.port, raw))
    decoded = reference_decode(raw)
    assert len(replies) == len(decoded) == 3
    for reply, request in zip(replies, decoded):
        assert_app_saw(reply, request)


# Framings two parsers may read differently, or that cost more than their body: refused, and nothing
# after them on the connection is served (it could be a request smuggled past a proxy).
REFUSED = {
    "content-length and transfer-encoding":
        (post(b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n", b"0\r\n\r\n"), 400),
    "two different content-lengths": (post(b"Content-Length: 5\r\nContent-Length: 6\r\n", b"hello!"), 400),
    "a folded header line (obs-fold)": (post(b"Transfer-Encoding:\r\n chunked\r\n", chunked(b"hello")), 400),
    "a folded content-length": (post(b"X-Note: a\r\n Content-Length: 99\r\nContent-Length: 5\r\n", b"hello"), 400),
    "chunked in HTTP/1.0": (post(b"Transfer-Encoding: chunked\r\n", chunked(b"hello"), version=b"1.0"), 400),
    "a chunk size that is not hex": (post(b"Transfer-Encoding: chunked\r\n", b"zz\r\nhello\r\n0\r\n\r\n"), 400),
    "a bare LF after a chunk size": (post(b"Transfer-Encoding: chunked\r\n", b"5\nhello\r\n0\r\n\r\n"), 400),
    "a transfer coding other than chunked": (post(b"Transfer-Encoding: gzip, chunked\r\n", chunked(b"hello")), 501),
    "one-byte chunks at the body size limit": (
        post(b"Transfer-Encoding: chunked\r\n", chunked(*[b"x"] * DEFAULTS.max_request_bytes)), 413,
    ),
    "a chunk extension of 60 KB":
        (post(b"Transfer-Encoding: chunked\r\n", chunked(b"hello", extension=b";" + b"e" * 60_000)), 413),
    "a head over 64 KiB":
        (post(b"".join(b"X-Field-%d: %s\r\n" % (i, b"h" * 7000) for i in range(10)) + b"Content-Length: 0\r\n", b""),
         431),
    "only empty lines, more than 64 KiB of them": (b"\r\n" * 40_000 + post(b"Content-Length: 0\r\n", b""), 400),
    "a body over the size limit, chunked": (
        post(b"Transfer-Encoding: chunked\r\n", chunked(*[b"y" * 65536] * (DEFAULTS.max_request_bytes // 65536 + 1))),
        413,
    ),
}


@pytest.mark.parametrize(("raw", "status"), REFUSED.values(), ids=REFUSED.keys())
def test_ambiguous_or_costly_framing_is_refused_and_nothing_after_it_is_served(server, raw, status):
    replies = parse_replies(exchange(server.port, raw.replace(CLOSE, b"") + SMUGGLED))
    assert [reply.status for reply in replies] == [status], [(reply.status, reply.body[:200]) for reply in replies]
    error = replies[0].json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert replies[0].headers["connection"] == "close"


def test_refusing_a_body_of_one_byte_chunks_costs_no_more_than_its_allowance(server):
    """A 1 MiB body in one-byte chunks (6 MiB on the wire) is refused after its framing allowance:
    the worker parses a few KiB of it, not a million chunks."""
    raw = post(b"Transfer-Encoding: chunked\r\n", chunked(*[b"x"] * DEFAULTS.max_request_bytes))
    before = worker_cpu_seconds(server)
    (reply,) = parse_replies(exchange(server.port, raw))
    spent = worker_cpu_seconds(server) - before
    assert reply.status == 413
    assert str(FRAMING_BODY_SHARE) in reply.json()["error"]["message"]
    # Parsing the whole body took h11 tens of seconds of CPU; the refusal, a few milliseconds.
    assert spent < 2.0, spent


def test_an_error_ends_the_connection_and_a_pipelined_request_is_not_served(server):
    bad = b"GET /healthz HTTP/1.1\r\nHost: test\r\nBad Header\r\n\r\n"
    replies = parse_replies(exchange(server.port, bad + SMUGGLED + SMUGGLED))
    assert [reply.status for reply in replies] == [400]


def test_empty_lines_before_a_kept_alive_request_are_ignored(server):
    first = b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n"
    last = b"GET /healthz HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
    replies = parse_replies(exchange(server.port, b"\r\n" + first + b"\r\n" + first + b"\n\r\n" + last))
    assert [reply.status for reply in replies] == [200, 200, 200]


def test_a_body_the_app_refuses_unread_costs_no_drain_and_the_connection_serves_on(server):
    """A 415 leaves a 1 MiB body unread by the app; the loop has read it to its end, so the next
    pipelined request is answered at once, without Gunicorn draining the body again."""
    body = b"x" * DEFAULTS.max_request_bytes
    refused = b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: text/plain\r\n" \
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    last = b"GET /healthz HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
    replies = parse_replies(exchange(server.port, refused + refused + last))
    assert [reply.status for reply in replies] == [415, 415, 200]


def test_a_key_in_a_malformed_header_never_reaches_the_log_or_the_client(server):
    raw = (b"POST /echo HTTP/1.1\r\nHost: test\r\nAuthorization : Bearer %s\r\nContent-Length: 2\r\n\r\n{}"
           % SECRET.encode())
    (reply,) = parse_replies(exchange(server.port, raw))
    assert reply.status == 400 and "illegal header line" in reply.json()["error"]["message"]
    assert SECRET.encode() not in reply.body
    assert wait_until(lambda: '"POST /echo HTTP/1.1" 400' in server.log(), timeout=10)
    assert SECRET not in server.log()


def statsd_datagrams(server) -> list[str]:
    """Return the statsd datagrams Gunicorn sent so far."""
    datagrams = getattr(server, "datagrams", [])
    while True:
        try:
            datagrams.append(server.statsd.recv(65536).decode())
        except BlockingIOError:
            break
    server.datagrams = datagrams
    return datagrams


def test_the_loops_own_answers_are_in_the_access_log_and_statsd(server):
    statsd_datagrams(server)  # what earlier tests sent, read before the buffer could fill
    refusals = {
        400: post(b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n", b"0\r\n\r\n", target=b"/echo?case=both"),
        413: post(b"Content-Length: %d\r\n" % (DEFAULTS.max_request_bytes + 1), b"", target=b"/echo?case=large"),
        501: post(b"Transfer-Encoding: gzip\r\n", b"", target=b"/echo?case=gzip"),
    }
    for status, raw in refusals.items():
        (reply,) = parse_replies(exchange(server.port, raw))
        assert reply.status == status
    for status, case in ((400, "both"), (413, "large"), (501, "gzip")):
        line = f'"POST /echo?case={case} HTTP/1.1" {status}'
        assert wait_until(lambda line=line: line in server.log(), timeout=10), server.log()[-2000:]
        assert wait_until(lambda status=status: any(f"gunicorn.request.status.{status}:1|c" in datagram
                                                     for datagram in statsd_datagrams(server)), timeout=10)


def worker_cpu_seconds(server) -> float:
    """Return the CPU time (user and system) the server's workers have used."""
    total = 0
    for pid in server.worker_pids():
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / CLOCK_TICKS


def cpu_of_chunked_posts(server, body_bytes: int, count: int) -> float:
    """Return the workers' CPU time for `count` POSTs of a body sent in 512-byte chunks."""
    raw = post(b"Transfer-Encoding: chunked\r\n", chunked(*[b"c" * 512] * (body_bytes // 512)))
    before = worker_cpu_seconds(server)
    for _ in range(count):
        (reply,) = parse_replies(exchange(server.port, raw))
        assert reply.status == 200 and reply.json()["body_length"] == body_bytes
    return worker_cpu_seconds(server) - before


def test_a_chunked_body_costs_cpu_in_proportion_to_its_size(server):
    """Four times the chunks cost about four times the CPU. Gunicorn's chunked reader, which copied
    the rest of the request for every chunk, made it sixteen; the bound catches that, not a figure."""
    small = cpu_of_chunked_posts(server, DEFAULTS.max_request_bytes // 4, count=12)
    large = cpu_of_chunked_posts(server, DEFAULTS.max_request_bytes, count=12)
    assert large < 8 * max(small, 1 / CLOCK_TICKS), (small, large)


def tool_call_conversation(arguments: str) -> bytes:
    """Return a chat request whose assistant turn called a tool with these arguments."""
    return json.dumps({
        "messages": [
            {"role": "user", "content": "Look it up."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "look_up", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "found"},
        ],
        "max_tokens": 1,
    }).encode()


def nested_arrays(depth: int) -> str:
    """Return JSON arrays nested `depth` deep."""
    return "[" * depth + "]" * depth


def post_chat(server, data: bytes) -> Reply:
    """POST JSON bytes as a chat request on a fresh connection and return the reply."""
    raw = b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n" \
          b"Content-Length: %d\r\n%s\r\n%s" % (len(data), CLOSE, data)
    (reply,) = parse_replies(exchange(server.port, raw))
    return reply


DEPTHS = [MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 100_000]


@pytest.mark.parametrize("depth", DEPTHS)
def test_tool_call_arguments_nested_past_the_depth_limit_get_400(server, depth):
    # The arguments object is one level, the arrays in it the others.
    reply = post_chat(server, tool_call_conversation('{"a": ' + nested_arrays(depth - 1) + "}"))
    if depth <= MAX_JSON_DEPTH:
        assert reply.status == 200, reply.body[:300]
    else:
        assert reply.status == 400, reply.body[:300]
        error = reply.json()["error"]
        assert error["param"] == "messages[1].tool_calls[0].function.arguments"
        assert f"deeper than {MAX_JSON_DEPTH} levels" in error["message"]


@pytest.mark.parametrize("depth", DEPTHS)
def test_request_bodies_nested_past_the_depth_limit_get_400(server, depth):
    # The body, `tools`, a tool, its function and its parameters are five levels; the arrays the others.
    body = ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "tools": [{"type": "function", '
            '"function": {"name": "f", "parameters": {"type": "object", "x": ' + nested_arrays(depth - 5) + "}}}]}")
    reply = post_chat(server, body.encode())
    if depth <= MAX_JSON_DEPTH:
        assert reply.status == 200, reply.body[:300]
    else:
        assert reply.status == 400, reply.body[:300]
        assert f"nested deeper than {MAX_JSON_DEPTH} levels" in reply.json()["error"]["message"]
