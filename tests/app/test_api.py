"""The HTTP API through Flask's test client: OpenAI's objects, SSE framing and every 4xx."""

import json

import pytest

from harness import sse_payloads
from service.engine import SamplingParams
from tests.support import started_engine

USER = [{"role": "user", "content": "Write a haiku about CPUs."}]


def tool_with(parameters: dict) -> dict:
    """Return a function tool `f` taking the given parameters schema."""
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


TOOL = tool_with({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Paris"}'}}


def chat(client, **body):
    """POST a chat completion with the given fields."""
    return client.post("/v1/chat/completions", json={"messages": USER, **body})


def stream_payloads(response) -> list:
    """Return the payloads of a whole streamed response, which must end with a whole event."""
    body = response.get_data(as_text=True)
    assert body.endswith("\n\n")
    return sse_payloads(body)


def test_non_streaming_reply_is_a_chat_completion(client):
    response = chat(client, max_tokens=6, temperature=0)
    assert response.status_code == 200
    body = response.get_json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == "tiny"
    assert isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    # Greedy on the fixed random-weight model: it runs to max_tokens (no EOS that early).
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["completion_tokens"] == 6


def test_stream_frames_role_content_finish_usage_then_done(client):
    response = chat(client, max_tokens=5, seed=11, stream=True, stream_options={"include_usage": True})
    assert response.status_code == 200
    assert response.mimetype == "text/event-stream"
    assert response.headers["Cache-Control"] == "no-cache"
    assert response.headers["X-Accel-Buffering"] == "no"
    payloads = stream_payloads(response)
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finish = chunks[-2]
    assert finish["choices"][0]["delta"] == {}
    assert finish["choices"][0]["finish_reason"] == "length"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 5
    assert all(chunk["usage"] is None for chunk in chunks[:-1])
    content = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks[1:-2])
    whole = chat(client, max_tokens=5, seed=11).get_json()
    assert content == whole["choices"][0]["message"]["content"]


def test_stream_without_usage_option_has_no_usage_field(client):
    payloads = stream_payloads(chat(client, max_tokens=2, seed=4, stream=True))
    assert all("usage" not in chunk for chunk in payloads[:-1])
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"


def test_stream_sends_ping_comments_while_waiting(make_settings, tiny_model_dir):
    from service.app import create_app

    settings = make_settings(max_running=1, sse_ping_seconds=0.05)
    with started_engine(settings) as engine:
        app = create_app(settings, engine=engine)
        blocker = engine.submit(engine.template.encode("hello"), SamplingParams(max_tokens=100_000, temperature=0))
        blocker.next_event(timeout=30)
        response = app.test_client().post(
            "/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "stream": True}, buffered=False
        )
        stream = response.response
        first = next(stream)
        assert first.startswith(b"data: ") or first.startswith("data: ")
        second = next(stream)
        assert (second.decode() if isinstance(second, bytes) else second) == ": ping\n\n"
        blocker.cancel()
        rest = b"".join(part if isinstance(part, bytes) else part.encode() for part in stream)
        assert rest.endswith(b"data: [DONE]\n\n")


def test_same_seed_same_reply_over_http(client):
    first = chat(client, max_tokens=8, seed=1234, temperature=0.9).get_json()
    second = chat(client, max_tokens=8, seed=1234, temperature=0.9).get_json()
    assert first["choices"][0]["message"] == second["choices"][0]["message"]


def test_max_completion_tokens_is_honoured(client):
    body = chat(client, max_completion_tokens=3, temperature=0).get_json()
    assert body["usage"]["completion_tokens"] <= 3


def test_content_as_text_parts_equals_plain_string(client):
    texts = [{"type": "text", "text": "Write a haiku "}, {"type": "text", "text": "about CPUs."}]
    parts = [{"role": "user", "content": texts}]
    as_parts = client.post("/v1/chat/completions",
                           json={"messages": parts, "max_tokens": 4, "temperature": 0}).get_json()
    as_string = chat(client, max_tokens=4, temperature=0).get_json()
    # The second reuses the first's prompt KV: every count but cached_tokens is the same.
    assert {**as_parts["usage"], "prompt_tokens_details": None} == {**as_string["usage"], "prompt_tokens_details": None}
    assert as_parts["choices"][0]["message"] == as_string["choices"][0]["message"]


def test_unknown_fields_are_ignored(client):
    assert chat(client, max_tokens=1, user="abc", logit_bias={}, some_future_field=[1]).status_code == 200


def test_null_n_and_stream_mean_their_defaults_as_openai_accepts(client):
    response = chat(client, max_tokens=1, n=None, stream=None)
    assert response.status_code == 200, response.get_json()
    assert response.get_json()["object"] == "chat.completion"


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content[0].type"),
        ({"messages": USER, "temperature": -0.1}, "temperature"),
        ({"messages": USER, "temperature": 2.5}, "temperature"),
        ({"messages": USER, "temperature": "1"}, "temperature"),
        ({"messages": USER, "top_p": 0}, "top_p"),
        ({"messages": USER, "top_p": 1.5}, "top_p"),
        ({"messages": USER, "top_k": -2}, "top_k"),
        ({"messages": USER, "max_tokens": 0}, "max_tokens"),
        ({"messages": USER, "max_tokens": 1.5}, "max_tokens"),
        ({"messages": USER, "max_tokens": 10**30}, "max_tokens"),
        ({"messages": USER, "max_tokens": True}, "max_tokens"),
        ({"messages": USER, "presence_penalty": 3}, "presence_penalty"),
        ({"messages": USER, "frequency_penalty": -3}, "frequency_penalty"),
        ({"messages": USER, "seed": 2**64}, "seed"),
        ({"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": USER, "stop": 5}, "stop"),
        ({"messages": USER, "stop": [""]}, "stop[0]"),
        ({"messages": USER, "n": 9}, "n"),
        ({"messages": USER, "n": 0}, "n"),
        ({"messages": USER, "stream": "yes"}, "stream"),
        ({"messages": USER, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"messages": USER, "tools": {"type": "function"}}, "tools"),
        ({"messages": USER, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"messages": USER, "tools": [{"type": "function", "function": {"name": "no spaces"}}]},
         "tools[0].function.name"),
        ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
         "tools[0].function.parameters"),
        ({"messages": USER, "tools": [TOOL, TOOL]}, "tools"),
        ({"messages": USER, "tools": [TOOL], "tool_choice": "maybe"}, "tool_choice"),
        ({"messages": USER, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}},
         "tool_choice"),
        ({"messages": USER, "tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice.function"),
        ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
        ({"messages": USER, "tools": [TOOL], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"messages": USER, "tools": [tool_with({"type": "string", "format": "no-such-format"})],
          "tool_choice": "required"}, "tools"),
        ({"messages": USER, "tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
        ({"messages": USER, "response_format": "json"}, "response_format"),
        ({"messages": USER, "response_format": {"type": "xml"}}, "response_format.type"),
        ({"messages": USER, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
         "response_format.json_schema.name"),
        ({"messages": USER, "response_format": {
            "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objekt"}}}},
         "response_format"),
        ({"messages": USER, "response_format": {
            "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "string", "format": "no-such"}}}},
         "response_format"),
        ({"messages": USER, "logprobs": "yes"}, "logprobs"),
        ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": USER, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": USER, "repetition_penalty": 0}, "repetition_penalty"),
        ({"messages": USER, "repetition_penalty": 2.5}, "repetition_penalty"),
        ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages[0].tool_calls"),
        ({"messages": [*USER, {"role": "assistant", "content": None}]}, "messages[1].content"),
        ({"messages": [*USER, {"role": "assistant",
                               "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{oops"}}]}]},
         "messages[1].tool_calls[0].function.arguments"),
        ({"messages": [*USER, {"role": "assistant",
                               "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}]}]},
         "messages[1].tool_calls[0].function.arguments"),
        ({"messages": [*USER, {"role": "assistant", "tool_calls": [{**CALL, "type": "code"}]}]},
         "messages[1].tool_calls[0].type"),
    ],
)
def test_bad_fields_get_400_naming_the_field(client, body, param):
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.get_json()
    error = response.get_json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]
    assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    "raw",
    [b"{", b"[]", b'"text"', b"null", b'{"messages": NaN}', b'{"temperature": Infinity}', b"\xff\xfe{}",
     b"[" * 100_000],
)
def test_malformed_bodies_get_400(client, raw):
    response = client.post("/v1/chat/completions", data=raw, content_type="application/json")
    assert response.status_code == 400
    assert response.get_json()["error"]["type"] == "invalid_request_error"


def test_wrong_content_type_gets_415(client):
    response = client.post("/v1/chat/completions", data=json.dumps({"messages": USER}), content_type="text/plain")
    assert response.status_code == 415
    assert "application/json" in response.get_json()["error"]["message"]


def test_unknown_model_gets_404_model_not_found(client):
    response = chat(client, model="gpt-4o")
    assert response.status_code == 404
    assert response.get_json()["error"]["code"] == "model_not_found"


def test_served_model_name_is_accepted(client):
    assert chat(client, model="tiny", max_tokens=1).status_code == 200


def test_prompt_plus_max_tokens_beyond_context_names_both_numbers(client, engine):
    prompt_tokens = len(engine.template.encode(engine.template.render(USER)))
    response = chat(client, max_tokens=256)
    assert response.status_code == 400
    error = response.get_json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "max_tokens"
    assert str(prompt_tokens) in error["message"] and "256" in error["message"]
    assert chat(client, max_tokens=256 - prompt_tokens).status_code == 200


def test_prompt_longer_than_context_gets_400(client):
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 400}]})
    assert response.status_code == 400
    assert response.get_json()["error"]["code"] == "context_length_exceeded"


def test_max_tokens_above_configured_limit_gets_400(make_settings, engine):
    from service.app import create_app

    client = create_app(make_settings(max_model_len=256, max_tokens_limit=8), engine=engine).test_client()
    response = chat(client, max_tokens=9)
    assert response.status_code == 400
    assert "8" in response.get_json()["error"]["message"]


def test_models_lists_the_alias_then_the_folder_name(client, tiny_model_dir):
    body = client.get("/v1/models").get_json()
    assert body["object"] == "list"
    assert [model["id"] for model in body["data"]] == ["tiny", tiny_model_dir.name]
    assert client.get("/v1/models/tiny").get_json()["object"] == "model"
    assert client.get(f"/v1/models/{tiny_model_dir.name}").get_json()["id"] == tiny_model_dir.name
    assert client.get("/v1/models/other").status_code == 404


def test_health_and_readiness(client, engine):
    assert client.get("/healthz").get_json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.get_json()["status"] == "ready"
    assert ready.get_json()["model"] == "tiny"


def test_readiness_is_503_until_the_model_is_loaded(make_settings):
    from service.app import create_app
    from service.engine import Engine

    engine = Engine(make_settings())
    client = create_app(make_settings(), engine=engine).test_client()
    assert client.get("/readyz").status_code == 503
    assert client.get("/healthz").status_code == 200
    engine.start()
    try:
        assert engine.wait_ready(60)
        assert client.get("/readyz").status_code == 200
    finally:
        engine.stop()


def test_unknown_route_and_method_use_the_error_shape(client):
    assert client.get("/v2/nothing").get_json()["error"]["code"] == "not_found"
    response = client.get("/v1/chat/completions")
    assert response.status_code == 405
    assert response.get_json()["error"]["type"] == "invalid_request_error"


def test_doubled_slash_and_options_without_cors_get_json_errors_not_html(client):
    doubled = client.post("/v1//chat/completions", json={"messages": USER})
    assert doubled.status_code == 404 and doubled.get_json()["error"]["code"] == "not_found"
    for path in ("/v1/chat/completions", "/v1/models", "/healthz"):
        options = client.options(path)
        assert options.status_code == 405, path
        assert options.get_json()["error"]["code"] == "method_not_allowed"


def test_omitted_sampling_fields_take_the_models_generation_config(app):
    from service.api.chat_request import parse_chat_request

    chat = app.extensions["corechat"].chat
    omitted = chat.prepare(parse_chat_request({"messages": USER})).params
    assert (omitted.temperature, omitted.top_p, omitted.top_k) == (0.7, 0.8, 20)  # Qwen2.5's generation_config
    given = chat.prepare(parse_chat_request({"messages": USER, "temperature": 0, "top_p": 0.5, "top_k": 3})).params
    assert (given.temperature, given.top_p, given.top_k) == (0.0, 0.5, 3)
    # repetition_penalty applies greedy or not, as transformers and vLLM apply it.
    assert omitted.repetition_penalty == given.repetition_penalty == 1.05
    neutral = chat.prepare(parse_chat_request({"messages": USER, "repetition_penalty": 1.0})).params
    assert neutral.repetition_penalty == 1.0


# A template in the style of many non-Qwen models: it raises on a role order it does not support.
STRICT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be first') }}{%- endif %}"
    "{%- if message['role'] == 'assistant' and loop.first %}"
    "{{ raise_exception('Conversation must start with the user') }}{%- endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def strict_template_client(tiny_model_dir, tmp_path_factory, make_settings):
    """Return a client of the tiny model given a chat template that raises on role orders it refuses."""
    from service.app import create_app

    model_dir = tmp_path_factory.mktemp("strict-template")
    for path in tiny_model_dir.iterdir():
        if path.name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
            (model_dir / path.name).symlink_to(path)
    tokenizer_config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": STRICT_TEMPLATE}))
    (model_dir / "chat_template.jinja").write_text(STRICT_TEMPLATE)
    settings = make_settings(model=str(model_dir), dtype="bfloat16", max_model_len=256)
    with started_engine(settings) as engine:
        yield create_app(settings, engine=engine).test_client()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "messages,reason",
    [
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "System message must be first"),
        ([{"role": "system", "content": "a"}, {"role": "developer", "content": "b"}, {"role": "user", "content": "c"}],
         "System message must be first"),
        ([{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}],
         "Conversation must start with the user"),
    ],
)
def test_a_chat_template_that_refuses_the_messages_gets_400_naming_messages(strict_template_client, messages, reason,
                                                                            stream):
    response = strict_template_client.post("/v1/chat/completions", json={"messages": messages, "stream": stream})
    assert response.status_code == 400, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert error["param"] == "messages" and error["type"] == "invalid_request_error"
    assert reason in error["message"]


def test_a_strict_chat_template_serves_the_role_orders_it_accepts(strict_template_client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    response = strict_template_client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3})
    assert response.status_code == 200, response.get_data(as_text=True)


def test_a_chat_template_without_tool_support_gets_400_naming_tools(strict_template_client):
    response = strict_template_client.post("/v1/chat/completions", json={"messages": USER, "tools": [TOOL]})
    assert response.status_code == 400, response.get_data(as_text=True)
    assert response.get_json()["error"]["param"] == "tools"
    # tool_choice "none" shows the model no tools, so such a template serves it.
    response = strict_template_client.post(
        "/v1/chat/completions", json={"messages": USER, "tools": [TOOL], "tool_choice": "none", "max_tokens": 2})
    assert response.status_code == 200, response.get_data(as_text=True)


def test_tools_and_a_tool_round_trip_render_through_the_models_template(app):
    from service.api.chat_request import parse_chat_request

    chat = app.extensions["corechat"].chat
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    prepared = chat.prepare(parse_chat_request({"messages": messages, "tools": [TOOL]}))
    prompt = chat.engine.tokenizer.decode(prepared.prompt_ids)
    # Qwen2.5's <tools>
    assert '{"type": "function", "function": {"name": "f", "parameters": {"type": "object"' in prompt
    assert '<tool_call>\n{"name": "f", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    without = chat.prepare(parse_chat_request({"messages": messages, "tools": [TOOL], "tool_choice": "none"}))
    assert "<tools>" not in chat.engine.tokenizer.decode(without.prompt_ids)


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user",
                    "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": USER, "modalities": ["text", "audio"]}, "modalities"),
    ({"messages": USER, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
])
def test_images_and_audio_are_refused_naming_the_field(client, body, param):
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.get_json()["error"]["param"] == param


def test_text_as_the_only_modality_is_accepted(client):
    assert chat(client, max_tokens=1, modalities=["text"]).status_code == 200


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/audio/speech"])
def test_routes_not_served_are_404s(client, path):
    response = client.post(path, json={"input": "x", "model": "tiny"})
    assert response.status_code == 404 and response.get_json()["error"]["code"] == "not_found"
