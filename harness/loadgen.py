"""Many HTTP/1.1 exchanges at once from one thread, each on its own connection, timed as they happen.

A thread per client would put the test's own GIL contention into every latency it measures; one
selector loop sends and reads all of them, and h11 (the client side of the library the server uses
to frame requests) reads the responses, 1xx included.
"""

import json
import selectors
import socket
import time
from dataclasses import dataclass, field

import h11

from harness.sse import sse_payloads


@dataclass
class Exchange:
    """One request on a connection of its own, and what came back.

    `raw` replaces the request h11 would write: a test sends exactly those bytes (a partial body, a
    malformed chunk) and the exchange then waits for whatever the server answers.
    """

    target: str
    method: str = "POST"
    body: bytes = b""
    headers: tuple = ()
    raw: bytes | None = None
    half_close: bool = False
    start_after: float = 0.0
    sent_at: float | None = None
    informational: list = field(default_factory=list)
    status: int | None = None
    status_at: float | None = None
    response_headers: dict = field(default_factory=dict)
    received: bytearray = field(default_factory=bytearray)
    ended_at: float | None = None
    error: str | None = None

    @property
    def seconds_to_status(self) -> float:
        """Return the time from sending the request to the status line of the final response."""
        return self.status_at - self.sent_at

    def json(self) -> dict:
        """Return the response body as JSON."""
        return json.loads(bytes(self.received))

    def sse_payloads(self) -> list:
        """Return the data payloads of an SSE response, DONE last."""
        return sse_payloads(bytes(self.received))


CHAT = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
# Each way a client can leave a worker waiting for the rest of its request.
STALLS = {
    "headers never ended": CHAT,
    "12 of 1000 body bytes": CHAT + b"Content-Length: 1000\r\n\r\n" + b'{"messages":',
    "Expect: 100-continue, then no body": CHAT + b"Content-Length: 1000\r\nExpect: 100-continue\r\n\r\n",
    "chunked body without its last chunk":
        CHAT + b"Transfer-Encoding: chunked\r\n\r\nc\r\n" + b'{"messages":' + b"\r\n",
}
STALLED_PER_KIND = 20  # more than any worker's request threads once spread over 2 workers


def raw_exchange(raw: bytes, **fields) -> Exchange:
    """Build an exchange that sends exactly `raw`."""
    return Exchange("/v1/chat/completions", raw=raw, **fields)


def chat_exchange(body: dict, **fields) -> Exchange:
    """Build a chat completion exchange that opts out of the response cache."""
    return Exchange(
        "/v1/chat/completions",
        body=json.dumps(body).encode(),
        headers=(("Content-Type", "application/json"), ("Cache-Control", "no-cache")),
        **fields,
    )


def probe_exchanges(targets: tuple[str, ...], every: float, during: float, start_after: float = 0.0) -> list[Exchange]:
    """Build GETs of the targets in turn, one every `every` seconds for `during` seconds."""
    count = int(during / every)
    return [Exchange(targets[i % len(targets)], "GET", start_after=start_after + i * every) for i in range(count)]


class _Connection:
    """The client side of one exchange: its socket, its h11 state and its bytes still to send."""

    def __init__(self, exchange: Exchange, address: tuple[str, int]):
        self.exchange = exchange
        self.h11 = h11.Connection(h11.CLIENT)
        headers = [("Host", f"{address[0]}:{address[1]}"), ("Connection", "close"), *exchange.headers]
        if exchange.method == "POST":
            headers.append(("Content-Length", str(len(exchange.body))))
        request = self.h11.send(h11.Request(method=exchange.method, target=exchange.target, headers=headers))
        body = self.h11.send(h11.Data(data=exchange.body)) if exchange.body else b""
        end = self.h11.send(h11.EndOfMessage())
        self.outgoing = exchange.raw if exchange.raw is not None else request + body + end
        self.sock = socket.socket()
        self.sock.setblocking(False)
        self.sock.connect_ex(address)

    def on_writable(self) -> bool:
        """Send what remains; return whether everything was sent."""
        try:
            sent = self.sock.send(self.outgoing)
        except BlockingIOError:
            return False
        except OSError as error:
            self.outgoing = b""
            self.fail(f"{type(error).__name__}: {error}")
            return True
        if self.exchange.sent_at is None:
            self.exchange.sent_at = time.monotonic()
        self.outgoing = self.outgoing[sent:]
        if not self.outgoing and self.exchange.half_close:
            self.sock.shutdown(socket.SHUT_WR)
        return not self.outgoing

    def on_readable(self) -> bool:
        """Read and parse what arrived; return whether the exchange ended."""
        try:
            data = self.sock.recv(65536)
        except BlockingIOError:
            return False
        except OSError as error:
            return self.fail(f"{type(error).__name__}: {error}")
        self.h11.receive_data(data)
        try:
            return self._take_events()
        except h11.RemoteProtocolError as error:
            return self.fail(f"bad response: {error}")

    def _take_events(self) -> bool:
        """Record the events h11 has; return whether the response ended."""
        exchange = self.exchange
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                return False
            if isinstance(event, h11.InformationalResponse):
                exchange.informational.append(event.status_code)
            elif isinstance(event, h11.Response):
                exchange.status, exchange.status_at = event.status_code, time.monotonic()
                exchange.response_headers = {name.decode(): value.decode() for name, value in event.headers}
            elif isinstance(event, h11.Data):
                exchange.received += event.data
            elif isinstance(event, h11.EndOfMessage):
                exchange.ended_at = time.monotonic()
                return True
            elif isinstance(event, h11.ConnectionClosed):
                return self.fail("closed before a whole response")
            else:
                return self.fail(f"unexpected {event!r}")

    def fail(self, error: str) -> bool:
        """Record why the exchange ended without a whole response; return True (it ended)."""
        self.exchange.error = error
        self.exchange.ended_at = time.monotonic()
        return True


def run_exchanges(port: int, exchanges: list[Exchange], timeout: float, host: str = "127.0.0.1") -> None:
    """Run every exchange, each starting `start_after` seconds in, until all end or timeout passes.

    An exchange still open at the timeout gets error "timeout".
    """
    selector = selectors.DefaultSelector()
    waiting = sorted(exchanges, key=lambda exchange: exchange.start_after)
    began = time.monotonic()
    deadline = began + timeout
    open_connections = 0
    while (waiting or open_connections) and time.monotonic() < deadline:
        now = time.monotonic()
        while waiting and began + waiting[0].start_after <= now:
            connection = _Connection(waiting.pop(0), (host, port))
            selector.register(connection.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, connection)
            open_connections += 1
        wait = min(0.05, max(0.0, began + waiting[0].start_after - now)) if waiting else 0.05
        for key, mask in selector.select(wait):
            connection = key.data
            if mask & selectors.EVENT_WRITE and connection.on_writable():
                selector.modify(connection.sock, selectors.EVENT_READ, connection)
            if mask & selectors.EVENT_READ and connection.exchange.ended_at is None:
                connection.on_readable()
            if connection.exchange.ended_at is not None:
                selector.unregister(connection.sock)
                connection.sock.close()
                open_connections -= 1
    for key in list(selector.get_map().values()):
        key.data.fail("timeout")
        key.fileobj.close()
    for exchange in waiting:
        exchange.error = "not started before the timeout"
    selector.close()
