"""Server-Sent Events framing of OpenAI's streaming wire format."""

import json

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
PING = ": ping\n\n"
DONE = "data: [DONE]\n\n"


def sse_data(payload: dict) -> str:
    """Frame one JSON payload as an SSE data event."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_event(event_type: str, data_json: str) -> str:
    """Frame one typed event as the Responses API sends it: an `event:` line naming its type, then its JSON."""
    return f"event: {event_type}\ndata: {data_json}\n\n"
