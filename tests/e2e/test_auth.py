"""Access control through real Gunicorn: keys accepted and never logged, and a browser page allowed by CORS
reads a worker's own 503."""

import socket

import pytest
import requests

from tests.support import bearer

KEYS = ("sk-first-0123456789", "sk-second-abcdefghij")
ALLOWED_ORIGIN = "https://chat.example.com"
USER = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def keyed_gunicorn(gunicorn):
    """Run one Gunicorn worker that needs a key, allows one origin and has two request places."""
    with gunicorn(workers=1, api_keys=",".join(KEYS), cors_origins=ALLOWED_ORIGIN, max_running=1, max_queue=1,
                  max_tokens_limit=32000) as server:
        yield server


def test_keys_over_real_gunicorn_and_never_in_its_log(keyed_gunicorn):
    server = keyed_gunicorn
    url = f"{server.url}/v1/chat/completions"
    body = {"messages": USER, "max_tokens": 3, "stream": True}
    refused = requests.post(url, json=body, headers=bearer("sk-not-a-key-42"), timeout=30)
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    with requests.post(url, json=body, headers=bearer(KEYS[1]), stream=True, timeout=60) as accepted:
        assert accepted.status_code == 200
        assert accepted.text.rstrip().endswith("data: [DONE]")
    assert requests.get(f"{server.url}/healthz", timeout=10).status_code == 200
    assert requests.options(
        url, headers={"Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST"}, timeout=10
    ).status_code == 204
    log = server.log_path.read_text(errors="replace")
    assert "POST /v1/chat/completions" in log
    assert not any(secret in log for secret in (*KEYS, "sk-not-a-key-42"))


def test_an_allowed_page_can_read_the_workers_own_503_and_its_retry_after(keyed_gunicorn):
    """The event loop refuses a request beyond the places before the app (and its CORS hook) sees
    it: the refusal carries the CORS headers itself."""
    from harness import StreamingClient, hang_up_all

    endless = {"messages": USER, "max_tokens": 30000, "stream": True}
    holders = [StreamingClient(keyed_gunicorn.url, endless, headers=bearer(KEYS[0])) for _ in range(2)]
    try:
        for holder in holders:
            holder.wait_for_headers()
        refused = requests.post(f"{keyed_gunicorn.url}/v1/chat/completions", json=endless, timeout=30,
                                headers={**bearer(KEYS[0]), "Origin": ALLOWED_ORIGIN})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "overloaded"
        assert refused.headers["Access-Control-Allow-Origin"] == ALLOWED_ORIGIN
        assert "Retry-After" in refused.headers["Access-Control-Expose-Headers"] and refused.headers["Retry-After"]
        assert refused.headers["Vary"] == "Origin"
        assert refused.headers["X-Content-Type-Options"] == "nosniff" and refused.headers["Cache-Control"] == "no-store"
        # A client that waits for `100 Continue` before its body gets the refusal instead, uploading nothing.
        with socket.create_connection(("127.0.0.1", keyed_gunicorn.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                         b"Authorization: Bearer %s\r\nExpect: 100-continue\r\nContent-Length: 1000\r\n\r\n"
                         % KEYS[0].encode())
            assert sock.recv(12) == b"HTTP/1.1 503"
    finally:
        hang_up_all(holders)
