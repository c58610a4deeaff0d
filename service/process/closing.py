"""How corechat's worker (worker.py) ends a connection from its event loop: a refusal answered at once
and logged like any response, a drain before the close (lingering), the deadlines of requests that
arrive too slowly and of idle and lingering connections, and the close itself."""

import selectors
import socket
import time
from functools import partial

from gunicorn.workers.gthread import TConn

from ..observability.metrics import count_refused_by_worker
from .arrival import ArrivingRequest, RefusedRequest
from .refusal import access_entry, render

READ_BYTES = 64 * 1024
# After its last response a closing connection is drained this long (RFC 9112 section 9.6), so
# unread request bytes do not make the kernel reset it before the client has read the response.
LINGER_SECONDS = 2.0
LINGER_BYTES = 64 * 1024
EXPIRY_CHECK_SECONDS = 0.5


class Connection(TConn):
    """A client connection: whether its request holds a place, and the request it carries."""

    def __init__(self, cfg, sock, client, server):
        super().__init__(cfg, sock, client, server)
        self.holds_place = False
        self.leftover = b""
        self.arrived: ArrivingRequest | None = None
        self.send_timed_out = False


class ConnectionEnds:
    """The worker's ways to end connections, in its event loop (a mixin of CorechatWorker, whose
    poller, connection tables and counters it uses)."""

    def refuse(self, arriving: ArrivingRequest, refused: RefusedRequest) -> None:
        """Answer a request from the loop, log and count it like any response, and close the connection."""
        conn = arriving.conn
        self.stop_waiting(conn)
        response = render(refused, arriving, self.cors_origins)
        self.send_now(conn, response)
        line = arriving.request_line()
        if line is not None and line[0] == b"POST":
            count_refused_by_worker(refused.code)
        self.log_answer(arriving, refused.status, len(response))
        self.linger(conn)

    def log_answer(self, arriving: ArrivingRequest, status: int, sent: int) -> None:
        """Write an answer the app never saw to the access log (and statsd, when Gunicorn sends to it)."""
        started_at = arriving.started_at or time.monotonic()
        self.log.access(*access_entry(arriving, status, sent, time.monotonic() - started_at))

    def send_now(self, conn: Connection, data: bytes) -> None:
        """Send a short answer without blocking the loop (it fits an empty socket buffer)."""
        try:
            conn.sock.send(data)
        except OSError:
            self.log.debug("could not send to %s", conn.client)

    def linger(self, conn: Connection) -> None:
        """Close the connection once the client has read what was sent: shut our side, then drain."""
        try:
            conn.sock.setblocking(False)
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self.close(conn)
            return
        self.lingering[conn] = (time.monotonic() + LINGER_SECONDS, 0)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self.on_lingering_bytes, conn))

    def on_lingering_bytes(self, conn: Connection, _sock) -> None:
        """Discard what a closing connection still sends; close it at its end of file or past the cap."""
        try:
            data = conn.sock.recv(READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        deadline, drained = self.lingering[conn]
        if not data or drained + len(data) > LINGER_BYTES:
            self.close(conn)
        else:
            self.lingering[conn] = (deadline, drained + len(data))

    def expire_waiting(self) -> None:
        """Answer 408 to requests that took too long to arrive; close idle and lingering connections past their time."""
        now = time.monotonic()
        if now < self.next_expiry_check:
            return
        self.next_expiry_check = now + EXPIRY_CHECK_SECONDS
        for conn, arriving in list(self.arriving.items()):
            if arriving.deadline > now:
                continue
            if arriving.idle:
                self.close(conn)
            else:
                message = f"the request did not arrive within {self.arrival_seconds:g} seconds"
                self.log.info("refused a request from %s: %s", conn.client, message)
                self.refuse(arriving, RefusedRequest(408, message, "request_timeout"))
        for conn, (deadline, _drained) in list(self.lingering.items()):
            if deadline <= now:
                self.close(conn)

    def stop_waiting(self, conn: Connection) -> None:
        """Take a connection out of the loop's watch."""
        arriving = self.arriving.pop(conn, None)
        if arriving is not None:
            self.arriving_bytes -= len(arriving.body)
        self.lingering.pop(conn, None)
        try:
            self.poller.unregister(conn.sock)
        except (KeyError, ValueError):
            pass

    def close(self, conn: Connection) -> None:
        """Close a connection the loop watches or that a request thread is done with."""
        self.stop_waiting(conn)
        self.nr_conns -= 1
        conn.close()
