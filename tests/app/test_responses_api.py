"""OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`) through Flask's test client, on the real
tiny model and, for stored responses, a real redis-server.

Every object and event is validated with the `openai` package's own types; replies are greedy, so a
response is compared with the chat completion of the same conversation, which it must equal.
"""

import json

import pytest
from jsonschema import Draft202012Validator
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from service.app import create_app
from tests.contract import schema_validator
from tests.support import bearer

STREAM_EVENT = TypeAdapter(ResponseStreamEvent)
GREEDY = {"temperature": 0}
NUMBER_PARAMETERS = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                     "required": ["n"], "additionalProperties": False}
TOOL = {"type": "function", "name": "pick", "description": "Pick a number.", "parameters": NUMBER_PARAMETERS,
        "strict": True}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
KEYS = ("sk-first-key", "sk-second-key")


def create(client, headers=None, **body):
    """POST a response with the given fields."""
    return client.post("/v1/responses", json=body, headers=headers or {})


def whole(client, headers=None, **body) -> Response:
    """Create a response, fail unless it is a 200, and return it as the openai package types it."""
    reply = create(client, headers, **body)
    assert reply.status_code == 200, reply.get_json()
    assert reply.headers["X-Cache"] in ("hit", "miss", "bypass")
    schema_validator("ResponseObject").validate(reply.get_json())
    return Response.model_validate(reply.get_json())


def streamed(client, headers=None, **body) -> list:
    """Stream a response and return its events as the openai package types them, checking the framing: each event's
    `event:` line names the type its data carries, and the events are numbered from 0 in order."""
    reply = create(client, headers, stream=True, **body)
    assert reply.status_code == 200, reply.get_data(as_text=True)
    assert reply.mimetype == "text/event-stream"
    published = schema_validator("ResponseStreamEvent")
    events = []
    for frame in reply.get_data(as_text=True).split("\n\n"):
        if not frame or frame.startswith(":"):
            continue
        name_line, data_line = frame.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {data['type']}"
        published.validate(data)
        events.append(STREAM_EVENT.validate_python(data))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    return events


def chat_text(client, messages: list[dict], **body) -> dict:
    """Return the greedy chat completion of a conversation."""
    reply = client.post("/v1/chat/completions", json={"messages": messages, **GREEDY, **body})
    assert reply.status_code == 200, reply.get_json()
    return reply.get_json()


def prompt_tokens(client, messages: list[dict]) -> int:
    """Return how many tokens the chat template makes of a conversation, generation prompt included."""
    return client.post("/tokenize", json={"messages": messages}).get_json()["count"]


def output_text(response: Response) -> str:
    """Return the text of a response's one message."""
    messages = [item for item in response.output if item.type == "message"]
    assert len(messages) == 1 and len(messages[0].content) == 1
    return messages[0].content[0].text


def test_text_input_is_the_chat_completion_of_one_user_message_with_its_usage(client):
    response = whole(client, input="Write a haiku about CPUs.", max_output_tokens=6, **GREEDY)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == "tiny"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in response.output] == ["message"]
    assert response.output[0].role == "assistant" and response.output[0].status == "incomplete"
    user = [{"role": "user", "content": "Write a haiku about CPUs."}]
    chat = chat_text(client, user, max_tokens=6)
    assert output_text(response) == chat["choices"][0]["message"]["content"]
    usage = response.usage
    assert usage.input_tokens == prompt_tokens(client, user) == chat["usage"]["prompt_tokens"]
    assert usage.output_tokens == 6
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert response.store is False  # the app has no Redis: nothing is kept, and the response says so


def test_items_with_every_role_and_part_and_instructions_are_the_same_chat_conversation(client):
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Answer "}, {"type": "input_text",
                                                                                     "text": "briefly."}]},
        {"type": "message", "role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Blue.", "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Another?"}]},
    ]
    response = whole(client, input=items, instructions="You are terse.", max_output_tokens=5, **GREEDY)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "Another?"}]
    chat = chat_text(client, messages, max_tokens=5)
    assert output_text(response) == chat["choices"][0]["message"]["content"]
    assert response.usage.input_tokens == prompt_tokens(client, messages)
    assert response.instructions == "You are terse."


def test_a_greedy_response_is_cached_like_a_chat_completion(client):
    body = {"input": "Cache me.", "max_output_tokens": 4, **GREEDY}
    first = create(client, **body)
    second = create(client, **body)
    assert (first.headers["X-Cache"], second.headers["X-Cache"]) == ("miss", "hit")
    assert output_text(Response.model_validate(second.get_json())) == output_text(
        Response.model_validate(first.get_json()))
    assert first.get_json()["id"] != second.get_json()["id"]


def test_stream_sends_openais_events_in_order_and_its_deltas_join_into_the_final_text(client):
    body = {"input": "Tell me about caches.", "max_output_tokens": 8, **GREEDY}
    events = streamed(client, **body)
    types = [event.type for event in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) == len(types) - 8 and deltas
    final = events[-1].response
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.status == "incomplete" and final.id == events[0].response.id
    assert "".join(deltas) == events[-4].text == events[-3].part.text == output_text(final)
    assert events[-2].item == final.output[0]
    assert {event.item_id for event in events[3:-2]} == {final.output[0].id}
    assert output_text(final) == output_text(whole(client, **body))
    assert final.usage.output_tokens == 8


def test_a_reply_that_ends_by_itself_completes_and_follows_the_json_schema(client):
    text = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}}
    response = whole(client, input="Answer in JSON.", text=text, max_output_tokens=60, **GREEDY)
    assert response.status == "completed" and response.incomplete_details is None
    Draft202012Validator(SCHEMA).validate(json.loads(output_text(response)))
    assert response.text.format.type == "json_schema" and response.text.format.schema_ == SCHEMA
    events = streamed(client, input="Answer in JSON.", text=text, max_output_tokens=60, **GREEDY)
    assert events[-1].type == "response.completed" and events[-1].response.status == "completed"
    assert output_text(events[-1].response) == output_text(response)


def test_json_object_format_constrains_the_reply_from_its_first_token(client):
    response = whole(client, input="JSON please.", text={"format": {"type": "json_object"}}, max_output_tokens=3,
                     **GREEDY)
    assert response.text.format.type == "json_object"
    assert output_text(response).lstrip().startswith("{")


def forced_call(client, tool_choice, **body) -> Response:
    """Return a response whose tool_choice forces a call of TOOL."""
    return whole(client, input="Pick a number.", tools=[TOOL], tool_choice=tool_choice, max_output_tokens=60,
                 parallel_tool_calls=False, **GREEDY, **body)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "pick"}])
def test_a_forced_tool_call_is_a_function_call_item_whose_arguments_follow_the_schema(client, tool_choice):
    response = forced_call(client, tool_choice)
    assert response.status == "completed"
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls == response.output
    call = calls[0]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.name == "pick"
    assert call.status == "completed"
    Draft202012Validator(NUMBER_PARAMETERS).validate(json.loads(call.arguments))
    assert response.tools[0].name == "pick" and response.tools[0].parameters == NUMBER_PARAMETERS


def test_a_streamed_call_is_added_then_its_argument_deltas_join_into_its_arguments(client):
    events = streamed(client, input="Pick a number.", tools=[TOOL], tool_choice="required", max_output_tokens=60,
                      parallel_tool_calls=False, **GREEDY)
    types = [event.type for event in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert set(types[3:-3]) == {"response.function_call_arguments.delta"}
    added, done, final = events[2].item, events[-2].item, events[-1].response
    assert added.type == "function_call" and added.arguments == "" and added.status == "in_progress"
    arguments = "".join(event.delta for event in events[3:-3])
    assert arguments == events[-3].arguments == done.arguments
    assert (done.call_id, done.id) == (added.call_id, added.id) and final.output == [done]
    whole_call = forced_call(client, "required").output[0]
    assert (whole_call.name, whole_call.arguments) == (done.name, done.arguments)
    Draft202012Validator(NUMBER_PARAMETERS).validate(json.loads(arguments))


def test_a_function_call_output_given_back_is_read_as_the_chat_tool_message(client):
    call = forced_call(client, "required").output[0]
    items = [{"role": "user", "content": "Pick a number."},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments,
              "id": call.id, "status": "completed"},
             {"type": "function_call_output", "call_id": call.call_id, "output": "7"}]
    response = whole(client, input=items, tools=[TOOL], max_output_tokens=4, **GREEDY)
    assert response.status in ("completed", "incomplete")
    messages = [{"role": "user", "content": "Pick a number."},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.call_id, "type": "function", "function": {"name": call.name,
                                                                          "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "7"}]
    chat_tool = {"type": "function", "function": {key: TOOL[key] for key in ("name", "description", "parameters",
                                                                             "strict")}}
    chat = chat_text(client, messages, tools=[chat_tool], max_tokens=4)
    assert response.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert response.output == [] or output_text(response) == (chat["choices"][0]["message"]["content"] or "")


def test_tool_choice_none_answers_in_text(client):
    response = whole(client, input="Pick a number.", tools=[TOOL], tool_choice="none", max_output_tokens=4, **GREEDY)
    assert [item.type for item in response.output] == ["message"]
    assert response.tool_choice == "none"


@pytest.mark.parametrize("body, param", [
    ({"input": "Hi", "background": True}, "background"),
    ({"input": "Hi", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "Hi", "reasoning": {"effort": "low", "summary": "auto"}}, "reasoning.summary"),
    ({"input": "Hi", "reasoning": {"generate_summary": "concise"}}, "reasoning.generate_summary"),
    ({"input": "Hi", "reasoning": {"effort": "low", "budget_tokens": 64}}, "reasoning.budget_tokens"),
    ({"input": "Hi", "truncation": "auto"}, "truncation"),
    ({"input": "Hi", "top_logprobs": 2}, "top_logprobs"),
    ({"input": "Hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "Hi", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "Hi", "max_tool_calls": 2}, "max_tool_calls"),
    ({"input": "Hi", "service_tier": "flex"}, "service_tier"),
    ({"input": "Hi", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "Hi", "tools": [TOOL, {"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[1].type"),
    ({"input": "Hi", "tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0].type"),
    ({"input": "Hi", "tools": [{"type": "computer_use_preview"}]}, "tools[0].type"),
    ({"input": "Hi", "tools": [{"type": "image_generation"}]}, "tools[0].type"),
    ({"input": "Hi", "tools": [{"type": "mcp", "server_label": "x"}]}, "tools[0].type"),
    ({"input": "Hi", "tools": [TOOL], "tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "Sums."}]},
                {"role": "user", "content": "Hi"}]},
     "input[0].summary"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}, "input[0].encrypted_content"),
])
def test_unsupported_fields_and_built_in_tools_are_refused_by_name(client, body, param):
    reply = create(client, **body)
    assert reply.status_code == 400
    error = reply.get_json()["error"]
    assert error["param"] == param and error["code"] == "unsupported_parameter"
    assert f"'{param}' is not supported" in error["message"]


@pytest.mark.parametrize("body, param, words", [
    ({"input": "Hi", "seed": 1}, "seed", "unknown parameter 'seed'"),
    ({}, "input", "'input' is a required property"),
    ({"input": []}, "input", "at least one item"),
    ({"input": "Hi", "temperature": 3}, "temperature", "less than or equal to 2"),
    ({"input": "Hi", "reasoning": {"effort": "max"}}, "reasoning.effort", "expected"),
    ({"input": "Hi", "reasoning": "high"}, "reasoning", "valid dictionary"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "expected"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments",
     "must be a JSON object"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "7"}]}, "input[0].call_id",
     "no function call with call_id 'call_x'"),
    ({"input": "Hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice",
     "no tool named 'other'"),
    ({"input": "Hi", "tools": [TOOL, TOOL]}, "tools", "must be unique"),
    ({"input": "Hi", "tools": [TOOL], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "text.format", "cannot be combined"),
    ({"input": "Hi", "max_output_tokens": 99999}, "max_output_tokens", "max_output_tokens is 99999"),
    ({"input": "Hi", "model": "gpt-4o"}, "model", "does not exist"),
    ({"input": "Hi", "store": True}, "store", "needs a Redis"),
    ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id", "needs a Redis"),
])
def test_bad_requests_are_400s_naming_the_responses_field(client, body, param, words):
    reply = create(client, **body)
    assert reply.status_code in (400, 404), reply.get_json()
    error = reply.get_json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert "max_completion_tokens" not in error["message"] and "response_format" not in error["message"]


def test_an_input_past_the_context_is_context_length_exceeded_on_input(client):
    reply = create(client, input="word " * 400)
    assert reply.status_code == 400
    error = reply.get_json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "input")


def test_without_redis_nothing_is_retrievable(client):
    response = whole(client, input="Hi", max_output_tokens=2, **GREEDY)
    reply = client.get(f"/v1/responses/{response.id}")
    assert reply.status_code == 404 and reply.get_json()["error"]["param"] == "response_id"


@pytest.fixture()
def stored_client(make_settings, engine, redis_server):
    """Return a test client of an app with two API keys and responses stored in a real Redis."""
    settings = make_settings(max_model_len=256, redis_url=redis_server.url, api_keys=",".join(KEYS))
    return create_app(settings, engine=engine).test_client()


FIRST, SECOND = bearer(KEYS[0]), bearer(KEYS[1])


def test_a_stored_response_is_retrieved_whole_by_its_key_alone(stored_client, redis_server):
    response = whole(stored_client, FIRST, input="Remember me.", max_output_tokens=4, metadata={"k": "v"}, **GREEDY)
    assert response.store is True and response.metadata == {"k": "v"}
    retrieved = stored_client.get(f"/v1/responses/{response.id}", headers=FIRST)
    assert retrieved.status_code == 200
    assert Response.model_validate(retrieved.get_json()) == response
    other = stored_client.get(f"/v1/responses/{response.id}", headers=SECOND)
    absent = stored_client.get("/v1/responses/resp_0123", headers=SECOND)
    assert other.status_code == absent.status_code == 404
    assert other.get_json()["error"]["message"].replace(response.id, "resp_0123") == absent.get_json()["error"][
        "message"]
    unstored = whole(stored_client, FIRST, input="Forget me.", max_output_tokens=2, store=False, **GREEDY)
    assert unstored.store is False
    assert stored_client.get(f"/v1/responses/{unstored.id}", headers=FIRST).status_code == 404
    assert stored_client.get(f"/v1/responses/{response.id}?stream=true", headers=FIRST).status_code == 400


def test_a_response_one_worker_stores_is_read_and_continued_by_another(make_settings, engine, redis_server):
    settings = make_settings(max_model_len=256, redis_url=redis_server.url, api_keys=",".join(KEYS))
    storing, reading = (create_app(settings, engine=engine).test_client() for _ in range(2))
    response = whole(storing, FIRST, input="Shared.", max_output_tokens=3, **GREEDY)
    assert Response.model_validate(reading.get(f"/v1/responses/{response.id}", headers=FIRST).get_json()) == response
    assert whole(reading, FIRST, input="Next.", previous_response_id=response.id, max_output_tokens=2,
                 **GREEDY).usage.input_tokens > response.usage.input_tokens


def test_a_streamed_response_is_stored_as_its_last_event_says(stored_client):
    events = streamed(stored_client, FIRST, input="Stream and keep.", max_output_tokens=5, **GREEDY)
    final = events[-1].response
    retrieved = stored_client.get(f"/v1/responses/{final.id}", headers=FIRST).get_json()
    assert Response.model_validate(retrieved) == final


def test_previous_response_id_continues_the_whole_conversation_without_its_instructions(stored_client):
    first = whole(stored_client, FIRST, input="Name a fruit.", instructions="Be brief.", max_output_tokens=4,
                  **GREEDY)
    second = whole(stored_client, FIRST, input="And a vegetable?", previous_response_id=first.id,
                   max_output_tokens=4, **GREEDY)
    third = whole(stored_client, FIRST, input="And a nut?", previous_response_id=second.id, max_output_tokens=4,
                  **GREEDY)
    assert third.previous_response_id == second.id
    messages = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": output_text(first)},
                {"role": "user", "content": "And a vegetable?"}, {"role": "assistant", "content": output_text(second)},
                {"role": "user", "content": "And a nut?"}]
    chat = stored_client.post("/v1/chat/completions", headers=FIRST,
                              json={"messages": messages, "max_tokens": 4, **GREEDY}).get_json()
    assert output_text(third) == chat["choices"][0]["message"]["content"]
    assert third.usage.input_tokens == chat["usage"]["prompt_tokens"]
    # The earlier turns' KV state is reused from the host's prefix store, as a chat conversation's is: at least
    # the second turn's prompt but its last token (a stored sequence's last token is computed again for its logits).
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens - 1
    refused = create(stored_client, SECOND, input="Next?", previous_response_id=first.id)
    assert refused.status_code == 404
    assert refused.get_json()["error"]["code"] == "previous_response_not_found"


def test_a_function_call_is_answered_through_previous_response_id(stored_client):
    first = whole(stored_client, FIRST, input="Pick a number.", tools=[TOOL], tool_choice="required",
                  parallel_tool_calls=False, max_output_tokens=60, **GREEDY)
    call = first.output[0]
    answer = [{"type": "function_call_output", "call_id": call.call_id, "output": "7"}]
    second = whole(stored_client, FIRST, input=answer, previous_response_id=first.id, tools=[TOOL],
                   max_output_tokens=3, **GREEDY)
    assert second.usage.input_tokens > first.usage.input_tokens
    unanswered = create(stored_client, FIRST, input=[{**answer[0], "call_id": "call_other"}],
                        previous_response_id=first.id)
    assert unanswered.status_code == 400 and unanswered.get_json()["error"]["param"] == "input[0].call_id"


def test_a_response_that_cannot_be_kept_is_a_503_never_a_silent_success(stored_client, redis_server):
    redis_server.stop()
    reply = create(stored_client, FIRST, input="Keep me.", max_output_tokens=2, **GREEDY)
    assert reply.status_code == 503 and reply.headers["Retry-After"]
    events = streamed(stored_client, FIRST, input="Keep me too.", max_output_tokens=2, **GREEDY)
    assert events[-1].type == "response.failed" and events[-1].response.error.code == "server_error"
    assert whole(stored_client, FIRST, input="Do not keep.", max_output_tokens=2, store=False, **GREEDY).store is False
    assert stored_client.get("/v1/responses/resp_1", headers=FIRST).status_code == 503


def test_responses_count_in_the_request_metrics_as_chat_does(client):
    from prometheus_client import REGISTRY

    def count(outcome: str) -> float:
        return REGISTRY.get_sample_value("corechat_requests_total", {"outcome": outcome}) or 0.0

    before = count("length"), count("unsupported_parameter")
    whole(client, input="Count me.", max_output_tokens=2, **GREEDY)
    create(client, input="Refuse me.", background=True)
    assert (count("length"), count("unsupported_parameter")) == (before[0] + 1, before[1] + 1)
