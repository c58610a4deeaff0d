"""Server-Sent Events framing of OpenAI's streaming wire format."""

import json

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
PING = ": ping\n\n"
DONE = "data: [DONE]\n\n"


def sse_data(payload: dict) -> str:
    """Frame one JSON payload as an SSE data event."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"
