"""The response models (service/api/responses.py) against what the server sends.

A stream's chunks are built as plain data for speed (service/api/chat.py); these tests hold that fast path to
the model: every chunk a real server streams, and chunks of values the tiny model cannot be made to
produce, validate as a ChatCompletionChunk and render byte for byte as the model renders them.
"""

import pytest
import requests

from harness import TINY_MODEL_DIR
from service.api.chat import ChatCompletions, render_logprob
from service.api.chat_request import parse_chat_request
from service.api.responses import ChatCompletion, ChatCompletionChunk, Model, ModelList
from service.api.sse import sse_data
from service.engine import TokenLogprob
from service.errors import ErrorResponse

USER = [{"role": "user", "content": "Write a haiku about CPUs."}]
# Closed objects: a forced call is a bounded number of tokens, so max_tokens never cuts it.
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
    "additionalProperties": False}}}
    for name in ("f", "g")]


def as_the_model_renders(frame: str) -> str:
    """Parse one SSE data frame as the model it claims to be and render it again as the server frames it."""
    raw = frame.removeprefix("data: ").removesuffix("\n\n")
    model = ErrorResponse if raw.startswith('{"error"') else ChatCompletionChunk
    return sse_data(model.model_validate_json(raw).model_dump(exclude_unset=True))


@pytest.mark.parametrize("body", [
    {"max_tokens": 4},
    {"max_tokens": 4, "stream_options": {"include_usage": True}},
    {"max_tokens": 4, "logprobs": True, "top_logprobs": 3},
    {"max_tokens": 60, "tools": TOOLS, "tool_choice": "required"},
    {"max_tokens": 8, "tools": TOOLS, "tool_choice": "auto", "logprobs": True},
    {"max_tokens": 8, "response_format": {"type": "json_object"}, "stream_options": {"include_usage": True}},
    {"max_tokens": 60, "functions": [tool["function"] for tool in TOOLS], "function_call": {"name": "g"}},
], ids=["plain", "usage", "logprobs", "forced-tools", "auto-tools-logprobs", "json-usage", "legacy-function-call"])
def test_every_streamed_chunk_renders_exactly_as_the_model_renders_it(default_server, body):
    response = requests.post(f"{default_server.url}/v1/chat/completions",
                             json={"messages": USER, "stream": True, **body}, timeout=60)
    assert response.status_code == 200, response.text
    frames = [event + "\n\n" for event in response.text.removesuffix("\n\n").split("\n\n") if not event.startswith(":")]
    assert frames[-1] == "data: [DONE]\n\n"
    for frame in frames[:-1]:
        assert as_the_model_renders(frame) == frame
    if body.get("tool_choice") == "required":
        assert '"tool_calls":[{"index":0,"id":"call_' in response.text
    if "functions" in body:
        assert '"delta":{"function_call":{"name":"g","arguments":' in response.text
        assert '"tool_calls"' not in response.text
        assert '"finish_reason":"function_call"' in response.text


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


def test_a_chunk_the_model_does_not_describe_is_refused():
    """The byte-for-byte checks above mean something only if the model refuses what it does not describe."""
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "system_fingerprint": None,
             "choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None}]}
    ChatCompletionChunk.model_validate(chunk)
    for bad in ({**chunk, "extra": 1}, {**chunk, "choices": [{**chunk["choices"][0], "delta": {"content": None}}]},
                {**chunk, "choices": [{**chunk["choices"][0], "finish_reason": "cancelled"}]},
                {**chunk, "created": "1"}, {key: value for key, value in chunk.items() if key != "system_fingerprint"}):
        with pytest.raises(ValueError):
            ChatCompletionChunk.model_validate(bad)


def test_whole_replies_and_models_leave_out_what_openai_leaves_out(default_server):
    url = default_server.url
    reply = requests.post(f"{url}/v1/chat/completions", json={"messages": USER, "max_tokens": 3}, timeout=60).json()
    ChatCompletion.model_validate(reply)
    assert set(reply["choices"][0]["message"]) == {"role", "content"}
    assert reply["choices"][0]["logprobs"] is None and reply["system_fingerprint"]
    called = requests.post(f"{url}/v1/chat/completions", timeout=60, json={
        "messages": USER, "max_tokens": 60, "tools": TOOLS[:1], "tool_choice": "required",
        "parallel_tool_calls": False})
    message = ChatCompletion.model_validate(called.json()).choices[0].message
    assert message.content is None and len(message.tool_calls) == 1
    assert called.json()["choices"][0]["message"]["content"] is None
    models = ModelList.model_validate(requests.get(f"{url}/v1/models", timeout=10).json())
    assert [model.id for model in models.data] == [
        Model.model_validate(requests.get(f"{url}/v1/models/{name}", timeout=10).json()).id
        for name in ("tiny", TINY_MODEL_DIR.name)]
