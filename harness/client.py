"""Chat requests as clients send them: one on a fresh connection, a stream timed from the client's side
(the benchmarks' client, which reads llama-server's streams too), a stream read in its own thread
that a test can watch and hang up."""

import http.client
import json
import threading
import time
from dataclasses import dataclass, field

import requests

from harness.sse import DONE, sse_payload, sse_stream

# A prompt the tiny model answers at any length: the end-to-end tests' default.
COUNTING = [{"role": "user", "content": "Count to a thousand, slowly."}]
# logit_bias forbidding Qwen2's end-of-text and end-of-turn tokens: a random model's reply, which may
# end at any token, then runs to its max_tokens.
NO_END_OF_TURN = {"151643": -100, "151645": -100}
SHORT_PROMPT = "Explain in two sentences why the sky is blue."


def chat(server, **body) -> requests.Response:
    """Send one chat request (COUNTING unless `messages` is given) on a fresh connection, so requests spread
    over the workers."""
    return requests.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": COUNTING, **body},
        headers={"Connection": "close"},
        timeout=60,
    )


def short_chat(tag: str) -> list[dict]:
    """Return a short one-turn chat, made unique by a tag so no response cache answers it."""
    return [{"role": "user", "content": f"({tag}) {SHORT_PROMPT}"}]


@dataclass
class StreamResult:
    """What the client saw of one streamed chat completion."""

    status: int = 0
    first_byte_seconds: float = 0.0
    first_token_seconds: float = 0.0
    total_seconds: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Prompt tokens the server reused instead of computing, as its usage reports them.
    cached_tokens: int = 0
    text: str = ""
    gaps: list[float] = field(default_factory=list)
    x_cache: str = ""
    error: str = ""

    @property
    def decode_tokens_per_second(self) -> float:
        """Return tokens after the first per second after the first."""
        decode_seconds = self.total_seconds - self.first_token_seconds
        if self.completion_tokens < 2 or decode_seconds <= 0:
            return 0.0
        return (self.completion_tokens - 1) / decode_seconds


def stream_chat(base_url: str, messages: list[dict], max_tokens: int, timeout: float = 600,
                extra: dict | None = None, greedy: bool = True) -> StreamResult:
    """Send one streamed chat completion, greedy unless told (then sampled as the server's defaults or
    `extra` say; `extra`: more fields of its body); time it from the client."""
    host, port = base_url.removeprefix("http://").split(":")
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, **({"temperature": 0} if greedy else {}),
                       "stream": True, "stream_options": {"include_usage": True}, **(extra or {})})
    result = StreamResult()
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    began = time.perf_counter()
    try:
        connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        result.status = response.status
        result.x_cache = response.getheader("X-Cache", "")
        if response.status != 200:
            result.error = response.read().decode(errors="replace")[:300]
            return result
        last_token_at = None
        while line := response.readline():
            now = time.perf_counter() - began
            if not result.first_byte_seconds:
                result.first_byte_seconds = now
            chunk = sse_payload(line, strict=False)  # a peer server may send other fields
            if chunk is None or chunk == DONE:
                continue
            if "error" in chunk:
                result.error = chunk["error"].get("message", "error")
            if chunk.get("usage"):
                result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                result.completion_tokens = chunk["usage"]["completion_tokens"]
                result.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            content = "".join(choice["delta"].get("content") or "" for choice in chunk.get("choices", []))
            result.text += content
            if content:
                if last_token_at is None:
                    result.first_token_seconds = now
                else:
                    result.gaps.append(now - last_token_at)
                last_token_at = now
        result.total_seconds = (last_token_at or time.perf_counter() - began)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        connection.close()
    return result


def concurrent_streams(base_url: str, message_lists: list[list[dict]],
                       max_tokens: int) -> tuple[list[StreamResult], float]:
    """Run one stream per message list at once; return the results and the wall time of all."""
    results: list[StreamResult | None] = [None] * len(message_lists)

    def run(index: int) -> None:
        results[index] = stream_chat(base_url, message_lists[index], max_tokens)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(message_lists))]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - began


def stream_reply(url: str, body: dict, reply: dict, joined: threading.Event | None = None) -> None:
    """Stream a reply into `reply`: X-Cache, content chunks, first-content and end times."""
    with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=300) as response:
        reply["status"] = response.headers["X-Cache"]
        if joined:
            joined.set()
        reply["chunks"] = []
        try:
            for payload in sse_stream(response.iter_lines(decode_unicode=True)):
                if payload == DONE:
                    reply["done_at"] = time.monotonic()
                    break
                content = payload["choices"][0]["delta"].get("content") if payload["choices"] else None
                if content:
                    reply.setdefault("first_content_at", time.monotonic())
                    reply["chunks"].append(content)
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError):
            reply["broken"] = True  # the serving worker died


class StreamingClient:
    """A streamed chat request read in its own thread, which the test can watch and hang up.

    `chunks` grows as content arrives; `status` is the X-Cache header; `ended` is set once the stream
    ended, broke, or was hung up.
    """

    def __init__(self, url: str, body: dict, headers: dict | None = None):
        self.url = url
        self.body = body
        self.headers = {"Connection": "close", **(headers or {})}
        self.status: str | None = None
        self.chunks: list[str] = []
        self.errors: list[dict] = []
        self.done = False
        self.ended = threading.Event()
        self._hang_up = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        """Read the stream until its end, or until told to hang up."""
        try:
            with requests.post(f"{self.url}/v1/chat/completions", json=self.body, headers=self.headers, stream=True,
                               timeout=300) as response:
                self.status = response.headers.get("X-Cache")
                for payload in sse_stream(response.iter_lines(decode_unicode=True)):
                    if payload == DONE:
                        self.done = True
                        break
                    if "error" in payload:
                        self.errors.append(payload["error"])
                        continue
                    content = payload["choices"][0]["delta"].get("content") if payload["choices"] else None
                    if content:
                        self.chunks.append(content)
                    if self._hang_up.is_set():
                        break
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError):
            pass
        finally:
            self.ended.set()

    @property
    def text(self) -> str:
        """Return the content received so far."""
        return "".join(self.chunks)

    def wait_for_headers(self, timeout: float = 60) -> None:
        """Block until the response's headers arrived (a queued request has them before any token)."""
        deadline = time.monotonic() + timeout
        while self.status is None:
            assert not self.ended.is_set(), "the stream ended before its headers"
            assert time.monotonic() < deadline, f"no headers after {timeout} s"
            time.sleep(0.01)

    def wait_for_chunks(self, count: int, timeout: float = 120) -> None:
        """Block until `count` content chunks arrived (failing if the stream ends or time runs out first)."""
        deadline = time.monotonic() + timeout
        while len(self.chunks) < count:
            assert not self.ended.is_set(), f"the stream ended after {len(self.chunks)} chunks"
            assert time.monotonic() < deadline, f"only {len(self.chunks)} chunks after {timeout} s"
            time.sleep(0.01)

    def hang_up(self) -> None:
        """Close the connection at the next chunk, as a client that goes away does, and wait for it."""
        hang_up_all([self])

    def finish(self, timeout: float = 300) -> "StreamingClient":
        """Wait for the stream to end."""
        assert self.ended.wait(timeout), "the stream did not end"
        return self


def hang_up_all(clients: list[StreamingClient]) -> None:
    """Hang up every client at its next chunk, then wait for all: a queued stream's next chunk comes
    only once the one ahead of it is gone, so waiting for each in turn could wait on the queued one."""
    for client in clients:
        client._hang_up.set()
    for client in clients:
        assert client.ended.wait(120), "a hung-up stream did not end"
