"""The response cache in-process: keys, replay, storage rules, fail-open and single-flight takeover.

Every behaviour is checked against a real redis-server and, where the embedded store shares it, the
in-process store too.
"""

import re
import socket
import threading
import time

import pytest

from harness import DONE, RedisServer, sse_payloads
from service.api.chat_request import parse_chat_request
from service.app import create_app
from service.cache import CachedReply, cache_key
from service.cache.entries import FlightRecord, flight_key, lock_key, reply_key
from service.engine import Finished, TextDelta

USER = [{"role": "user", "content": "Write a haiku about CPUs."}]
GREEDY = {"messages": USER, "max_tokens": 12, "temperature": 0}


def build_app(make_settings, engine, redis_url: str = "", **overrides):
    """Return an app on the shared engine with the cache on Redis (a URL) or in process (empty)."""
    settings = make_settings(max_model_len=256, redis_url=redis_url, cache_breaker_seconds=0.3, **overrides)
    return create_app(settings, engine=engine)


@pytest.fixture(params=["redis", "local"])
def backend(request, tmp_path):
    """Yield the REDIS_URL of each backend: a real redis-server, then the in-process store."""
    if request.param == "local":
        yield ""
        return
    server = RedisServer(tmp_path).start()
    yield server.url
    server.stop()


def post(app, body, headers=None):
    """POST a chat completion through a fresh test client, unbuffered so streams can be read lazily."""
    return app.test_client().post("/v1/chat/completions", json=body, headers=headers or {}, buffered=False)


def content_chunks(body: str) -> list[str]:
    """Return the content deltas of an SSE body in order."""
    return [payload["choices"][0]["delta"]["content"] for payload in sse_payloads(body)
            if payload != DONE and payload["choices"] and payload["choices"][0]["delta"].get("content")]


def without_ids(text: str) -> str:
    """Blank out what differs between two replies to the same request: ids, timestamps, keep-alive
    pings, and how many prompt tokens were not computed (a replay computes none, a pass reuses a prefix)."""
    text = re.sub(r'"cached_tokens":\d+', '"cached_tokens":0', text.replace(": ping\n\n", ""))
    return re.sub(r'"created":\d+', '"created":0', re.sub(r"chatcmpl-[0-9a-f]+", "chatcmpl-x", text))


def key_of(app, body) -> str:
    """Return the store key of a request's reply, computed as the view does."""
    core = app.extensions["corechat"]
    with app.app_context():
        prepared = core.chat.prepare(parse_chat_request(body))
    return cache_key(core.engine.fingerprint, "", prepared.prompt_ids, prepared.params)


def test_tools_and_response_formats_key_their_own_replies_and_logprobs_bypass(make_settings, engine, backend):
    app = build_app(make_settings, engine, backend)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    variants = [GREEDY, {**GREEDY, "tools": [tool]}, {**GREEDY, "tools": [tool], "tool_choice": "required"},
                {**GREEDY, "response_format": {"type": "json_object"}}, {**GREEDY, "repetition_penalty": 1.2},
                {**GREEDY, "structured_outputs": {"regex": "[0-9]+"}},
                {**GREEDY, "structured_outputs": {"regex": "[a-z]+"}},
                {**GREEDY, "structured_outputs": {"choice": ["a", "b"]}}, {**GREEDY, "grammar": "root ::= [0-9]+"}]
    assert len({key_of(app, body) for body in variants}) == len(variants)
    with_logprobs = {**GREEDY, "logprobs": True}
    assert [post(app, with_logprobs).headers["X-Cache"] for _ in range(2)] == ["bypass", "bypass"]


def test_same_rendered_prompt_from_different_json_shares_an_entry(make_settings, engine, backend):
    app = build_app(make_settings, engine, backend)
    as_parts = {**GREEDY, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Write a haiku "}, {"type": "text", "text": "about CPUs."}]}]}
    as_developer = {**GREEDY, "messages": [{"role": "developer", "content": "Be brief."}, *USER]}
    as_system = {**GREEDY, "messages": [{"role": "system", "content": "Be brief."}, *USER]}
    assert post(app, GREEDY).headers["X-Cache"] == "miss"
    assert post(app, as_parts).headers["X-Cache"] == "hit"
    assert post(app, as_developer).headers["X-Cache"] == "miss"
    assert post(app, as_system).headers["X-Cache"] == "hit"


# Hits ---------------------------------------------------------------------------------------


def test_hit_replays_the_original_bytes_in_both_modes(make_settings, engine, backend):
    app = build_app(make_settings, engine, backend)
    body = {**GREEDY, "stream": True, "stream_options": {"include_usage": True}}
    fresh = post(app, body)
    fresh_text = fresh.get_data(as_text=True)
    replayed = post(app, body)
    assert (fresh.headers["X-Cache"], replayed.headers["X-Cache"]) == ("miss", "hit")
    assert without_ids(replayed.get_data(as_text=True)) == without_ids(fresh_text)
    assert len(content_chunks(fresh_text)) > 1
    whole = post(app, GREEDY)
    assert whole.headers["X-Cache"] == "hit"
    uncached = post(app, GREEDY, {"Cache-Control": "no-cache"})
    assert without_ids(whole.get_data(as_text=True)) == without_ids(uncached.get_data(as_text=True))
    assert whole.get_json()["usage"]["completion_tokens"] == 12
    assert whole.get_json()["choices"][0]["message"]["content"] == "".join(content_chunks(fresh_text))


def test_seeded_sampling_is_cached_and_unseeded_sampling_bypasses(make_settings, engine, backend):
    app = build_app(make_settings, engine, backend)
    sampled = {**GREEDY, "temperature": 0.8}
    assert [post(app, sampled).headers["X-Cache"] for _ in range(2)] == ["bypass", "bypass"]
    seeded = {**sampled, "seed": 7}
    assert [post(app, seeded).headers["X-Cache"] for _ in range(2)] == ["miss", "hit"]


def test_cache_control_no_cache_neither_reads_nor_writes(make_settings, engine, backend):
    app = build_app(make_settings, engine, backend)
    for _ in range(2):
        response = post(app, {**GREEDY, "stream": True}, {"Cache-Control": "max-age=0, No-Cache"})
        assert response.headers["X-Cache"] == "bypass"
        assert response.get_data(as_text=True).endswith("data: [DONE]\n\n")
    assert post(app, GREEDY).headers["X-Cache"] == "miss"
    assert post(app, GREEDY, {"Cache-Control": "no-store"}).headers["X-Cache"] == "bypass"


# Storage ------------------------------------------------------------------------------------


def test_reply_is_stored_with_the_configured_ttl(make_settings, engine, redis_server):
    app = build_app(make_settings, engine, redis_server.url, cache_ttl_seconds=1234)
    post(app, GREEDY).get_data()
    store = app.extensions["corechat_cache"].store
    ttl = store.client.ttl(reply_key(key_of(app, GREEDY)))
    assert 1200 < ttl <= 1234
    assert store.client.keys("corechat:v2:lock:*") == []


def test_reply_larger_than_the_cap_is_not_stored(make_settings, engine, backend):
    app = build_app(make_settings, engine, backend, cache_max_entry_bytes=10)
    assert [post(app, GREEDY).headers["X-Cache"] for _ in range(2)] == ["miss", "miss"]
    assert app.extensions["corechat_cache"].store.get(reply_key(key_of(app, GREEDY))) is None


def test_corrupt_entry_is_ignored_deleted_and_replaced(make_settings, engine, backend, caplog):
    app = build_app(make_settings, engine, backend)
    store = app.extensions["corechat_cache"].store
    key = reply_key(key_of(app, GREEDY))
    expected = post(app, GREEDY).get_json()["choices"][0]["message"]
    for garbage in (b"\xff\x00not json", b'[["a"],"cancelled",1,2]', b'{"pieces":[]}', b'[[1],"stop",1,2]'):
        store.put(key, garbage, 60)
        response = post(app, GREEDY)
        assert response.headers["X-Cache"] == "miss"
        assert response.get_json()["choices"][0]["message"] == expected
        CachedReply.decode(store.get(key))
    assert caplog.text.count("deleting corrupt cache entry") == 4


# Fail open ----------------------------------------------------------------------------------


def read_stream(response) -> str:
    """Read a whole SSE response and check it ended cleanly."""
    text = response.get_data(as_text=True)
    assert text.endswith("data: [DONE]\n\n") and '"error"' not in text
    return text


def wait_until_cached(app, body, timeout: float = 10) -> None:
    """Send a request until it is a hit (the breaker lets the store back in after a short pause).

    Each reply is read to its end: a stream dropped unread cancels its generation, which is then never stored.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = post(app, body)
        response.get_data()
        if response.headers["X-Cache"] == "hit":
            return
        time.sleep(0.1)
    raise AssertionError("the cache did not recover")


def test_requests_succeed_with_redis_absent_killed_midstream_and_back(make_settings, engine, tmp_path, caplog):
    redis = RedisServer(tmp_path)
    app = build_app(make_settings, engine, redis.url)
    body = {**GREEDY, "stream": True}
    for _ in range(3):
        response = post(app, body)
        assert response.headers["X-Cache"] == "bypass"
        read_stream(response)
    assert caplog.text.count("response cache store failed") == 1

    redis.start()
    wait_until_cached(app, body)

    other = {**body, "max_tokens": 13}
    leader = post(app, other)
    assert leader.headers["X-Cache"] == "miss"
    chunks = leader.iter_encoded()
    next(chunks)
    redis.stop()
    assert "".join(chunk.decode() for chunk in chunks).endswith("data: [DONE]\n\n")
    for _ in range(3):
        response = post(app, other)
        assert response.headers["X-Cache"] == "bypass"
        read_stream(response)

    redis.start()
    wait_until_cached(app, other)
    redis.stop()


def test_a_server_answering_garbage_is_treated_as_down(make_settings, engine):
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer_garbage():
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            with connection:
                connection.recv(1024)
                connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n\x00\xff")

    threading.Thread(target=answer_garbage, daemon=True).start()
    try:
        app = build_app(make_settings, engine, f"redis://127.0.0.1:{port}/0")
        for _ in range(2):
            response = post(app, GREEDY)
            assert response.status_code == 200
            assert response.headers["X-Cache"] == "bypass"
    finally:
        listener.close()


# Single-flight ------------------------------------------------------------------------------


def engine_pieces(app, body) -> list[TextDelta]:
    """Return the pieces, with their tokens, of an uncached generation of a request, as the app would ask."""
    core = app.extensions["corechat"]
    with app.app_context():
        prepared = core.chat.prepare(parse_chat_request(body))
    events = list(core.engine.submit(prepared.prompt_ids, prepared.params).events())
    return [event for event in events if isinstance(event, TextDelta)]


def leave_a_dead_leaders_run(app, body, pieces: list[TextDelta], lease_seconds: float, *, token_ids=None) -> None:
    """Leave in the store what a worker that died mid-reply leaves: its lock, not renewed, and its run."""
    store = app.extensions["corechat_cache"].store
    digest = key_of(app, body)
    assert store.acquire(lock_key(digest), "dead-leader", lease_seconds)
    records = [FlightRecord("begin", "run-1"), *(FlightRecord("piece", "run-1", piece) for piece in pieces)]
    for index, record in enumerate(records):
        assert store.append(lock_key(digest), "dead-leader", flight_key(digest), record.encode(), restart=index == 0)


def test_a_holder_whose_lease_lapsed_can_neither_write_renew_nor_release_after_a_takeover(backend):
    """The lock fences the flight stream's writes (what redis-py's Lock alone does not give): a leader
    that lost its lease never appends after, nor renews or frees the lock of, the worker that took over."""
    from service.cache.stores import LocalStore, RedisStore

    store = RedisStore(backend, connect_timeout=1.0, socket_timeout=1.0, wait_seconds=0.2) if backend else LocalStore(8)
    lock, stream = lock_key("fence"), flight_key("fence")
    assert store.acquire(lock, "leader", 0.3)
    assert store.append(lock, "leader", stream, {"k": "begin", "run": "first"}, restart=True)
    time.sleep(0.5)  # the leader stalls past its lease
    assert store.acquire(lock, "taker", 5.0)
    assert store.append(lock, "taker", stream, {"k": "begin", "run": "second"}, restart=True)
    assert not store.append(lock, "leader", stream, {"k": "piece", "run": "first", "text": "x", "ids": "1"})
    assert not store.renew(lock, "leader", 5.0, stream)
    store.release(lock, "leader")
    assert store.holder(lock) == "taker"
    assert [fields["run"] for _, fields in store.read_all(stream)] == ["second"]


def test_identical_requests_in_one_worker_cost_one_generation(make_settings, engine, backend):
    app = build_app(make_settings, engine, backend)
    body = {**GREEDY, "max_tokens": 16, "stream": True}
    finished_before = engine.facts.requests_finished
    replies = [None] * 4

    def ask(index):
        response = post(app, body)
        replies[index] = (response.headers["X-Cache"], content_chunks(read_stream(response)))

    threads = [threading.Thread(target=ask, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(status for status, _ in replies) == ["hit", "hit", "hit", "miss"]
    assert all(chunks == replies[0][1] for _, chunks in replies)
    assert engine.facts.requests_finished - finished_before == 1


def test_generation_goes_on_for_a_follower_in_the_worker_when_the_first_client_leaves(make_settings, engine, backend):
    app = build_app(make_settings, engine, backend)
    body = {**GREEDY, "max_tokens": 16, "stream": True}
    leader = post(app, body)
    assert leader.headers["X-Cache"] == "miss"
    leader_chunks = leader.iter_encoded()
    received = ""
    while not content_chunks(received):
        received += next(leader_chunks).decode()
    finished_before = engine.facts.requests_finished
    follower = post(app, body)
    leader.close()
    assert follower.headers["X-Cache"] == "hit"
    chunks = content_chunks(read_stream(follower))
    assert chunks[: len(content_chunks(received))] == content_chunks(received)
    assert engine.facts.requests_finished - finished_before == 1  # the one generation, not a second
    replayed = post(app, body)
    assert replayed.headers["X-Cache"] == "hit"
    assert content_chunks(read_stream(replayed)) == chunks


def test_a_worker_takes_over_the_run_of_one_whose_client_left_and_continues_its_tokens(make_settings, engine,
                                                                                      redis_server):
    leader_worker = build_app(make_settings, engine, redis_server.url)
    other_worker = build_app(make_settings, engine, redis_server.url)
    body = {**GREEDY, "max_tokens": 24, "temperature": 1.0, "seed": 11, "stream": True}
    leader = post(leader_worker, body)
    assert leader.headers["X-Cache"] == "miss"
    leader_chunks = leader.iter_encoded()
    received = ""
    while len(content_chunks(received)) < 3:
        received += next(leader_chunks).decode()
    follower = post(other_worker, body)
    assert follower.headers["X-Cache"] == "hit"
    follower_chunks = follower.iter_encoded()
    followed = ""
    while len(content_chunks(followed)) < 3:
        followed += next(follower_chunks).decode()
    leader.close()
    chunks = content_chunks(followed + "".join(chunk.decode() for chunk in follower_chunks))
    sent = content_chunks(received)
    assert chunks[: len(sent)] == sent
    records = [FlightRecord.decode(fields) for _, fields in
               redis_server_records(other_worker, body)]
    kinds = [record.kind for record in records]
    assert "abandoned" in kinds and kinds[-1] == "end"
    assert "piece" in kinds[kinds.index("abandoned"):]  # the other worker generated the rest
    tokens = [token for record in records if record.kind == "piece" for token in record.event.token_ids]
    assert engine.tokenizer.decode(tokens, skip_special_tokens=True) == "".join(chunks)
    assert records[-1].event.completion_tokens == 24
    replayed = post(leader_worker, body)
    assert replayed.headers["X-Cache"] == "hit"
    assert content_chunks(read_stream(replayed)) == chunks


def redis_server_records(app, body) -> list:
    """Return the records of a request's flight stream."""
    return app.extensions["corechat_cache"].store.read_all(flight_key(key_of(app, body)))


def test_a_worker_continues_the_run_of_one_that_died(make_settings, engine, backend):
    app = build_app(make_settings, engine, backend, cache_lease_seconds=0.5)
    body = {**GREEDY, "max_tokens": 16, "stream": True}
    pieces = engine_pieces(app, body)
    leave_a_dead_leaders_run(app, body, pieces[:2], 0.5)
    response = post(app, body)
    assert response.headers["X-Cache"] == "hit"
    chunks = content_chunks(read_stream(response))
    assert chunks[:2] == [piece.text for piece in pieces[:2]] and len(chunks) > 2
    replayed = post(app, body)
    assert replayed.headers["X-Cache"] == "hit"
    assert content_chunks(read_stream(replayed)) == chunks


def test_a_failed_generation_fails_every_reader_of_its_flight_once(make_settings, engine, backend, caplog):
    # The worker that takes the run over holds a lease of 2 s: with 0.5 s, a suite loading the machine once
    # let it lapse before the failure was written (a leader past its lease writes nothing), and the last
    # request below took the broken run over again. The dead leader's lease stays 0.5 s.
    app = build_app(make_settings, engine, backend, cache_lease_seconds=2.0)
    body = {**GREEDY, "max_tokens": 16, "stream": True}
    # A run whose tokens the model cannot take: continuing it fails in the engine's prompt pass.
    broken = TextDelta("?", (10**9,))
    leave_a_dead_leaders_run(app, body, [broken], 0.5)
    replies = [None] * 3

    def ask(index):
        response = post(app, body)
        replies[index] = response.get_data(as_text=True)

    threads = [threading.Thread(target=ask, args=(index,)) for index in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert all('"error"' in reply and reply.endswith("data: [DONE]\n\n") for reply in replies)
    assert caplog.text.count("prompt pass failed") == 1
    whole = post(app, {**body, "stream": False})
    assert whole.status_code == 200 and whole.headers["X-Cache"] == "miss"  # a new run, after the failed one


def test_a_cancelled_cache_source_still_ends_with_a_last_event(make_settings, engine):
    """A reader that cancels, then waits for the last event (as a non-streamed reply does when its
    client hangs up), gets one at once instead of waiting forever."""
    from service.engine import Started

    app = build_app(make_settings, engine)
    post(app, GREEDY).get_data()
    core = app.extensions["corechat"]
    with app.test_request_context():
        prepared = core.chat.prepare(parse_chat_request(GREEDY))
        source, status = app.extensions["corechat_cache"].open(prepared, engine.fingerprint, core.chat.start)
    assert status == "hit"
    assert isinstance(source.next_event(timeout=1), Started)
    source.cancel()
    began = time.monotonic()
    last = source.next_event(timeout=1)
    assert isinstance(last, Finished) and last.finish_reason == "cancelled"
    assert time.monotonic() - began < 0.5
    assert list(source.events())[-1].finish_reason == "cancelled"
