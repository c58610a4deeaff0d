"""Where the cache keeps replies, locks and in-flight streams: Redis, or one worker's memory.

Both stores offer the same small set of primitives, so the single-flight logic above them is written
once and behaves the same with and without Redis.
"""

import threading
import time
from collections import OrderedDict

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .connections import RedisConnector

# Only the lock's holder may release it, renew it (and with it its flight stream) or write to the stream:
# a leader whose lease lapsed can never write after the one that took over began. Acquiring is the same
# SET NX PX as redis-py's Lock, and the lease is renewed from the flight's thread either way (Lock has
# no watchdog). Hand-written rather than redis-py's Lock because its scripts (release, extend,
# reacquire) guard the lock key alone: it has no write made conditional on holding the lock, and
# `owned()` then XADD leaves a window in which a leader whose lease just lapsed appends after the
# worker that took over began its run; its extend cannot keep the flight stream alive in the same
# step; and LocalStore offers these same primitives without Redis, so the scripts would still read the
# key Lock writes.
RELEASE_SCRIPT = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""
RENEW_SCRIPT = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('pexpire', KEYS[1], ARGV[2])
redis.call('expire', KEYS[2], ARGV[3])
return 1
"""
APPEND_SCRIPT = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[3] == '1' then redis.call('del', KEYS[2]) end
redis.call('xadd', KEYS[2], '*', unpack(ARGV, 4))
redis.call('expire', KEYS[2], ARGV[2])
return 1
"""
# A flight stream outlives its last write long enough for every follower to read the end, or to take
# over a run whose generator stopped.
FLIGHT_STREAM_SECONDS = 60
HEALTH_CHECK_SECONDS = 30


class RedisStore:
    """The shared store: one Redis, or the master of a Sentinel group, for every worker and host."""

    stream_start = "0-0"

    def __init__(self, url: str, *, connect_timeout: float, socket_timeout: float, wait_seconds: float,
                 sentinel_password: str = ""):
        # No retries: a failed call fails fast and the caller serves uncached. Behind Sentinel, a call
        # during a failover fails the same way, and a later one reaches the promoted master.
        connector = RedisConnector(
            url, sentinel_socket_timeout=socket_timeout, sentinel_password=sentinel_password,
            socket_connect_timeout=connect_timeout,
            retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=HEALTH_CHECK_SECONDS,
        )
        self.client = connector.client(socket_timeout)
        # A follower's blocking read waits up to wait_seconds on purpose: it gets its own connections
        # with a timeout that long plus the usual, so every other call can keep a short timeout.
        self._waiting_client = connector.client(socket_timeout + wait_seconds)
        self._wait_seconds = wait_seconds
        self.errors = (redis.RedisError, OSError)
        self._release = self.client.register_script(RELEASE_SCRIPT)
        self._renew = self.client.register_script(RENEW_SCRIPT)
        self._append = self.client.register_script(APPEND_SCRIPT)

    def get(self, key: str) -> bytes | None:
        """Return a stored value, or None."""
        return self.client.get(key)

    def put(self, key: str, value: bytes, ttl_seconds: int) -> None:
        """Store a value with an expiry."""
        self.client.set(key, value, ex=ttl_seconds)

    def delete(self, key: str) -> None:
        """Remove a value."""
        self.client.delete(key)

    def acquire(self, key: str, token: str, lease_seconds: float) -> bool:
        """Take a lock unless someone holds it; return whether this token now holds it."""
        return bool(self.client.set(key, token, nx=True, px=int(lease_seconds * 1000)))

    def renew(self, key: str, token: str, lease_seconds: float, stream: str) -> bool:
        """Extend a lock this token holds and keep its flight stream alive; return whether it still held it."""
        return bool(self._renew(keys=[key, stream], args=[token, int(lease_seconds * 1000), FLIGHT_STREAM_SECONDS]))

    def release(self, key: str, token: str) -> None:
        """Drop a lock if this token holds it."""
        self._release(keys=[key], args=[token])

    def holder(self, key: str) -> str | None:
        """Return the token holding a lock, or None."""
        token = self.client.get(key)
        return token.decode() if token is not None else None

    def append(self, key: str, token: str, stream: str, record: dict[str, str], *, restart: bool = False) -> bool:
        """Add a record to a flight stream (emptied first if `restart`) if this token holds the lock;
        return whether it did."""
        fields = [item for pair in record.items() for item in pair]
        args = [token, FLIGHT_STREAM_SECONDS, "1" if restart else "0", *fields]
        return bool(self._append(keys=[key, stream], args=args))

    def read_all(self, stream: str) -> list[tuple[object, dict[str, str]]]:
        """Return every record of a stream."""
        return [(record_id, self._decoded(fields)) for record_id, fields in self.client.xrange(stream)]

    def read(self, stream: str, after, block_seconds: float) -> list[tuple[object, dict[str, str]]]:
        """Return the records after `after`, waiting up to block_seconds for the first one."""
        block_ms = max(1, int(min(block_seconds, self._wait_seconds) * 1000))
        reply = self._waiting_client.xread({stream: after}, block=block_ms)
        if not reply:
            return []
        return [(record_id, self._decoded(fields)) for record_id, fields in reply[0][1]]

    @staticmethod
    def _decoded(fields: dict[bytes, bytes]) -> dict[str, str]:
        """Return a stream entry's fields as text."""
        return {field.decode(): value.decode() for field, value in fields.items()}


class LocalStore:
    """The embedded store: one worker's memory, an LRU of replies plus locks and streams for its threads."""

    stream_start = 0
    errors = ()

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._changed = threading.Condition()
        self._values: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._locks: dict[str, tuple[str, float]] = {}
        # Record ids grow across streams, as Redis's do: a stream restarted under a reader never
        # hands it ids it has already passed.
        self._streams: dict[str, tuple[float, list[tuple[int, dict[str, str]]]]] = {}
        self._last_id = 0

    def get(self, key: str) -> bytes | None:
        """Return a stored value, or None."""
        with self._changed:
            entry = self._values.get(key)
            if entry is None:
                return None
            expires_at, value = entry
            if expires_at <= time.monotonic():
                del self._values[key]
                return None
            self._values.move_to_end(key)
            return value

    def put(self, key: str, value: bytes, ttl_seconds: int) -> None:
        """Store a value with an expiry, evicting the least recently used beyond max_entries."""
        with self._changed:
            self._values[key] = (time.monotonic() + ttl_seconds, value)
            self._values.move_to_end(key)
            while len(self._values) > self.max_entries:
                self._values.popitem(last=False)

    def delete(self, key: str) -> None:
        """Remove a value."""
        with self._changed:
            self._values.pop(key, None)

    def acquire(self, key: str, token: str, lease_seconds: float) -> bool:
        """Take a lock unless someone holds it; return whether this token now holds it."""
        with self._changed:
            self._forget_expired()
            if key in self._locks:
                return False
            self._locks[key] = (token, time.monotonic() + lease_seconds)
            return True

    def renew(self, key: str, token: str, lease_seconds: float, stream: str) -> bool:
        """Extend a lock this token holds and keep its flight stream alive; return whether it still held it."""
        with self._changed:
            if self.holder(key) != token:
                return False
            self._locks[key] = (token, time.monotonic() + lease_seconds)
            if stream in self._streams:
                self._streams[stream] = (time.monotonic() + FLIGHT_STREAM_SECONDS, self._streams[stream][1])
            return True

    def release(self, key: str, token: str) -> None:
        """Drop a lock if this token holds it."""
        with self._changed:
            if self.holder(key) == token:
                del self._locks[key]

    def holder(self, key: str) -> str | None:
        """Return the token holding a lock, or None."""
        with self._changed:
            token, expires_at = self._locks.get(key, (None, 0.0))
            return token if expires_at > time.monotonic() else None

    def append(self, key: str, token: str, stream: str, record: dict[str, str], *, restart: bool = False) -> bool:
        """Add a record to a flight stream (emptied first if `restart`) if this token holds the lock, and
        wake its readers; return whether it did."""
        with self._changed:
            if self.holder(key) != token:
                return False
            records = [] if restart else self._records(stream)
            self._last_id += 1
            records.append((self._last_id, dict(record)))
            self._streams[stream] = (time.monotonic() + FLIGHT_STREAM_SECONDS, records)
            self._changed.notify_all()
            return True

    def read(self, stream: str, after: int, block_seconds: float) -> list[tuple[int, dict[str, str]]]:
        """Return the records after id `after`, waiting up to block_seconds for the first one."""
        with self._changed:
            self._changed.wait_for(lambda: self._after(stream, after), block_seconds)
            return self._after(stream, after)

    def read_all(self, stream: str) -> list[tuple[int, dict[str, str]]]:
        """Return every record of a stream."""
        with self._changed:
            return self._after(stream, self.stream_start)

    def _records(self, stream: str) -> list[tuple[int, dict[str, str]]]:
        """Return a live stream's records (called with the condition held)."""
        expires_at, records = self._streams.get(stream, (0.0, []))
        return records if expires_at > time.monotonic() else []

    def _after(self, stream: str, after: int) -> list[tuple[int, dict[str, str]]]:
        """Return a stream's records after id `after` (called with the condition held)."""
        return [(record_id, record) for record_id, record in self._records(stream) if record_id > after]

    def _forget_expired(self) -> None:
        """Drop expired locks and streams (called with the condition held)."""
        now = time.monotonic()
        for key in [key for key, (_, expires_at) in self._locks.items() if expires_at <= now]:
            del self._locks[key]
        for key in [key for key, (expires_at, _) in self._streams.items() if expires_at <= now]:
            del self._streams[key]
