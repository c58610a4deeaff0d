"""The response cache's redis+sentinel:// URL: parsed with default ports, IPv6 and decoded credentials,
refused without quoting it when malformed, and its passwords kept out of the settings' repr."""

from urllib.parse import quote

import pytest

from service.cache.connections import SentinelURL, is_sentinel_url, parse_sentinel_url
from service.settings import Settings

# Characters a URL must percent-encode, and ones Redis's config files and ACLs treat specially.
MASTER_PASSWORD = "m@ster:pass/w%rd?#1"
SENTINEL_PASSWORD = "s3ntinel@pass:2"


# The URL ------------------------------------------------------------------------------------


def test_sentinel_url_lists_each_sentinel_with_default_ports_ipv6_and_the_masters_decoded_credentials():
    url = ("redis+sentinel://cache-user:m%40ster%3Apass%2Fw%25rd%3F%231@"
           "10.0.0.1:26380,[::1],[fd00::2]:5000,sentinel-c/my%20master/3")
    assert parse_sentinel_url(url) == SentinelURL(
        sentinels=(("10.0.0.1", 26380), ("::1", 26379), ("fd00::2", 5000), ("sentinel-c", 26379)),
        master_name="my master", db=3, username="cache-user", password=MASTER_PASSWORD, ssl=False,
    )
    assert parse_sentinel_url("redis+sentinel://h/corechat") == SentinelURL((("h", 26379),), "corechat")
    assert parse_sentinel_url("REDIS+SENTINEL://:only-a-password@h/corechat/").password == "only-a-password"
    assert MASTER_PASSWORD not in repr(parse_sentinel_url(url))
    assert is_sentinel_url(url) and is_sentinel_url("rediss+sentinel://h/m")
    assert not is_sentinel_url("redis://h:6379/0") and not is_sentinel_url("rediss://h/0")


@pytest.mark.parametrize("tail", [
    "h:26379", "h:26379/", "h:26379//0",  # no master name
    "h:0/m", "h:65536/m", "h:port/m", "h:/m", "h:-1/m", "h:\u00b2/m",  # bad ports
    "::1/m", "::1:26379/m", "[::1/m", "[::1]26379/m", "[not-an-address]:1/m", "[]:1/m",  # IPv6 unbracketed or bad
    "/m", "h1,,h2/m", ":26379/m",  # a sentinel without a host
    "h/m/zero", "h/m/0/1", "h/m/0?ssl=true", "h/m#0",  # a bad database, options
])
def test_a_malformed_sentinel_url_is_refused_without_quoting_it(tail):
    url = f"redis+sentinel://:{quote(MASTER_PASSWORD, safe='')}@{tail}"
    with pytest.raises(ValueError, match="^REDIS_URL: ") as refused:
        parse_sentinel_url(url)
    assert "m%40ster" not in str(refused.value) and tail not in str(refused.value)


def test_sentinel_passwords_stay_out_of_the_settings_repr():
    settings = Settings(redis_url=f"redis+sentinel://:{quote(MASTER_PASSWORD, safe='')}@h/corechat",
                        redis_sentinel_password=SENTINEL_PASSWORD)
    assert not any(secret in f"{settings!r} {settings}" for secret in ("m%40ster", SENTINEL_PASSWORD))
