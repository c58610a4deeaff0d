"""What corechat's worker (worker.py) does in its request threads, and as a request ends: run the app
within the send deadline, answer Gunicorn's own errors in OpenAI's shape, build the 503 of a full
worker, and give a finished request's place back before the connection waits for its next request."""

import errno
import time

from gunicorn.http import errors as gunicorn_errors
from gunicorn.workers.gthread import STOP_KEEPALIVE_LINGER

from ..errors import RETRY_AFTER_SECONDS
from ..observability.metrics import send_timeouts_total
from ..observability.request_record import CacheStatus
from .arrival import GUNICORN_ERRORS, MALFORMED, RefusedRequest, http_error


class RequestThreads:
    """The request-thread side of CorechatWorker (a mixin: it uses the worker's settings, places and log)."""

    def handle(self, conn):
        """Serve one request in a thread, remembering its connection for handle_error."""
        self.serving.conn = conn
        try:
            return super().handle(conn)
        finally:
            self.serving.conn = None

    def handle_request(self, req, conn):
        """Run the app, its response sent within the send deadline.

        The loop already answered any Expect: 100-continue before the body came. A response whose
        client has read none of it for SEND_TIMEOUT_SECONDS is cut: the kernel aborts the connection
        (TCP_USER_TIMEOUT, set at accept), the next send fails, and Gunicorn closing the app's
        iterator cancels the generation.
        """
        req._expected_100_continue = False
        # Gunicorn's max_keepalived: gthread counts its idle connections, this worker its waiting ones.
        if len(self.arriving) >= self.max_keepalived:
            req.force_close()
        try:
            return super().handle_request(req, conn)
        except OSError as error:
            if error.errno != errno.ETIMEDOUT:
                raise
            conn.send_timed_out = True
            self.log.info(
                "closed the connection of %s: it read nothing of its response for %g seconds (SEND_TIMEOUT_SECONDS)",
                conn.client, self.send_seconds,
            )
            send_timeouts_total.inc()
            return False

    def _keepalive_after(self, conn, keepalive):
        """Keep the connection when the response allows: the loop has read the request to its end, so
        a body the app left unread holds no bytes of the socket (gthread would drain it)."""
        return keepalive

    def handle_error(self, req, client, addr, exc):
        """Answer an error Gunicorn raised in a request thread in OpenAI's shape, not as an HTML page,
        and log it like any other response."""
        if isinstance(exc, gunicorn_errors.ParseException):
            status, code = GUNICORN_ERRORS.get(type(exc), MALFORMED)
            # The exception's text may quote a header value (an API key): only its kind is told.
            self.log.warning("refused a request from %s: %s", addr, type(exc).__name__)
            response = http_error(status, f"invalid HTTP request: {type(exc).__name__}", code)
        else:
            self.log.exception("error handling a request")
            status = 500
            response = http_error(status, "internal server error", "internal_error")
        try:
            client.sendall(response)
        except OSError:
            self.log.debug("could not send the error response")
        conn = getattr(self.serving, "conn", None)
        if conn is not None and conn.arrived is not None:
            self.log_answer(conn.arrived, status, len(response))

    def overloaded(self, reason: str = "") -> RefusedRequest:
        """Build the 503 of a request this worker has no room for."""
        return RefusedRequest(
            503,
            reason or f"all {self.places} request places of this worker are taken (MAX_RUNNING + MAX_QUEUE); "
                      "retry shortly",
            "overloaded",
            # Every chat response says whether the cache served it: this one never reached it.
            headers={"Retry-After": str(RETRY_AFTER_SECONDS), "X-Cache": CacheStatus.BYPASS},
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
        if conn.send_timed_out:
            # The kernel has aborted it: nothing left to linger for.
            self.close(conn)
        elif keepalive:
            idle_seconds = self.cfg.keepalive if self.alive else min(self.cfg.keepalive, STOP_KEEPALIVE_LINGER)
            self.await_request(conn, time.monotonic() + idle_seconds, idle=True, leftover=conn.leftover)
        else:
            self.linger(conn)
