"""Single-flight end to end: real Gunicorn workers (and a second "host") sharing a real Redis.

The servers run the defaults a user gets (lease, queue, batch); only the model is the tiny one and
warm-up is off.
"""

import json
import logging
import os
import signal
import socket
import struct
import threading
import time

import pytest
import redis as redis_client
import requests
from transformers import AutoTokenizer

from harness import (
    DONE,
    GunicornServer,
    StreamingClient,
    finished_by_worker,
    ready_facts,
    scrape,
    sse_payloads,
    stream_reply,
    value,
    wait_for_samples,
)

log = logging.getLogger(__name__)

BODY = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 40, "temperature": 0,
        "stream": True}


@pytest.fixture(scope="module")
def shared_redis(module_redis):
    """Run one redis-server for the module's servers."""
    return module_redis()


def start_server(gunicorn, redis, workers: int) -> GunicornServer:
    """Start corechat under Gunicorn on the tiny model with the cache on the shared Redis."""
    return gunicorn(workers=workers, max_model_len=4096, warmup=False, sse_ping_seconds=0.5,
                    redis_url=redis.url).start()


@pytest.fixture(scope="module")
def two_workers(gunicorn, shared_redis):
    """Run a 2-worker server using the shared Redis."""
    server = start_server(gunicorn, shared_redis, workers=2)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def one_worker(gunicorn, shared_redis):
    """Run a second host with one worker on the same Redis."""
    server = start_server(gunicorn, shared_redis, workers=1)
    yield server
    server.stop()


def test_concurrent_identical_requests_cost_one_generation_and_followers_stream_live(two_workers):
    # Seeded at temperature 1 and long: a greedy reply of the tiny model repeats
    # itself, speculation takes it in a few steps, and it could end before a follower's first token arrives.
    body = {**BODY, "temperature": 1.0, "seed": 7, "max_tokens": 400}
    before = sum(finished_by_worker(two_workers).values())
    samples_before = scrape(two_workers)
    replies = [{} for _ in range(4)]
    threads = [threading.Thread(target=stream_reply, args=(two_workers.url, body, reply)) for reply in replies]
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

    def delta(name):
        """Return how much a counter rose across the four requests."""
        return value(samples_after, name) - value(samples_before, name)

    assert delta("corechat_singleflight_followers_total") == 3
    # One generation's tokens are the engine's; the three followers' are replayed.
    assert delta("corechat_generation_tokens_total") > 0
    assert delta("corechat_replayed_generation_tokens_total") == 3 * delta("corechat_generation_tokens_total")
    assert delta("corechat_replayed_prompt_tokens_total") == 3 * delta("corechat_prompt_tokens_total") > 0
    # Followers are answered from the cache: the engine's prompt time is observed once, for the leader.
    assert delta("corechat_prompt_processing_seconds_count") == 1


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
    # The hit's usage counts as replayed, not as the engine's work, and its zero timings stay out of
    # the engine's histograms.
    assert delta("corechat_replayed_generation_tokens_total") == replayed.json()["usage"]["completion_tokens"] > 0
    assert delta("corechat_replayed_prompt_tokens_total") == replayed.json()["usage"]["prompt_tokens"]
    assert delta("corechat_generation_tokens_total") == delta("corechat_prompt_tokens_total") == 0
    for engine_only in ("queue_wait", "prompt_processing", "inter_token_latency"):
        assert delta(f"corechat_{engine_only}_seconds_count") == 0, engine_only


def test_follower_on_another_host_takes_over_when_the_leader_worker_dies(two_workers, shared_redis, gunicorn):
    other_host = start_server(gunicorn, shared_redis, workers=1)
    # Long enough that the leader is still generating when it is killed, even on a quiet machine,
    # where a few dozen tokens of the tiny model end before the kill lands.
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


# Takeovers: a reply continued by another worker is one coherent generation -------------------

SEEDED = {"messages": [{"role": "user", "content": "Tell me a story about a lighthouse keeper."}],
          "temperature": 1.0, "seed": 11, "max_tokens": 200, "stream": True}


def start_background_load(server, streams: int, tag: str) -> list[StreamingClient]:
    """Start unrelated uncached streams on a server and wait until each is running or queued."""
    clients = [
        StreamingClient(server.url, {"messages": [{"role": "user", "content": f"{tag} story number {index}."}],
                                     "temperature": 0, "max_tokens": 300, "stream": True},
                        {"Cache-Control": "no-cache"})
        for index in range(streams)
    ]
    for client in clients:
        client.wait_for_headers()
    return clients


def assert_one_coherent_generation(records: list[dict], text: str, tokenizer) -> None:
    """Check a run's pieces are the text sent, and that its tokens decode to that text as one sequence."""
    pieces = [record for record in records if record["k"] == "piece"]
    assert "".join(record["text"] for record in pieces) == text
    tokens = [int(token) for record in pieces for token in record["ids"].split()]
    assert tokenizer.decode(tokens, skip_special_tokens=True) == text


def redis_now_ms(redis) -> int:
    """Return Redis's clock in milliseconds, the unit of stream record ids."""
    seconds, microseconds = redis.time()
    return seconds * 1000 + microseconds // 1000


def flights_since(redis, since_ms: int) -> dict[bytes, list[dict]]:
    """Return the records of every flight stream begun since a Redis time."""
    found = {}
    for key in redis.keys("corechat:v2:flight:*"):
        entries = redis.xrange(key)
        if entries and int(entries[0][0].split(b"-")[0]) >= since_ms:
            found[key] = [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in entries]
    return found


def test_leader_closed_mid_stream_under_load_is_continued_as_one_generation(
    two_workers, one_worker, shared_redis, tiny_model_dir
):
    redis = redis_client.Redis(port=shared_redis.port)
    since = redis_now_ms(redis)
    background = start_background_load(one_worker, 6, "A") + start_background_load(two_workers, 6, "B")
    leader = StreamingClient(one_worker.url, SEEDED)
    leader.wait_for_chunks(10)
    followers = [StreamingClient(two_workers.url, SEEDED) for _ in range(4)]
    for follower in followers:
        follower.wait_for_chunks(3)
    leader.hang_up()
    for follower in followers:
        follower.finish()
    for client in background:
        client.finish()

    assert leader.status == "miss" and [follower.status for follower in followers] == ["hit"] * 4
    assert all(follower.done and not follower.errors for follower in followers)
    assert all(follower.chunks == followers[0].chunks for follower in followers)
    assert followers[0].chunks[: len(leader.chunks)] == leader.chunks
    (records,) = flights_since(redis, since).values()
    kinds = [record["k"] for record in records]
    assert kinds[0] == "begin" and kinds[-1] == "end" and "piece" in kinds[kinds.index("abandoned"):]
    assert records[-1]["completion_tokens"] == "200"
    assert_one_coherent_generation(records, followers[0].text, AutoTokenizer.from_pretrained(tiny_model_dir))
    for server in (one_worker, two_workers):
        replay = StreamingClient(server.url, SEEDED).finish()
        assert replay.status == "hit" and replay.chunks == followers[0].chunks


def test_redis_killed_mid_flight_leaves_one_text_for_every_client_and_stores_it(one_worker, shared_redis):
    body = {**SEEDED, "seed": 12}
    background = start_background_load(one_worker, 8, "C")
    leader = StreamingClient(one_worker.url, body)
    leader.wait_for_chunks(5)
    followers = [StreamingClient(one_worker.url, body) for _ in range(3)]
    for follower in followers:
        follower.wait_for_chunks(5)
    shared_redis.stop()
    time.sleep(0.1)
    shared_redis.start()  # the same port, empty: the flight's lock and stream are gone
    for client in [leader, *followers, *background]:
        client.finish()
    assert (leader.status, [follower.status for follower in followers]) == ("miss", ["hit"] * 3)
    assert leader.done and all(follower.chunks == leader.chunks for follower in followers)
    # The worker left Redis alone while its breaker was open; the flight stored its reply once Redis was back.
    time.sleep(2.5)
    replay = StreamingClient(one_worker.url, body).finish()
    assert replay.status == "hit" and replay.chunks == leader.chunks


def open_slow_reader(server, body: dict) -> socket.socket:
    """Send a streamed request on a socket with a tiny receive buffer, and read only its first bytes."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload))
    received = b""
    while b"X-Cache: miss" not in received or b'"content":"' not in received:
        received += sock.recv(1024)
    return sock


def generations_by_worker(server) -> dict[int, int]:
    """Return the generations each worker finished, asking until every worker answered."""
    for _ in range(20):
        finished = finished_by_worker(server)
        if len(finished) == server.workers:
            return finished
    raise AssertionError(f"only workers {sorted(finished)} answered")


def test_a_slow_leader_client_keeps_the_lease_and_nobody_generates_twice(two_workers, one_worker, shared_redis):
    body = {**SEEDED, "temperature": 0, "max_tokens": 600}
    before = generations_by_worker(two_workers)
    slow = open_slow_reader(one_worker, body)
    try:
        follower = StreamingClient(two_workers.url, body)
        # The leader's client reads nothing for longer than the lease: the worker renews it anyway.
        time.sleep(4)
        follower.finish()
        assert follower.status == "hit" and follower.done and len(follower.chunks) > 100
        assert generations_by_worker(two_workers) == before  # the follower's host generated nothing
        received = b""
        while chunk := slow.recv(65536):
            received += chunk
    finally:
        slow.close()
    # The raw HTTP/1.1 bytes: headers and chunk sizes around the events.
    leader_text = "".join(payload["choices"][0]["delta"].get("content", "")
                          for payload in sse_payloads(received, strict=False)
                          if payload != DONE and "id" in payload and payload["choices"])
    assert follower.text.endswith(leader_text) and len(leader_text) > len(follower.text) // 2


def test_a_leader_reset_before_its_first_byte_stops_its_generation_within_a_few_tokens(one_worker, shared_redis):
    """The first write fails and the generation is abandoned a few of the tiny model's steps later (how many
    depends on when the request thread runs beside the engine's), not at its 4000 tokens."""
    body = {**SEEDED, "temperature": 0, "max_tokens": 4000, "messages": [{"role": "user", "content": "Reset me."}]}
    redis = redis_client.Redis(port=shared_redis.port)
    since = redis_now_ms(redis)
    sock = socket.create_connection(("127.0.0.1", one_worker.port))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # a reset: the server's first write fails
    deadline = time.monotonic() + 60
    while not [records for records in flights_since(redis, since).values() if records[-1]["k"] == "abandoned"]:
        assert time.monotonic() < deadline, "the generation was never abandoned"
        time.sleep(0.05)
    (records,) = flights_since(redis, since).values()
    generated = sum(len(record["ids"].split()) for record in records if record["k"] == "piece")
    log.info("the reset leader's generation stopped after %d tokens", generated)
    assert generated <= 32
    assert redis.keys("corechat:v2:lock:*") == []
    assert all(worker["running"] == 0 for worker in ready_facts(one_worker).values())
    wait_for_samples(one_worker, lambda samples: value(samples, "corechat_requests_running")
                     + value(samples, "corechat_requests_waiting") == 0)


def prompt_failures(*servers) -> int:
    """Count the engine's failed prompt passes in the servers' logs."""
    return sum(server.log().count("prompt pass failed") for server in servers)


def test_a_failed_takeover_fails_its_followers_once_with_x_cache_on_every_error(two_workers, one_worker,
                                                                              shared_redis):
    body = {"messages": [{"role": "user", "content": "Fail me once."}], "temperature": 0, "max_tokens": 4000,
            "stream": True}
    redis = redis_client.Redis(port=shared_redis.port)
    since = redis_now_ms(redis)
    first = StreamingClient(one_worker.url, body)
    first.wait_for_chunks(1)
    first.hang_up()
    (stream,) = flights_since(redis, since)
    deadline = time.monotonic() + 60
    while redis.xrange(stream)[-1][1][b"k"] != b"abandoned":
        assert time.monotonic() < deadline, "the first generation was never abandoned"
        time.sleep(0.05)
    # What a worker that took the run over and died left: its lock, and a last piece whose token the model
    # cannot take, so the next worker to continue the run fails in its prompt pass.
    run = redis.xrange(stream)[0][1][b"run"].decode()
    redis.xadd(stream, {"k": "piece", "run": run, "text": "?", "ids": str(10**9)})
    redis.set(stream.replace(b":flight:", b":lock:"), "dead-worker", px=3000)
    failures_before = prompt_failures(one_worker, two_workers)
    clients = [StreamingClient(server.url, body) for server in (one_worker, two_workers, two_workers)]
    whole = requests.post(f"{two_workers.url}/v1/chat/completions", json={**body, "stream": False}, timeout=120)
    for client in clients:
        client.finish()
    assert {client.status for client in clients} == {"hit"}  # all followed the dead worker's run
    assert all(client.errors and client.done for client in clients)
    assert whole.status_code == 500 and whole.headers["X-Cache"] in ("hit", "miss")
    assert prompt_failures(one_worker, two_workers) - failures_before == 1
    for response in (
        requests.post(f"{two_workers.url}/v1/chat/completions", json={"messages": []}, timeout=10),
        requests.post(f"{two_workers.url}/v1/chat/completions", json={**body, "model": "other"}, timeout=10),
        requests.get(f"{two_workers.url}/v1/chat/completions", timeout=10),
    ):
        assert response.status_code in (400, 404, 405) and response.headers["X-Cache"] == "bypass"
