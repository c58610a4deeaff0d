"""A generation seen by the metrics: it passes the engine's events through and times them.

The wrapper has the interface of the engine's Generation (`next_event`, `events`, `cancel`), so the
serving class streams from it unchanged and the engine needs no instrumentation of its own.
"""

import threading
import time

from . import metrics
from .engine import Failed, Finished, Started, TextDelta, events_until_last


class ObservedGeneration:
    """Wrap an event source and record its request's latencies, tokens, gauges and outcome."""

    def __init__(self, source, *, arrived_at: float):
        self.source = source
        self.arrived_at = arrived_at
        self.started = False
        self.first_text_at: float | None = None
        self._ended = False
        self._lock = threading.Lock()
        metrics.requests_waiting.inc()

    def next_event(self, timeout: float | None = None):
        """Return the source's next event (or None on timeout), recording what it tells."""
        event = self.source.next_event(timeout=timeout)
        if isinstance(event, Started):
            self._start(event)
        elif isinstance(event, TextDelta):
            if self.first_text_at is None:
                self.first_text_at = time.monotonic()
                metrics.time_to_first_token_seconds.observe(self.first_text_at - self.arrived_at)
        elif isinstance(event, Finished):
            self._finish(event)
        elif isinstance(event, Failed):
            self._end("internal_error")
        return event

    def events(self):
        """Yield every event up to and including the last one."""
        return events_until_last(self)

    def cancel(self) -> None:
        """Cancel the source; a request that had not ended counts as cancelled."""
        self.source.cancel()
        self._end("cancelled")

    def _start(self, started: Started) -> None:
        """Move the request from waiting to running."""
        with self._lock:
            if self._ended or self.started:
                return
            self.started = True
            metrics.requests_waiting.dec()
            metrics.requests_running.inc()
        # A cache replay never queued for an engine; its zero would drag the engine's queue times down.
        if not started.cached:
            metrics.queue_wait_seconds.observe(started.queue_seconds)

    def _finish(self, finished: Finished) -> None:
        """Record the engine's own timings and the reply's token counts, then end the request."""
        # Token counters follow the usage every response reports, cached or not; the engine's timing
        # histograms take only replies the engine generated (a cache replay's timings are zeros).
        # No completion tokens: the engine never ran the prompt (cancelled while queued).
        if finished.completion_tokens > 0:
            if not finished.cached:
                metrics.prompt_processing_seconds.observe(finished.prompt_seconds)
            metrics.prompt_tokens_total.inc(finished.prompt_tokens)
            if self.first_text_at is None:
                # The reply had no text (an immediate EOS, or only held-back bytes): its first
                # token reached the client with this final event.
                metrics.time_to_first_token_seconds.observe(time.monotonic() - self.arrived_at)
        # The engine's decode time over the gaps between tokens, once per request: exact, cheap,
        # and blind to text held back for a stop string, which per-delta gaps would count.
        if finished.completion_tokens > 1 and not finished.cached:
            metrics.inter_token_latency_seconds.observe(finished.decode_seconds / (finished.completion_tokens - 1))
        metrics.generation_tokens_total.inc(finished.completion_tokens)
        self._end(finished.finish_reason)

    def _end(self, outcome: str) -> None:
        """Release the request's gauge, count its outcome and duration, once."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            (metrics.requests_running if self.started else metrics.requests_waiting).dec()
        metrics.request_duration_seconds.observe(time.monotonic() - self.arrived_at)
        metrics.requests_total.labels(outcome).inc()
