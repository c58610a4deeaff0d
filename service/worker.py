"""corechat's Gunicorn worker: requests arrive whole, and are admitted or refused, in the event loop.

Gunicorn's gthread worker hands a connection to a request thread as soon as its first byte arrives,
and the thread then waits for the rest: sixteen clients that send half a request held every thread
of a worker, and probes timed out behind them. Here the worker's selector loop reads every request
to its end (h11 frames it: headers, Content-Length or chunked body, Expect: 100-continue), within
REQUEST_ARRIVAL_SECONDS and MAX_REQUEST_BYTES, and only then gives the bytes to a request thread,
where Gunicorn parses them again from memory and runs the app. Keep-alive connections wait in the
same loop between requests.

Admission happens in the loop too, before any wait: a POST (a chat completion, the only request that
holds its thread for long: it streams, waits for a whole reply or follows an identical request) takes
one of the worker's MAX_RUNNING + MAX_QUEUE places until its response ends, or is refused with a 503
at once when none is free. The worker has a thread per place plus SPARE_HTTP_THREADS, so a request
that got a place always gets a thread, and probes, scrapes and other quick requests find a free one.

A worker starts accepting connections only once its engine is ready, so no request waits on a model
load. This module is imported by Gunicorn's master (it resolves the worker class), so it imports
neither Flask nor torch at the top.
"""

import errno
import selectors
import socket
import threading
import time
from collections import deque
from functools import partial

from gunicorn import http
from gunicorn.http import errors as gunicorn_errors
from gunicorn.workers.gthread import STOP_KEEPALIVE_LINGER, TConn, ThreadWorker

from .arrival import GUNICORN_ERRORS, MALFORMED, ArrivingRequest, RefusedRequest, http_error
from .settings import get_settings

READ_BYTES = 64 * 1024
ACCEPT_BATCH = 16
BURST_ROUNDS = 8
# After its last response a closing connection is drained this long (RFC 9112 section 9.6), so
# unread request bytes do not make the kernel reset it before the client has read the response.
LINGER_SECONDS = 2.0
LINGER_BYTES = 64 * 1024
EXPIRY_CHECK_SECONDS = 0.5
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class Connection(TConn):
    """A client connection: whether its request holds a place, and what the client sent after it."""

    def __init__(self, cfg, sock, client, server):
        super().__init__(cfg, sock, client, server)
        self.holds_place = False
        self.leftover = b""


def count_refusal(code: str) -> None:
    """Count a chat request the worker refused in the metrics (in the worker, after fork)."""
    from .metrics import count_refused_by_worker

    count_refused_by_worker(code)


class CorechatWorker(ThreadWorker):
    """gthread, with whole requests read in the event loop and accepting deferred until the engine is ready."""

    @classmethod
    def check_config(cls, cfg, log):
        """Refuse the protocols this worker does not frame itself (TLS, HTTP/2, uwsgi)."""
        super().check_config(cfg, log)
        if cfg.is_ssl or cfg.protocol != "http" or cfg.http2_cleartext != "off":
            raise RuntimeError(
                "corechat's worker serves plain HTTP/1.1 only: terminate TLS and HTTP/2 in front of it "
                "(nginx), and leave Gunicorn's certfile, protocol and http2_cleartext at their defaults"
            )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        settings = get_settings()
        self.arrival_seconds = settings.request_arrival_seconds
        self.max_body_bytes = settings.max_request_bytes
        self.places = settings.request_places
        self.free_places = settings.request_places
        self.arriving: dict[Connection, ArrivingRequest] = {}
        self.dispatched: deque[Connection] = deque()
        self.lingering: dict[Connection, tuple[float, int]] = {}
        self.open_for_requests = False
        self.next_expiry_check = 0.0

    # Readiness ------------------------------------------------------------------------------

    def open_when(self, settled, on_open) -> None:
        """Accept connections once settled() returns (it blocks; run in a thread), then call on_open
        when settled() returned True.

        Until then the worker heartbeats and accepts nothing, so no request waits on a model load;
        the kernel hands connections to the workers that accept.
        """

        def wait_then_open():
            """Wait in a thread, then open in the event loop."""
            ready = settled()
            self.method_queue.defer(self._open, on_open if ready else None)

        threading.Thread(target=wait_then_open, name="corechat-open", daemon=True).start()

    def _open(self, on_open) -> None:
        """Start accepting connections (in the event loop)."""
        self.open_for_requests = True
        self.set_accept_enabled(self.nr_conns < self.worker_connections)
        if on_open is not None:
            on_open()

    def set_accept_enabled(self, enabled):
        """Accept connections only once the worker is open for requests, and never once it stops."""
        super().set_accept_enabled(enabled and self.open_for_requests and self.alive)

    def handle_exit(self, sig, frame):
        """On SIGTERM, close this worker's listening sockets at once, then drain.

        On SIGTERM the master closes its listeners, but every worker holds inherited copies, so the
        kernel kept completing new connections into a backlog that no one would accept: clients hung
        until the worker exited and then got a reset. Closed here, new connections are refused at
        once and go to another worker, host or (during a reload) the new master's workers, while the
        requests in flight finish within graceful_timeout.

        The socket itself is closed, not Gunicorn's wrapper (which would drop it): an accept the
        loop had already polled for then fails with EBADF, which accept() expects, instead of
        crashing the worker and cutting its streams.
        """
        for listener in self.sockets:
            listener.sock.close()
        super().handle_exit(sig, frame)

    # The event loop --------------------------------------------------------------------------

    def run(self):
        """Serve until told to stop, then let the requests in flight finish within graceful_timeout."""
        self.poller.register(self.method_queue.fileno(), selectors.EVENT_READ, self.method_queue.run_callbacks)
        while self.alive:
            self.notify()
            self.set_accept_enabled(self.nr_conns < self.worker_connections)
            self.wait_for_and_dispatch_events(timeout=1.0)
            if not self.is_parent_alive():
                break
            self.expire_waiting()
        self.set_accept_enabled(False)
        # A request a client may already be sending on a kept-alive connection is still answered
        # (with "Connection: close"); idle connections close soon after.
        linger_until = time.monotonic() + STOP_KEEPALIVE_LINGER
        for arriving in self.arriving.values():
            if arriving.idle:
                arriving.deadline = min(arriving.deadline, linger_until)
        graceful_deadline = time.monotonic() + self.cfg.graceful_timeout
        while self.nr_conns > 0 and time.monotonic() < graceful_deadline:
            self.notify()
            self.wait_for_and_dispatch_events(timeout=EXPIRY_CHECK_SECONDS)
            self.expire_waiting()
        for conn in [*self.arriving, *self.lingering]:
            self.close(conn)
        self.tpool.shutdown(wait=False)
        self.poller.close()
        self.method_queue.close()
        for listener in self.sockets:
            listener.close()

    def accept(self, listener):
        """Accept the connections waiting (a few at most, so the workers share a burst) and read
        what each already sent."""
        for _ in range(ACCEPT_BATCH):
            if self.nr_conns >= self.worker_connections:
                return
            try:
                client_sock, client_addr = listener.accept()
            except OSError as error:
                # EBADF: SIGTERM closed the listener between the poll and this call.
                if error.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.ECONNABORTED, errno.EBADF):
                    raise
                return
            self.nr_conns += 1
            conn = Connection(self.cfg, client_sock, client_addr, listener.getsockname())
            arriving = self.await_request(conn, time.monotonic() + self.arrival_seconds, idle=False)
            self.on_request_bytes(arriving, client_sock)

    def await_request(self, conn: Connection, deadline: float, *, idle: bool, leftover: bytes = b"") -> ArrivingRequest:
        """Read the connection's next request in the loop, starting from bytes already received."""
        arriving = ArrivingRequest(conn, deadline, idle=idle, max_body_bytes=self.max_body_bytes)
        self.arriving[conn] = arriving
        conn.sock.setblocking(False)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self.on_request_bytes, arriving))
        if leftover:
            self.take_bytes(arriving, leftover)
        return arriving

    def on_request_bytes(self, arriving: ArrivingRequest, _sock) -> None:
        """Read what the client sent (the connection is readable)."""
        try:
            data = arriving.conn.sock.recv(READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        self.take_bytes(arriving, data)

    def take_bytes(self, arriving: ArrivingRequest, data: bytes) -> None:
        """Frame the bytes; dispatch a whole request, refuse a bad one, or wait for more."""
        if arriving.idle and data:
            arriving.idle = False
            arriving.deadline = time.monotonic() + self.arrival_seconds
        try:
            whole = arriving.take(data)
        except RefusedRequest as refused:
            self.log.warning("refused a request from %s: %s", arriving.conn.client, refused.message)
            self.refuse(arriving, refused)
            return
        except ConnectionError:
            self.close(arriving.conn)
            return
        if whole is not None:
            self.dispatch(arriving, *whole)
        elif arriving.waits_for_continue():
            arriving.continued = True
            self.send_now(arriving.conn, CONTINUE)

    def dispatch(self, arriving: ArrivingRequest, request: bytes, leftover: bytes) -> None:
        """Give a whole request to a request thread, parsed by Gunicorn from memory, never from the
        socket; a POST first takes a place, or is refused when none is free."""
        conn = arriving.conn
        if arriving.method == b"POST":
            if not self.free_places:
                self.refuse(arriving, self.overloaded())
                return
            self.free_places -= 1
            conn.holds_place = True
        self.stop_waiting(conn)
        conn.parser = http.get_parser(self.cfg, [request], conn.client)
        conn.leftover = leftover
        conn.data_ready = True
        self.dispatched.append(conn)

    def wait_for_and_dispatch_events(self, timeout):
        """Handle what is ready, and what became ready meanwhile (a burst), then start the requests
        that became whole.

        Running request threads contend for the GIL with this loop, which then refused the rest of
        a burst only between their slices: with 72 requests at once per worker, the last refusals
        came after 0.9 s. Started after the burst, they let the loop refuse it within tens of ms.
        """
        for burst_round in range(BURST_ROUNDS):
            events = self.poller.select(timeout if burst_round == 0 else 0)
            if not events:
                break
            for key, _ in events:
                key.data(key.fileobj)
        while self.dispatched:
            self.enqueue_req(self.dispatched.popleft())

    def handle_request(self, req, conn):
        """Run the app; the loop already answered any Expect: 100-continue before the body came."""
        req._expected_100_continue = False
        return super().handle_request(req, conn)

    def handle_error(self, req, client, addr, exc):
        """Answer an error Gunicorn raised in a request thread in OpenAI's shape, not as an HTML page."""
        if isinstance(exc, gunicorn_errors.ParseException):
            status, code = GUNICORN_ERRORS.get(type(exc), MALFORMED)
            self.log.warning("refused a request from %s: %s", addr, exc)
            response = http_error(status, f"invalid HTTP request: {exc}", code)
        else:
            self.log.exception("error handling a request")
            response = http_error(500, "internal server error", "internal_error")
        try:
            client.sendall(response)
        except OSError:
            self.log.debug("could not send the error response")

    def overloaded(self) -> RefusedRequest:
        """Build the 503 of a POST that found every place of this worker taken."""
        # Imported here: the constant's module imports Flask (see http_error).
        from .errors import RETRY_AFTER_SECONDS

        return RefusedRequest(
            503,
            f"all {self.places} request places of this worker are taken (MAX_RUNNING + MAX_QUEUE); retry shortly",
            "overloaded",
            # Every chat response says whether the cache served it: this one never reached it.
            headers={"Retry-After": str(RETRY_AFTER_SECONDS), "X-Cache": "bypass"},
        )

    def finish_request(self, conn, fs):
        """After a response (in the loop): give back its place, then wait for the next request on
        the connection, or close it."""
        if conn.holds_place:
            conn.holds_place = False
            self.free_places += 1
        try:
            keepalive = not fs.cancelled() and fs.result()
        except Exception:
            keepalive = False
        # Bytes Gunicorn's parser left unread mean it framed the request differently from h11: the
        # next request's start is unknown, so the connection closes.
        if keepalive and not conn.parser.unreader.take_buffered():
            idle_seconds = self.cfg.keepalive if self.alive else min(self.cfg.keepalive, STOP_KEEPALIVE_LINGER)
            self.await_request(conn, time.monotonic() + idle_seconds, idle=True, leftover=conn.leftover)
        else:
            self.linger(conn)

    # Closing ---------------------------------------------------------------------------------

    def refuse(self, arriving: ArrivingRequest, refused: RefusedRequest) -> None:
        """Answer a request from the loop, count it if it was a chat request, and close the connection."""
        conn = arriving.conn
        self.stop_waiting(conn)
        self.send_now(conn, http_error(refused.status, refused.message, refused.code, refused.headers))
        if arriving.method == b"POST":
            count_refusal(refused.code)
        self.linger(conn)

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
        self.arriving.pop(conn, None)
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
