"""Conversation turns' KV state in Redis, for the hosts that share it (SHARED_KV_TTL_SECONDS), on a Redis
apart from the replies' (SHARED_KV_REDIS_URL), so large KV entries never evict cached replies.

The engine's prefix store (service/engine/prefixes.py) keeps a host's stored sequences as files;
this keeps finished turns' files in Redis under their names, so a turn that lands on another host
fetches its conversation's KV state (one round trip to find the longest, one to read it) instead
of passing the whole prompt again. Like the response cache it fails open: a Redis that errs or
times out is left alone for a while, and the prompt is computed.
"""

import logging

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from . import CircuitBreaker
from .connections import RedisConnector

log = logging.getLogger(__name__)

KEY_PREFIX = "corechat:kv:"
BREAKER_OPEN_SECONDS = 5.0
BREAKER_LOG_SECONDS = 60.0


class RedisPrefixes:
    """SharedPrefixes (service/engine/prefixes.py) on Redis: each file a string with a time to live."""

    def __init__(self, url: str, *, ttl_seconds: int, max_bytes: int, connect_timeout: float, socket_timeout: float,
                 sentinel_password: str = ""):
        connector = RedisConnector(url, sentinel_socket_timeout=socket_timeout, sentinel_password=sentinel_password,
                                   socket_connect_timeout=connect_timeout, retry=Retry(NoBackoff(), 0))
        self.client = connector.client(socket_timeout)
        self.ttl_seconds = ttl_seconds
        self.max_bytes = max_bytes
        self.breaker = CircuitBreaker(BREAKER_OPEN_SECONDS, BREAKER_LOG_SECONDS, subject="shared KV state in Redis",
                                      fallback="prompts are computed on this host")

    @classmethod
    def from_settings(cls, settings) -> "RedisPrefixes | None":
        """Return the shared store SHARED_KV_TTL_SECONDS asks for, on SHARED_KV_REDIS_URL (else REDIS_URL), or None."""
        url = settings.shared_kv_redis_url.get_secret_value() or settings.redis_url.get_secret_value()
        if not url or not settings.shared_kv_ttl_seconds:
            return None
        if not settings.shared_kv_redis_url.get_secret_value():
            log.warning("SHARED_KV_TTL_SECONDS keeps KV state in REDIS_URL's Redis beside the cached replies, whose "
                        "least recently used keys it will push out; give it a Redis of its own with "
                        "SHARED_KV_REDIS_URL (deploy/redis/corechat-kv.conf)")
        return cls(url, ttl_seconds=settings.shared_kv_ttl_seconds, max_bytes=settings.shared_kv_max_mb * 1024 * 1024,
                   connect_timeout=settings.cache_connect_timeout_seconds,
                   socket_timeout=settings.shared_kv_socket_timeout_seconds,
                   sentinel_password=settings.redis_sentinel_password.get_secret_value())

    def publish(self, name: str, data: memoryview) -> None:
        """Keep a file under its name for SHARED_KV_TTL_SECONDS, unless it is larger than SHARED_KV_MAX_MB."""
        if data.nbytes > self.max_bytes or not self.breaker.closed():
            return
        try:
            self.client.set(KEY_PREFIX + name, data, ex=self.ttl_seconds)
        except redis.RedisError as exc:
            self.breaker.trip(exc)

    def fetch(self, names: list[str]) -> tuple[str, bytes] | None:
        """Return the first of the names Redis keeps, and its file (None on any failure)."""
        if not names or not self.breaker.closed():
            return None
        try:
            with self.client.pipeline(transaction=False) as pipeline:
                for name in names:
                    pipeline.exists(KEY_PREFIX + name)
                present = pipeline.execute()
            for name, exists in zip(names, present, strict=True):
                if exists:
                    data = self.client.get(KEY_PREFIX + name)
                    if data is not None:
                        return name, data
            return None
        except redis.RedisError as exc:
            self.breaker.trip(exc)
            return None
