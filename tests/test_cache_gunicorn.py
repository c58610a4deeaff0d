"""Single-flight end to end: real Gunicorn workers (and a second "host") sharing a real Redis."""

import logging
import os
import signal
import threading
import time

import pytest
import requests

from support import GunicornServer, RedisServer, finished_by_worker, scrape, stream_reply, value

log = logging.getLogger(__name__)

BODY = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 40, "temperature": 0,
        "stream": True}


@pytest.fixture(scope="module")
def shared_redis(tmp_path_factory):
    """Run one redis-server for the module's servers."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


def start_server(log_dir, redis, workers: int) -> GunicornServer:
    """Start corechat under Gunicorn on the tiny model with the cache on the shared Redis."""
    return GunicornServer(
        log_dir, workers=workers, max_model_len=4096, warmup=False,
        sse_ping_seconds=0.5, redis_url=redis.url, cache_lease_seconds=1.0,
    ).start()


@pytest.fixture(scope="module")
def two_workers(tiny_model_dir, shared_redis, tmp_path_factory):
    """Run a 2-worker server using the shared Redis."""
    server = start_server(tmp_path_factory.mktemp("gunicorn"), shared_redis, workers=2)
    yield server
    server.stop()


def test_concurrent_identical_requests_cost_one_generation_and_followers_stream_live(two_workers):
    before = sum(finished_by_worker(two_workers).values())
    samples_before = scrape(two_workers)
    replies = [{} for _ in range(4)]
    threads = [threading.Thread(target=stream_reply, args=(two_workers.url, BODY, reply)) for reply in replies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert sum(finished_by_worker(two_workers).values()) - before == 1
    leader = next(reply for reply in replies if reply["status"] == "miss")
    followers = [reply for reply in replies if reply is not leader]
    assert [reply["status"] for reply in followers] == ["hit"] * 3
    assert len(leader["chunks"]) > 1
    assert all(reply["chunks"] == leader["chunks"] for reply in followers)
    assert all(reply["first_content_at"] < leader["done_at"] for reply in followers)
    samples_after = scrape(two_workers)
    assert value(samples_after, "corechat_singleflight_followers_total") - value(
        samples_before, "corechat_singleflight_followers_total"
    ) == 3
    # Followers are answered from the cache: the engine's prompt time is observed once, for the leader.
    assert value(samples_after, "corechat_prompt_processing_seconds_count") - value(
        samples_before, "corechat_prompt_processing_seconds_count"
    ) == 1


def test_cache_hit_is_counted_and_its_first_token_lands_in_a_fast_bucket(two_workers):
    body = {**BODY, "stream": False, "max_tokens": 12}
    generated = requests.post(f"{two_workers.url}/v1/chat/completions", json=body, timeout=60)
    assert generated.headers["X-Cache"] == "miss"
    before = scrape(two_workers)
    replayed = requests.post(
        f"{two_workers.url}/v1/chat/completions", json=body, headers={"Connection": "close"}, timeout=60
    )
    assert replayed.headers["X-Cache"] == "hit"
    assert replayed.json()["choices"] == generated.json()["choices"]
    after = scrape(two_workers)

    def delta(name, **labels):
        """Return how much a sample rose across the hit."""
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("corechat_cache_lookups_total", result="hit") == 1
    assert delta("corechat_cache_lookups_total", result="miss") == 0
    assert delta("corechat_time_to_first_token_seconds_count") == 1
    # A liveness bound, not a speed claim: a replay from Redis takes milliseconds, a 50 ms bucket is generous.
    assert delta("corechat_time_to_first_token_seconds_bucket", le="0.05") == 1
    # The hit's usage is counted as a fresh reply's, but its zero timings stay out of the engine's histograms.
    assert delta("corechat_generation_tokens_total") == replayed.json()["usage"]["completion_tokens"]
    assert delta("corechat_prompt_tokens_total") == replayed.json()["usage"]["prompt_tokens"]
    for engine_only in ("queue_wait", "prompt_processing", "inter_token_latency"):
        assert delta(f"corechat_{engine_only}_seconds_count") == 0, engine_only


def test_follower_on_another_host_takes_over_when_the_leader_worker_dies(
    two_workers, shared_redis, tmp_path_factory
):
    other_host = start_server(tmp_path_factory.mktemp("other-host"), shared_redis, workers=1)
    # Long enough that the leader is still generating when it is killed, even on a quiet machine
    # (30 tokens of the tiny model took 40 ms there, and the leader finished first).
    body = {**BODY, "max_tokens": 400}
    try:
        leader, follower = {}, {}
        leader_joined, follower_joined = threading.Event(), threading.Event()
        leader_thread = threading.Thread(target=stream_reply, args=(other_host.url, body, leader, leader_joined))
        leader_thread.start()
        assert leader_joined.wait(60)
        follower_thread = threading.Thread(
            target=stream_reply, args=(two_workers.url, body, follower, follower_joined)
        )
        follower_thread.start()
        assert follower_joined.wait(60)
        deadline = time.monotonic() + 60
        while not follower.get("chunks") and time.monotonic() < deadline:
            time.sleep(0.05)
        (worker_pid,) = other_host.worker_pids()
        os.kill(worker_pid, signal.SIGKILL)
        follower_thread.join(300)
        leader_thread.join(60)
    finally:
        other_host.stop()
    assert (leader["status"], follower["status"]) == ("miss", "hit")
    assert leader.get("broken") and "done_at" not in leader
    reference = {}
    stream_reply(two_workers.url, body, reference)
    assert reference["status"] == "hit"
    assert follower["chunks"] == reference["chunks"]
    assert len(follower["chunks"]) > 1



# Redis faults: the workers fail open (uncached) and go back to the cache by themselves -----------


def timed_chat(url: str, body: dict, headers: dict | None = None) -> tuple[float, requests.Response]:
    """Send one chat request on a fresh connection; return its seconds and its response."""
    began = time.monotonic()
    response = requests.post(
        f"{url}/v1/chat/completions", json=body, headers={"Connection": "close", **(headers or {})}, timeout=60
    )
    assert response.status_code == 200, response.text
    return time.monotonic() - began, response


def wait_for_hit(url: str, body: dict, timeout: float = 20) -> None:
    """Send a request until it is a cache hit (each worker's breaker lets Redis back in after a pause)."""
    deadline = time.monotonic() + timeout
    while timed_chat(url, body)[1].headers["X-Cache"] != "hit":
        assert time.monotonic() < deadline, "caching did not resume"
        time.sleep(0.2)


def test_hung_redis_adds_bounded_latency_and_caching_resumes_after_it_wakes(two_workers, shared_redis):
    body = {**BODY, "stream": False, "max_tokens": 8, "seed": 11}
    uncached = sorted(timed_chat(two_workers.url, body, {"Cache-Control": "no-cache"})[0] for _ in range(5))
    shared_redis.process.send_signal(signal.SIGSTOP)  # Redis accepts connections but never answers
    try:
        during = [timed_chat(two_workers.url, body) for _ in range(6)]
    finally:
        shared_redis.process.send_signal(signal.SIGCONT)
    assert {response.headers["X-Cache"] for _, response in during} == {"bypass"}
    added_seconds = max(seconds for seconds, _ in during) - uncached[len(uncached) // 2]
    log.info("a hung Redis added at most %.3f s to a request (uncached median %.3f s)", added_seconds,
             uncached[len(uncached) // 2])
    # A liveness bound, not a speed claim: one socket timeout (0.25 s) per worker, then the breaker is open.
    assert added_seconds < 1.0, added_seconds
    wait_for_hit(two_workers.url, body)


def test_killed_redis_serves_uncached_and_a_restart_brings_hits_back(two_workers, shared_redis):
    body = {**BODY, "stream": False, "max_tokens": 9, "seed": 12}
    shared_redis.stop()
    try:
        for _ in range(4):
            assert timed_chat(two_workers.url, body)[1].headers["X-Cache"] == "bypass"
    finally:
        shared_redis.start()  # the same port, empty
    wait_for_hit(two_workers.url, body)
