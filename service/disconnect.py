"""Notice a client that hung up while it waits for a whole (non-streamed) reply.

A stream learns of a gone client when a write fails (each token or `: ping`), and its generator's
`finally` cancels the generation. A non-streamed reply writes nothing until the end, so without this
a client that gave up would keep an engine slot busy until its last token.
"""

import logging
import socket

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25


def client_gone(environ) -> bool:
    """Tell whether the client closed its connection, peeking at the socket Gunicorn exposes."""
    sock = environ.get("gunicorn.socket")
    if sock is None:  # not under Gunicorn (Flask's test client): nothing to watch
        return False
    try:
        # A readable socket that yields no bytes is at end of file: the client closed it.
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class WatchedSource:
    """An engine event source that cancels itself when the client's connection closes."""

    def __init__(self, source, environ):
        self.source = source
        self.environ = environ

    def next_event(self, timeout: float | None = None):
        """Return the source's next event."""
        return self.source.next_event(timeout)

    def cancel(self) -> None:
        """Cancel the source."""
        self.source.cancel()

    def events(self):
        """Yield every event up to the last, cancelling the source once the client is gone."""
        from .engine import Failed, Finished  # here, not at the top: the master loads torch only when preloading

        cancelled = False
        while True:
            event = self.source.next_event(timeout=POLL_SECONDS)
            if not cancelled and client_gone(self.environ):
                log.info("client closed the connection; cancelling its generation")
                self.source.cancel()
                cancelled = True
            if event is None:
                continue
            yield event
            if isinstance(event, (Finished, Failed)):
                return
