"""End to end through the shipped nginx config, started on loopback in front of real Gunicorn."""

import os
import signal
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from harness import COUNTING, DONE, sse_payload
from service.settings import Settings
from tests.e2e.deploy_support import NginxServer
from tests.e2e.never_readers import NEVER_READING, Prober, never_reading_stream, tls
from tests.support import wait_until

LONG_REPLY = {"messages": COUNTING, "max_tokens": 1500, "temperature": 0}
# nginx's read timeout for the stream route in these tests, and the ping interval well inside it.
READ_TIMEOUT_SECONDS = 2
PING_SECONDS = 0.5
# Long generations end at this cap (finish_reason "length"), which keeps the tests' duration bounded.
GENERATION_CAP_SECONDS = 5
DEFAULTS = Settings.model_construct()
# How long the probes go on once the never-readers fill the places.
FULL_SECONDS = 15
# A stream of many megabytes (twenty alternatives a token), more than nginx and the kernel buffer.
NEVER_READ_STREAM = {"messages": COUNTING, "max_tokens": DEFAULTS.max_tokens_limit, "stream": True,
                     "temperature": 0, "logprobs": True, "top_logprobs": 20}


def start_stack(gunicorn, nginx_dir, **settings):
    """Start one single-worker Gunicorn and nginx in front of it; return both."""
    upstream = gunicorn(workers=1, max_model_len=4096, sse_ping_seconds=PING_SECONDS,
                        max_generation_seconds=GENERATION_CAP_SECONDS, **settings)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify_path = upstream.log_path.parent / "notify"
    notify.bind(str(notify_path))
    upstream.env["NOTIFY_SOCKET"] = str(notify_path)
    upstream.start()
    notify.settimeout(10)
    upstream.notifications = notify.recv(4096).decode()
    notify.close()
    nginx = NginxServer(nginx_dir, [upstream.port], read_timeout=f"{READ_TIMEOUT_SECONDS}s")
    return upstream, nginx.start()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, gunicorn):
    """Gunicorn (one worker, one running sequence) behind the shipped nginx config."""
    upstream, nginx = start_stack(gunicorn, tmp_path_factory.mktemp("nginx"), max_running=1)
    yield upstream, nginx
    nginx.stop()
    upstream.stop()


def read_stream(nginx: NginxServer, body: dict, events: list, on_first_data=None) -> None:
    """Stream a chat reply through nginx, appending (kind, arrival time) for every SSE line as it arrives."""
    with requests.post(f"{nginx.url}/v1/chat/completions", json={**body, "stream": True}, stream=True, timeout=60,
                       verify=nginx.ca_file) as response:
        assert response.status_code == 200, response.text
        for line in response.iter_lines(decode_unicode=True):
            now = time.monotonic()
            payload = sse_payload(line)
            if line.startswith(": ping"):
                events.append(("ping", now))
            elif payload == DONE:
                events.append(("done", now))
            elif payload is not None:
                content = any(choice.get("delta", {}).get("content") for choice in payload.get("choices", []))
                events.append(("content" if content else "data", now))
                if on_first_data:
                    on_first_data()
                    on_first_data = None


def occupy_engine(url: str, finished: dict) -> threading.Thread:
    """Start a long non-streamed generation that holds the single engine slot, and wait until it runs."""

    def generate():
        """Generate until the length cap and note when it ended."""
        requests.post(
            f"{url}/v1/chat/completions",
            json=LONG_REPLY,
            timeout=60,
        )
        finished["at"] = time.monotonic()

    thread = threading.Thread(target=generate)
    thread.start()
    deadline = time.monotonic() + 30
    while requests.get(f"{url}/readyz", timeout=5).json()["running"] < 1:
        assert time.monotonic() < deadline, "the occupying generation never started"
        time.sleep(0.05)
    return thread


def test_gunicorn_tells_systemd_it_is_ready(stack):
    gunicorn, _ = stack
    assert "READY=1" in gunicorn.notifications


def test_queued_stream_is_unbuffered_and_kept_alive_by_pings_past_the_read_timeout(stack):
    """The stream waits behind another generation for longer than nginx's read timeout.

    Its first chunk reaches the client while it still waits (nginx does not buffer), and the `: ping`
    comments keep nginx from cutting the silent connection with a 504.
    """
    gunicorn, nginx = stack
    occupier_finished = {}
    occupier = occupy_engine(gunicorn.url, occupier_finished)
    events = []
    read_stream(nginx, {"messages": COUNTING, "max_tokens": 50}, events)
    occupier.join()
    kinds = [kind for kind, _ in events]
    first_data_at = next(at for kind, at in events if kind == "data")
    first_content_at = next(at for kind, at in events if kind == "content")
    assert first_data_at < occupier_finished["at"], "the first chunk was held back until the generation ahead ended"
    assert first_content_at - first_data_at > READ_TIMEOUT_SECONDS, "the stream did not wait long enough to test"
    assert kinds.count("ping") >= 2
    assert kinds[-1] == "done"


def test_stream_first_chunk_arrives_long_before_generation_ends(stack):
    _, nginx = stack
    events = []
    read_stream(nginx, LONG_REPLY, events)
    contents = [at for kind, at in events if kind == "content"]
    assert events[-1][0] == "done"
    assert len(contents) >= 3
    # The first token arrives in the first half of the stream's life, not in one burst at its end.
    started_at, ended_at = events[0][1], events[-1][1]
    assert contents[0] - started_at < 0.5 * (ended_at - started_at)


def test_https_reaches_gunicorn_with_hsts_and_plain_http_is_redirected_to_it(stack):
    _, nginx = stack
    response = requests.get(f"{nginx.url}/v1/models", timeout=10, verify=nginx.ca_file)
    assert response.status_code == 200 and response.json()["object"] == "list"
    assert response.headers["Strict-Transport-Security"] == "max-age=31536000"
    redirect = requests.post(f"{nginx.http_url}/v1/chat/completions?a=1", json={}, timeout=10, allow_redirects=False)
    assert redirect.status_code == 308
    assert redirect.headers["Location"] == f"{nginx.url}/v1/chat/completions?a=1"


def test_a_client_above_the_rate_limit_gets_429_in_openai_shape_then_is_served_again(stack):
    _, nginx = stack

    def get_models(_) -> requests.Response:
        """Ask for the model list over TLS."""
        return requests.get(f"{nginx.url}/v1/models", timeout=10, verify=nginx.ca_file)

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(get_models, range(150)))
    limited = [response for response in responses if response.status_code == 429]
    assert limited and {response.status_code for response in responses} == {200, 429}
    error = limited[0].json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "rate_limited"
    assert limited[0].headers["Retry-After"] == "1" and limited[0].headers["Strict-Transport-Security"]
    # The excess drains at the steady rate.
    assert wait_until(lambda: get_models(None).status_code == 200, timeout=10)


def test_a_post_whose_worker_dies_mid_reply_is_not_sent_to_another_host(stack, tmp_path_factory):
    """Here nginx lists the module's Gunicorn twice, as two hosts: a POST retried after its worker died
    with it in hand would reach the other entry (served once the master has respawned the worker),
    generating the reply twice, or spreading a request that kills workers."""
    gunicorn, _ = stack
    nginx = NginxServer(tmp_path_factory.mktemp("nginx-two-hosts"), [gunicorn.port, gunicorn.port]).start()
    marker = uuid.uuid4().hex
    answer = {}

    def post():
        """Ask for a long whole reply through nginx."""
        answer["status"] = requests.post(
            f"{nginx.url}/v1/chat/completions?attempt={marker}", json=LONG_REPLY, headers={"Cache-Control": "no-cache"},
            timeout=60, verify=nginx.ca_file,
        ).status_code

    try:
        thread = threading.Thread(target=post)
        thread.start()
        assert wait_until(lambda: requests.get(f"{gunicorn.url}/readyz", timeout=5).json()["running"] == 1, timeout=30)
        (worker,) = gunicorn.worker_pids()
        os.kill(worker, signal.SIGKILL)
        thread.join(60)
        assert answer["status"] == 502
        gunicorn.wait_ready()
        assert marker not in gunicorn.log(), "the POST was replayed to another host"
    finally:
        nginx.stop()


def test_sigterm_lets_an_in_flight_stream_finish_and_refuses_new_connections(stack):
    """Runs last in this module: it stops the module's Gunicorn."""
    gunicorn, nginx = stack
    events = []
    streaming = threading.Event()

    def stream():
        """Stream a long reply through nginx, noting each line as it arrives (a prompt of its own:
        an earlier test's reply would come from the response cache at once)."""
        body = {**LONG_REPLY, "messages": [{"role": "user", "content": "Count to a thousand, slowly, and drain."}]}
        read_stream(nginx, body, events, on_first_data=streaming.set)

    thread = threading.Thread(target=stream)
    thread.start()
    assert streaming.wait(30)
    gunicorn.process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert thread.is_alive(), "the stream ended at SIGTERM instead of draining"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", gunicorn.port), timeout=2).close()
    assert requests.get(f"{nginx.url}/v1/models", timeout=10, verify=nginx.ca_file).status_code == 502
    thread.join(60)
    assert gunicorn.process.wait(60) == 0
    kinds = [kind for kind, _ in events]
    assert kinds[-1] == "done", gunicorn.log()
    assert "content" in kinds


@pytest.fixture(scope="module")
def default_stack(tmp_path_factory, gunicorn):
    """Gunicorn as `make serve` runs it (2 workers, every setting at its default) behind the shipped nginx config."""
    with gunicorn(workers=2) as upstream:
        nginx = NginxServer(tmp_path_factory.mktemp("nginx-defaults"), [upstream.port]).start()
        yield upstream, nginx
        nginx.stop()


def test_through_nginx_a_fresh_request_is_answered_at_once_while_60_clients_never_read(default_stack):
    """60 streams that are never read, from three addresses (nginx lets each at most 32 connections), fill
    both workers' places; a client at another address is answered or refused at once every second,
    from before the places fill until FULL_SECONDS after (test_worker.py follows the direct case on
    until the send deadline frees them)."""
    upstream, nginx = default_stack
    connect = tls(nginx.port)

    def chat_statuses() -> list[int]:
        return [status for kind, status, _ in prober.answers if kind == "chat"]

    # /healthz through nginx is loopback's alone (127.0.0.1): another address asks for the model list.
    with Prober(connect, source=("127.0.0.2", 0), quick_path="/v1/models") as prober:
        clients = [never_reading_stream(lambda source, timeout, buffer, index=index: connect(
            (f"127.0.0.{10 + index % 3}", 0), timeout, buffer), NEVER_READ_STREAM) for index in range(NEVER_READING)]
        try:
            full = wait_until(lambda: 503 in chat_statuses(), 60)
            time.sleep(FULL_SECONDS)
        finally:
            for sock in clients:
                sock.close()
    assert full, (prober.answers, upstream.log()[-3000:])
    assert not prober.late_or_unanswered({"chat": {200, 503}, "quick": {200}}), prober.answers
    assert len(prober.answers) >= FULL_SECONDS
