"""The HTTP front of a worker (service/process/worker.py) under real Gunicorn with its default settings:
requests are read whole in the event loop before a thread takes them, errors Gunicorn and the
worker raise are OpenAI-shaped, and a half-closed client is not a gone one.
"""

import json
import socket
import statistics
import time

import pytest

from harness import COUNTING, scrape, value, wait_for_samples
from harness.loadgen import (
    CHAT,
    STALLED_PER_KIND,
    STALLS,
    Exchange,
    chat_exchange,
    probe_exchanges,
    raw_exchange,
    run_exchanges,
)
from service.settings import Settings
from tests.e2e.never_readers import NEVER_READING, PROBE_INTERVAL_SECONDS, Prober, never_reading_stream, plain

pytestmark = pytest.mark.serial

DEFAULTS = Settings.model_construct()
PROBES = ("/healthz", "/readyz", "/metrics")
FAST_SECONDS = 0.1


def assert_openai_error(exchange: Exchange, status: int, code: str) -> dict:
    """Check an exchange ended in OpenAI's error shape with this status and code; return the error."""
    assert exchange.error is None, exchange.error
    assert exchange.status == status, (exchange.status, bytes(exchange.received))
    assert exchange.response_headers["content-type"] == "application/json"
    error = exchange.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return error


def test_stalled_clients_hold_no_thread_and_get_408_after_the_arrival_limit(default_server):
    stalled = {kind: [raw_exchange(raw) for _ in range(STALLED_PER_KIND)] for kind, raw in STALLS.items()}
    probes = probe_exchanges(PROBES, every=0.05, during=3.0, start_after=0.5)
    began = time.monotonic()
    run_exchanges(default_server.port, [*sum(stalled.values(), []), *probes],
                  timeout=DEFAULTS.request_arrival_seconds + 10)

    assert all(probe.status == 200 for probe in probes), [(probe.status, probe.error) for probe in probes]
    for target in PROBES:
        seconds = [probe.seconds_to_status for probe in probes if probe.target == target]
        assert statistics.median(seconds) < FAST_SECONDS, (target, sorted(seconds))
    for kind, exchanges in stalled.items():
        for exchange in exchanges:
            error = assert_openai_error(exchange, 408, "request_timeout")
            assert f"{DEFAULTS.request_arrival_seconds:g} seconds" in error["message"]
            # Answered after the limit, not long after it (the event loop checks once a second).
            limit = DEFAULTS.request_arrival_seconds
            assert limit <= exchange.status_at - began <= limit + 5
        expected = [100] if "Expect" in kind else []
        assert {tuple(exchange.informational) for exchange in exchanges} == {tuple(expected)}, kind


def internal_errors(server) -> float:
    """Return how many chat requests the server counted as internal errors."""
    return value(scrape(server), "corechat_requests_total", outcome="internal_error")


def test_malformed_chunk_size_gets_400_in_openai_shape_and_is_no_internal_error(default_server):
    before = internal_errors(default_server)
    exchange = raw_exchange(CHAT + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n")
    run_exchanges(default_server.port, [exchange], timeout=10)
    assert_openai_error(exchange, 400, "malformed_request")
    assert internal_errors(default_server) == before
    assert "unhandled error" not in default_server.log()


def test_errors_gunicorn_raises_itself_are_openai_shaped(default_server):
    too_long_line = raw_exchange(b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: localhost\r\n\r\n")
    too_large_field = raw_exchange(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"b" * 9000 + b"\r\n\r\n")
    bad_header_name = raw_exchange(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nBad{Name}: x\r\n\r\n")
    too_large_body = raw_exchange(CHAT + b"Content-Length: %d\r\n\r\n" % (DEFAULTS.max_request_bytes + 1))
    run_exchanges(default_server.port, [too_long_line, too_large_field, bad_header_name, too_large_body], timeout=10)
    assert_openai_error(too_long_line, 414, "request_line_too_long")
    assert_openai_error(too_large_field, 431, "request_headers_too_large")
    assert_openai_error(bad_header_name, 400, "malformed_request")
    assert_openai_error(too_large_body, 413, "request_too_large")


def test_expect_100_continue_gets_its_interim_answer_and_the_reply(default_server):
    body = json.dumps({"messages": COUNTING, "max_tokens": 4}).encode()
    with socket.create_connection(("127.0.0.1", default_server.port), timeout=10) as sock:
        sock.sendall(CHAT + b"Connection: close\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
        assert sock.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        reply = b"".join(iter(lambda: sock.recv(65536), b""))
    assert reply.startswith(b"HTTP/1.1 200 ")
    assert reply.count(b"100 Continue") == 0


def test_pipelined_requests_on_one_kept_alive_connection_are_each_answered(default_server):
    body = json.dumps({"messages": COUNTING, "max_tokens": 2}).encode()
    chat = CHAT + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    last = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", default_server.port), timeout=10) as sock:
        sock.sendall(chat + chat + last)
        replies = b"".join(iter(lambda: sock.recv(65536), b""))
    assert replies.count(b"HTTP/1.1 200 OK") == 3, replies
    assert replies.count(b'"object":"chat.completion"') == 2 and replies.endswith(b'{"status":"ok"}\n')


def test_half_closed_client_gets_the_whole_reply(default_server):
    exchange = chat_exchange({"messages": COUNTING, "max_tokens": 40, "temperature": 0}, half_close=True)
    run_exchanges(default_server.port, [exchange], timeout=60)
    assert exchange.error is None and exchange.status == 200, (exchange.error, bytes(exchange.received))
    choice = exchange.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"]
    assert set(exchange.informational) <= {100}


def test_client_that_closes_a_non_streamed_request_frees_its_engine_slot(default_server):
    body = json.dumps({"messages": COUNTING, "max_tokens": 4000, "temperature": 0}).encode()
    sock = socket.create_connection(("127.0.0.1", default_server.port), timeout=10)
    sock.sendall(CHAT + b"Cache-Control: no-cache\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    wait_for_samples(default_server, lambda samples: value(samples, "corechat_requests_running") == 1, timeout=10)
    sock.close()
    closed_at = time.monotonic()
    wait_for_samples(default_server, lambda samples: value(samples, "corechat_requests_running") == 0, timeout=10)
    assert time.monotonic() - closed_at < 2.0


# A stream long enough to fill any socket buffer long before it ends.
# Twenty alternatives per token make a reply of many megabytes: more than the kernel buffers on
# loopback (a send buffer autotunes up to 4 MiB), so every such stream blocks and meets the deadline.
LONG_STREAM = {"messages": COUNTING, "max_tokens": DEFAULTS.max_tokens_limit, "stream": True, "temperature": 0,
               "logprobs": True, "top_logprobs": 20}


def test_clients_that_never_read_lose_their_places_at_the_send_deadline(default_server):
    """60 streams whose clients never read, above the defaults' capacity: a fresh request is served or
    refused at once throughout, probed every second from before the places fill until after the send
    deadline freed them, and the streams that filled their buffers are cut at SEND_TIMEOUT_SECONDS,
    their generations cancelled and counted."""
    before = scrape(default_server)
    connect = plain(default_server.port)
    with Prober(connect) as prober:
        clients = [never_reading_stream(connect, LONG_STREAM) for _ in range(NEVER_READING)]
        try:
            wait_for_samples(default_server, lambda samples: value(samples, "corechat_requests_running") > 0,
                             timeout=30)
            running = 2 * DEFAULTS.max_running
            cut = wait_for_samples(
                default_server,
                lambda samples: (value(samples, "corechat_send_timeouts_total")
                                 - value(before, "corechat_send_timeouts_total")) >= running,
                timeout=DEFAULTS.send_timeout_seconds + 60,
            )
            time.sleep(3 * PROBE_INTERVAL_SECONDS)
        finally:
            for sock in clients:
                sock.close()
    assert len(prober.answers) >= 2 * DEFAULTS.send_timeout_seconds / (PROBE_INTERVAL_SECONDS + 1)
    assert not prober.late_or_unanswered({"chat": {200, 503}, "quick": {200}}), prober.answers
    assert {503} <= {status for kind, status, _ in prober.answers if kind == "chat"}  # the places did fill
    cancelled = value(cut, "corechat_requests_total", outcome="cancelled") - value(
        before, "corechat_requests_total", outcome="cancelled")
    assert cancelled >= running
    log = default_server.log_path.read_text(errors="replace")
    assert "read nothing of its response" in log
    # The refusals of the requests beyond the places are in the access log.
    assert '"POST /v1/chat/completions HTTP/1.1" 503' in log
    wait_for_samples(
        default_server,
        lambda samples: value(samples, "corechat_requests_running") == value(samples, "corechat_requests_waiting") == 0,
        timeout=60,
    )
