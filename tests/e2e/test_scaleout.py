"""Scale-out: two corechat instances (standing for two hosts) behind the shipped nginx, one Redis
running the shipped config, which the instances reach as its ACL user `corechat`."""

import threading

import pytest
import requests

from harness import GunicornServer, finished_by_worker, scrape, stream_reply, value
from tests.e2e.deploy_support import NginxServer, ShippedRedis

CHAT = {"messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 16, "temperature": 0, "seed": 7}


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory, gunicorn):
    """Start Redis from the shipped config, two single-worker instances on it, and nginx before them."""
    redis = ShippedRedis(tmp_path_factory.mktemp("redis")).start()
    # A short lease, so a leader renews it (a Lua script) several times in one reply.
    instances = [gunicorn(workers=1, redis_url=redis.url(), cache_lease_seconds=0.6) for _ in range(2)]
    try:
        for instance in instances:
            instance.start()
        nginx = NginxServer(tmp_path_factory.mktemp("nginx"), [instance.port for instance in instances]).start()
        yield instances, nginx
        nginx.stop()
    finally:
        for instance in instances:
            instance.stop()
        redis.stop()


def served_requests(instance: GunicornServer) -> int:
    """Count the chat requests an instance's access log shows."""
    return instance.log().count('"POST /v1/chat/completions')


def test_reply_generated_on_one_host_is_a_cache_hit_on_the_other(two_hosts):
    (first, second), nginx = two_hosts
    generated = requests.post(f"{first.url}/v1/chat/completions", json=CHAT, timeout=60)
    assert generated.status_code == 200
    assert generated.headers.get("X-Cache") == "miss"
    replayed = requests.post(f"{second.url}/v1/chat/completions", json=CHAT, timeout=60)
    assert replayed.headers.get("X-Cache") == "hit"
    assert replayed.json()["choices"][0]["message"] == generated.json()["choices"][0]["message"]

    # Through nginx, least_conn spreads requests over both hosts, and each one hits the shared cache.
    before = [served_requests(first), served_requests(second)]
    for _ in range(4):
        through_nginx = requests.post(f"{nginx.url}/v1/chat/completions", json=CHAT, timeout=60, verify=nginx.ca_file)
        assert through_nginx.headers.get("X-Cache") == "hit"
        assert through_nginx.json()["choices"][0]["message"] == generated.json()["choices"][0]["message"]
    after = [served_requests(first), served_requests(second)]
    assert all(count_after > count_before for count_before, count_after in zip(before, after))


def test_a_follower_on_the_other_host_shares_one_generation_under_the_shipped_acl(two_hosts):
    """Every command of single-flight (locks, Lua renew/release, stream add/read) is allowed to `corechat`."""
    (first, second), _ = two_hosts
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 300,
            "temperature": 0, "stream": True}
    before = sum(finished_by_worker(first).values()) + sum(finished_by_worker(second).values())
    followers_before = value(scrape(second), "corechat_singleflight_followers_total")
    leader, follower = {}, {}
    leader_joined, follower_joined = threading.Event(), threading.Event()
    leading = threading.Thread(target=stream_reply, args=(first.url, body, leader, leader_joined))
    leading.start()
    assert leader_joined.wait(60)
    following = threading.Thread(target=stream_reply, args=(second.url, body, follower, follower_joined))
    following.start()
    leading.join(120)
    following.join(120)
    assert (leader["status"], follower["status"]) == ("miss", "hit")
    assert follower["chunks"] == leader["chunks"] and len(leader["chunks"]) > 1
    assert sum(finished_by_worker(first).values()) + sum(finished_by_worker(second).values()) - before == 1
    assert value(scrape(second), "corechat_singleflight_followers_total") - followers_before == 1
    # A refused command fails open silently for the client: only the log tells.
    for instance in (first, second):
        assert "response cache store failed" not in instance.log()
