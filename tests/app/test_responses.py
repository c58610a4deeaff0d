"""The response models (service/api/responses.py) against what the server sends.

A stream's chunks are built as plain data for speed (service/api/chat.py); these tests hold that fast path to
the model: every chunk a real server streams, and chunks of values the tiny model cannot be made to
produce, validate as a ChatCompletionChunk and render byte for byte as the model renders them.
"""

import pytest

from service.api.chat import ChatCompletions, render_logprob
from service.api.chat_request import parse_chat_request
from service.api.responses import ChatCompletionChunk
from service.api.sse import sse_data
from service.engine import TokenLogprob
from service.errors import ErrorResponse

USER = [{"role": "user", "content": "Write a haiku about CPUs."}]


def as_the_model_renders(frame: str) -> str:
    """Parse one SSE data frame as the model it claims to be and render it again as the server frames it."""
    raw = frame.removeprefix("data: ").removesuffix("\n\n")
    model = ErrorResponse if raw.startswith('{"error"') else ChatCompletionChunk
    return sse_data(model.model_validate_json(raw).model_dump(exclude_unset=True))


@pytest.fixture(scope="module")
def chat(engine, make_settings) -> ChatCompletions:
    """Return the serving class around the shared engine."""
    return ChatCompletions(engine, make_settings(max_model_len=256))


AWKWARD_TEXT = 'é✓ 🙂 \u2028\u2029 "quoted" \\ back\x00slash\x1f </script>'


@pytest.mark.parametrize("include_usage", [False, True])
def test_chunks_of_awkward_values_render_exactly_as_the_model_renders_them(chat, include_usage):
    """Values the tiny model's replies cannot be steered to: tiny and huge log probabilities, control and
    non-BMP characters, a tool call's header and an arguments piece."""
    request = parse_chat_request({"messages": USER, "stream": True, "stream_options": {"include_usage": include_usage}})
    prepared = chat.prepare(request)
    top = (TokenLogprob(AWKWARD_TEXT, tuple(AWKWARD_TEXT.encode()), -1.2e-05), TokenLogprob("\ufffd", (0xF0,), -1e300))
    entries = [render_logprob(TokenLogprob(AWKWARD_TEXT, tuple(AWKWARD_TEXT.encode()), -0.0, top)),
               render_logprob(TokenLogprob("x", (120,), -7.5))]
    header = {"index": 0, "id": "call_0123", "type": "function", "function": {"name": AWKWARD_TEXT, "arguments": ""}}
    piece = {"index": 1, "function": {"arguments": '{"n": 1'}}
    chunks = [
        chat._chunk(prepared, {"role": "assistant", "content": ""}),
        chat._chunk(prepared, {"content": AWKWARD_TEXT}, logprobs=entries),
        chat._chunk(prepared, {"tool_calls": [header, piece]}),
        chat._chunk(prepared, {"function_call": {"name": AWKWARD_TEXT, "arguments": '{"n": 1'}}),
        chat._chunk(prepared, {"function_call": {"arguments": AWKWARD_TEXT}}),
        chat._chunk(prepared, {}, "function_call"),
        chat._chunk(prepared, {}, "tool_calls"),
        chat._chunk(prepared, {}, "length", logprobs=entries[1:]),
    ]
    for chunk in chunks:
        assert ("usage" in chunk) == include_usage
        frame = sse_data(chunk)
        assert as_the_model_renders(frame) == frame
        assert sse_data(ChatCompletionChunk.model_validate(chunk).model_dump(exclude_unset=True)) == frame
