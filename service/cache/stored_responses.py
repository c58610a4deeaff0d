"""Responses kept for `GET /v1/responses/{id}` and `previous_response_id`, in REDIS_URL's Redis, each under the scope
of its API key for RESPONSES_STORE_TTL_SECONDS.

Unlike the response cache this store does not fail open: a response the client asked to keep is kept or
its request fails, and a read Redis cannot answer is a failure (StoreUnavailable), never an absent
response. Without REDIS_URL there is no store: each worker's memory would keep a response where a
request to another worker could not find it.
"""

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..settings import Settings
from .connections import RedisConnector

KEY_PREFIX = "corechat:response:"
# The scope of the responses of an API without keys.
OPEN_SCOPE = "open"


class StoreUnavailable(Exception):
    """Redis did not answer a read or a write of the store."""


class StoredResponses:
    """Stored responses as strings in Redis, each keyed by its owner's scope and its id, with a time to live."""

    def __init__(self, url: str, *, ttl_seconds: int, connect_timeout: float, socket_timeout: float,
                 sentinel_password: str = ""):
        connector = RedisConnector(url, sentinel_socket_timeout=socket_timeout, sentinel_password=sentinel_password,
                                   socket_connect_timeout=connect_timeout, retry=Retry(NoBackoff(), 0))
        self.client = connector.client(socket_timeout)
        self.ttl_seconds = ttl_seconds

    @classmethod
    def from_settings(cls, settings: Settings) -> "StoredResponses | None":
        """Return the store on REDIS_URL, or None without it."""
        url = settings.redis_url.get_secret_value()
        if not url:
            return None
        return cls(url, ttl_seconds=settings.responses_store_ttl_seconds,
                   connect_timeout=settings.cache_connect_timeout_seconds,
                   socket_timeout=settings.cache_socket_timeout_seconds,
                   sentinel_password=settings.redis_sentinel_password.get_secret_value())

    @staticmethod
    def _key(owner: str | None, response_id: str) -> str:
        """Return where a response lives: under its owner's scope (a hash of its API key), so no other key finds it."""
        return f"{KEY_PREFIX}{owner or OPEN_SCOPE}:{response_id}"

    def keep(self, owner: str | None, response_id: str, document: bytes) -> None:
        """Keep a response's document for the store's time to live, or raise StoreUnavailable."""
        try:
            self.client.set(self._key(owner, response_id), document, ex=self.ttl_seconds)
        except (redis.RedisError, OSError) as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc

    def find(self, owner: str | None, response_id: str) -> bytes | None:
        """Return the document of one of the owner's responses, None if it has none of that id, or raise
        StoreUnavailable."""
        try:
            return self.client.get(self._key(owner, response_id))
        except (redis.RedisError, OSError) as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc
