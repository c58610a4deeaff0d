"""Input limits Gunicorn's framing enforces: a chunked body over the size limit gets a 413, a small one is
served."""

import json
import socket

import pytest

USER = [{"role": "user", "content": "Write a haiku about CPUs."}]


@pytest.fixture(scope="module")
def limited_gunicorn(gunicorn):
    """Run one Gunicorn worker with a 4 KiB body limit."""
    with gunicorn(workers=1, max_request_bytes=4096) as server:
        yield server


def post_chunked(port: int, body: bytes, chunk_size: int = 1000) -> tuple[bytes, bytes]:
    """POST a body with Transfer-Encoding: chunked (no Content-Length) and return (head, body)."""
    pieces = [body[start : start + chunk_size] for start in range(0, len(body), chunk_size)]
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces)
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + chunks + b"0\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, reply_body = reply.partition(b"\r\n\r\n")
    return head, reply_body


def test_chunked_body_over_the_size_limit_gets_413_from_gunicorn(limited_gunicorn):
    """Without Content-Length the limit must still hold: Gunicorn de-chunks, werkzeug counts."""
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 8000}]}).encode()
    head, reply_body = post_chunked(limited_gunicorn.port, body)
    assert head.startswith(b"HTTP/1.1 413"), head
    assert json.loads(reply_body)["error"]["code"] == "request_too_large"


def test_small_chunked_body_is_served_by_gunicorn(limited_gunicorn):
    head, _ = post_chunked(limited_gunicorn.port, json.dumps({"messages": USER, "max_tokens": 1}).encode())
    assert head.startswith(b"HTTP/1.1 200"), head
