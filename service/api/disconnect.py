"""Notice a client that hung up while it waits for a whole (non-streamed) reply.

A stream learns of a gone client when a write fails (each token or `: ping`), and its generator's
`finally` cancels the generation. A non-streamed reply writes nothing until the end, so without this
a client that gave up would keep an engine slot busy until its last token.

A client that only shut down its sending side (a half-close) still reads, and must get its reply;
at end of file the two look the same. A write tells them apart: a fully closed peer answers it with
a reset. The write is an interim `100 Continue`, which HTTP/1.1 clients must accept and skip
(RFC 9110, 15.2), sent before Gunicorn has written anything of the response (the watch runs while
the view waits for the reply). HTTP/1.0 has no 1xx responses: there, end of file means gone.
"""

import logging
import socket
import time
from collections.abc import Iterator

from ..engine import Event, EventSource, Failed, Finished

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25
# A half-closed client gets one probe now and then, so a later full close is still noticed.
PROBE_SECONDS = 2.0
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class ClientWatch:
    """Tell whether the client of a request went away, from the socket Gunicorn exposes."""

    def __init__(self, environ):
        self.sock = environ.get("gunicorn.socket")  # None outside Gunicorn (Flask's test client)
        self.can_probe = environ.get("SERVER_PROTOCOL") != "HTTP/1.0"
        self.probed_at: float | None = None

    def gone(self) -> bool:
        """Tell whether the client closed its connection (not only its sending side)."""
        if self.sock is None:
            return False
        try:
            if self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                return True  # the reset a probe drew from a closed peer
            if self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b"":
                return False  # the client's next request, already sent
        except BlockingIOError:
            return False
        except OSError:
            return True
        return not self.can_probe or self._probe()

    def _probe(self) -> bool:
        """Write a 100 Continue now and then to a client at end of file; tell whether the write failed."""
        now = time.monotonic()
        if self.probed_at is not None and now - self.probed_at < PROBE_SECONDS:
            return False
        self.probed_at = now
        try:
            self.sock.send(CONTINUE, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True
        return False


class WatchedSource(EventSource):
    """An event source that cancels itself when the client's connection closes."""

    def __init__(self, source: EventSource, environ):
        self.source = source
        self.client = ClientWatch(environ)

    def next_event(self, timeout: float | None = None) -> Event | None:
        """Return the source's next event."""
        return self.source.next_event(timeout)

    def cancel(self) -> None:
        """Cancel the source."""
        self.source.cancel()

    def events(self) -> Iterator[Event]:
        """Yield every event up to the last, cancelling the source once the client is gone."""
        cancelled = False
        while True:
            event = self.source.next_event(timeout=POLL_SECONDS)
            if not cancelled and self.client.gone():
                log.info("client closed the connection; cancelling its generation")
                self.source.cancel()
                cancelled = True
            if event is None:
                continue
            yield event
            if isinstance(event, (Finished, Failed)):
                return
