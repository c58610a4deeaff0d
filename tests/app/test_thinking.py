"""Thinking on the chat API and the Responses API: chat_template_kwargs.enable_thinking, reasoning_effort and
reasoning.effort reach Qwen3's template (and so the prompt, and so the cache key), and a thinking model's <think>
block goes out apart from the content (chat's reasoning_content, the Responses API's reasoning item), whole and
streamed; Qwen2's replies are unchanged."""

import pytest
from openai.types.responses import Response

from harness import DONE, RedisServer, sse_payloads
from service.api.responses import ChatCompletionChunk
from service.app import create_app
from tests.app.test_responses_api import STREAM_EVENT, output_text, streamed, whole
from tests.support import started_engine, thinking_opened_by_the_prompt

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


# The Responses API -----------------------------------------------------------------------------------------------
# The random-weight model never writes <think> on its own, and the Responses API has no grammar field to make it;
# a template that opens the thinking in its prompt (as Qwen3-Thinking-2507's and DeepSeek-R1's do) makes every
# reply thinking, which the chat path splits off too (tests.support.thinking_opened_by_the_prompt).


@pytest.fixture(scope="module")
def opened_engine(make_settings, tmp_path_factory):
    """Return a started engine on the tiny Qwen3 whose prompt opens the thinking: its replies are thinking."""
    from devtools.devmodel import build_dev_model

    built = build_dev_model(tmp_path_factory.mktemp("qwen3-base") / "qwen3-tiny", preset="qwen3-tiny")
    folder = thinking_opened_by_the_prompt(built, tmp_path_factory.mktemp("qwen3-opened") / "qwen3-opened")
    with started_engine(make_settings(model=str(folder), model_name="qwen3-tiny", max_model_len=256)) as engine:
        yield engine


@pytest.fixture()
def opened_app(make_settings, opened_engine):
    """Return a fresh app around the thinking-opened engine, without a cache."""
    return create_app(make_settings(model=opened_engine.settings.model, model_name="qwen3-tiny", max_model_len=256),
                      engine=opened_engine)


def reasoning_and_text(response: Response) -> tuple[str | None, str]:
    """Return a response's reasoning item's text (None without one) and its message's text, checking the order."""
    types = [item.type for item in response.output]
    assert types in (["message"], ["reasoning", "message"]), types
    if types == ["message"]:
        return None, output_text(response)
    reasoning = response.output[0]
    assert reasoning.id.startswith("rs_") and reasoning.summary == [] and len(reasoning.content) == 1
    assert reasoning.content[0].type == "reasoning_text"
    return reasoning.content[0].text, output_text(response)


def test_a_responses_reasoning_item_and_message_are_the_chat_completions_reasoning_content_and_content(opened_app):
    client = opened_app.test_client()
    response = whole(client, input="What is 2 + 2?", max_output_tokens=12, temperature=0)
    reasoning, text = reasoning_and_text(response)
    message = chat(opened_app, max_tokens=12).get_json()["choices"][0]["message"]
    assert reasoning and (reasoning, text) == (message["reasoning_content"], message["content"])
    assert response.status == "incomplete" and response.output[0].status == "incomplete"
    assert response.usage.output_tokens == 12 and response.usage.output_tokens_details.reasoning_tokens == 0


def test_a_streamed_responses_reasoning_deltas_join_into_its_done_text_and_the_whole_response(opened_app):
    """The reasoning item is output 0, opened and closed as a message is (its text part a reasoning_text), before
    the message; every event is typed by the openai package (streamed() validates each)."""
    client = opened_app.test_client()
    body = {"input": "What is 2 + 2?", "max_output_tokens": 12, "temperature": 0}
    events = streamed(client, **body)
    types = [event.type for event in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    added, part = events[2:4]
    assert added.item.type == "reasoning" and added.item.content == [] and added.item.status == "in_progress"
    assert part.part.type == "reasoning_text" and part.part.text == ""
    assert types[-9:] == ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                          "response.output_item.added", "response.content_part.added", "response.output_text.done",
                          "response.content_part.done", "response.output_item.done", "response.incomplete"]
    deltas = [event for event in events if event.type == "response.reasoning_text.delta"]
    assert len(deltas) == len(types) - 13 and deltas
    assert {(event.item.id if "output_item" in event.type else event.item_id, event.output_index)
            for event in events[2:-6]} == {(added.item.id, 0)}
    assert {event.output_index for event in events[-6:-1]} == {1}
    final = events[-1].response
    assert "".join(event.delta for event in deltas) == events[-9].text == events[-8].part.text
    assert events[-7].item == final.output[0] and events[-2].item == final.output[1]
    assert reasoning_and_text(final) == reasoning_and_text(whole(client, **body))
    assert events[-9].text == final.output[0].content[0].text


def test_a_reply_that_thinks_then_answers_is_written_as_a_reasoning_item_then_a_message_as_chat_splits_it(qwen3_app):
    """The writer both views use, fed a Qwen3 reply a character at a time: the pieces held at the markers settle
    into the same two texts as chat's reasoning_content and content of that reply."""
    from service.api.chat import ReplyParsers
    from service.api.reasoning import ReasoningParser
    from service.api.responses_api.output import ResponseFacts, ResponseWriter
    from service.api.responses_api.request import parse_responses_request
    from service.engine import Finished, ReasoningMarkers

    message = chat(qwen3_app, structured_outputs=THOUGHT).get_json()["choices"][0]["message"]
    facts = ResponseFacts(response_id="resp_1", created_at=0, model="qwen3-tiny", temperature=0.0, top_p=1.0,
                          request=parse_responses_request({"input": "What is 2 + 2?"}), store=False)
    writer = ResponseWriter(facts, ReplyParsers(ReasoningParser(ReasoningMarkers("<think>", "</think>")), None))
    events = writer.begin()
    for character in "<think>\nAdd two and two.\n</think>\n\nIt is 4.":
        events += writer.feed(character)
    events += writer.end(Finished("stop", prompt_tokens=14, completion_tokens=15, prompt_seconds=0.0,
                                  decode_seconds=0.0))
    events.append(writer.last_event())
    typed = [STREAM_EVENT.validate_json(event.model_dump_json()) for event in events]
    response = Response.model_validate_json(writer.response.model_dump_json())
    assert response.status == "completed" and [item.status for item in response.output] == ["completed"] * 2
    assert reasoning_and_text(response) == (message["reasoning_content"], message["content"])
    reasoning = "".join(event.delta for event in typed if event.type == "response.reasoning_text.delta")
    text = "".join(event.delta for event in typed if event.type == "response.output_text.delta")
    assert (reasoning, text) == reasoning_and_text(response)


@pytest.mark.parametrize("effort", ["none", "minimal", "low", "high"])
def test_reasoning_effort_renders_the_prompt_chats_reasoning_effort_renders(qwen3_app, effort):
    response = whole(qwen3_app.test_client(), input=USER[0]["content"], reasoning={"effort": effort},
                     max_output_tokens=1, temperature=0)
    assert response.usage.input_tokens == prompt_tokens(qwen3_app, reasoning_effort=effort)
    assert response.reasoning.effort == effort


@pytest.mark.parametrize("effort", ["none", "minimal"])
def test_reasoning_effort_none_or_minimal_gives_no_reasoning_item(opened_app, effort):
    response = whole(opened_app.test_client(), input=USER[0]["content"], reasoning={"effort": effort},
                     max_output_tokens=12, temperature=0)
    message = chat(opened_app, max_tokens=12, reasoning_effort=effort).get_json()["choices"][0]["message"]
    assert "reasoning_content" not in message
    assert reasoning_and_text(response) == (None, message["content"])
    thinking = whole(opened_app.test_client(), input=USER[0]["content"], reasoning={"effort": "low"},
                     max_output_tokens=12, temperature=0)
    assert reasoning_and_text(thinking)[0]


def test_qwen2s_responses_have_no_reasoning_item_whatever_the_effort(client):
    """Qwen2.5's template has no <think>: `reasoning.effort` is taken and changes nothing."""
    body = {"input": USER[0]["content"], "max_output_tokens": 6, "temperature": 0}
    plain, asked = whole(client, **body), whole(client, **body, reasoning={"effort": "high"})
    assert [item.type for item in asked.output] == ["message"]
    assert output_text(asked) == output_text(plain)
    assert asked.usage.input_tokens == plain.usage.input_tokens


def test_a_continued_response_gives_the_thinking_back_as_chat_does_and_the_template_drops_it(
        make_settings, opened_engine, redis_server):
    """The stored conversation holds the reasoning item; it goes back as the assistant turn's reasoning_content,
    which Qwen3's template drops from a turn before the last user message."""
    app = create_app(make_settings(model=opened_engine.settings.model, model_name="qwen3-tiny", max_model_len=256,
                                   redis_url=redis_server.url), engine=opened_engine)
    client = app.test_client()
    first = whole(client, input="What is 2 + 2?", max_output_tokens=8, temperature=0)
    reasoning, text = reasoning_and_text(first)
    second = whole(client, input="And 3 + 3?", previous_response_id=first.id, max_output_tokens=8, temperature=0)
    given_back = [USER[0], {"role": "assistant", "content": text, "reasoning_content": reasoning},
                  {"role": "user", "content": "And 3 + 3?"}]
    reply = chat(app, messages=given_back, max_tokens=8).get_json()
    assert reasoning_and_text(second) == (reply["choices"][0]["message"]["reasoning_content"],
                                          reply["choices"][0]["message"]["content"])
    assert second.usage.input_tokens == reply["usage"]["prompt_tokens"]
    without = [given_back[0], {"role": "assistant", "content": text}, given_back[2]]
    assert second.usage.input_tokens == prompt_tokens(app, messages=without)


def test_thinking_given_back_before_a_function_call_is_read_again_in_that_tool_loop(qwen3_app):
    """After the last user message (a tool loop), Qwen3's template keeps an assistant turn's thinking: a reasoning
    item given back renders as chat's reasoning_content on that turn does."""
    arguments = '{"n": 7}'
    items = [USER[0],
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Seven will do."}]},
             {"type": "function_call", "call_id": "call_1", "name": "pick", "arguments": arguments},
             {"type": "function_call_output", "call_id": "call_1", "output": "7"}]
    response = whole(qwen3_app.test_client(), input=items, max_output_tokens=1, temperature=0)
    call = {"id": "call_1", "type": "function", "function": {"name": "pick", "arguments": arguments}}
    turn = {"role": "assistant", "content": None, "tool_calls": [call]}
    answer = {"role": "tool", "tool_call_id": "call_1", "content": "7"}
    with_thinking = prompt_tokens(qwen3_app, messages=[USER[0], {**turn, "reasoning_content": "Seven will do."},
                                                       answer])
    assert response.usage.input_tokens == with_thinking > prompt_tokens(qwen3_app, messages=[USER[0], turn, answer])
