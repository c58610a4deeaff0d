"""The Responses API through the official `openai` client against real Gunicorn (two workers) and a real Redis:
whole, streamed (also through the client's own event accumulator), stored and retrieved across workers,
continued with previous_response_id, function calls answered, and another API key kept out; and a thinking
model's reasoning item, typed by the client."""

import json

import openai
import pytest
from jsonschema import Draft202012Validator
from openai.types.responses import ResponseReasoningItem
from pydantic import BaseModel, Field

from tests.support import openai_client, thinking_opened_by_the_prompt

KEYS = ("sk-responses-first", "sk-responses-second")
NUMBER_PARAMETERS = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                     "required": ["n"], "additionalProperties": False}
TOOL = {"type": "function", "name": "pick", "description": "Pick a number.", "parameters": NUMBER_PARAMETERS,
        "strict": True}
GREEDY = {"model": "tiny", "temperature": 0}
# Retrievals over new connections, which the kernel spreads over the workers.
RETRIEVALS = 6


@pytest.fixture(scope="module")
def server(gunicorn, module_redis):
    """Run corechat with two workers, two API keys and responses stored in a real Redis."""
    with gunicorn(workers=2, warmup=False, api_keys=",".join(KEYS), redis_url=module_redis().url) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    """Return an openai client with the first key."""
    return openai_client(server, api_key=KEYS[0])


@pytest.fixture(scope="module")
def other_client(server):
    """Return an openai client with the second key."""
    return openai_client(server, api_key=KEYS[1])


def test_whole_and_streamed_responses_agree_and_the_deltas_join_into_the_text(client):
    whole = client.responses.create(input="Write about caches.", max_output_tokens=8, **GREEDY)
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.store is True
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 8 and whole.output_text
    events = list(client.responses.create(input="Write about caches.", max_output_tokens=8, stream=True, **GREEDY))
    types = [event.type for event in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == whole.output_text
    assert [event.sequence_number for event in events] == list(range(len(events)))


class Answer(BaseModel):
    ok: bool
    n: int = Field(ge=0, le=99)


def test_a_strict_text_format_is_parsed_by_the_client_whole_and_from_its_own_stream_accumulator(client):
    parsed = client.responses.parse(input="Answer in JSON.", text_format=Answer, max_output_tokens=60, **GREEDY)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Answer)
    assert parsed.output_parsed == Answer.model_validate_json(parsed.output_text)
    # The client rebuilds the response from the events, checking each against the items it holds.
    with client.responses.stream(input="Answer in JSON.", text_format=Answer, max_output_tokens=60,
                                 **GREEDY) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed and final.output_text == parsed.output_text


def test_a_stored_response_is_retrieved_by_its_key_alone(server, client, other_client):
    response = client.responses.create(input="Remember this.", instructions="Be brief.", max_output_tokens=4,
                                       **GREEDY)
    for _ in range(RETRIEVALS):
        # A new connection each time, which either worker may take.
        assert openai_client(server, api_key=KEYS[0]).responses.retrieve(response.id) == response
    with pytest.raises(openai.NotFoundError):
        other_client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as refused:
        other_client.responses.create(input="Go on.", previous_response_id=response.id, **GREEDY)
    assert refused.value.body["code"] == "previous_response_not_found"


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(input="Name a fruit.", max_output_tokens=4, **GREEDY)
    second = client.responses.create(input="And a vegetable?", previous_response_id=first.id, max_output_tokens=4,
                                     **GREEDY)
    conversation = [{"role": "user", "content": "Name a fruit."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "And a vegetable?"}]
    chat = client.chat.completions.create(messages=conversation, max_tokens=4, **GREEDY)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    streamed = list(client.responses.create(input="And a nut?", previous_response_id=second.id, max_output_tokens=3,
                                            stream=True, **GREEDY))
    assert client.responses.retrieve(streamed[-1].response.id) == streamed[-1].response


def test_a_function_call_is_made_and_its_output_answered_through_the_stored_conversation(client):
    first = client.responses.create(input="Pick a number.", tools=[TOOL], tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=60, **GREEDY)
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "pick" and call.call_id.startswith("call_")
    Draft202012Validator(NUMBER_PARAMETERS).validate(json.loads(call.arguments))
    second = client.responses.create(
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "7"}],
        previous_response_id=first.id, tools=[TOOL], max_output_tokens=3, **GREEDY)
    assert second.output[0].type == "message"
    assert second.usage.input_tokens > first.usage.input_tokens
    streamed = list(client.responses.create(input="Pick a number.", tools=[TOOL],
                                            tool_choice={"type": "function", "name": "pick"}, max_output_tokens=60,
                                            stream=True, **GREEDY))
    arguments = "".join(event.delta for event in streamed if event.type == "response.function_call_arguments.delta")
    assert arguments == streamed[-1].response.output[0].arguments == call.arguments


def test_built_in_tools_and_unsupported_fields_are_bad_requests_naming_them(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(input="Search.", tools=[{"type": "web_search"}], **GREEDY)
    assert refused.value.body["param"] == "tools[0].type"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(input="Think.", reasoning={"effort": "high", "summary": "auto"}, **GREEDY)
    assert refused.value.body["param"] == "reasoning.summary"


@pytest.fixture(scope="module")
def thinking_client(gunicorn, tmp_path_factory):
    """Return an openai client of corechat (one worker, nothing kept) on the tiny Qwen3 whose prompt opens the
    thinking, so that its replies are thinking."""
    from devtools.devmodel import build_dev_model

    built = build_dev_model(tmp_path_factory.mktemp("qwen3-base") / "qwen3-tiny", preset="qwen3-tiny")
    folder = thinking_opened_by_the_prompt(built, tmp_path_factory.mktemp("qwen3-opened") / "qwen3-opened")
    with gunicorn(workers=1, warmup=False, model=str(folder), model_name="qwen3-tiny") as server:
        yield openai_client(server)


def test_a_thinking_models_reasoning_item_is_chats_reasoning_content_whole_and_streamed(thinking_client):
    body = {"input": "What is 2 + 2?", "max_output_tokens": 12, "model": "qwen3-tiny", "temperature": 0}
    whole = thinking_client.responses.create(**body)
    reasoning, message = whole.output
    assert isinstance(reasoning, ResponseReasoningItem) and reasoning.id.startswith("rs_") and reasoning.summary == []
    chat = thinking_client.chat.completions.create(messages=[{"role": "user", "content": body["input"]}],
                                                   max_tokens=12, model="qwen3-tiny", temperature=0)
    assert reasoning.content[0].text == chat.choices[0].message.reasoning_content
    assert message.type == "message" and whole.output_text == chat.choices[0].message.content
    events = list(thinking_client.responses.create(**body, stream=True))
    deltas = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    assert [deltas] == [event.text for event in events if event.type == "response.reasoning_text.done"]
    assert deltas == reasoning.content[0].text == events[-1].response.output[0].content[0].text
    unthinking = thinking_client.responses.create(**body, reasoning={"effort": "none"})
    assert [item.type for item in unthinking.output] == ["message"] and unthinking.reasoning.effort == "none"
