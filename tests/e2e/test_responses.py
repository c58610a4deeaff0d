"""The response models (service/api/responses.py) against what the server sends.

A stream's chunks are built as plain data for speed (service/api/chat.py); these tests hold that fast path to
the model: every chunk a real server streams, and chunks of values the tiny model cannot be made to
produce, validate as a ChatCompletionChunk and render byte for byte as the model renders them.
"""

import pytest
import requests

from harness import TINY_MODEL_DIR
from service.api.responses import ChatCompletion, Model, ModelList
from tests.app.test_responses import as_the_model_renders

USER = [{"role": "user", "content": "Write a haiku about CPUs."}]
# Closed objects: a forced call is a bounded number of tokens, so max_tokens never cuts it.
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
    "additionalProperties": False}}}
    for name in ("f", "g")]


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
