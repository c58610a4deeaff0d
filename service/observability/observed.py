"""Generations seen by the metrics: wrappers that pass the events through and count and time them.

The wrappers are event sources as the engine's Generation is (EventSource), so the serving class
and the cache read them unchanged and the engine needs no instrumentation of its own.
`EngineWork` wraps each generation the engine runs and counts its tokens; `ObservedGeneration`
wraps each request's source (the engine's or the cache's) and records what its client saw.
"""

import logging
import threading
import time

from ..engine import ChoiceEvent, ChoiceGroup, Event, EventSource, Failed, Finished, Generation, Started, TextDelta
from . import metrics
from .request_record import current_record

log = logging.getLogger(__name__)


def ms(seconds: float) -> str:
    """Format seconds as milliseconds for a log line."""
    return f"{seconds * 1000:.1f}"


class EngineWork(EventSource):
    """Count the tokens the engine processed for one generation, once, whoever reads it.

    A generation is read by its one request, or by the single-flight relay that feeds every request
    asking for the same reply: wrapping it here, not per request, counts the engine's work once.
    """

    def __init__(self, generation: Generation | ChoiceGroup):
        self.generation = generation
        self.sent_tokens = 0
        self._counted = False
        self._lock = threading.Lock()

    def next_event(self, timeout: float | None = None) -> Event | None:
        """Return the generation's next event (or None on timeout), counting its tokens at its end."""
        event = self.generation.next_event(timeout=timeout)
        # A choice's text counts as any text; a request's last event comes after its choices' ones.
        text = event.event if isinstance(event, ChoiceEvent) else event
        if isinstance(text, TextDelta):
            self.sent_tokens += len(text.token_ids)
        elif isinstance(event, Finished):
            # A continuation's forced tokens are in completion_tokens, but the engine processed them as prompt.
            forced = len(self.generation.forced_ids)
            # A reply of max_tokens 0 (a legacy completion's echo) had its prompt pass and no token.
            self._count(processed_prompt=event.completion_tokens > 0 or event.prompt_seconds > 0,
                        generated=max(0, event.completion_tokens - forced))
            metrics.speculative_tokens_total.labels("accepted").inc(event.accepted_draft_tokens)
            metrics.speculative_tokens_total.labels("rejected").inc(event.rejected_draft_tokens)
        elif isinstance(event, Failed):
            self._count(processed_prompt=self.sent_tokens > 0, generated=self.sent_tokens)
        return event

    def cancel(self) -> None:
        """Cancel the generation, counting what it sent: nobody may read its last event after this."""
        self.generation.cancel()
        self._count(processed_prompt=self.sent_tokens > 0, generated=self.sent_tokens)

    def _count(self, *, processed_prompt: bool, generated: int) -> None:
        """Add the generation's tokens to the engine's counters, the first time only."""
        with self._lock:
            if self._counted:
                return
            self._counted = True
        if processed_prompt:
            metrics.prompt_tokens_total.inc(len(self.generation.input_ids))
        metrics.generation_tokens_total.inc(generated)


class ObservedGeneration(EventSource):
    """Wrap an event source and record its request's latencies, tokens, gauges and outcome."""

    def __init__(self, source: EventSource, *, arrived_at: float):
        self.source = source
        self.arrived_at = arrived_at
        # The request is parsed, rendered, tokenized and looked up in the cache by the time it is wrapped.
        self.opened_at = time.monotonic()
        self.started = False
        self.queue_seconds = 0.0
        self.taken_at = 0.0
        self.first_text_at: float | None = None
        self.first_written_at: float | None = None
        self._ended = False
        self._lock = threading.Lock()
        metrics.requests_waiting.inc()

    def next_event(self, timeout: float | None = None) -> Event | None:
        """Return the source's next event (or None on timeout), recording what it tells."""
        if self.first_text_at is not None and self.first_written_at is None:
            # A stream asks for its next event once it has written the first text to the socket.
            self.first_written_at = time.monotonic()
        event = self.source.next_event(timeout=timeout)
        if isinstance(event, Started):
            self._start(event)
        elif isinstance(event, TextDelta) or (isinstance(event, ChoiceEvent) and isinstance(event.event, TextDelta)):
            if self.first_text_at is None:
                self.first_text_at = time.monotonic()
                metrics.time_to_first_token_seconds.observe(self.first_text_at - self.arrived_at)
        elif isinstance(event, Finished):
            self._finish(event)
        elif isinstance(event, Failed):
            self._end("internal_error")
        return event

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
            self.queue_seconds, self.taken_at = started.queue_seconds, started.taken_at
            metrics.queue_wait_seconds.observe(started.queue_seconds)

    def _finish(self, finished: Finished) -> None:
        """Record the engine's own timings and the reply's token counts, then end the request."""
        # The engine's token counters are EngineWork's; a reply this worker did not generate at all
        # (a cache hit, or a follower of another request's run) counts as replayed. The engine's
        # timing histograms take only replies the engine generated (a cache replay's timings are zeros).
        # A follower whose flight took over generating holds text this engine made: not replayed.
        if finished.cached and not getattr(self.source, "generated", False):
            metrics.replayed_prompt_tokens_total.inc(finished.prompt_tokens)
            metrics.replayed_generation_tokens_total.inc(finished.completion_tokens)
        # No completion tokens and no prompt time: the engine never ran the prompt (cancelled while queued).
        if finished.completion_tokens > 0 or finished.prompt_seconds > 0:
            if not finished.cached:
                metrics.prompt_processing_seconds.observe(finished.prompt_seconds)
            if self.first_text_at is None:
                # The reply had no text (an immediate EOS, or only held-back bytes): its first
                # token reached the client with this final event.
                metrics.time_to_first_token_seconds.observe(time.monotonic() - self.arrived_at)
        # The engine's decode time over the gaps between tokens, once per request: exact, cheap,
        # and blind to text held back for a stop string, which per-delta gaps would count.
        if finished.completion_tokens > 1 and not finished.cached:
            metrics.inter_token_latency_seconds.observe(finished.decode_seconds / (finished.completion_tokens - 1))
        if not finished.cached and self.first_text_at is not None:
            self._log_first_token(finished)
        self._end(finished.finish_reason)

    def _log_first_token(self, finished: Finished) -> None:
        """Log, at debug level, where the time until the first token went (docs/performance.md reads it)."""
        first_token = self.first_text_at - self.arrived_at
        # Split at the engine's own instants (submitted, taken), so the parts add up without overlap:
        # the request is submitted a little before this wrapper opens.
        submitted_at = self.taken_at - self.queue_seconds if self.taken_at else self.opened_at
        before_queue = submitted_at - self.arrived_at
        after_prompt = first_token - before_queue - self.queue_seconds - finished.prompt_seconds
        written = ms(self.first_written_at - self.first_text_at) if self.first_written_at else "-"
        log.debug(
            "first token timings (ms): first_token=%s before_queue=%s queue=%s prompt_pass=%s after_prompt_pass=%s "
            "first_write=%s prompt_tokens=%d cached_prompt_tokens=%d",
            ms(first_token), ms(before_queue), ms(self.queue_seconds), ms(finished.prompt_seconds),
            ms(after_prompt), written, finished.prompt_tokens, finished.cached_prompt_tokens,
        )

    def _end(self, outcome: str) -> None:
        """Release the request's gauge, count its outcome and duration, once."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            (metrics.requests_running if self.started else metrics.requests_waiting).dec()
        metrics.request_duration_seconds.observe(time.monotonic() - self.arrived_at)
        metrics.requests_total.labels(outcome).inc()


def observe(source: EventSource) -> ObservedGeneration:
    """Wrap a generation (or any event source) so its events feed the request metrics."""
    record = current_record()
    record.observed = True
    return ObservedGeneration(source, arrived_at=record.arrived_at)
