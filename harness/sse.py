"""The one reader of server-sent events, for corechat's streams and llama-server's alike.

corechat sends nothing but `data:` lines, blank lines between events and `: ping` comments, so a
line of any other kind fails a strict read; a reader of raw HTTP bytes (headers and chunk sizes
around the events) reads with strict=False.
"""

import json
from collections.abc import Iterable, Iterator

# What the last event of a stream carries.
DONE = "[DONE]"


def sse_payload(line: str | bytes, *, strict: bool = True) -> dict | str | None:
    """Return what one line carries: a `data:` line's JSON, or DONE; None for a blank line or a comment."""
    if isinstance(line, bytes):
        line = line.decode()
    line = line.rstrip("\r\n")
    if line.startswith("data: "):
        raw = line[len("data: ") :]
        return DONE if raw == DONE else json.loads(raw)
    if strict and line and not line.startswith(":"):
        raise AssertionError(f"not a line of server-sent events: {line!r}")
    return None


def sse_stream(lines: Iterable[str | bytes], *, strict: bool = True) -> Iterator[dict | str]:
    """Yield the payloads of a stream's lines as they arrive (`response.iter_lines()`)."""
    for line in lines:
        payload = sse_payload(line, strict=strict)
        if payload is not None:
            yield payload


def sse_payloads(body: str | bytes, *, strict: bool = True) -> list[dict | str]:
    """Return the payloads of a whole body, DONE last if the stream ended."""
    return list(sse_stream(body.splitlines(), strict=strict))
