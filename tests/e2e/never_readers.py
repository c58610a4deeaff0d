"""Clients that open streams and never read them, and probes that must be answered or refused at once
meanwhile: what the direct and the nginx tests of the send deadline share.

A connection is made by a `connect(source_address)` callable, plain TCP to Gunicorn or TLS to nginx,
so both tests run the same clients.
"""

import json
import socket
import ssl
import threading
import time
from collections.abc import Callable

from harness import COUNTING
from harness.loadgen import CHAT

# Above the 2 x (MAX_RUNNING + MAX_QUEUE) = 48 places of the default server.
NEVER_READING = 60
# A fresh request must be answered or refused well within this, whatever the never-readers do (the
# goal is 1 s; the bound only catches a request left waiting, on a loaded 2-core machine).
PROBE_LIMIT_SECONDS = 3.0
PROBE_INTERVAL_SECONDS = 1.0

# Makes a connection: (source address or None, timeout, receive buffer or None) -> socket.
Connect = Callable[[tuple[str, int] | None, float, int | None], socket.socket]


def open_tcp(port: int, source, timeout: float, receive_buffer: int | None) -> socket.socket:
    """Connect to a loopback port from a source address, with a receive buffer set before the handshake
    (so the window the client offers is that small from the start)."""
    sock = socket.socket()
    if receive_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    if source:
        sock.bind(source)
    sock.settimeout(timeout)
    sock.connect(("127.0.0.1", port))
    return sock


def plain(port: int) -> Connect:
    """Return a maker of TCP connections to a loopback port."""
    return lambda source, timeout, receive_buffer=None: open_tcp(port, source, timeout, receive_buffer)


def tls(port: int) -> Connect:
    """Return a maker of TLS connections to a loopback port (the test certificate is not checked)."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE

    def connect(source, timeout, receive_buffer=None):
        return context.wrap_socket(open_tcp(port, source, timeout, receive_buffer), server_hostname="localhost")

    return connect


def never_reading_stream(connect: Connect, body: dict) -> socket.socket:
    """Open a streamed chat request whose client offers a small receive window and never reads."""
    sock = connect(None, 30, 4096)
    encoded = json.dumps(body).encode()
    sock.sendall(CHAT + b"Cache-Control: no-cache\r\nContent-Length: %d\r\n\r\n%s" % (len(encoded), encoded))
    return sock


def status_of(connect: Connect, raw: bytes, source) -> int:
    """Send one request on a fresh connection and return its status (0 when none came in time)."""
    try:
        with connect(source, PROBE_LIMIT_SECONDS) as sock:
            sock.sendall(raw)
            head = b""
            while b"\r\n" not in head:
                chunk = sock.recv(64)
                if not chunk:
                    break
                head += chunk
            return int(head.split()[1]) if head.startswith(b"HTTP/") else 0
    except OSError:
        return 0


class Prober:
    """Send a fresh streamed chat request and a quick GET (a probe, /healthz, unless another path is
    given) every second, from `source`, in a thread; keep each one's status and how long it took."""

    def __init__(self, connect: Connect, source: tuple[str, int] | None = None, quick_path: str = "/healthz"):
        body = json.dumps({"messages": COUNTING, "max_tokens": 2, "stream": True}).encode()
        self.requests = {"chat": CHAT + b"Content-Length: %d\r\n\r\n%s" % (len(body), body),
                         "quick": b"GET %s HTTP/1.1\r\nHost: localhost\r\n\r\n" % quick_path.encode()}
        self.connect, self.source = connect, source
        self.answers: list[tuple[str, int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Prober":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(PROBE_INTERVAL_SECONDS):
            for kind, raw in self.requests.items():
                began = time.monotonic()
                status = status_of(self.connect, raw, self.source)
                self.answers.append((kind, status, time.monotonic() - began))

    def late_or_unanswered(self, allowed: dict[str, set[int]]) -> list[tuple[str, int, float]]:
        """Return the probes that got no allowed status, or got it later than PROBE_LIMIT_SECONDS."""
        return [answer for answer in self.answers
                if answer[1] not in allowed[answer[0]] or answer[2] > PROBE_LIMIT_SECONDS]
