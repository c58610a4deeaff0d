"""Overload, client disconnects and worker faults, through real Gunicorn over real HTTP.

The single-slot server runs one worker with MAX_RUNNING=1 and MAX_QUEUE=1, so a generation that
leaked its slot (or a queue place) would visibly block or refuse the next request.
"""

import json
import os
import signal
import socket
import time

import pytest
import requests

from harness import COUNTING, ready_facts
from tests.support import wait_until

# Long enough to outlast every test step; the server's max_generation_seconds ends it in bounded time.
ENDLESS = {"messages": COUNTING, "max_tokens": 30_000, "temperature": 0}
GENERATION_SECONDS = 8
TOKEN = b'"delta":{"content":"'  # a generated token, not the role chunk sent before generation starts
DONE = b"data: [DONE]\n\n\r\n0\r\n\r\n"  # the last SSE event and the end of the chunked body
LIVENESS_SECONDS = 3.0  # far below GENERATION_SECONDS: a leaked slot would hold the next request longer


@pytest.fixture(scope="module")
def single_slot_server(gunicorn):
    """Run one worker that generates one sequence at a time and queues one more."""
    with gunicorn(workers=1, max_running=1, max_queue=1, max_tokens_limit=100_000,
                  max_generation_seconds=GENERATION_SECONDS, sse_ping_seconds=0.1) as server:
        yield server


def readyz(server) -> dict:
    """Return one worker's /readyz body."""
    return requests.get(f"{server.url}/readyz", headers={"Connection": "close"}, timeout=10).json()


def wait_engine_idle(server, timeout: float = 60) -> None:
    """Wait until the single worker runs and queues nothing (the previous test's leftovers ended)."""
    def idle() -> bool:
        """Tell whether the worker runs and queues nothing."""
        facts = readyz(server)
        return facts["running"] + facts["waiting"] == 0

    assert wait_until(idle, timeout)


class RawStream:
    """A chat request on its own socket, read by hand so the test decides when to hang up."""

    def __init__(self, server, body: dict):
        payload = json.dumps(body).encode()
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        # no-cache: identical greedy requests would otherwise share one generation through the cache.
        self.sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Cache-Control: no-cache\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload)
        )
        self.received = b""

    def read_until(self, marker: bytes) -> None:
        """Read until marker has arrived."""
        while marker not in self.received:
            chunk = self.sock.recv(65536)
            assert chunk, f"connection closed before {marker!r}: {self.received[-300:]!r}"
            self.received += chunk

    def read_to_end(self) -> bytes:
        """Read until the server closes or ends the stream; return everything received."""
        while not self.received.endswith(DONE) and (chunk := self.sock.recv(65536)):
            self.received += chunk
        return self.received

    def hang_up(self) -> None:
        """Close the connection as a client that goes away does."""
        self.sock.close()


def time_a_one_token_request(server) -> float:
    """Return the seconds a one-token request takes from send to reply."""
    began = time.monotonic()
    response = requests.post(
        f"{server.url}/v1/chat/completions", json={"messages": COUNTING, "max_tokens": 1}, timeout=60
    )
    assert response.status_code == 200, response.text
    return time.monotonic() - began


def test_full_queue_gets_503_with_retry_after_at_once_and_accepted_requests_complete(single_slot_server):
    wait_engine_idle(single_slot_server)
    running = RawStream(single_slot_server, {**ENDLESS, "stream": True})
    running.read_until(TOKEN)  # generating: the one slot is taken
    queued = RawStream(single_slot_server, {**ENDLESS, "max_tokens": 5, "stream": True})
    queued.read_until(b": ping")  # waiting: the one queue place is taken
    facts = readyz(single_slot_server)
    assert (facts["running"], facts["waiting"]) == (1, 1)

    began = time.monotonic()
    refused = requests.post(f"{single_slot_server.url}/v1/chat/completions", json={"messages": COUNTING}, timeout=10)
    refusal_seconds = time.monotonic() - began
    assert refused.status_code == 503
    assert refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["code"] == "overloaded"
    assert refused.headers["X-Cache"] == "bypass"  # a reply no sampling seed makes reproducible
    assert refusal_seconds < 2.0, refusal_seconds  # a liveness bound, far above what a refusal takes

    assert running.read_to_end().endswith(DONE)
    assert queued.read_to_end().endswith(DONE)
    assert b'"finish_reason":"length"' in queued.received


def test_hanging_up_mid_stream_frees_the_slot_for_the_next_request(single_slot_server):
    wait_engine_idle(single_slot_server)
    stream = RawStream(single_slot_server, {**ENDLESS, "stream": True})
    stream.read_until(TOKEN)
    assert readyz(single_slot_server)["running"] == 1
    stream.hang_up()
    assert time_a_one_token_request(single_slot_server) < LIVENESS_SECONDS
    assert wait_until(lambda: readyz(single_slot_server)["running"] == 0, 5)


def test_hanging_up_while_queued_frees_the_queue_place(single_slot_server):
    wait_engine_idle(single_slot_server)
    blocker = RawStream(single_slot_server, {**ENDLESS, "stream": True})
    blocker.read_until(TOKEN)
    queued = RawStream(single_slot_server, {**ENDLESS, "stream": True})
    queued.read_until(b": ping")
    assert readyz(single_slot_server)["waiting"] == 1
    queued.hang_up()  # the next `: ping` write fails, which cancels the queued generation
    assert wait_until(lambda: readyz(single_slot_server)["waiting"] == 0, LIVENESS_SECONDS)
    blocker.hang_up()
    assert time_a_one_token_request(single_slot_server) < LIVENESS_SECONDS


def test_hanging_up_on_a_non_streamed_request_stops_its_generation(single_slot_server):
    wait_engine_idle(single_slot_server)
    waiting_whole = RawStream(single_slot_server, ENDLESS)
    assert wait_until(lambda: readyz(single_slot_server)["running"] == 1, LIVENESS_SECONDS)
    waiting_whole.hang_up()  # nothing is written until the end: the socket is watched instead
    assert time_a_one_token_request(single_slot_server) < LIVENESS_SECONDS


def test_hanging_up_on_a_queued_non_streamed_request_frees_the_queue_place(single_slot_server):
    wait_engine_idle(single_slot_server)
    blocker = RawStream(single_slot_server, {**ENDLESS, "stream": True})
    blocker.read_until(TOKEN)
    queued_whole = RawStream(single_slot_server, ENDLESS)
    assert wait_until(lambda: readyz(single_slot_server)["waiting"] == 1, LIVENESS_SECONDS)
    queued_whole.hang_up()
    assert wait_until(lambda: readyz(single_slot_server)["waiting"] == 0, LIVENESS_SECONDS)
    blocker.hang_up()


@pytest.fixture(scope="module")
def two_worker_server(gunicorn):
    """Run two workers whose generations end after a few seconds. The module's last test stops it."""
    with gunicorn(workers=2, max_tokens_limit=100_000, max_generation_seconds=5, sse_ping_seconds=0.2,
                  graceful_timeout=30) as server:
        yield server


def busy_workers(server) -> dict[int, int]:
    """Return, for every worker, how many generations it runs or queues."""
    return {pid: facts["running"] + facts["waiting"] for pid, facts in ready_facts(server).items()}


def test_worker_killed_mid_stream_ends_only_its_streams_and_is_replaced(two_worker_server):
    streams = []
    while len(streams) < 8:
        stream = RawStream(two_worker_server, {**ENDLESS, "stream": True})
        stream.read_until(TOKEN)
        streams.append(stream)
        counts = busy_workers(two_worker_server)
        if len(counts) == 2 and all(counts.values()):
            break
    assert all(counts.values()), f"every stream landed on one worker: {counts}"
    victim = next(iter(counts))
    os.kill(victim, signal.SIGKILL)

    ends = [stream.read_to_end() for stream in streams]  # a hang here fails on the socket timeout
    complete = [received for received in ends if received.endswith(DONE)]
    assert len(streams) - len(complete) == counts[victim]  # the victim's clients saw a cut stream
    assert len(complete) == sum(count for pid, count in counts.items() if pid != victim)

    two_worker_server.wait_ready(120)
    assert victim not in two_worker_server.worker_pids()
    assert len(two_worker_server.worker_pids()) == 2


def test_sigterm_lets_in_flight_streams_finish(two_worker_server):
    """Runs last on two_worker_server (after a worker of it was killed and replaced): it stops it."""
    stream = RawStream(two_worker_server, {**ENDLESS, "stream": True})
    stream.read_until(TOKEN)
    began = time.monotonic()
    two_worker_server.process.send_signal(signal.SIGTERM)
    assert stream.read_to_end().endswith(DONE)
    assert b'"finish_reason":"length"' in stream.received
    assert two_worker_server.process.wait(30) == 0
    assert time.monotonic() - began < 30  # graceful_timeout
