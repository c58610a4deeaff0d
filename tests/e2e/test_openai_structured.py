"""Tools, structured output and logprobs through the official `openai` client against real Gunicorn.

The server runs as `make serve` does (2 workers, every setting at its default). Random weights
never choose to call a tool, so the tool tests force the call with tool_choice: what they prove is
that constrained decoding makes the call happen and its arguments follow the function's schema.
"""

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import openai
import pytest
from jsonschema import Draft202012Validator
from pydantic import BaseModel, Field

from tests.support import openai_client

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                      "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Objects, arrays, enums, numbers and strings (whose escapes a random model produces plenty of),
# each bounded so that a reply fits its max_tokens.
NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 16},
        "rating": {"type": "integer", "minimum": -5, "maximum": 5},
        "kind": {"enum": ["book", "film", "game"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "author": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 10},
                "born": {"type": "integer", "minimum": 1900, "maximum": 2020},
            },
            "required": ["name", "born"],
            "additionalProperties": False,
        },
        "parts": {
            "type": "array",
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "n": {"type": "integer", "minimum": 0, "maximum": 99},
                    "label": {"enum": ["a", "b\"q", "c\\d"]},
                },
                "required": ["n", "label"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["title", "rating", "kind", "ok", "tags", "author", "parts"],
    "additionalProperties": False,
}
CONSTRAINED_REPLIES = 50


@pytest.fixture(scope="module")
def client(default_server):
    """Return an openai client of a server run with the defaults; it never retries."""
    return openai_client(default_server)


def assert_calls_follow_the_schema(tool_calls, allowed_names: set[str]) -> None:
    """Check each call's id, name and that its arguments parse and validate against its function's schema."""
    assert tool_calls
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    for call in tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in allowed_names
        Draft202012Validator(schemas[call.function.name]).validate(json.loads(call.function.arguments))


def answer_calls(tool_calls) -> list[dict]:
    """Return the assistant turn carrying the calls and one tool message answering each."""
    assistant = {"role": "assistant", "content": None,
                 "tool_calls": [{"id": call.id, "type": "function",
                                 "function": {"name": call.function.name, "arguments": call.function.arguments}}
                                for call in tool_calls]}
    answers = [{"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"} for call in tool_calls]
    return [assistant, *answers]


def test_a_named_tool_choice_makes_one_whole_call_and_the_round_trip_completes(client):
    """The reply ends after the one named call, with room for many more, and finishes with `stop`, as OpenAI's
    does for a named tool_choice."""
    first = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, max_tokens=300, seed=1,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = first.choices[0]
    assert choice.finish_reason == "stop", choice
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    assert_calls_follow_the_schema(choice.message.tool_calls, {"get_weather"})
    final = client.chat.completions.create(
        model="tiny", messages=[*ASK, *answer_calls(choice.message.tool_calls)], tools=TOOLS, max_tokens=8, seed=1)
    assert isinstance(final.choices[0].message.content, str) and final.choices[0].message.content
    # The calls and their results are in the second prompt.
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + 10 * len(choice.message.tool_calls)


def test_tool_choice_required_streams_calls_as_id_and_name_then_arguments(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=120,
        seed=2, stream=True))
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert "<tool_call>" not in content and "</tool_call>" not in content and not content.strip()
    deltas = [delta for chunk in chunks for delta in chunk.choices[0].delta.tool_calls or []]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name in {"get_weather", "get_time"}
    calls = {}
    for delta in deltas:
        if delta.id is not None:
            calls[delta.index] = {"id": delta.id, "name": delta.function.name,
                                  "arguments": delta.function.arguments or ""}
        else:
            assert delta.function.name is None
            calls[delta.index]["arguments"] += delta.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert len(calls) == 1
    merged = [openai.types.chat.ChatCompletionMessageToolCall(
        id=call["id"], type="function", function={"name": call["name"], "arguments": call["arguments"]})
        for call in calls.values()]
    assert_calls_follow_the_schema(merged, {"get_weather", "get_time"})
    final = list(client.chat.completions.create(
        model="tiny", messages=[*ASK, *answer_calls(merged)], tools=TOOLS, max_tokens=6, seed=2, stream=True))
    assert final[-1].choices[0].finish_reason == "length"  # seeded: runs to max_tokens


class Review(BaseModel):
    title: str = Field(max_length=16)
    stars: int = Field(ge=1, le=5)
    verdict: Literal["good", "bad"]
    notes: list[Annotated[str, Field(max_length=8)]] = Field(max_length=2)


def test_parse_with_a_pydantic_model_returns_the_parsed_object(client):
    completion = client.chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "Review a film."}], response_format=Review,
        max_tokens=300, seed=4, temperature=0.0)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, Review)
    assert message.parsed == Review.model_validate_json(message.content)


def test_logprobs_are_typed_and_come_from_the_distribution_sampled(client):
    completion = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=3)
    entries = completion.choices[0].logprobs.content
    # Every token of the reply, the end-of-turn token that stops it aside.
    ending = completion.choices[0].finish_reason == "stop"
    assert len(entries) == completion.usage.completion_tokens - ending
    for entry in entries:
        assert isinstance(entry, openai.types.chat.ChatCompletionTokenLogprob)
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        alternatives = [alt.logprob for alt in entry.top_logprobs]
        assert alternatives == sorted(alternatives, reverse=True)
        # Greedy takes the most likely token of the distribution the logprobs describe.
        assert (entry.token, entry.logprob) == (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    streamed = list(client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=3, stream=True))
    streamed_entries = [entry for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
                        for entry in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed_entries] == [(e.token, e.logprob) for e in entries]


def test_every_constrained_reply_parses_and_validates_under_a_nested_schema(client):
    validator = Draft202012Validator(NESTED_SCHEMA)
    response_format = {"type": "json_schema", "json_schema": {"name": "item", "schema": NESTED_SCHEMA, "strict": True}}

    def reply(seed: int):
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Describe item {seed}."}],
            response_format=response_format, max_tokens=400, seed=seed, temperature=1.0)

    with ThreadPoolExecutor(8) as pool:
        completions = list(pool.map(reply, range(CONSTRAINED_REPLIES)))
    escapes = 0
    for completion in completions:
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        document = json.loads(choice.message.content)
        validator.validate(document)
        escapes += "\\" in choice.message.content
    assert len({completion.choices[0].message.content for completion in completions}) > CONSTRAINED_REPLIES // 2
    assert escapes, "no reply exercised string escapes"


STRICT_TOOLS = [{"type": "function", "function": {**tool["function"], "strict": True}} for tool in TOOLS]
# Qwen2.5's `<tool_call>` token: biased up, the random model opens a call at once.
TOOL_CALL_OPEN_ID = "151657"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_strict_tools_under_auto_make_every_call_follow_its_schema(client, stream):
    """Under tool_choice auto, a call the model opens (pushed by logit_bias here: a random model would
    never choose one) is completed as the strict tool's schema says."""
    request = dict(model="tiny", messages=ASK, tools=STRICT_TOOLS, tool_choice="auto", parallel_tool_calls=False,
                   max_tokens=200, seed=3, logit_bias={TOOL_CALL_OPEN_ID: 100})
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert_calls_follow_the_schema(choice.message.tool_calls, {"get_weather", "get_time"})
        return
    chunks = list(client.chat.completions.create(**request, stream=True))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    calls = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    name = next(call.function.name for call in calls if call.function.name)
    arguments = "".join(call.function.arguments or "" for call in calls)
    Draft202012Validator({tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}[name]).validate(
        json.loads(arguments))


def test_strict_tools_under_auto_leave_a_text_reply_text(client):
    """The same request without the push answers in text, which never spells out a call."""
    for seed in range(5):
        choice = client.chat.completions.create(model="tiny", messages=ASK, tools=STRICT_TOOLS, tool_choice="auto",
                                                max_tokens=40, seed=seed).choices[0]
        assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
        assert "<tool_call>" not in (choice.message.content or "")


def test_strict_tools_cannot_be_combined_with_response_format_under_auto(client):
    """Two grammars for one reply are refused with the field named, not one of them silently dropped."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=ASK, tools=STRICT_TOOLS, max_tokens=4,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"type": "object"}}})
    assert refused.value.body["param"] == "response_format"
