"""Thinking on the chat API: chat_template_kwargs.enable_thinking and reasoning_effort reach Qwen3's
template (and so the prompt, and so the cache key), and a thinking model's <think> block goes out as
reasoning_content apart from the content, whole and streamed; Qwen2's replies are unchanged."""

import pytest

from harness import DONE, RedisServer, sse_payloads
from service.api.responses import ChatCompletionChunk
from service.app import create_app
from tests.support import started_engine

USER = [{"role": "user", "content": "What is 2 + 2?"}]
# A grammar that makes the random-weight model write what a thinking Qwen3 writes.
THOUGHT = {"regex": r"<think>\nAdd two and two\.\n</think>\n\nIt is 4\."}
GREEDY = {"messages": USER, "max_tokens": 40, "temperature": 0}


@pytest.fixture(scope="module")
def qwen3_engine(make_settings, tmp_path_factory):
    """Return a started engine on a tiny random Qwen3, whose template thinks unless told not to."""
    from devtools.devmodel import build_dev_model

    folder = build_dev_model(tmp_path_factory.mktemp("qwen3") / "qwen3-tiny", preset="qwen3-tiny")
    with started_engine(make_settings(model=str(folder), model_name="qwen3-tiny", max_model_len=256)) as engine:
        yield engine


@pytest.fixture()
def qwen3_app(make_settings, qwen3_engine):
    """Return a fresh app around the Qwen3 engine, without a cache."""
    return create_app(make_settings(model=qwen3_engine.settings.model, model_name="qwen3-tiny", max_model_len=256),
                      engine=qwen3_engine)


def chat(app, **fields):
    """POST a chat completion; return the response."""
    return app.test_client().post("/v1/chat/completions", json={**GREEDY, **fields})


def prompt_tokens(app, **fields) -> int:
    """Return how many prompt tokens a request's conversation rendered to."""
    response = chat(app, max_tokens=1, **fields)
    assert response.status_code == 200, response.get_json()
    return response.get_json()["usage"]["prompt_tokens"]


def test_enable_thinking_false_and_reasoning_effort_none_render_qwen3s_empty_think_block(qwen3_app):
    """<think>\\n\\n</think>\\n\\n is four tokens; low to xhigh, true and no field leave the prompt as it is;
    chat_template_kwargs decides over reasoning_effort."""
    thinking = prompt_tokens(qwen3_app)
    assert prompt_tokens(qwen3_app, chat_template_kwargs={"enable_thinking": False}) == thinking + 4
    assert prompt_tokens(qwen3_app, reasoning_effort="none") == thinking + 4
    assert prompt_tokens(qwen3_app, reasoning_effort="minimal") == thinking + 4
    assert prompt_tokens(qwen3_app, chat_template_kwargs={"enable_thinking": True}) == thinking
    assert prompt_tokens(qwen3_app, reasoning_effort="high") == thinking
    assert prompt_tokens(qwen3_app, chat_template_kwargs={}) == thinking
    assert prompt_tokens(qwen3_app, reasoning_effort="none",
                         chat_template_kwargs={"enable_thinking": True}) == thinking


def test_tokenize_renders_messages_with_the_same_thinking_switch_as_chat(qwen3_app):
    """/tokenize counts what a chat request with the same messages and chat_template_kwargs is charged."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    client = qwen3_app.test_client()
    counts = [client.post("/tokenize", json={"messages": USER, **fields}).get_json()["count"] for fields in ({}, off)]
    assert counts == [prompt_tokens(qwen3_app), prompt_tokens(qwen3_app, **off)]
    assert counts[1] == counts[0] + 4


@pytest.mark.parametrize("fields, param", [
    ({"chat_template_kwargs": {"enable_thinking": "false"}}, "chat_template_kwargs.enable_thinking"),
    ({"chat_template_kwargs": {"enable_thinking": 0}}, "chat_template_kwargs.enable_thinking"),
    ({"chat_template_kwargs": {"thinking": True}}, "chat_template_kwargs.thinking"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"reasoning_effort": "maximal"}, "reasoning_effort"),
    ({"reasoning_effort": False}, "reasoning_effort"),
])
def test_a_malformed_thinking_field_is_a_400_naming_it(client, fields, param):
    response = client.post("/v1/chat/completions", json={**GREEDY, **fields})
    assert response.status_code == 400
    assert response.get_json()["error"]["param"] == param


def test_qwen3s_thinking_goes_out_as_reasoning_content_in_a_whole_reply(qwen3_app):
    response = chat(qwen3_app, structured_outputs=THOUGHT)
    assert response.status_code == 200, response.get_json()
    choice = response.get_json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "It is 4.", "reasoning_content": "Add two and two."}
    assert choice["finish_reason"] == "stop"


def test_qwen3s_streamed_reasoning_joins_into_the_whole_replys_fields(qwen3_app):
    response = chat(qwen3_app, structured_outputs=THOUGHT, stream=True)
    payloads = [payload for payload in sse_payloads(response.get_data(as_text=True)) if payload != DONE]
    for payload in payloads:
        assert ChatCompletionChunk.model_validate(payload).model_dump(exclude_unset=True) == payload
    deltas = [payload["choices"][0]["delta"] for payload in payloads if payload["choices"]]
    assert "".join(delta.get("reasoning_content", "") for delta in deltas) == "Add two and two."
    assert "".join(delta.get("content", "") for delta in deltas) == "It is 4."
    assert not any("reasoning_content" in delta and "content" in delta for delta in deltas)


def test_a_reply_without_thinking_has_no_reasoning_content(qwen3_app):
    response = chat(qwen3_app, structured_outputs={"regex": r"It is 4\."},
                    chat_template_kwargs={"enable_thinking": False})
    assert response.get_json()["choices"][0]["message"] == {"role": "assistant", "content": "It is 4."}


def test_qwen2s_reply_keeps_think_markers_as_content(client):
    """Qwen2.5's template has no <think>: its replies are content alone, whatever they hold."""
    response = client.post("/v1/chat/completions", json={**GREEDY, "structured_outputs": THOUGHT})
    message = response.get_json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "<think>\nAdd two and two.\n</think>\n\nIt is 4."}


@pytest.mark.parametrize("backend", ["redis", "local"])
def test_requests_differing_only_in_enable_thinking_never_share_a_cached_reply(make_settings, qwen3_engine,
                                                                                tmp_path, backend):
    """The cache key holds the prompt's token ids, which the template renders differently for each."""
    server = RedisServer(tmp_path).start() if backend == "redis" else None
    try:
        app = create_app(make_settings(model=qwen3_engine.settings.model, model_name="qwen3-tiny", max_model_len=256,
                                       redis_url=server.url if server else ""), engine=qwen3_engine)
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        on = {"chat_template_kwargs": {"enable_thinking": True}}
        assert chat(app, **off).headers["X-Cache"] == "miss"
        assert chat(app, **on).headers["X-Cache"] == "miss"
        # reasoning_effort renders the same prompts, so it finds the same replies.
        assert chat(app, reasoning_effort="none").headers["X-Cache"] == "hit"
        assert chat(app, reasoning_effort="high").headers["X-Cache"] == "hit"
        replies = {chat(app, **fields).get_json()["usage"]["prompt_tokens"] for fields in (off, on)}
        assert len(replies) == 2
    finally:
        if server is not None:
            server.stop()
