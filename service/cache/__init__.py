"""The response cache: reproducible replies stored and replayed in their original chunks.

Identical requests in flight at once cost one generation (single-flight: flights.py in a worker,
runs.py across workers). Redis (one server, or the master a Sentinel group names) shares replies and
flights across workers and hosts; without REDIS_URL each worker keeps its own in-process store with
the same behaviour. Any store failure fails open: the request is served uncached and the store is
left alone for a short while. With API keys, each key has its own replies unless CACHE_SCOPE=shared;
a request's cache_salt narrows its scope further.
"""

import logging
import math
import threading
import time

from flask import Flask, current_app, request

from ..engine import EventSource
from ..observability import metrics
from ..observability.request_record import CacheStatus, current_record
from ..settings import Settings
from .entries import CachedReply, cache_key, is_reproducible
from .flights import Flight, FlightReader
from .runs import Run
from .stores import LocalStore, RedisStore

__all__ = ["CachedReply", "Flight", "FlightReader", "ResponseCache", "cache_key", "current_cache", "init_app",
           "no_cache_requested", "no_store_requested"]

log = logging.getLogger(__name__)

# The app's extension under which the cache is kept.
EXTENSION = "corechat_cache"
OPT_OUT_DIRECTIVES = {"no-cache", "no-store"}
# The routes whose replies the cache serves: each response says what the cache did.
CACHED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def cache_directives(cache_control: str) -> set[str]:
    """Return the directives of a Cache-Control header, lower-cased, without their values."""
    return {part.split("=", 1)[0].strip().lower() for part in cache_control.split(",")}


def no_cache_requested(cache_control: str) -> bool:
    """Tell whether a request's Cache-Control header opts out of the response cache."""
    return bool(cache_directives(cache_control) & OPT_OUT_DIRECTIVES)


def no_store_requested(cache_control: str) -> bool:
    """Tell whether a request's Cache-Control header asks that nothing of it be stored (its KV state included)."""
    return "no-store" in cache_directives(cache_control)


class CircuitBreaker:
    """Leave a failing store alone for a while, and log its failures at most once per interval."""

    def __init__(self, open_seconds: float, log_seconds: float, subject: str = "response cache store",
                 fallback: str = "serving uncached"):
        self.open_seconds = open_seconds
        self.log_seconds = log_seconds
        self.subject = subject
        self.fallback = fallback
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
            log.warning("%s failed (%s: %s); %s, next try in %.1f s", self.subject, type(error).__name__, error,
                        self.fallback, self.open_seconds)


class ResponseCache:
    """One worker's view of the cache: its store, its breaker, its flights and the cache settings."""

    def __init__(self, store: LocalStore | RedisStore, settings: Settings):
        self.store = store
        self.shared_across_keys = settings.cache_scope == "shared"
        self.ttl_seconds = settings.cache_ttl_seconds
        self.max_entry_bytes = settings.cache_max_entry_bytes
        self.lease_seconds = settings.cache_lease_seconds
        self.poll_seconds = settings.cache_poll_seconds
        self.breaker = CircuitBreaker(settings.cache_breaker_seconds, settings.cache_error_log_seconds)
        self._flights: dict[str, Flight] = {}
        self._flights_lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings) -> "ResponseCache":
        """Build the cache on Redis when REDIS_URL is set, else on this worker's memory."""
        redis_url = settings.redis_url.get_secret_value()
        if redis_url:
            store = RedisStore(
                redis_url,
                connect_timeout=settings.cache_connect_timeout_seconds,
                socket_timeout=settings.cache_socket_timeout_seconds,
                wait_seconds=settings.cache_poll_seconds,
                sentinel_password=settings.redis_sentinel_password.get_secret_value(),
            )
        else:
            store = LocalStore(settings.cache_local_entries)
        return cls(store, settings)

    def scope(self, api_key_hash: str | None, salt: str | None = None) -> str:
        """Return the cache scope of a caller, known by a hash of its API key (None when keys are off), and of
        the request's cache_salt: replies and stored KV state are reused only within one scope."""
        parts = []
        if api_key_hash is not None and not self.shared_across_keys:
            parts.append(f"key:{api_key_hash}")
        if salt is not None:
            parts.append(f"salt:{salt}")
        return "|".join(parts)

    def bypasses(self, prepared, fingerprint: str, *, opted_out: bool = False) -> bool:
        """Tell whether a request's reply is generated without the cache, neither read from it nor stored."""
        # A stored reply keeps its text, not its logprobs: requests for them always generate. A reply is one
        # choice's: a request for several (n > 1) always generates too.
        return (opted_out or not fingerprint or not is_reproducible(prepared.params) or bool(prepared.params.logprobs)
                or len(prepared.choice_params) > 1)

    def open(
        self, prepared, fingerprint: str, start, *, scope: str = "", bypass: bool = False
    ) -> tuple[EventSource, CacheStatus]:
        """Return the source of a reply and what the cache did for it.

        `start(forced_ids)` queues a real generation; it is called only when this worker has to generate.
        `bypass` is what `bypasses` told; when `open` raises, `failed_status(bypass)` is the error's X-Cache value.
        """
        if bypass:
            return start(()), self._lookup_result("bypass")
        digest = cache_key(fingerprint, scope, prepared.prompt_ids, prepared.params)
        with self._flights_lock:
            flight = self._flights.get(digest)
            reader = flight.join() if flight is not None else None
            if reader is None:
                flight = Flight(digest, self._forget)
                self._flights[digest] = flight
                reader = flight.join(leads=True)
            else:
                metrics.count_singleflight_follower()
                return reader, self._lookup_result("hit")
        try:
            result = Run(self, flight, prepared.params, start).open()
        except BaseException:
            reader.cancel()
            raise
        reader.leads = result in ("miss", "error")
        if result == "follow":
            metrics.count_singleflight_follower()
            result = "hit"
        return reader, self._lookup_result(result)

    def _forget(self, flight: Flight) -> None:
        """Drop a flight no request can join any more."""
        with self._flights_lock:
            if self._flights.get(flight.digest) is flight:
                del self._flights[flight.digest]

    def failed_status(self, bypass: bool) -> CacheStatus:
        """Return the X-Cache value of a request whose `open` raised: `miss` if it used the store, else `bypass`."""
        return CacheStatus.MISS if not bypass and self.breaker.closed() else CacheStatus.BYPASS

    @staticmethod
    def _lookup_result(result: str) -> CacheStatus:
        """Settle a lookup's result (hit, miss, bypass or error): count it and return its X-Cache value."""
        metrics.count_cache_lookup(result)
        return CacheStatus.BYPASS if result == "error" else CacheStatus(result)


def settled_status(source: EventSource, status: CacheStatus) -> CacheStatus:
    """Return the X-Cache value of a whole reply: a `hit` whose flight went on to generate text is a `miss`."""
    if status is CacheStatus.HIT and isinstance(source, FlightReader) and source.generated:
        return CacheStatus.MISS
    return status


def add_status_header(response):
    """Put X-Cache on every chat or completion response, errors included (`bypass` when the cache was not consulted)."""
    if request.path in CACHED_PATHS:
        response.headers["X-Cache"] = current_record().x_cache
    return response


def init_app(app: Flask, settings: Settings, cache: ResponseCache | None = None) -> None:
    """Attach the response cache (built here, so each forked worker has its own Redis pool)."""
    app.extensions[EXTENSION] = cache or ResponseCache.from_settings(settings)
    app.after_request(add_status_header)


def current_cache() -> ResponseCache:
    """Return the response cache of the app handling the current request."""
    return current_app.extensions[EXTENSION]
