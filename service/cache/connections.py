"""How a REDIS_URL becomes Redis clients: straight to one server, or to the master a Sentinel group names.

redis-py parses `redis://`, `rediss://` and `unix://` URLs but has no URL for Sentinel, so the
`redis+sentinel://` form other clients use is parsed here; failover itself is redis-py's: a client
from `Sentinel.master_for` asks the sentinels for the master whenever it opens a connection, so it
follows a promoted replica.
"""

import ipaddress
from dataclasses import dataclass, field
from urllib.parse import unquote

import redis
from redis.sentinel import Sentinel

SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}
DEFAULT_SENTINEL_PORT = 26379


@dataclass(frozen=True)
class SentinelURL:
    """A parsed `redis+sentinel://` URL: where the sentinels listen and which master (and database) to use."""

    sentinels: tuple[tuple[str, int], ...]
    master_name: str
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ssl: bool = False


def is_sentinel_url(url: str) -> bool:
    """Tell whether a REDIS_URL names a Sentinel group rather than one server."""
    return url.partition("://")[0].lower() in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelURL:
    """Parse `redis[s]+sentinel://[user:password@]host[:port][,host[:port]...]/master-name[/db]`.

    The user and password (percent-encoded, as in any URL) are the master's; IPv6 hosts go in
    brackets; a port defaults to 26379. Errors never quote the URL, which may hold a password.
    """
    scheme, _, rest = url.partition("://")
    if scheme.lower() not in SENTINEL_SCHEMES:
        raise ValueError("REDIS_URL: a Sentinel URL starts with redis+sentinel:// or rediss+sentinel://")
    netloc, _, path = rest.partition("/")
    if "?" in path or "#" in path:
        raise ValueError("REDIS_URL: a Sentinel URL takes no query options or fragment")
    userinfo, _, hosts = netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    name, _, db = path.partition("/")
    if not name:
        raise ValueError("REDIS_URL: a Sentinel URL names its master after the sentinels: .../<master-name>[/<db>]")
    if db and not (db.isascii() and db.isdigit()):
        raise ValueError("REDIS_URL: the database after the master name must be a number")
    return SentinelURL(
        sentinels=tuple(_parse_address(item, index) for index, item in enumerate(hosts.split(","), 1)),
        master_name=unquote(name),
        db=int(db or 0),
        username=unquote(username) or None,
        password=unquote(password) or None,
        ssl=SENTINEL_SCHEMES[scheme.lower()],
    )


def _parse_address(item: str, index: int) -> tuple[str, int]:
    """Parse one sentinel's `host[:port]` or `[ipv6][:port]` (the index-th of the URL's list)."""
    problem = f"REDIS_URL: sentinel {index} must be host[:port] or [IPv6 address][:port]"
    if item.startswith("["):
        host, bracket, port = item[1:].partition("]")
        if not bracket or (port and not port.startswith(":")):
            raise ValueError(problem)
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(problem) from None
        has_port, port = bool(port), port[1:]
    else:
        if item.count(":") > 1:
            raise ValueError(problem + " (an IPv6 address goes in brackets)")
        host, has_port, port = item.partition(":")
    if not host:
        raise ValueError(problem)
    if not has_port:
        return host, DEFAULT_SENTINEL_PORT
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"REDIS_URL: the port of sentinel {index} must be a number from 1 to 65535")
    return host, int(port)


class RedisConnector:
    """Build clients of the Redis a REDIS_URL names, each with its own pool and socket timeout.

    For a Sentinel URL every client reaches the current master through the sentinels, which are asked
    with the same options (no retries, short timeouts: `sentinel_socket_timeout` for their answers).
    """

    def __init__(self, url: str, *, sentinel_socket_timeout: float, sentinel_password: str = "", **options):
        self._url = url
        self._options = options
        self._target: SentinelURL | None = None
        self._sentinel: Sentinel | None = None
        if is_sentinel_url(url):
            self._target = parse_sentinel_url(url)
            self._sentinel = Sentinel(self._target.sentinels, sentinel_kwargs={
                **options, "socket_timeout": sentinel_socket_timeout, "password": sentinel_password or None,
                "ssl": self._target.ssl,
            })

    def client(self, socket_timeout: float) -> redis.Redis:
        """Return a new client whose calls wait at most socket_timeout for an answer."""
        target = self._target
        if target is None or self._sentinel is None:
            return redis.Redis.from_url(self._url, socket_timeout=socket_timeout, **self._options)
        return self._sentinel.master_for(
            target.master_name, db=target.db, username=target.username, password=target.password, ssl=target.ssl,
            socket_timeout=socket_timeout, **self._options,
        )
