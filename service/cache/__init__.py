"""The response cache: reproducible replies stored and replayed in their original chunks.

Identical requests in flight at once cost one generation (single-flight): the first one leads and
publishes its pieces as the engine produces them, the others follow live and take over if the leader
goes away. Redis shares all of this across workers and hosts; without REDIS_URL each worker keeps its
own in-process store with the same behaviour. Any store failure fails open: the request is served
uncached and the store is left alone for a short while.
"""

import contextlib
import logging
import math
import time
import uuid

from ..engine import Failed, Finished, Started, TextDelta, events_until_last
from .. import metrics
from ..errors import APIError
from .entries import (
    CachedReply,
    cache_key,
    flight_key,
    is_complete,
    is_reproducible,
    lock_key,
    reply_key,
)
from .stores import LocalStore, RedisStore

log = logging.getLogger(__name__)

# How often one lookup retries when the lock's holder vanishes between two calls.
CHOOSE_ATTEMPTS = 3
OPT_OUT_DIRECTIVES = {"no-cache", "no-store"}


def no_cache_requested(cache_control: str) -> bool:
    """Tell whether a request's Cache-Control header opts out of the cache."""
    directives = {part.split("=", 1)[0].strip().lower() for part in cache_control.split(",")}
    return bool(directives & OPT_OUT_DIRECTIVES)


def _is_last(event) -> bool:
    """Tell whether an event ends a reply."""
    return isinstance(event, (Finished, Failed))


class EventSource:
    """Give a generator of engine events the interface of a Generation, for ChatCompletions to render.

    The generator yields None after a short wait with nothing to report, so next_event keeps its timeout.
    """

    def __init__(self, steps):
        self._steps = steps

    def next_event(self, timeout: float | None = None):
        """Return the next event, or None if none came within timeout seconds.

        A reply that ended without its last event (it was cancelled) ends as cancelled, so a reader
        that waits for the last event after cancelling does not wait forever.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for event in self._steps:
            if event is not None:
                return event
            if deadline is not None and time.monotonic() >= deadline:
                return None
        return Finished("cancelled", 0, 0, 0.0, 0.0)

    def events(self):
        """Yield every event up to and including the last one."""
        return events_until_last(self)

    def cancel(self) -> None:
        """Stop the reply; a leader's generation is cancelled and its followers take over."""
        self._steps.close()


class CircuitBreaker:
    """Leave a failing store alone for a while, and log its failures at most once per interval."""

    def __init__(self, open_seconds: float, log_seconds: float):
        self.open_seconds = open_seconds
        self.log_seconds = log_seconds
        self._open_until = 0.0
        self._logged_at = -math.inf

    def closed(self) -> bool:
        """Tell whether the store may be used now."""
        return time.monotonic() >= self._open_until

    def trip(self, error: Exception) -> None:
        """Record a store failure: serve uncached for open_seconds."""
        now = time.monotonic()
        self._open_until = now + self.open_seconds
        if now - self._logged_at >= self.log_seconds:
            self._logged_at = now
            log.warning(
                "response cache store failed (%s: %s); serving uncached, next try in %.1f s",
                type(error).__name__, error, self.open_seconds,
            )


class ResponseCache:
    """One worker's view of the cache: its store, its breaker and the cache settings."""

    def __init__(self, store, settings):
        self.store = store
        self.ttl_seconds = settings.cache_ttl_seconds
        self.max_entry_bytes = settings.cache_max_entry_bytes
        self.lease_seconds = settings.cache_lease_seconds
        self.poll_seconds = settings.cache_poll_seconds
        self.breaker = CircuitBreaker(settings.cache_breaker_seconds, settings.cache_error_log_seconds)

    @classmethod
    def from_settings(cls, settings) -> "ResponseCache":
        """Build the cache on Redis when REDIS_URL is set, else on this worker's memory."""
        if settings.redis_url:
            store = RedisStore(
                settings.redis_url,
                connect_timeout=settings.cache_connect_timeout_seconds,
                socket_timeout=settings.cache_socket_timeout_seconds,
                wait_seconds=settings.cache_poll_seconds,
            )
        else:
            store = LocalStore(settings.cache_local_entries)
        return cls(store, settings)

    def open(self, prepared, fingerprint: str, start, *, opted_out: bool = False):
        """Return the source of a reply and its X-Cache value (hit, miss or bypass).

        `start` starts a real generation; it is called only when this request has to generate.
        """
        if opted_out or not fingerprint or not is_reproducible(prepared.params):
            return start(), self._lookup_result("bypass")
        if not self.breaker.closed():
            return start(), self._lookup_result("error")
        flight = Flight(self, cache_key(fingerprint, prepared.prompt, prepared.params), prepared.params, start)
        try:
            kind, upstream = flight.choose()
        except self.store.errors as error:
            self.breaker.trip(error)
            return start(), self._lookup_result("error")
        if kind == "follow":
            return flight.follower_source(upstream), self._lookup_result("hit")
        return EventSource(upstream), self._lookup_result(kind)

    @staticmethod
    def _lookup_result(result: str) -> str:
        """Settle a lookup's result (hit, miss, bypass or error) and return its X-Cache value."""
        metrics.count_cache_lookup(result)
        return "bypass" if result == "error" else result


class Flight:
    """One cacheable request's way to its reply: stored, led by this request, or followed."""

    def __init__(self, cache: ResponseCache, digest: str, params, start):
        self.cache = cache
        self.store = cache.store
        self.digest = digest
        self.params = params
        self.start = start
        self.reply_key = reply_key(digest)
        self.lock_key = lock_key(digest)

    def choose(self):
        """Return (kind, events): a stored reply (hit), a generation this request leads (miss), a
        leader's stream to follow (follow), or an unshared generation when the lock keeps changing hands
        (bypass)."""
        for _ in range(CHOOSE_ATTEMPTS):
            reply = self.cached_reply()
            if reply is not None:
                return "hit", self.replay(reply)
            token = uuid.uuid4().hex
            if self.store.acquire(self.lock_key, token, self.cache.lease_seconds):
                return "miss", self.start_leading(token)
            holder = self.store.holder(self.lock_key)
            if holder is not None:
                return "follow", self.read_flight(holder)
        return "bypass", self.lead(None, self.start())

    def follower_source(self, upstream) -> EventSource:
        """Return the source of a request that follows another's generation (counted here, once)."""
        metrics.count_singleflight_follower()
        return EventSource(self.relay(upstream))

    def cached_reply(self) -> CachedReply | None:
        """Return the stored reply, or None; a corrupt entry is logged, deleted and counts as none."""
        data = self.store.get(self.reply_key)
        if data is None:
            return None
        try:
            return CachedReply.decode(data)
        except ValueError as error:
            log.warning("deleting corrupt cache entry %s: %s", self.reply_key, error)
            self.store.delete(self.reply_key)
            return None

    @staticmethod
    def replay(reply: CachedReply):
        """Yield a stored reply as the engine first produced it."""
        yield Started(queue_seconds=0.0, cached=True)
        for piece in reply.pieces:
            yield TextDelta(piece)
        yield Finished(reply.finish_reason, reply.prompt_tokens, reply.completion_tokens, 0.0, 0.0, cached=True)

    def start_leading(self, token: str):
        """Start the generation this request leads, giving the lock back if it cannot start."""
        try:
            generation = self.start()
        except BaseException:
            with contextlib.suppress(*self.store.errors):
                self.store.release(self.lock_key, token)
            raise
        return self.lead(token, generation)

    def lead(self, token: str | None, generation):
        """Relay an engine generation, publishing and storing it when `token` holds the lock."""
        publisher = Publisher(self, token)
        pieces = []
        try:
            while True:
                event = generation.next_event(timeout=self.cache.poll_seconds)
                publisher.keep_lease()
                if isinstance(event, TextDelta):
                    pieces.append(event.text)
                    publisher.publish_piece(event.text)
                elif isinstance(event, Finished):
                    publisher.finish(event, pieces)
                yield event
                if _is_last(event):
                    return
        finally:
            generation.cancel()
            publisher.abandon()

    def read_flight(self, token: str):
        """Yield a leader's pieces as it publishes them; end without a last event if it goes away."""
        stream = flight_key(self.digest, token)
        after = self.store.stream_start
        leader_gone = False
        while True:
            records = self.store.read(stream, after, self.cache.poll_seconds)
            for after, record in records:
                event = self._event_of(record)
                if event is None:
                    return
                yield event
                if _is_last(event):
                    return
            if records:
                continue
            # The leader writes its last record before it lets the lock go: read once more after that.
            if leader_gone:
                return
            leader_gone = self.store.holder(self.lock_key) != token
            yield None

    @staticmethod
    def _event_of(record: dict[str, str]):
        """Turn a flight record into an event; None for an abandoned flight or a record that makes no sense."""
        try:
            if record["k"] == "piece":
                return TextDelta(record["text"])
            if record["k"] == "end" and record["reason"] in ("stop", "length"):
                return Finished(record["reason"], int(record["prompt_tokens"]), int(record["completion_tokens"]),
                                0.0, 0.0, cached=True)
        except (KeyError, ValueError):
            log.warning("ignoring a malformed single-flight record %r", record)
        return None

    def relay(self, upstream):
        """Pass on a leader's events; if it goes away, continue from whatever comes next, without
        repeating the text this request already sent."""
        yield Started(queue_seconds=0.0, cached=True)
        sent_chars = 0
        try:
            while True:
                upstream_chars = 0
                try:
                    for event in upstream:
                        if isinstance(event, TextDelta):
                            upstream_chars += len(event.text)
                            if upstream_chars > sent_chars:
                                yield TextDelta(event.text[len(event.text) - (upstream_chars - sent_chars) :])
                                sent_chars = upstream_chars
                        elif not isinstance(event, Started):
                            yield event
                            if _is_last(event):
                                return
                    upstream.close()
                    upstream = self.choose()[1]
                except self.store.errors as error:
                    self.cache.breaker.trip(error)
                    upstream.close()
                    upstream = self.lead(None, self.start())
        except APIError as error:
            yield Failed(error.message)
        finally:
            upstream.close()


class Publisher:
    """A leader's side of single-flight: keep the lock, publish pieces, store the finished reply.

    A store failure here never reaches the leader's client: publishing stops and the client is served.
    """

    def __init__(self, flight: Flight, token: str | None):
        self.flight = flight
        self.store = flight.store
        self.token = token
        self.stream = flight_key(flight.digest, token) if token else None
        self.publishing = token is not None
        self.renewed_at = time.monotonic()

    def keep_lease(self) -> None:
        """Renew the lock a few times per lease, and stop publishing if someone else holds it now."""
        lease = self.flight.cache.lease_seconds
        if not self.publishing or time.monotonic() - self.renewed_at < lease / 3:
            return
        self.renewed_at = time.monotonic()
        if not self._guarded(self.store.renew, self.flight.lock_key, self.token, lease):
            log.info("single-flight lease of %s lost; generating on without publishing", self.flight.digest)
            self.publishing = False

    def publish_piece(self, text: str) -> None:
        """Send one text piece to the followers."""
        if self.publishing:
            self._guarded(self.store.append, self.stream, {"k": "piece", "text": text})

    def finish(self, finished: Finished, pieces: list[str]) -> None:
        """Store a complete reply, send the followers its end, and let the lock go."""
        if self.token is None:
            return
        if finished.finish_reason == "cancelled":
            self.abandon()
            return
        if is_complete(finished, self.flight.params):
            self._store(CachedReply(tuple(pieces), finished.finish_reason, finished.prompt_tokens,
                                    finished.completion_tokens))
        if self.publishing:
            self._guarded(self.store.append, self.stream, {
                "k": "end", "reason": finished.finish_reason, "prompt_tokens": str(finished.prompt_tokens),
                "completion_tokens": str(finished.completion_tokens),
            })
            self._release()

    def abandon(self) -> None:
        """Tell followers this leader stopped without a reply, so one of them takes over now."""
        if self.publishing:
            self._guarded(self.store.append, self.stream, {"k": "abandoned"})
            self._release()

    def _store(self, reply: CachedReply) -> None:
        """Store a finished reply unless it is larger than the size cap."""
        data = reply.encode()
        if len(data) > self.flight.cache.max_entry_bytes:
            log.info("not caching a reply of %d bytes (cache_max_entry_bytes is %d)", len(data),
                     self.flight.cache.max_entry_bytes)
            return
        self._guarded(self.store.put, self.flight.reply_key, data, self.flight.cache.ttl_seconds)

    def _release(self) -> None:
        """Let the lock go and stop publishing."""
        self.publishing = False
        self._guarded(self.store.release, self.flight.lock_key, self.token)

    def _guarded(self, call, *args):
        """Run a store call; on failure trip the breaker, stop publishing and return None."""
        try:
            return call(*args)
        except self.store.errors as error:
            self.flight.cache.breaker.trip(error)
            self.publishing = False
            return None


def init_app(app, cache: ResponseCache | None = None) -> None:
    """Attach the response cache (built here, so each forked worker has its own Redis pool)."""
    app.extensions["corechat_cache"] = cache or ResponseCache.from_settings(app.extensions["corechat"].settings)
