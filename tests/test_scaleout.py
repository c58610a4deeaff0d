"""Scale-out: two corechat instances (standing for two hosts) behind the shipped nginx, one Redis."""

import pytest
import requests

from deploy_support import NginxServer, ShippedRedis
from support import GunicornServer

CHAT = {"messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 16, "temperature": 0, "seed": 7}


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory, tiny_model_dir):
    """Start Redis from the shipped config, two single-worker instances on it, and nginx before them."""
    redis = ShippedRedis(tmp_path_factory.mktemp("redis")).start()
    instances = [
        GunicornServer(
            tmp_path_factory.mktemp("gunicorn"), workers=1, model=tiny_model_dir, model_name="tiny", redis_url=redis.url()
        )
        for _ in range(2)
    ]
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
        through_nginx = requests.post(f"{nginx.url}/v1/chat/completions", json=CHAT, timeout=60)
        assert through_nginx.headers.get("X-Cache") == "hit"
        assert through_nginx.json()["choices"][0]["message"] == generated.json()["choices"][0]["message"]
    after = [served_requests(first), served_requests(second)]
    assert all(count_after > count_before for count_before, count_after in zip(before, after))
