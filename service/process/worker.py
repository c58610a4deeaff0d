"""corechat's Gunicorn worker: requests arrive whole, and are admitted or refused, in the event loop.

Gunicorn's gthread worker hands a connection to a request thread as soon as its first byte arrives,
and the thread then waits for the rest: as many clients as a worker has threads, each sending half a
request, would hold all of them, and probes would time out behind them. Here the worker's selector
loop reads every request to its end (h11 frames it, arrival.py), within REQUEST_ARRIVAL_SECONDS and
the size limits, and only then gives a request thread what h11 decoded, rebuilt as one
Content-Length request that Gunicorn parses from memory before it runs the app. Keep-alive
connections wait in the same loop between requests.

Admission happens in the loop too, before any wait: a POST (a chat completion, the only request that
holds its thread for long: it streams, waits for a whole reply or follows an identical request; a
quick /tokenize or /detokenize is counted alike) takes one of the worker's MAX_RUNNING + MAX_QUEUE
places until its response ends, or is refused with a 503 at once when none is free, as soon as its
head has arrived (before a `100 Continue`, so a full worker never makes a client upload the body it
refuses). The worker has a thread per place plus
SPARE_HTTP_THREADS, so a request that got a place always gets a thread, and probes, scrapes and
other quick requests find a free one. A response whose client reads none of it for
SEND_TIMEOUT_SECONDS is cut, which cancels its generation and frees its place.

A worker starts accepting connections only once its engine is ready, so no request waits on a model
load; while it has nothing to do and another worker gathers streams, it leaves new connections to
that one (gathering.py). How a connection ends is closing.py's; what runs in a request thread,
request_threads.py's.
"""

import errno
import ipaddress
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial

from gunicorn import http
from gunicorn.workers.gthread import STOP_KEEPALIVE_LINGER, ThreadWorker

from ..settings import get_settings
from .arrival import (
    ArrivingRequest,
    RefusedRequest,
    WholeRequest,
)
from .closing import EXPIRY_CHECK_SECONDS, READ_BYTES, Connection, ConnectionEnds
from .gathering import DEFER_SECONDS, GATHER_REFRESH_SECONDS, Gathering
from .request_threads import RequestThreads

ACCEPT_BATCH = 16
BURST_ROUNDS = 8
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# Gunicorn settings that change how a request is read or routed, which this worker's own reading
# would silently contradict: (setting, the value it must keep, why).
UNSUPPORTED_SETTINGS = (
    ("proxy_protocol", "off", "the event loop reads plain HTTP/1.1 from the first byte"),
    ("casefold_http_method", False, "admission counts only an exact POST, and Flask would route a `post` as POST"),
    ("permit_unconventional_http_method", False, "admission counts only an exact POST"),
)


class CorechatWorker(RequestThreads, ConnectionEnds, ThreadWorker):
    """gthread, with whole requests read in the event loop and accepting deferred until the engine is ready."""

    @classmethod
    def check_config(cls, cfg, log):
        """Refuse at start the Gunicorn settings this worker cannot honour, saying which and why."""
        super().check_config(cfg, log)
        if cfg.is_ssl or cfg.protocol != "http" or cfg.http2_cleartext != "off":
            raise RuntimeError(
                "corechat's worker serves plain HTTP/1.1 only: terminate TLS and HTTP/2 in front of it "
                "(nginx), and leave Gunicorn's certfile, protocol and http2_cleartext at their defaults"
            )
        for name, required, reason in UNSUPPORTED_SETTINGS:
            if getattr(cfg, name) != required:
                raise RuntimeError(f"corechat's worker needs Gunicorn's {name} = {required!r}: {reason}")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        settings = get_settings()
        self.arrival_seconds = settings.request_arrival_seconds
        self.send_seconds = settings.send_timeout_seconds
        self.max_body_bytes = settings.max_request_bytes
        self.places = settings.request_places
        self.free_places = settings.request_places
        # Bodies still arriving may hold this much of the worker's memory together: as many whole
        # bodies as the worker has places, the most it could serve at once anyway.
        self.arriving_budget = settings.request_places * settings.max_request_bytes
        self.arriving_bytes = 0
        self.allowed_networks = settings.allowed_network_list
        self.cors_origins = settings.cors_origin_set
        self.arriving: dict[Connection, ArrivingRequest] = {}
        self.dispatched: deque[Connection] = deque()
        self.lingering: dict[Connection, tuple[float, int]] = {}
        self.open_for_requests = False
        self.stopped_listening = False
        self.next_expiry_check = 0.0
        self.serving = threading.local()
        self.max_running = settings.max_running
        # Set by the lifecycle when this worker gathers streams with the others (gathering.py): its
        # slot in the table, and whether its engine has little prompt work ahead.
        self.gathering: Gathering | None = None
        self.gather_room: Callable[[], bool] = lambda: True
        # Set by the lifecycle when this worker lends cores: the machine's load, read at every wake of
        # the loop, which wakes every idle_wake_seconds while idle (cores.py: SharedCores.sample_load).
        self.sample_load: Callable[[], None] = lambda: None
        self.idle_wake_seconds = 1.0
        self.accepting_again_at = 0.0

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
        """Accept connections only once the worker is open for requests, never once it stops, and not
        while it leaves them to a worker that gathers streams."""
        super().set_accept_enabled(enabled and self.open_for_requests and self.alive and not self.stopped_listening
                                   and time.monotonic() >= self.accepting_again_at)

    def handle_exit(self, sig, frame):
        """On SIGTERM, stop listening at once (in the event loop), then drain.

        On SIGTERM the master closes its listeners, but every worker holds inherited copies, so the
        kernel kept completing new connections into a backlog that no one would accept: clients hung
        until the worker exited and then got a reset. Closed, new connections are refused at once and
        go to another worker, host or (during a reload) the new master's workers, while the requests
        in flight finish within graceful_timeout.

        The handler interrupts the loop anywhere, even inside the poller's own bookkeeping, so it
        only asks the loop to stop listening: the wake-up it queues runs stop_listening there within
        one turn.
        """
        super().handle_exit(sig, frame)
        self.method_queue.defer(self.stop_listening)

    def stop_listening(self) -> None:
        """Take the listeners out of the poller, then close them (in the event loop).

        Closed while still registered, a listener inherited from the master stays in epoll (the
        master's copy keeps it open), and a connection waiting in its backlog woke the loop without
        end.
        """
        self.set_accept_enabled(False)
        self.stopped_listening = True
        self.publish_gathering()
        for listener in self.sockets:
            listener.close()

    # The event loop --------------------------------------------------------------------------

    def run(self):
        """Serve until told to stop, then let the requests in flight finish within graceful_timeout."""
        self.poller.register(self.method_queue.fileno(), selectors.EVENT_READ, self.method_queue.run_callbacks)
        while self.alive:
            self.notify()
            self.set_accept_enabled(self.nr_conns < self.worker_connections)
            # A worker that left connections to a gathering one looks at its listeners again soon,
            # and one with streams says again soon whether it gathers (its engine's state moves on);
            # an idle one that lends cores wakes every load window to read the machine's load.
            holding = self.gathering is not None and self.streams()
            timeout = GATHER_REFRESH_SECONDS if holding else self.idle_wake_seconds
            deferred = self.accepting_again_at - time.monotonic()
            self.wait_for_and_dispatch_events(timeout=min(timeout, deferred) if deferred > 0 else timeout)
            self.sample_load()
            self.publish_gathering()
            if not self.is_parent_alive():
                break
            self.expire_waiting()
        self.stop_listening()
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

    def accept(self, listener):
        """Accept the connections waiting (a few at most, so the workers share a burst) and read
        what each already sent."""
        # A listener's readiness may come in the same batch of events as the wake-up that closed it.
        if self.stopped_listening:
            return
        if self.gathering is None or self.streams():
            self.accept_some(listener)
            self.publish_gathering()
            return
        with self.gathering.deciding():
            if self.gathering.defers(idle=True):
                self.accepting_again_at = time.monotonic() + DEFER_SECONDS
                self.set_accept_enabled(False)
                return
            try:
                self.accept_some(listener)
            finally:
                self.publish_gathering()

    def accept_some(self, listener) -> None:
        """Accept up to ACCEPT_BATCH waiting connections and read what each already sent."""
        for _ in range(ACCEPT_BATCH):
            if self.nr_conns >= self.worker_connections:
                return
            try:
                client_sock, client_addr = listener.accept()
            except OSError as error:
                if error.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.ECONNABORTED):
                    raise
                return
            if not self.peer_allowed(client_addr):
                self.log.debug("closed a connection from %s, outside ALLOWED_NETWORKS", client_addr)
                client_sock.close()
                continue
            self.nr_conns += 1
            # The send deadline is the kernel's: a connection whose data has waited this long for the
            # client to acknowledge it, or to open a window closed by a client that reads nothing,
            # is aborted, and the next send fails with ETIMEDOUT. A send timeout would not do: the
            # kernel buffers megabytes of a stream before a send blocks, and Python waits for
            # readability before every recv on a socket with a timeout (the disconnect watch peeks).
            if client_sock.family in (socket.AF_INET, socket.AF_INET6):
                client_sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(self.send_seconds * 1000))
            conn = Connection(self.cfg, client_sock, client_addr, listener.getsockname())
            arriving = self.await_request(conn, time.monotonic() + self.arrival_seconds, idle=False)
            self.on_request_bytes(arriving, client_sock)

    def streams(self) -> int:
        """Return the POSTs this worker holds a place for or is reading, with the new connections whose
        method has not arrived yet (probes and scrapes are no streams once it has)."""
        reading = sum(1 for arriving in self.arriving.values()
                      if arriving.method == b"POST" or (not arriving.idle and not arriving.method))
        return self.places - self.free_places + reading

    def publish_gathering(self) -> None:
        """Tell the other workers whether this one gathers new streams: it is open, holds some and fewer
        than MAX_RUNNING, and its engine has little prompt work ahead."""
        if self.gathering is None:
            return
        open_ = self.open_for_requests and self.alive and not self.stopped_listening
        self.gathering.publish(open_ and 0 < self.streams() < self.max_running and self.gather_room())

    def peer_allowed(self, client) -> bool:
        """Tell whether a peer may connect: loopback (or a Unix socket, which has no address), or an
        address in ALLOWED_NETWORKS (an IPv4 peer of a dual-stack listener by its IPv4 address)."""
        if not isinstance(client, tuple):
            return True
        address = ipaddress.ip_address(client[0].partition("%")[0])
        address = getattr(address, "ipv4_mapped", None) or address
        return address.is_loopback or any(address in network for network in self.allowed_networks)

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
        if arriving.started_at is None and data:
            arriving.started_at = time.monotonic()
            if arriving.idle:
                arriving.idle = False
                arriving.deadline = arriving.started_at + self.arrival_seconds
        try:
            whole = self.frame(arriving, data)
            if self.arriving_bytes > self.arriving_budget:
                raise self.overloaded(f"request bodies still arriving fill this worker's {self.arriving_budget} bytes")
        except RefusedRequest as refused:
            self.log.warning("refused a request from %s: %s", arriving.conn.client, refused.message)
            self.refuse(arriving, refused)
            return
        except ConnectionError:
            self.close(arriving.conn)
            return
        if arriving.request is not None and not arriving.admitted:
            if not self.admit(arriving):
                return
        if whole is not None:
            self.dispatch(arriving, whole)
        elif arriving.waits_for_continue():
            arriving.continued = True
            self.send_now(arriving.conn, CONTINUE)

    def frame(self, arriving: ArrivingRequest, data: bytes) -> WholeRequest | None:
        """Give the bytes to the request's framing, counting the body bytes the worker holds for it."""
        held = len(arriving.body)
        try:
            return arriving.take(data)
        finally:
            self.arriving_bytes += len(arriving.body) - held

    def admit(self, arriving: ArrivingRequest) -> bool:
        """Refuse a POST as soon as its head has arrived when no place is free; tell whether it goes on.

        The place itself is taken when the whole request has arrived (dispatch): a slow upload holds
        none meanwhile.
        """
        if arriving.method == b"POST" and not self.free_places:
            self.refuse(arriving, self.overloaded())
            return False
        arriving.admitted = True
        return True

    def dispatch(self, arriving: ArrivingRequest, whole: WholeRequest) -> None:
        """Give a whole request to a request thread, parsed by Gunicorn from memory, never from the
        socket; a POST takes a place, or is refused when none is free."""
        conn = arriving.conn
        if arriving.method == b"POST":
            if not self.free_places:
                self.refuse(arriving, self.overloaded())
                return
            self.free_places -= 1
            conn.holds_place = True
        self.stop_waiting(conn)
        # What the access log may still need of the request is its head; its body went into `whole`.
        arriving.body.clear()
        conn.parser = http.get_parser(self.cfg, [whole.head, whole.body] if whole.body else [whole.head], conn.client)
        conn.leftover = whole.leftover
        conn.arrived = arriving
        conn.data_ready = True
        self.dispatched.append(conn)

    def wait_for_and_dispatch_events(self, timeout):
        """Handle what is ready, and what became ready meanwhile (a burst), then start the requests
        that became whole.

        Running request threads contend for the GIL with this loop, which would then refuse the
        rest of a burst only between their slices; started after the burst, they let the loop
        refuse all of it at once (test_admission.py holds refusals to its bound).
        """
        for burst_round in range(BURST_ROUNDS):
            events = self.poller.select(timeout if burst_round == 0 else 0)
            if not events:
                break
            for key, _ in events:
                key.data(key.fileobj)
        while self.dispatched:
            self.enqueue_req(self.dispatched.popleft())
