"""The response cache behind Redis Sentinel, in this process: a malformed URL stops the app at start without
its password, and rediss+sentinel:// speaks TLS to the sentinels and the master."""

from urllib.parse import quote

import pytest
import redis
from redis.sentinel import SentinelManagedSSLConnection

from service.cache.connections import RedisConnector

# Characters a URL must percent-encode, and ones Redis's config files and ACLs treat specially.
MASTER_PASSWORD = "m@ster:pass/w%rd?#1"


def test_a_malformed_sentinel_url_stops_the_app_at_start_without_its_password(make_settings, engine):
    from service.app import create_app

    settings = make_settings(redis_url=f"redis+sentinel://:{quote(MASTER_PASSWORD, safe='')}@127.0.0.1:26379")
    with pytest.raises(ValueError, match="names its master") as refused:
        create_app(settings, engine=engine)
    assert "m%40ster" not in str(refused.value) and "m@ster" not in str(refused.value)


def test_rediss_sentinel_url_speaks_tls_to_the_sentinels_and_the_master():
    connector = RedisConnector("rediss+sentinel://:pw@127.0.0.1:1/corechat/2", sentinel_socket_timeout=0.25,
                               sentinel_password="sentinel-pw", socket_connect_timeout=0.1)
    client = connector.client(0.5)
    pool = client.connection_pool
    assert pool.connection_class is SentinelManagedSSLConnection
    assert (pool.connection_kwargs["db"], pool.connection_kwargs["password"]) == (2, "pw")
    assert pool.connection_kwargs["socket_timeout"] == 0.5
    sentinel_options = connector._sentinel.sentinels[0].connection_pool.connection_kwargs
    assert (sentinel_options["password"], sentinel_options["socket_timeout"]) == ("sentinel-pw", 0.25)
    assert connector._sentinel.sentinels[0].connection_pool.connection_class is redis.SSLConnection
